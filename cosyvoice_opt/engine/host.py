"""Device-to-host copies that wait for the GPU with the GIL released, and can be started before they are awaited.

`.tolist()`, `.cpu()` and `.item()` on a CUDA tensor wait for the GPU while holding the GIL, so the engine's other
thread cannot run any Python meanwhile: next to the decode loop (one such wait per token), a 13 ms flow-encoder
call was measured taking 350 ms on the H200. `HostCopy` copies into pinned memory asynchronously and waits on a
CUDA event, whose `synchronize` releases the GIL; started right after the work that produces it, it can be awaited
after more work has been queued (the decode loop queues step N+1 before it reads step N).
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostCopy:
    """`t` on its way to the CPU: the copy is queued on the current stream now; `wait` returns it once done."""

    def __init__(self, t: Tensor) -> None:
        self._done = None
        if t.device.type != "cuda":
            self._out = t
            return
        self._out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._out.copy_(t, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(t.device))

    def wait(self) -> Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._out


def to_host(t: Tensor) -> Tensor:
    """`t` on the CPU, after the work queued before it on the current stream (a no-op for CPU tensors)."""
    return HostCopy(t).wait()
