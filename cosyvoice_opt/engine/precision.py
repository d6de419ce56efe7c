"""Per-module precision policy and the NaN/inf guard.

The LLM and flow run in the requested precision (bf16 by default on CUDA); HiFT stays fp32 because its sine source
integrates phase over the whole utterance, so small f0 errors grow into audible drift, and it is cheap anyway.
Upstream reported fp16 flow to be NaN-prone: every low-precision flow chunk is checked and recomputed in fp32
when it is not finite.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cosyvoice_opt.errors import InputError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def validate_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    return precision


@dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved dtype of each module (`name` is never "auto")."""

    name: str
    llm: torch.dtype
    flow: torch.dtype
    hift: torch.dtype

    @classmethod
    def resolve(cls, precision: str, device: torch.device) -> PrecisionPolicy:
        """`auto` is bf16 on CUDA and fp32 on CPU (CPU half precision is emulated and slow)."""
        name = validate_precision(precision)
        if name == "auto":
            name = "bf16" if device.type == "cuda" else "fp32"
        dtype = _DTYPES[name]
        return cls(name=name, llm=dtype, flow=dtype, hift=torch.float32)

    @property
    def guarded(self) -> bool:
        """Whether flow output must be checked for NaN/inf (only low precision can overflow)."""
        return self.flow != torch.float32


class FallbackCounter:
    """Counts and logs chunks recomputed in fp32 (reported in engine stats)."""

    def __init__(self) -> None:
        self.count = 0

    def record(self, module: str, what: str) -> None:
        self.count += 1
        log.warning("%s produced NaN/inf in %s; recomputed that chunk in fp32 (%d so far)", module, what, self.count)
