"""Prometheus text exposition (format 0.0.4) for the HTTP API: a few counters and histograms, no dependency."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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


class Metrics:
    """What the API counts. Thread-safe: handlers run on the event loop, streams finish in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status)
        self.failures: Counter[str] = Counter()  # speech requests that failed, by reason
        self.first_chunk = Histogram()
        self.total = Histogram()
        self.audio_seconds = 0.0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def count_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def observe_first_chunk(self, seconds: float) -> None:
        with self._lock:
            self.first_chunk.observe(seconds)

    def observe_done(self, seconds: float, audio_seconds: float) -> None:
        with self._lock:
            self.total.observe(seconds)
            self.audio_seconds += audio_seconds

    def render(self, readings: list[tuple[str, str, str, float]]) -> str:
        """The exposition text, plus live engine/GPU `readings` as (name, "gauge" | "counter", help, value)."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, body: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *body])

        with self._lock:
            family("cosyvoice_api_requests_total", "counter", "HTTP API requests by endpoint and status code.",
                   [f'cosyvoice_api_requests_total{{endpoint="{_label(e)}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())])
            family("cosyvoice_speech_failures_total", "counter", "Speech requests that failed, by reason.",
                   [f'cosyvoice_speech_failures_total{{reason="{_label(r)}"}} {n}'
                    for r, n in sorted(self.failures.items())])
            family("cosyvoice_speech_first_chunk_seconds", "histogram",
                   "Seconds from a speech request's arrival to its first audio chunk.",
                   self.first_chunk.lines("cosyvoice_speech_first_chunk_seconds"))
            family("cosyvoice_speech_total_seconds", "histogram",
                   "Seconds from a speech request's arrival to its last audio byte.",
                   self.total.lines("cosyvoice_speech_total_seconds"))
            family("cosyvoice_speech_audio_seconds_total", "counter", "Seconds of audio delivered.",
                   [f"cosyvoice_speech_audio_seconds_total {_number(self.audio_seconds)}"])
        for name, kind, help_text, value in readings:
            family(name, kind, help_text, [f"{name} {_number(value)}"])
        return "\n".join(lines) + "\n"


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
