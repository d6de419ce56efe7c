"""Capturing a CUDA graph while the engine serves.

`torch.cuda.graph` prepares every capture by synchronizing the whole device and emptying the allocator's GPU cache
and its pinned host cache. The engine captures flow and HiFT graphs on first use, while its other thread keeps
serving: that would stall the capturing thread on everybody's queued work, hand cached GPU memory back to the driver
(the next allocations pay cudaMalloc again: an `empty_cache()` on the hot path) and drop the pinned buffers of the
host copies (`engine/host.py`). A correct capture needs none of it, so `capture` leaves it out and orders the capture
after the caller's work with a stream wait instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, stream: torch.cuda.Stream) -> Iterator[None]:
    """Record into `graph` the CUDA work this thread issues in the block, on `stream` (after the work already queued
    on the current stream), allocating from `pool` (graphs that never run at the same time may share one).
    Thread-local: other threads keep launching their own work meanwhile."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
