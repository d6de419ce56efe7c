"""Capturing CUDA graphs while another thread keeps the GPU busy.

`torch.cuda.graph` prepares every capture by synchronizing the whole device and emptying the allocator's GPU cache
and its pinned host cache. The engine captures its flow and HiFT graphs at start-up (and again after a precision
switch or a larger pool), while its other thread may be running: that would stall the capturing thread on
everybody's queued work, hand cached GPU memory back to the driver (the next allocations pay cudaMalloc again) and
drop the pinned buffers of the host copies (`engine/host.py`). A capture runs nothing, so it needs none of that:
`capture` only records. What it does need is memory that the allocator cannot take from its cache while a capture
is under way, so `capture_or_eager` hands the cache back and tries again when a capture runs out of memory, once; a
capture that fails otherwise leaves that shape eager. `GraphSet` keeps such graphs by shape (the flow's and HiFT's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar

import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, stream: torch.cuda.Stream) -> Iterator[None]:
    """Record into `graph` the CUDA work this thread issues in the block, on `stream`, allocating from `pool` (graphs
    that never run at the same time may share one). Thread-local: other threads keep launching their own work
    meanwhile. If the block fails, that error is raised, not the one ending the broken capture may add."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        except BaseException:
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
            raise
        graph.capture_end()


def capture_or_eager(capture_fn: Callable[[], None], what: str) -> bool:
    """Run `capture_fn` (a warm-up and a `capture`); True if it captured. Out of memory, the allocator's cached blocks
    are handed back (a capture cannot use them) and it runs once more; out of memory again, the error propagates
    (the vocoder then retries its requests one at a time). Any other failure is logged and gives False: the caller
    runs that shape eagerly, correct and slower."""
    try:
        try:
            capture_fn()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            capture_fn()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a driver or library that cannot capture this shape: run it eagerly
        log.warning("capturing %s failed (%s: %s); it runs eagerly", what, type(e).__name__, e)
        return False
    return True


class Capturable(Protocol):
    def capture(self, pool: tuple[int, int] | None, stream: torch.cuda.Stream | None) -> None: ...


G = TypeVar("G", bound=Capturable)


class GraphSet(Generic[G]):
    """A fixed set of graphs of one kind by shape, all captured at start-up (`capture_all`). Serving never captures:
    a capture stalls its thread for 0.1-0.3 s and allocates, so the shapes a request can bring are padded to the
    keys of the set, and a shape outside it runs eagerly (correct, slower: counted in `misses`). The captures share
    one memory pool and one stream of their own, so graphs must run one at a time (from one thread) and be done with
    their output before the next one runs."""

    def __init__(self, label: str, device: torch.device, capturing: bool) -> None:
        self.label = label  # a %-format of the key, for the log
        self.capturing = capturing
        self.entries: dict[Hashable, G] = {}
        self.captures = 0
        self.misses = 0  # calls whose shape the set does not hold (eager)
        self._pool = torch.cuda.graph_pool_handle() if capturing else None
        self._stream = torch.cuda.Stream(device) if capturing else None

    def capture_all(self, keys: list[Hashable], make: Callable[[Hashable], G]) -> None:
        """Make and capture a graph per key (a key that fails to capture stays eager; out of memory propagates)."""
        if not self.capturing:
            return
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            if key in self.entries:
                continue
            graph = make(key)
            if capture_or_eager(lambda graph=graph: graph.capture(self._pool, self._stream), self.label % key):
                self.captures += 1
                self.entries[key] = graph
            else:  # a capture that failed may leave its pool marked as recording: the next ones take a fresh pool
                self._pool = torch.cuda.graph_pool_handle()
            if (i + 1) % 25 == 0:
                log.info("captured %d of %d %s graphs (%.1f s)", i + 1, len(keys), self.label.split(" ")[1],
                         time.perf_counter() - t0)
        log.info("captured %d %s graphs in %.1f s", len(self.entries), self.label.split(" ")[1],
                 time.perf_counter() - t0)

    def get(self, key: Hashable, make: Callable[[Hashable], G]) -> G:
        """The captured graph of `key`, else a fresh uncaptured one (eager)."""
        graph = self.entries.get(key)
        if graph is not None:
            return graph
        if self.capturing:
            self.misses += 1
        return make(key)

    def clear(self) -> None:
        """Drop every graph (what they read is going away); later ones get a new pool, the old one went with them."""
        self.entries.clear()
        if self.capturing:
            self._pool = torch.cuda.graph_pool_handle()
