"""The serving benchmark: workload, schedule, underrun rule, capacity search, and short runs on the tiny model."""

from __future__ import annotations

import json
import platform
import re
import sys

import numpy as np
import pytest

from cosyvoice_opt.bench import capacity, serving, transport
from cosyvoice_opt.bench.cli import main
from cosyvoice_opt.bench.loopback import serve_in_process
from cosyvoice_opt.bench.report import (
    FAILED,
    OK,
    REJECTED,
    Delivery,
    Record,
    TextTimes,
    late_pieces,
    passes,
    summarize,
    summarize_bistream,
    underruns,
)
from cosyvoice_opt.bench.serving import in_process_target
from cosyvoice_opt.bench.transport import HttpTransport, InProcessTransport, http_lengths, token_pieces
from cosyvoice_opt.bench.workload import TOKENS_PER_SECOND, Workload, poisson_arrivals, synthetic_prompt
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.counters import stage_use
from cosyvoice_opt.errors import EngineBusy
from cosyvoice_opt.limits import MAX_QUEUE_WAIT_RANGE
from cosyvoice_opt.server.model_names import model_ids

TINY_WORKLOAD = Workload(prompt_seconds=(3.0, 4.0), audio_seconds=(0.4, 0.8), seed=7)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    config = EngineConfig(random_size="tiny", device="cpu", precision="fp32",
                          voices_dir=str(tmp_path_factory.mktemp("voices")))
    with Engine.from_model_dir(None, config) as e:
        yield e


# ---- workload ------------------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_and_have_the_rate():
    times = poisson_arrivals(50.0, 200.0, seed=3)
    assert times == poisson_arrivals(50.0, 200.0, seed=3)  # reproducible
    assert times != poisson_arrivals(50.0, 200.0, seed=4)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 200.0
    assert abs(len(times) - 50 * 200) < 4 * np.sqrt(50 * 200)  # Poisson count: mean = variance = rate x duration
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / 50) < 0.001
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: coefficient of variation 1
    assert poisson_arrivals(0.0, 10.0) == [] and poisson_arrivals(5.0, 0.0) == []


def test_workload_draws_within_its_ranges_and_every_voice_differs():
    workload = Workload(prompt_seconds=(3.0, 10.0), audio_seconds=(2.0, 20.0), words_per_second=2.5, seed=1)
    specs = [workload.request(i) for i in range(200)]
    assert all(3.0 <= s.voice.seconds <= 10.0 and 2.0 <= s.audio_seconds <= 20.0 for s in specs)
    assert all(s.tokens == round(s.audio_seconds * TOKENS_PER_SECOND) for s in specs)
    seconds = [s.voice.seconds for s in specs]
    assert min(seconds) < 4.0 and max(seconds) > 9.0  # spread over the range, not bunched
    assert len({s.voice.name for s in specs}) == 200 and len({s.voice.seed for s in specs}) == 200
    assert len({s.voice.f0 for s in specs}) == 200 and len({s.text for s in specs}) == 200
    assert len({s.voice.prompt_text for s in specs}) == 200
    for s in specs[:5]:  # text and transcript lengths follow the audio lengths; one sentence each
        assert len(s.text.split()) == round(s.audio_seconds * 2.5)
        assert len(s.voice.prompt_text.split()) == round(s.voice.seconds * 2.5)
        assert re.fullmatch(r"[A-Z][a-z ]+\.", s.text)
    a, b = specs[0].voice.audio(), specs[1].voice.audio()
    assert a[0] == b[0] == 16000 and len(a[1]) == int(specs[0].voice.seconds * 16000)
    assert 0.1 < np.abs(a[1]).max() < 1.0
    # the same request whatever was drawn before it; another seed, other requests
    assert Workload(seed=1).request(17) == specs[17]
    assert Workload(seed=2).request(17).voice != specs[17].voice
    with pytest.raises(ValueError):
        Workload(audio_seconds=(5.0, 2.0))


def test_voice_variants_are_the_same_requests_with_other_voices():
    base, twins = Workload(seed=3), Workload(seed=3, voice_variant=1)
    for k in range(20):
        a, b = base.request(k), twins.request(k)
        assert (a.index, a.text, a.audio_seconds, a.tokens) == (b.index, b.text, b.audio_seconds, b.tokens)
        assert (a.voice.seconds, a.voice.f0, a.voice.prompt_text) == (b.voice.seconds, b.voice.f0, b.voice.prompt_text)
        assert a.voice.name != b.voice.name and b.voice.name == f"{a.voice.name}-v1"
        assert not np.array_equal(a.voice.audio()[1], b.voice.audio()[1])  # other samples: new to the prompt caches


def test_synthetic_prompt_defaults_are_the_sweeps_fixed_prompt():
    rate, wave = synthetic_prompt()
    t = np.arange(3 * 16000) / 16000
    phase = 2 * np.pi * np.cumsum(170 + 50 * np.sin(2 * np.pi * 0.7 * t)) / 16000
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    expected = 0.25 * tone * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2) + np.random.default_rng(0).normal(
        0, 0.01, t.shape)
    assert rate == 16000 and np.array_equal(wave, expected.astype(np.float32))


# ---- report --------------------------------------------------------------------------------------------------------
def test_underruns_count_late_pieces_and_playback_resumes_at_arrival():
    # starts at 0.5 and plays to 1.5; 1.25 is early (to 2.5); 2.5625 is 62.5 ms late (event; plays to 3.5625);
    # 3.59375 is 31.25 ms late (within the tolerance; to 4.09375); 4.25 is 156.25 ms late (event; to 4.75)
    arrivals = [(0.5, 1.0), (1.25, 1.0), (2.5625, 1.0), (3.59375, 0.5), (4.25, 0.5), (4.5, 0.25)]
    assert underruns(arrivals) == (2, 0.15625)
    assert underruns(arrivals, tolerance=0.0) == (3, 0.15625)
    # one stall of a second: the pieces after it are on time for the resumed playback, not late all the way
    assert underruns([(0.0, 1.0), (2.0, 1.0), (2.5, 1.0), (3.5, 1.0)]) == (1, 1.0)
    assert underruns([(0.25, 2.0)]) == (0, 0.0) and underruns([]) == (0, 0.0)
    assert underruns([(0.0, 1.0), (0.5, 1.0)]) == (0, 0.0)  # never late: the worst lateness is 0
    assert late_pieces(arrivals) == [2, 4] and late_pieces(arrivals, tolerance=0.0) == [2, 3, 4]
    assert late_pieces([(0.25, 2.0)]) == [] and late_pieces([]) == []


def test_summarize_counts_outcomes_underruns_and_delivered_audio():
    records = [
        Record(0, 0.0, Delivery(OK, [(0.5, 1.0), (1.25, 1.0), (2.5625, 1.0), (3.59375, 0.5), (4.25, 0.5)], 0.01)),
        Record(1, 0.25, Delivery(OK, [(0.25, 2.0), (1.0, 2.0)], 0.03)),
        Record(2, 0.5, Delivery(REJECTED, error="EngineBusy: busy", refused=0.125)),
        Record(3, 0.75, Delivery(FAILED, [(0.5, 0.5)], error="InputError: bad")),
    ]
    row = summarize(records, window_s=4.0, captures=2)
    assert (row["sent"], row["ok"], row["failed"], row["rejected"]) == (4, 2, 1, 1)
    assert (row["underrun_events"], row["underrun_streams"], row["worst_late_ms"]) == (2, 1, 156.25)
    assert row["underruns_by_piece"] == {2: 1, 4: 1}
    assert row["audio_s"] == 8.0 and row["audio_s_per_s"] == 2.0  # ok requests only
    assert row["first_packet_ms"]["p50"] == 375.0 and row["first_packet_ms"]["max"] == 500.0
    assert row["refusal_ms"]["p95"] == 125.0 and row["refusal_ms"]["max"] == 125.0  # refused requests only
    assert row["frontend_ms"]["p50"] == pytest.approx(20.0)
    assert row["errors"] == ["EngineBusy: busy", "InputError: bad"] and row["graph_captures"] == 2
    assert row["gpu_busy_pct"] is None and row["peak_mem_gb"] is None
    assert not passes(row, p95_ms=10_000)  # refused, failed and underrun
    clean = summarize(records[1:2], window_s=4.0)
    assert clean["refusal_ms"] == {}
    assert passes(clean, p95_ms=250.0) and not passes(clean, p95_ms=249.0)


def test_summarize_bistream_times_first_audio_from_the_unlocking_text_and_underruns_while_text_arrives():
    records = [  # text closed at 2.0: the 62.5 ms stall at 1.5625 is while text arrives, the 250 ms one at 3.25 after
        Record(0, 0.0, Delivery(OK, [(0.5, 0.5), (1.5625, 1.0), (3.25, 0.5)], 0.01,
                                text=TextTimes(12, 0.25, 2.0, 0.375))),
        Record(1, 0.5, Delivery(OK, [(1.0, 2.0)], 0.01, text=TextTimes(8, 0.875, 1.5, 0.9375))),
        Record(2, 1.0, Delivery(REJECTED, error="EngineBusy: busy", text=TextTimes(3, None, 0.5))),
    ]
    row = summarize_bistream(records, window_s=4.0)
    assert (row["sent"], row["ok"], row["failed"], row["rejected"]) == (3, 2, 0, 1)
    assert row["unlock_to_first_audio_ms"]["p50"] == 187.5 and row["unlock_to_first_audio_ms"]["max"] == 250.0
    assert row["text_to_first_audio_ms"]["p50"] == 93.75 and row["text_to_first_audio_ms"]["max"] == 125.0
    assert (row["text_open_underrun_events"], row["text_open_underrun_streams"]) == (1, 1)
    assert (row["underrun_events"], row["underrun_streams"]) == (2, 1)
    assert row["text_pieces"] == 20 and row["text_ms"]["max"] == 2000.0  # served requests only
    assert row["audio_s"] == 4.0 and row["audio_s_per_s"] == 1.0
    assert "graph_captures" not in row  # the engine's counters belong to the whole row


def test_token_pieces_stream_the_text_token_by_token(engine):
    for text in ("The quick brown fox jumps.", "今天天气真不错 ok"):
        pieces = token_pieces(engine.tokenizer, text)
        assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
        assert len(pieces) <= len(engine.tokenizer.encode(text))
    english = token_pieces(engine.tokenizer, "The quick brown fox jumps.")
    assert len(english) == len(engine.tokenizer.encode("The quick brown fox jumps."))  # one piece per token


# ---- capacity search -----------------------------------------------------------------------------------------------
def _searched(limit: float, start: float, steps: int) -> capacity.Capacity:
    return capacity.search(lambda rate: rate <= limit, start, steps)


def test_stage_use_reads_each_threads_share_and_work_sizes_off_the_counters():
    before = {"llm_steps": 100, "llm_rows": 300, "llm_busy_seconds": 1.0, "vocoder_rounds": 10,
              "vocoder_chunks": 30, "vocoder_busy_seconds": 2.0, "flow_calls": 12, "flow_rows": 40,
              "flow_prefix_calls": 2, "flow_prefix_rides": 1}
    after = {"llm_steps": 300, "llm_rows": 1100, "llm_busy_seconds": 2.5, "vocoder_rounds": 30,
             "vocoder_chunks": 130, "vocoder_busy_seconds": 5.0, "flow_calls": 52, "flow_rows": 240,
             "flow_prefix_calls": 6, "flow_prefix_rides": 9}
    use = stage_use(before, after, 4.0)
    assert use == pytest.approx({"llm_busy_pct": 37.5, "llm_steps_per_s": 50.0, "llm_rows_per_step": 4.0,
                                 "vocoder_busy_pct": 75.0, "rounds_per_s": 5.0, "chunks_per_round": 5.0,
                                 "flow_calls_per_s": 10.0, "flow_rows_per_call": 5.0, "prefix_calls_per_s": 1.0,
                                 "prefix_rides_per_s": 2.0})
    assert stage_use(before, {k: v for k, v in after.items() if k != "flow_rows"}, 4.0) is None  # an older server
    assert stage_use(None, after, 4.0) is None
    assert stage_use(after, before, 4.0) is None  # counters that went down: not the same engines (a replica left)


def test_capacity_doubles_then_bisects_within_its_steps():
    found = _searched(7.3, 1.0, 20)
    assert found.steps == [(1.0, True), (2.0, True), (4.0, True), (8.0, False), (6.0, True), (7.0, True),
                           (7.5, False), (7.25, True)]  # 7.5 is within 5 % of 7.25: done
    assert (found.best, found.failed_at) == (7.25, 7.5)
    bounded = _searched(7.3, 1.0, 5)
    assert [r for r, _ in bounded.steps] == [1.0, 2.0, 4.0, 8.0, 6.0] and (bounded.best, bounded.failed_at) == (6, 8)


def test_capacity_halves_when_the_start_fails_and_may_find_none():
    found = _searched(0.3, 1.0, 5)
    assert found.steps == [(1.0, False), (0.5, False), (0.25, True), (0.375, False), (0.3125, False)]
    assert (found.best, found.failed_at) == (0.25, 0.3125)
    none = _searched(0.0, 1.0, 3)
    assert none.best is None and none.failed_at == 0.25 and len(none.steps) == 3


# ---- runs on the tiny model ----------------------------------------------------------------------------------------
def test_open_loop_in_process_reports_every_field(tmp_path, capsys):
    """A few Poisson requests through the command line: all served, forced lengths delivered exactly. The queue
    bound is the longest accepted: a slow CI CPU paces the queue so slowly that a shorter one refuses some."""
    out = tmp_path / "serve.json"
    rate, duration, warmup, seed = 4.0, 1.5, 0.5, 11
    assert main(["--serve", "--random", "tiny", "--device", "cpu", "--rates", str(rate), "--duration",
                 str(duration), "--warmup", str(warmup), "--seed", str(seed), "--prompt-seconds", "3,4",
                 "--audio-seconds", "0.4,0.8", "--max-queue-wait", str(MAX_QUEUE_WAIT_RANGE[1]), "--json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    arrivals = poisson_arrivals(rate, warmup + duration, seed)
    measured = [k for k, t in enumerate(arrivals) if warmup <= t < warmup + duration]
    assert measured, "the seeded schedule has requests in the window"
    assert (row["sent"], row["ok"], row["failed"], row["rejected"]) == (len(measured), len(measured), 0, 0)
    assert row["warmup_sent"] == len(arrivals) - len(measured)
    workload = Workload((3.0, 4.0), (0.4, 0.8), seed=seed)
    expected_audio = sum(workload.request(k).tokens / TOKENS_PER_SECOND for k in measured)
    assert row["audio_s"] == pytest.approx(expected_audio)  # each request's forced length, to the sample
    assert row["audio_s_per_s"] == pytest.approx(row["audio_s"] / row["window_s"]) and row["window_s"] >= duration
    fp = row["first_packet_ms"]
    assert 0 < fp["p50"] <= fp["p95"] <= fp["p99"] <= fp["max"]
    assert 0 < row["frontend_ms"]["p50"] < fp["p50"]  # the first packet is timed from the call: frontend included
    assert row["underrun_streams"] <= row["underrun_events"] and row["worst_late_ms"] >= 0
    assert row["graph_captures"] == 0  # no CUDA graphs on the CPU
    assert row["gpu_busy_pct"] is None and row["peak_mem_gb"] is None  # n/a on CPU
    assert (row["mode"], row["rate"], row["transport"], row["lengths"]) == ("open", rate, "in-process", "forced")
    memory = row["host_memory"]  # this process serves: its RSS (and glibc's heap) at the load's start and end
    assert memory["start"]["rss_mb"] > 0 and memory["end"]["rss_mb"] > 0
    if sys.platform == "linux" and "glibc" in platform.libc_ver()[0]:
        assert memory["end"]["heap_in_use_mb"] > 0 and memory["end"]["heap_free_mb"] >= 0
    assert report["engine"]["model"] == "random tiny" and report["engine"]["max_queue_wait"] == MAX_QUEUE_WAIT_RANGE[1]
    assert row["refusal_ms"] == {}  # none refused
    stages = row["stages"]  # the engine's counters over the window
    assert min(stages["llm_busy_pct"], stages["vocoder_busy_pct"], stages["rounds_per_s"]) > 0
    assert stages["llm_rows_per_step"] >= 1 and stages["flow_rows_per_call"] >= 1
    table = capsys.readouterr().out
    assert "fp95" in table and f"{rate:g} req/s" in table and "voc%" in table and "dRssMB" in table
    assert "rfmax" in table and f"max queue wait {MAX_QUEUE_WAIT_RANGE[1]:.0f} s" in table


def test_bistream_clients_beside_an_open_loop_report_apart(engine, tmp_path, capsys):
    """Two streamed-text clients beside Poisson arrivals, no warm-up: each client's first request is measured and
    outlives the window (a second or two of CPU work each), so exactly two are; their texts arrive one token at a
    time and their speech ends at the forced length; the ordinary requests keep their own row and forced lengths."""
    out = tmp_path / "serve.json"
    rate, duration, seed = 2.0, 1.0, 11
    assert main(["--serve", "--random", "tiny", "--device", "cpu", "--precision", "fp32", "--rates", str(rate),
                 "--duration", str(duration), "--warmup", "0", "--seed", str(seed), "--prompt-seconds", "3,4",
                 "--audio-seconds", "2,3", "--bistream", "2", "--text-rate", "20",
                 "--max-queue-wait", str(MAX_QUEUE_WAIT_RANGE[1]), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    arrivals = poisson_arrivals(rate, duration, seed)
    workload = Workload((3.0, 4.0), (2.0, 3.0), seed=seed)
    assert (row["sent"], row["ok"]) == (len(arrivals), len(arrivals)) and row["lengths"] == "forced"
    assert row["audio_s"] == pytest.approx(sum(workload.request(k).tokens for k in range(len(arrivals)))
                                           / TOKENS_PER_SECOND)
    b = row["bistream"]
    assert (b["clients"], b["text_rate"], b["lengths"]) == (2, 20.0, "forced")
    assert (b["sent"], b["ok"], b["failed"], b["rejected"]) == (2, 2, 0, 0)
    streamed = [len(arrivals), len(arrivals) + 1]  # the clients' indices follow the schedule's
    # the speech ends at the forced length, or with the text phase's if longer: at most 15 speech tokens per 5 text
    # tokens, the prompt's text included (its blocks carry the prompt's speech first)
    forced = [workload.request(k).tokens for k in streamed]
    text_ids = [len(engine.tokenizer.encode(workload.request(k).text + workload.request(k).voice.prompt_text))
                for k in streamed]
    speech = round(b["audio_s"] * TOKENS_PER_SECOND)
    assert sum(forced) <= speech <= sum(max(f, 3 * n + 15) for f, n in zip(forced, text_ids, strict=True))
    assert b["text_pieces"] == sum(len(token_pieces(engine.tokenizer, workload.request(k).text)) for k in streamed)
    unlock, first = b["unlock_to_first_audio_ms"], b["first_packet_ms"]
    assert 0 < unlock["p50"] <= unlock["max"] <= first["max"]  # decoding waits for text sent from the call on
    assert b["text_ms"]["max"] <= 1000 * b["window_s"]
    assert 0 <= b["text_open_underrun_events"] <= b["underrun_events"]
    assert b["audio_s"] > 0 and row["audio_s_per_s_all"] == pytest.approx(row["audio_s_per_s"] + b["audio_s_per_s"])
    table = capsys.readouterr().out
    assert "ul95" in table and "undTx" in table


def test_http_both_runs_each_load_in_process_and_over_http_with_the_same_lengths(tmp_path, capsys, monkeypatch):
    """`--http both`: each load on one engine in-process, then over the API served here with twins of the voices
    (new to the engine's caches); both deliver the workload's forced lengths, and the report sets their first
    packets side by side. The queue's bound is the longest allowed: on a slow CPU the 5 s default refuses some of
    these requests as busy, which is not what this test is about."""
    workloads, original = [], serving.http_target

    def http_target(url, headers, clients, workload, *args, **kwargs):
        workloads.append(workload)
        return original(url, headers, clients, workload, *args, **kwargs)

    monkeypatch.setattr(serving, "http_target", http_target)
    out = tmp_path / "serve.json"
    rate, duration, warmup, seed = 4.0, 1.5, 0.5, 11
    assert main(["--serve", "--http", "both", "--random", "tiny", "--device", "cpu", "--rates", str(rate),
                 "--duration", str(duration), "--warmup", str(warmup), "--seed", str(seed), "--prompt-seconds", "3,4",
                 "--audio-seconds", "0.4,0.8", "--max-queue-wait", str(MAX_QUEUE_WAIT_RANGE[1]),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [w.voice_variant for w in workloads] == [1]
    local, http = report["rows"]
    assert (local["transport"], http["transport"]) == ("in-process", "http")
    assert (local["load"], http["load"]) == (f"{rate:g} req/s in-process", f"{rate:g} req/s http")
    assert report["transport"] == "in-process,http" and report["lengths"] == "forced"
    arrivals = poisson_arrivals(rate, warmup + duration, seed)
    measured = [k for k, t in enumerate(arrivals) if warmup <= t < warmup + duration]
    expected_audio = sum(Workload((3.0, 4.0), (0.4, 0.8), seed=seed).request(k).tokens for k in measured) / 25
    for row in (local, http):
        assert row["lengths"] == "forced" and row["rate"] == rate
        assert (row["sent"], row["ok"], row["failed"], row["rejected"]) == (len(measured), len(measured), 0, 0)
        assert row["audio_s"] == pytest.approx(expected_audio)  # the same requests' forced lengths, to the sample
    assert local["frontend_ms"]["p50"] > 0 and http["frontend_ms"] is None  # HTTP: voices saved beforehand
    (pair,) = report["comparison"]
    assert (pair["mode"], pair["value"], pair["load"]) == ("open", rate, f"{rate:g} req/s")
    assert pair["in_process_frontend_p50_ms"] == local["frontend_ms"]["p50"]
    for q in ("p50", "p95"):
        a, b = local["first_packet_ms"][q], http["first_packet_ms"][q]
        assert (pair[f"in_process_{q}_ms"], pair[f"http_{q}_ms"]) == (a, b)
        assert pair[f"http_adds_{q}_ms"] == pytest.approx(b - a)
    table = capsys.readouterr().out
    assert "in-proc p50" in table and "+http" in table and f"{rate:g} req/s http" in table


def test_http_both_is_refused_for_the_capacity_search():
    with pytest.raises(SystemExit):
        main(["--serve", "--http", "both", "--capacity"])


@pytest.mark.parametrize("flags", [["--http"], ["--url", "http://127.0.0.1:9"], [], ["--text-rate", "0"]])
def test_bistream_is_refused_where_it_is_not_measured(flags):
    serve = [] if flags == [] else ["--serve"]
    with pytest.raises(SystemExit):
        main([*serve, "--bistream", "1", *flags])


def test_closed_loop_clients_each_wait_for_their_last_request(engine):
    target = in_process_target(engine, TINY_WORKLOAD, duration=1.0, warmup=0.25, seed=0)
    run = target.measure("clients", 2, 100)
    assert run.records and all(r.delivery.status == OK for r in run.records)
    assert run.next_index >= 100 + len(run.records) + run.warmup_sent
    assert all(100 <= r.index < run.next_index for r in run.records)
    for r in run.records:  # two clients: never more than two requests in flight
        assert sum(s.sent <= r.sent < s.end for s in run.records) <= 2
    assert run.stats_before is not None and run.stats_after["completed"] >= run.stats_before["completed"]


def test_in_process_transport_counts_refusals_and_failures():
    """EngineBusy is a refusal, any other error a failure; neither ends the run."""

    class Refusing:  # request 1 is refused at the call, 2 at its first chunk; 3 fails
        def stream(self, request):
            if request.seed == 1:
                raise EngineBusy("at capacity", retry_after=2.0)
            return self._chunks(request.seed)

        def _chunks(self, seed):
            if seed == 2:
                raise EngineBusy("at capacity", retry_after=2.0)
            raise RuntimeError("broken")
            yield

    transport = InProcessTransport(Refusing())
    for index in (1, 2):
        refused = transport.send(transport.prepare(TINY_WORKLOAD.request(index)))
        assert refused.status == REJECTED and refused.error == "EngineBusy: at capacity" and not refused.arrivals
        assert refused.refused is not None and refused.refused >= 0  # when it was answered
    failed = transport.send(transport.prepare(TINY_WORKLOAD.request(3)))
    assert failed.status == FAILED and failed.error == "RuntimeError: broken" and failed.refused is None


def test_http_transport_streams_pcm_from_a_saved_voice(engine, monkeypatch):
    with serve_in_process(engine) as url:
        transport = HttpTransport(url)
        try:
            spec = TINY_WORKLOAD.request(3)
            prepared = transport.prepare(spec)
            assert spec.voice.name in engine.list_voices()
            delivery = transport.send(prepared)
            assert delivery.status == OK and delivery.first_packet > 0 and delivery.audio > 0
            assert transport.stats()["completed"] >= 1
            unknown = transport.send({**prepared, "voice": "no-such-voice"})
            assert unknown.status == FAILED and unknown.error.startswith("HTTP 400") and unknown.refused is None

            def refuse(request):
                raise EngineBusy("at capacity", retry_after=2.0)

            with monkeypatch.context() as m:
                m.setattr(engine, "stream", refuse)
                busy = transport.send(prepared)
            assert busy.status == REJECTED and "HTTP 503 (Retry-After 2)" in busy.error
            assert busy.refused is not None and busy.refused > 0  # when the refusal was answered
        finally:
            transport.close()
        assert spec.voice.name not in engine.list_voices()  # the run's voices are deleted afterwards


def test_http_transport_forces_the_workloads_lengths_on_random_weights(engine):
    """A server on random weights takes each request's forced token count, as the in-process transport forces it:
    the audio that comes back is that many tokens long, to the sample."""
    specs = [TINY_WORKLOAD.request(k) for k in (4, 5)]
    assert specs[0].tokens != specs[1].tokens  # two lengths: each request gets its own
    with serve_in_process(engine) as url:
        transport = HttpTransport(url)
        try:
            assert transport.lengths == "forced"
            for spec in specs:
                prepared = transport.prepare(spec)
                assert prepared["force_tokens"] == spec.tokens == InProcessTransport(engine).prepare(spec).force_tokens
                delivery = transport.send(prepared)
                assert delivery.status == OK, delivery.error
                assert delivery.audio == pytest.approx(spec.tokens / TOKENS_PER_SECOND)
        finally:
            transport.close()
    assert http_lengths({"is_random": False}) == "text"  # a real model's server refuses the field: not sent



@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_the_benchmarks_http_requests_name_a_model_every_server_answers_to(family):
    """The soak's and the serving benchmark's HTTP requests name a model that a server of either family accepts
    (a family's own alias would be refused by the other family's server with 404 model_not_found)."""
    info = {"model": f"random tiny ({family})", "is_random": True, "family": family}
    assert transport.MODEL in model_ids(info)
