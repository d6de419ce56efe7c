"""The load drivers of the serving benchmark: open-loop Poisson arrivals and closed-loop clients.

Both run an unmeasured warm-up, then the measured window; a request is measured when it is due inside the window
(open loop: its scheduled arrival; closed loop: its sending), and the window's report waits for every measured
request to end. One thread per request in flight: the open loop
starts each at its scheduled time, counted from one start instant (a late start never shifts the ones after it);
a closed-loop client sends its next request when its last one ends. A transport prepares a request before its time
(voice audio, a saved voice, a request body) and then sends it; its `stats()` are the engine's counters, read at
both ends of the window.

Either load may run beside `Bistream` clients: closed-loop clients whose requests stream their text in at a token
rate (a voice agent's LLM), measured by the same window rule as closed-loop clients. Every request of a run, of
either kind, has its own index (its own voice).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cosyvoice_opt.bench.report import Delivery, Record
from cosyvoice_opt.bench.workload import RequestSpec, Workload, poisson_arrivals


class Transport(Protocol):
    lengths: str  # "forced" (token counts forced) or "text" (lengths follow the text)

    def prepare(self, spec: RequestSpec, text_rate: float | None = None) -> object: ...

    def send(self, prepared: object) -> Delivery: ...

    def stats(self) -> dict | None: ...


@dataclass(frozen=True)
class Bistream:
    """Streamed-text clients beside a load: `clients` of them, each text arriving at `text_rate` tokens/s."""

    clients: int
    text_rate: float

    def __post_init__(self) -> None:
        if self.clients < 0 or not self.text_rate > 0:
            raise ValueError(f"need clients >= 0 and a positive text rate, got {self.clients}, {self.text_rate}")


@dataclass
class Run:
    """The measured requests of one run and the window they were measured in."""

    records: list[Record]
    started: float  # time.time() at the window's start (to pick the GPU readings of the window)
    ended: float  # time.time() when the last measured request ended
    window_s: float  # from the window's start to the later of its end and the last measured request's end
    stats_before: dict | None
    stats_after: dict | None
    warmup_sent: int
    next_index: int  # the first request index the run did not use (the next run's voices are new ones)


class _Collector:
    """Records of requests sent in [warmup, warmup + duration) seconds after `t0`; the threads that send them."""

    def __init__(self, transport: Transport, t0: float, warmup: float, duration: float, first_free: int) -> None:
        self.transport, self.t0, self.warmup, self.duration = transport, t0, warmup, duration
        self.records: list[Record] = []
        self.warmup_sent = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._indices = itertools.count(first_free)

    def take_index(self) -> int:
        """The next request index no request of the run has (closed-loop and streamed-text clients)."""
        with self._lock:
            return next(self._indices)

    def client(self, workload: Workload, text_rate: float | None = None) -> None:
        """A closed-loop client: sends its next request when its last one ends, until the window's end."""
        while True:
            index = self.take_index()
            prepared = self.transport.prepare(workload.request(index), text_rate)
            if time.perf_counter() - self.t0 >= self.warmup + self.duration:
                return
            self.send(index, prepared)

    def send(self, index: int, prepared: object, scheduled: float | None = None) -> None:
        """Send now (blocking); keep the record if it was due (scheduled, else sent) in the window."""
        sent = time.perf_counter() - self.t0
        delivery = self.transport.send(prepared)
        due = sent if scheduled is None else scheduled
        record = Record(index, sent, delivery, max(0.0, sent - due))
        with self._lock:
            if self.warmup <= due < self.warmup + self.duration:
                self.records.append(record)
            else:
                self.warmup_sent += 1

    def spawn(self, target: Callable, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def wait_until(self, offset: float) -> None:
        delay = self.t0 + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def _measure(transport: Transport, warmup: float, duration: float, drive: Callable[[_Collector], None],
             on_window: Callable[[], None] | None, first_free: int, workload: Workload,
             bistream: Bistream | None) -> Run:
    """Start the `bistream` clients and run `drive` (which starts the senders); at the window's start call
    `on_window` and take the stats; wait for every request. Indices from `first_free` on are the clients'."""
    collector = _Collector(transport, time.perf_counter(), warmup, duration, first_free)
    for _ in range(bistream.clients if bistream else 0):
        collector.spawn(collector.client, workload, bistream.text_rate)
    window: dict = {}

    def open_window() -> None:
        collector.wait_until(warmup)
        if on_window is not None:
            on_window()
        window["stats"], window["wall"] = transport.stats(), time.time()

    opener = threading.Thread(target=open_window, daemon=True)
    opener.start()
    drive(collector)
    opener.join()
    collector.join()
    stats_after = transport.stats()
    records = sorted(collector.records, key=lambda r: r.sent)
    last_end = max((r.end for r in records), default=warmup + duration)
    window_s = max(duration, last_end - warmup)
    return Run(records, window["wall"], window["wall"] + window_s, window_s, window["stats"], stats_after,
               collector.warmup_sent, collector.take_index())


def open_loop(transport: Transport, workload: Workload, rate: float, duration: float, warmup: float,
              first_index: int = 0, seed: int = 0, on_window: Callable[[], None] | None = None,
              bistream: Bistream | None = None) -> Run:
    """Poisson arrivals at `rate`/s for `warmup` + `duration` seconds, each request on its own thread. Every request
    is prepared before the clock starts, so the dispatching thread only waits and starts threads: work of its own
    (and the GIL it takes) would make arrivals late."""
    arrivals = poisson_arrivals(rate, warmup + duration, seed)
    prepared = [transport.prepare(workload.request(first_index + k)) for k in range(len(arrivals))]

    def drive(c: _Collector) -> None:
        for k, at in enumerate(arrivals):
            c.wait_until(at)
            c.spawn(c.send, first_index + k, prepared[k], at)
            prepared[k] = None  # the request's thread holds it now; freed when it ends
        c.wait_until(warmup + duration)  # the window is open until its end even when arrivals end before it

    return _measure(transport, warmup, duration, drive, on_window, first_index + len(arrivals), workload, bistream)


def closed_loop(transport: Transport, workload: Workload, clients: int, duration: float, warmup: float,
                first_index: int = 0, on_window: Callable[[], None] | None = None,
                bistream: Bistream | None = None) -> Run:
    """`clients` clients, each sending its next request when its last one ends, until `warmup` + `duration`."""

    def drive(c: _Collector) -> None:
        for _ in range(clients):
            c.spawn(c.client, workload)

    return _measure(transport, warmup, duration, drive, on_window, first_index, workload, bistream)
