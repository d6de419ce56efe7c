"""What a serving run's requests say: latency percentiles, playback underruns, delivered audio, and the table.

A request's record holds when each piece of its audio arrived; the listener is modelled as a player that starts
when the first piece arrives and plays without a buffer of its own, so a piece that arrives after the audio before
it has run out makes the player wait (an underrun when it waits more than `UNDERRUN_TOLERANCE_S`).

Streamed-text (bistream) requests, whose text arrives while the speech is made, are summarized apart: their first
audio is also timed from the text that let decoding start (`TextStream.unlocked_at`) and from the text it waited
for last (`TextStream.first_audio_text_at`), and their underruns are also
counted over the pieces that arrived while the text was still coming (a stall there is the text's or the server's).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

UNDERRUN_TOLERANCE_S = 0.05  # lateness a listener does not hear as a stall
OK, FAILED, REJECTED = "ok", "failed", "rejected"


@dataclass
class TextTimes:
    """When a streamed-text request's text arrived, in seconds from the call."""

    pieces: int  # pushes
    unlocked: float | None  # the push (or the end of the text) that let decoding start; None if it never did
    closed: float | None  # the end of the text
    first_audio_text: float | None = None  # the push (or end) that the first audio waited for last


@dataclass
class Delivery:
    """One request as its client saw it; times in seconds from the call."""

    status: str  # OK, FAILED or REJECTED (refused as busy: not served, not failed)
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio seconds) per piece
    frontend: float | None = None  # the engine's frontend time (in-process only)
    error: str = ""
    refused: float | None = None  # when a refusal (REJECTED) was answered
    text: TextTimes | None = None  # streamed text only

    @property
    def first_packet(self) -> float | None:
        return self.arrivals[0][0] if self.arrivals else None

    @property
    def audio(self) -> float:
        return sum(seconds for _, seconds in self.arrivals)

    @property
    def took(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else 0.0


@dataclass
class Record:
    """A delivery stamped by the load driver: which request, and when it was sent (s from the run's start)."""

    index: int
    sent: float
    delivery: Delivery
    dispatch_lag: float = 0.0  # s the call started after its scheduled time (open loop)

    @property
    def end(self) -> float:
        return self.sent + self.delivery.took


def _lateness(arrivals: list[tuple[float, float]]) -> list[float]:
    """How late each piece after the first is, in s (negative: early). Playback starts when the first piece arrives;
    a piece is late by the time between the end of the audio before it and its arrival; playback resumes when it
    arrives, so one stall does not make every later piece late too."""
    if not arrivals:
        return []
    late = []
    start, seconds = arrivals[0]
    played_until = start + seconds
    for arrival, seconds in arrivals[1:]:
        late.append(arrival - played_until)
        played_until = max(played_until, arrival) + seconds
    return late


def underruns(arrivals: list[tuple[float, float]], tolerance: float = UNDERRUN_TOLERANCE_S) -> tuple[int, float]:
    """(underrun events, worst lateness in s, never below 0) of one stream (see `_lateness`)."""
    late = _lateness(arrivals)
    return sum(x > tolerance for x in late), max([0.0, *late])


def late_pieces(arrivals: list[tuple[float, float]], tolerance: float = UNDERRUN_TOLERANCE_S) -> list[int]:
    """Indices of the pieces that arrived more than `tolerance` late (1: the second piece): where streams run dry."""
    return [i + 1 for i, x in enumerate(_lateness(arrivals)) if x > tolerance]


def percentiles_ms(values: list[float], qs: tuple[int, ...] = (50, 95, 99)) -> dict:
    """{"p50": ..., "max": ...} in ms of values in s; {} for none."""
    if not values:
        return {}
    ms = np.asarray(values) * 1000
    return {**{f"p{q}": float(np.percentile(ms, q)) for q in qs}, "max": float(ms.max())}


def graph_captures(stats: dict | None) -> int | None:
    """Flow and HiFT CUDA graphs captured so far (each stalls the vocoder once); None where stats lack them."""
    if not stats or "flow_graph_captures" not in stats or "hift_graph_captures" not in stats:
        return None
    return stats["flow_graph_captures"] + stats["hift_graph_captures"]


def _load_width(rows: list[dict]) -> int:
    return max([10, *(len(r["load"]) for r in rows)])


def compare_transports(rows: list[dict]) -> list[dict]:
    """Each load run both in-process and over HTTP (same requests, same engine): their first packet p50 and p95 side
    by side, and what HTTP adds (ms), with the in-process frontend p50 (the HTTP requests' voices are saved
    beforehand: their first packet holds no frontend)."""
    by_load: dict[tuple, dict] = {}
    for r in rows:
        by_load.setdefault((r["mode"], r.get("rate", r.get("clients"))), {})[r["transport"]] = r
    pairs = []
    for (mode, value), runs in by_load.items():
        if {"in-process", "http"} <= runs.keys():
            local, http = runs["in-process"]["first_packet_ms"], runs["http"]["first_packet_ms"]
            frontend = runs["in-process"]["frontend_ms"] or {}
            pair = {"mode": mode, "value": value, "load": runs["http"]["load"].removesuffix(" http"),
                    "in_process_frontend_p50_ms": frontend.get("p50")}
            for q in ("p50", "p95"):
                a, b = local.get(q), http.get(q)
                pair[f"in_process_{q}_ms"], pair[f"http_{q}_ms"] = a, b
                pair[f"http_adds_{q}_ms"] = None if None in (a, b) else b - a
            pairs.append(pair)
    return pairs


def print_comparison(pairs: list[dict]) -> None:
    """One line per load run both ways: first packet p50 and p95 in-process, over HTTP, and the difference, and the
    in-process frontend p50 (`fe50`; none over HTTP), in ms."""
    if not pairs:
        return
    w = _load_width(pairs)
    print(f"{'load':>{w}} {'in-proc p50':>11} {'http p50':>8} {'+http':>6} {'in-proc p95':>11} {'http p95':>8} "
          f"{'+http':>6} {'fe50':>6}  (first packet, ms; fe50: the in-process frontend)")
    for p in pairs:
        print(f"{p['load']:>{w}} {_fmt(p['in_process_p50_ms'], '11.0f')} {_fmt(p['http_p50_ms'], '8.0f')} "
              f"{_fmt(p['http_adds_p50_ms'], '+6.0f')} {_fmt(p['in_process_p95_ms'], '11.0f')} "
              f"{_fmt(p['http_p95_ms'], '8.0f')} {_fmt(p['http_adds_p95_ms'], '+6.0f')} "
              f"{_fmt(p['in_process_frontend_p50_ms'], '6.1f')}")


def print_stage_rows(rows: list[dict]) -> None:
    """One line per run whose engine counters were read: each thread's busy share and the sizes of its work."""
    rows = [r for r in rows if r.get("stages")]
    if not rows:
        return
    w = _load_width(rows)
    print(f"{'load':>{w}} {'llm%':>5} {'steps/s':>7} {'rows':>5} {'voc%':>5} {'rnd/s':>6} {'chunks':>6} "
          f"{'flow/s':>6} {'rows':>5} {'pfx/s':>5} {'ride/s':>6}")
    for r in rows:
        g = r["stages"]
        print(f"{r['load']:>{w}} {g['llm_busy_pct']:5.1f} {g['llm_steps_per_s']:7.1f} {g['llm_rows_per_step']:5.1f} "
              f"{g['vocoder_busy_pct']:5.1f} {g['rounds_per_s']:6.2f} {g['chunks_per_round']:6.1f} "
              f"{g['flow_calls_per_s']:6.2f} {g['flow_rows_per_call']:5.1f} {g['prefix_calls_per_s']:5.2f} "
              f"{g['prefix_rides_per_s']:6.2f}")


def summarize(records: list[Record], window_s: float, captures: int | None = None, gpu_busy: float | None = None,
              peak_mem_gb: float | None = None) -> dict:
    """The report of one run's measured requests; `window_s` is the time their audio is delivered over."""
    done = [r.delivery for r in records if r.delivery.status == OK]
    streams = [underruns(d.arrivals) for d in done]
    audio = sum(d.audio for d in done)
    frontend = [d.frontend for d in done if d.frontend is not None]
    errors = sorted({r.delivery.error for r in records if r.delivery.error})
    return {
        "sent": len(records),
        "ok": len(done),
        "failed": sum(r.delivery.status == FAILED for r in records),
        "rejected": sum(r.delivery.status == REJECTED for r in records),
        "first_packet_ms": percentiles_ms([d.first_packet for d in done]),
        "refusal_ms": percentiles_ms([r.delivery.refused for r in records if r.delivery.refused is not None]),
        "frontend_ms": percentiles_ms(frontend) if frontend else None,
        "underrun_events": sum(n for n, _ in streams),
        "underrun_streams": sum(n > 0 for n, _ in streams),
        "worst_late_ms": 1000 * max((w for _, w in streams), default=0.0),
        "underruns_by_piece": dict(sorted(Counter(i for d in done for i in late_pieces(d.arrivals)).items())),
        "audio_s": audio,
        "window_s": window_s,
        "audio_s_per_s": audio / window_s if window_s > 0 else 0.0,
        "dispatch_lag_ms_max": 1000 * max((r.dispatch_lag for r in records), default=0.0),
        "graph_captures": captures,
        "gpu_busy_pct": gpu_busy,
        "peak_mem_gb": peak_mem_gb,
        "errors": errors[:10],
    }


def summarize_bistream(records: list[Record], window_s: float) -> dict:
    """`summarize` of streamed-text requests, with: first audio from the text that let decoding start
    (`unlock_to_first_audio_ms`) and from the text it waited for last (`text_to_first_audio_ms`: the engine's own
    share), underruns of the audio that arrived while text was still arriving, pushes."""
    row = summarize(records, window_s)
    done = [r.delivery for r in records if r.delivery.status == OK and r.delivery.text is not None]
    unlock = [d.first_packet - d.text.unlocked for d in done if d.text.unlocked is not None]
    last_text = [d.first_packet - d.text.first_audio_text for d in done if d.text.first_audio_text is not None]
    open_ = [underruns([a for a in d.arrivals if d.text.closed is None or a[0] < d.text.closed]) for d in done]
    return {**{k: v for k, v in row.items() if k not in ("graph_captures", "gpu_busy_pct", "peak_mem_gb")},
            "unlock_to_first_audio_ms": percentiles_ms(unlock),
            "text_to_first_audio_ms": percentiles_ms(last_text),
            "text_open_underrun_events": sum(n for n, _ in open_),
            "text_open_underrun_streams": sum(n > 0 for n, _ in open_),
            "text_pieces": sum(d.text.pieces for d in done),
            "text_ms": percentiles_ms([d.text.closed for d in done if d.text.closed is not None])}


def passes(row: dict, p95_ms: float) -> bool:
    """The capacity criterion: something served, first packet p95 within `p95_ms`, no underrun, nothing failed or
    refused."""
    return (row["ok"] > 0 and row["failed"] == 0 and row["rejected"] == 0 and row["underrun_events"] == 0
            and row["first_packet_ms"]["p95"] <= p95_ms)


def _fmt(value, spec: str) -> str:
    width = int(spec.split(".")[0].rstrip("df") or 0)
    return "n/a".rjust(width) if value is None else format(value, spec)


def print_rows(rows: list[dict]) -> None:
    """One line per run: load, outcome counts, first packet ms, how long refusals took to be answered (`rf95`,
    `rfmax`, ms), frontend ms, underruns, audio-s/s, captures, GPU, the latest start of a request after its scheduled
    arrival (`lagMs`: large means the client, not the server, set the arrival times), and the serving process's RSS
    at the load's end and its change over the load (`rssGB`, `dRssMB`; n/a for a server elsewhere)."""
    w = _load_width(rows)
    print(f"{'load':>{w}} {'sent':>5} {'ok':>5} {'fail':>4} {'rej':>4} {'fp50':>7} {'fp95':>7} {'fp99':>7} "
          f"{'rf95':>6} {'rfmax':>6} {'fe50':>6} {'fe95':>6} {'under':>5} {'strm':>4} {'lateMs':>7} {'aud-s/s':>8} "
          f"{'cap':>4} {'gpu%':>5} {'memGB':>6} {'lagMs':>6} {'rssGB':>6} {'dRssMB':>7}")
    for r in rows:
        fp, fe, rf = r["first_packet_ms"], r["frontend_ms"] or {}, r.get("refusal_ms") or {}
        host = r.get("host_memory")
        rss = None if host is None else host["end"]["rss_mb"] / 1024
        grew = None if host is None else host["end"]["rss_mb"] - host["start"]["rss_mb"]
        print(f"{r['load']:>{w}} {r['sent']:5} {r['ok']:5} {r['failed']:4} {r['rejected']:4} "
              f"{_fmt(fp.get('p50'), '7.0f')} {_fmt(fp.get('p95'), '7.0f')} {_fmt(fp.get('p99'), '7.0f')} "
              f"{_fmt(rf.get('p95'), '6.0f')} {_fmt(rf.get('max'), '6.0f')} "
              f"{_fmt(fe.get('p50'), '6.1f')} {_fmt(fe.get('p95'), '6.1f')} {r['underrun_events']:5} "
              f"{r['underrun_streams']:4} {r['worst_late_ms']:7.0f} {r['audio_s_per_s']:8.2f} "
              f"{_fmt(r['graph_captures'], '4d')} {_fmt(r['gpu_busy_pct'], '5.1f')} {_fmt(r['peak_mem_gb'], '6.2f')} "
              f"{r['dispatch_lag_ms_max']:6.0f} {_fmt(rss, '6.2f')} {_fmt(grew, '+7.0f')}")


def print_bistream_rows(rows: list[dict]) -> None:
    """One line per run with streamed-text clients: their outcome counts, first audio from the unlocking text
    (`ul50`, `ul95`), from the text it waited for last (`lt50`, `lt95`) and from the call (`fp50`), underruns while
    text arrived and in all, their audio-s/s and everyone's."""
    w = _load_width(rows)
    print(f"{'load':>{w}} {'bistr':>5} {'tok/s':>6} {'sent':>5} {'ok':>5} {'fail':>4} {'rej':>4} {'ul50':>7} "
          f"{'ul95':>7} {'lt50':>6} {'lt95':>6} {'fp50':>7} {'undTx':>5} {'under':>5} {'aud-s/s':>8} {'all/s':>7}")
    for r in rows:
        b = r.get("bistream")
        if not b:
            continue
        ul, lt, fp = b["unlock_to_first_audio_ms"], b["text_to_first_audio_ms"], b["first_packet_ms"]
        print(f"{r['load']:>{w}} {b['clients']:5} {b['text_rate']:6g} {b['sent']:5} {b['ok']:5} {b['failed']:4} "
              f"{b['rejected']:4} {_fmt(ul.get('p50'), '7.0f')} {_fmt(ul.get('p95'), '7.0f')} "
              f"{_fmt(lt.get('p50'), '6.0f')} {_fmt(lt.get('p95'), '6.0f')} "
              f"{_fmt(fp.get('p50'), '7.0f')} {b['text_open_underrun_events']:5} {b['underrun_events']:5} "
              f"{b['audio_s_per_s']:8.2f} {r['audio_s_per_s_all']:7.2f}")
