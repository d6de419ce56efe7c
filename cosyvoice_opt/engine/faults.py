"""Which errors the engine survives and which end it.

Out of memory is local: the step or chunk that hit it is retried smaller or fails alone. Any other CUDA error (an
illegal address, a launch failure) poisons the process's CUDA context: every later call fails too, and CUDA objects
that are freed afterwards raise in their destructors, which aborts the process without a word. The engine therefore
stops at the first such error, fails every request with a clear message and, in a server, exits so that its
supervisor starts a fresh process.
"""

from __future__ import annotations

import torch


def is_fatal(error: BaseException) -> bool:
    """A CUDA error other than running out of memory."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(error, accelerator_error)) or "CUDA error" in str(error)
