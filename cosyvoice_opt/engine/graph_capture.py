"""Capturing a CUDA graph while the engine serves.

`torch.cuda.graph` prepares every capture by synchronizing the whole device and emptying the allocator's GPU cache
and its pinned host cache. The engine captures flow and HiFT graphs on first use, while its other thread keeps
serving: that would stall the capturing thread on everybody's queued work, hand cached GPU memory back to the driver
(the next allocations pay cudaMalloc again) and drop the pinned buffers of the host copies (`engine/host.py`). A
capture runs nothing, so it needs none of that: `capture` only records. What it does need is memory that the
allocator cannot take from its cache while a capture is under way, so `capture_or_eager` hands the cache back and
tries again when a capture runs out of memory, once; a capture that fails otherwise leaves that shape eager.
`GraphCache` keeps such graphs by shape (the flow's and HiFT's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
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


class GraphCache(Generic[G]):
    """Graphs of one kind by shape: made and, when `capturing`, captured on first use (`capture_or_eager`), kept in
    an LRU of `max_graphs`. Their captures share one memory pool and one stream of their own, so they must run one at
    a time (from one thread) and be done with their output before the next one runs."""

    def __init__(self, label: str, device: torch.device, capturing: bool, max_graphs: int) -> None:
        self.label = label  # a %-format of the key, for the log
        self.capturing = capturing
        self.max_graphs = max_graphs
        self.entries: OrderedDict[Hashable, G] = OrderedDict()
        self.captures = 0  # for the benchmark: captures that happened while serving
        self._pool = torch.cuda.graph_pool_handle() if capturing else None
        self._stream = torch.cuda.Stream(device) if capturing else None

    def get(self, key: Hashable, make: Callable[[], G]) -> G:
        graph = self.entries.get(key)
        if graph is not None:
            self.entries.move_to_end(key)
            return graph
        t0 = time.perf_counter()
        graph = make()
        what = self.label % key
        if self.capturing and capture_or_eager(lambda: graph.capture(self._pool, self._stream), what):
            self.captures += 1
            log.info("captured %s in %.2f s", what, time.perf_counter() - t0)
        self.entries[key] = graph
        if len(self.entries) > self.max_graphs:
            self.entries.popitem(last=False)
        return graph

    def clear(self) -> None:
        """Drop every graph (what they read is going away); later ones get a new pool, the old one went with them."""
        self.entries.clear()
        if self.capturing:
            self._pool = torch.cuda.graph_pool_handle()
