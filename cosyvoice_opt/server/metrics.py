"""Prometheus text exposition (format 0.0.4), no dependency: the requests of the HTTP API and the WebUI (one
`Metrics` per engine, `metrics_for`), the engine's counters (every client's requests: WebUI, HTTP API and CLI
alike), the process (as `prometheus_client`'s process collector names it) and the served model.

Names follow Prometheus' conventions: counters end in `_total`, units are spelled out (`_seconds`, `_bytes`)."""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import psutil

from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.server.errors import engine_error

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
Samples = float | list[tuple[dict[str, str], float]]  # one unlabelled value, or (labels, value) pairs
Reading = tuple[str, str, str, Samples]  # (name, "gauge" | "counter", help, samples)
CLIENT_CLOSED = 499  # the status a request counts under when its client left before the end (nginx's convention)

ENGINE_GAUGES = {  # stats() key -> help
    "running": "Requests decoding in the LLM now.",
    "waiting": "Requests queued for admission now.",
    "batch_size": "Requests in the current LLM batch.",
    "flow_pages": "Flow history pages (50 frames each) in the pool.",
    "flow_pages_used": "Flow history pages in use.",
    "streams": "Audio streams admitted now.",
    "max_streams": "Audio streams the engine admits at once, at most.",
    "pages_reserved": "Flow history pages reserved by the admitted requests.",
}
ENGINE_OUTCOMES = {  # stats() key -> outcome label of cosyvoice_engine_requests_total
    "completed": "completed", "failed": "failed", "rejected": "rejected_busy"}
ENGINE_COUNTERS = {  # stats() key -> help
    "fp32_fallbacks": "Audio chunks recomputed in fp32 after non-finite half-precision output, since start.",
    "flow_graph_captures": "CUDA graphs captured for the flow decoder, since start.",
    "hift_graph_captures": "CUDA graphs captured for the HiFT vocoder, since start.",
    "flow_graph_misses": "Flow decoder calls that found no captured CUDA graph and ran eagerly, since start.",
    "hift_graph_misses": "HiFT vocoder calls that found no captured CUDA graph and ran eagerly, since start.",
    "flow_prefix_hits": "Flow prompt prefixes reused from the prefix cache, since start.",
    "llm_steps": "LLM steps that queued work on the GPU, since start.",
    "llm_rows": "Decode rows in those steps (their mean is the LLM batch), since start.",
    "llm_busy_seconds": "Seconds the LLM thread spent in those steps, since start.",
    "vocoder_rounds": "Vocoder rounds (flow and HiFT for the chunks due) run, since start.",
    "vocoder_chunks": "Audio chunks those rounds made, since start.",
    "vocoder_busy_seconds": "Seconds the vocoder thread spent in rounds, since start; near 1 per second, it bounds "
                            "the throughput.",
    "flow_calls": "Paged flow calls (ten Euler steps each), prompt prefixes included, since start.",
    "flow_rows": "Rows those flow calls carried, since start.",
    "flow_prefix_calls": "Flow calls that computed prompt prefixes of new voices, since start.",
    "flow_prefix_rides": "Prompt prefixes of new voices computed as extra rows of a round's flow call, since start.",
}


class Histogram:
    """Cumulative buckets as Prometheus wants them; `observe` is O(log buckets)."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {total}')
        return [*out, f"{name}_sum {_number(self.sum)}", f"{name}_count {total}"]


def failure_reason(status: int, code: str | None = None) -> str | None:
    """Why a speech request failed, by its answer: "invalid" (the request was refused for what it said: 4xx),
    "busy" (503, try again later), "engine_dead" or "engine_error"; None when it did not fail (a client that left
    early is counted apart, as a disconnect)."""
    if status < 400 or status == CLIENT_CLOSED:
        return None
    if status < 500:
        return "invalid"
    if code == "engine_dead":
        return "engine_dead"
    return "busy" if status == 503 else "engine_error"


class Metrics:
    """What the HTTP API and the WebUI count. Thread-safe: handlers run on the event loop, streams finish in worker
    threads, the WebUI's events in Gradio's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (client, endpoint, status)
        self.failures: Counter[str] = Counter()  # speech requests that failed, by reason
        self.disconnects = 0  # speech requests whose client left before the end
        self.first_chunk = Histogram()
        self.duration = Histogram()
        self.audio_seconds = 0.0

    def count_request(self, endpoint: str, status: int, client: str = "api") -> None:
        with self._lock:
            self.requests[client, endpoint, status] += 1

    def count_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def count_disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def count_speech(self, endpoint: str, status: int, code: str | None = None, client: str = "api") -> None:
        """A speech request answered with `status` (error `code`, if any): by endpoint and status, and by reason
        when it failed."""
        self.count_request(endpoint, status, client)
        reason = failure_reason(status, code)
        if reason is not None:
            self.count_failure(reason)
        elif status == CLIENT_CLOSED:
            self.count_disconnect()

    def observe_first_chunk(self, seconds: float) -> None:
        with self._lock:
            self.first_chunk.observe(seconds)

    def observe_done(self, seconds: float, audio_seconds: float) -> None:
        with self._lock:
            self.duration.observe(seconds)
            self.audio_seconds += audio_seconds

    def render(self, readings: list[Reading]) -> str:
        """The exposition text, plus live engine/process `readings`."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, body: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *body])

        with self._lock:
            family("cosyvoice_requests_total", "counter", "Requests by client (api: the HTTP API, webui: the web "
                   "page), endpoint and status code (499: the client left before the end).",
                   [f'cosyvoice_requests_total{{client="{_label(c)}",endpoint="{_label(e)}",status="{s}"}} {n}'
                    for (c, e, s), n in sorted(self.requests.items())])
            family("cosyvoice_speech_failures_total", "counter", "Speech requests that failed, by reason: invalid "
                   "(refused for what the request said), busy (refused at capacity), engine_dead, engine_error.",
                   [f'cosyvoice_speech_failures_total{{reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.failures.items())])
            family("cosyvoice_speech_disconnects_total", "counter",
                   "Speech requests whose client left before the end (cancelled, not failed).",
                   [f"cosyvoice_speech_disconnects_total {self.disconnects}"])
            family("cosyvoice_speech_first_chunk_seconds", "histogram",
                   "Seconds from a speech request's arrival to its first audio chunk.",
                   self.first_chunk.lines("cosyvoice_speech_first_chunk_seconds"))
            family("cosyvoice_speech_duration_seconds", "histogram",
                   "Seconds from a speech request's arrival to its last audio byte.",
                   self.duration.lines("cosyvoice_speech_duration_seconds"))
            family("cosyvoice_speech_audio_seconds_total", "counter", "Seconds of audio delivered.",
                   [f"cosyvoice_speech_audio_seconds_total {_number(self.audio_seconds)}"])
        for name, kind, help_text, samples in readings:
            if isinstance(samples, list):
                family(name, kind, help_text, [f"{name}{{{_labels(labels)}}} {_number(v)}" for labels, v in samples])
            else:
                family(name, kind, help_text, [f"{name} {_number(samples)}"])
        return "\n".join(lines) + "\n"


_BY_ENGINE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


def metrics_for(engine) -> Metrics:
    """The one `Metrics` of everything served on `engine`: the HTTP API and the WebUI count into it, and /metrics
    shows both. An engine that cannot be weakly referenced (a test's stand-in) gets a fresh one."""
    with _BY_ENGINE_LOCK:
        try:
            return _BY_ENGINE.setdefault(engine, Metrics())
        except TypeError:
            return Metrics()


def count_ui_request(engine, endpoint: str, status: int, code: str | None = None) -> None:
    """A WebUI request on `engine` ended: `endpoint` is its event's API name ("/zero_shot", ...), `status` what the
    HTTP API would have answered (200 done, 400 bad input, 503 busy, 500 failed; `ui_status` maps an engine error).
    Counted beside the API's requests under client="webui"."""
    metrics_for(engine).count_speech(endpoint, status, code, client="webui")


def ui_status(error: CosyVoiceError) -> tuple[int, str | None]:
    """(status, code) for an engine error, as the HTTP API answers it: for `count_ui_request`."""
    answer = engine_error(error)
    return answer.status, answer.code


def engine_readings(engine) -> list[Reading]:
    """The engine's live gauges and counters, which count every client's requests (the WebUI calls the engine
    directly), its served model as an info metric, and its GPU memory on CUDA. A `stats()` key not described here
    is exported as a gauge under its own name (a gauge is right for any reading; a counter only for one that never
    goes down)."""
    info, stats = engine.info, engine.stats()
    readings: list[Reading] = [(f"cosyvoice_engine_{k}", "gauge", h, stats[k]) for k, h in ENGINE_GAUGES.items()
                               if k in stats]
    outcomes = [({"outcome": label}, stats[k]) for k, label in ENGINE_OUTCOMES.items() if k in stats]
    readings.append(("cosyvoice_engine_requests_total", "counter", "Synthesis requests the engine ended since start, "
                     "by outcome, from every client (WebUI, HTTP API, CLI); the warm-up is not one.", outcomes))
    for k, v in stats.items():
        if k in ENGINE_COUNTERS and isinstance(v, int | float):
            readings.append((f"cosyvoice_engine_{k}_total", "counter", ENGINE_COUNTERS[k], v))
        elif k not in ENGINE_GAUGES and k not in ENGINE_OUTCOMES and isinstance(v, int | float):
            readings.append((f"cosyvoice_engine_{k}", "gauge", f"Engine statistic: {k.replace('_', ' ')}.", v))
    readings.append(("cosyvoice_engine_max_batch_size", "gauge", "LLM continuous-batching limit.",
                     info["max_batch_size"]))
    readings.append(("cosyvoice_engine_up", "gauge", "Whether the engine serves: 1, or 0 once a fatal error "
                     "stopped it.", 0 if getattr(engine, "fatal_error", None) else 1))
    model = info["model"] if info["is_random"] else Path(info["model"]).name  # the folder's name, no server path
    readings.append(("cosyvoice_model_info", "gauge", "The served model: its name, precision and device.",
                     [({"model": model, "precision": info["precision"], "device": info["device"]}, 1)]))
    if str(info["device"]).startswith("cuda"):
        import torch

        device = torch.device(info["device"])
        readings += [
            ("cosyvoice_gpu_memory_allocated_bytes", "gauge", "GPU memory held by tensors.",
             torch.cuda.memory_allocated(device)),
            ("cosyvoice_gpu_memory_reserved_bytes", "gauge", "GPU memory reserved by the caching allocator.",
             torch.cuda.memory_reserved(device)),
            ("cosyvoice_gpu_memory_max_allocated_bytes", "gauge", "Peak GPU memory held by tensors.",
             torch.cuda.max_memory_allocated(device)),
        ]
    return readings


def process_readings() -> list[Reading]:
    """This process's memory, CPU time, file descriptors and start time, named and described as
    `prometheus_client`'s process collector does, so existing dashboards work."""
    proc = psutil.Process()
    with proc.oneshot():
        mem, cpu, started = proc.memory_info(), proc.cpu_times(), proc.create_time()
        fds = proc.num_fds() if hasattr(proc, "num_fds") else None  # POSIX only
    readings: list[Reading] = [
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", mem.vms),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", mem.rss),
        ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.", started),
        ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
         cpu.user + cpu.system),
    ]
    if fds is not None:
        readings.append(("process_open_fds", "gauge", "Number of open file descriptors.", fds))
        soft, _ = proc.rlimit(psutil.RLIMIT_NOFILE) if hasattr(psutil, "RLIMIT_NOFILE") else (None, None)
        if soft is not None and soft >= 0:
            readings.append(("process_max_fds", "gauge", "Maximum number of open file descriptors.", soft))
    return readings


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
