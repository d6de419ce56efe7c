"""Device-to-host copies that wait for the GPU with the GIL released.

`.tolist()`, `.cpu()` and `.item()` on a CUDA tensor wait for the GPU while holding the GIL, so the engine's other
thread cannot run any Python meanwhile: next to the decode loop (one such wait per token), a 13 ms flow-encoder
call was measured taking 350 ms on the H200. `to_host` copies into pinned memory asynchronously and waits on a
CUDA event, whose `synchronize` releases the GIL.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_host(t: Tensor) -> Tensor:
    """`t` on the CPU, after the work queued before it on the current stream (a no-op for CPU tensors)."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return out
