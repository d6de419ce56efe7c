"""Process-wide settings of the CUDA libraries that a server whose input shapes never stop changing needs.

Every request brings new shapes (prompt and text lengths, clip lengths, how many streams share a chunk), and cuDNN
builds a kernel plan per shape and keeps it. Measured on the H200 (docs/benchmarks.md, probes):
- attention (`scaled_dot_product_attention`'s cuDNN backend): each new length cost 1.9 MB of host memory and 75 ms in
  the eager LLM prefill (5.8 MB and ~300 ms in the flow), in per-thread caches without a bound, and a cached eager
  call was still slower than PyTorch's flash / memory-efficient kernels (LLM forward 15.8 vs 8.0 ms). So eager code
  runs without it. CUDA graphs are different: their shapes are fixed, so they build few plans, and for their masked
  attention cuDNN's kernels are the fastest (64 rows: decode 22 vs 35 us, estimator 71 vs 166 us), so the flow's
  captures run inside `cudnn_attention()`. A graph that holds them launches slowly, though: about 3 us of host
  time per node at every launch, against about 3 us in all for a graph of plain kernels. The flow's Euler steps pay
  it, and it costs them nothing: a one-row call takes 28 ms of host time and 27 ms of GPU time (~10,000 kernels), and
  with a Triton attention of plain kernels in cuDNN's place its host time was 18 ms, its wall the same, and larger
  calls were slower (64 rows: 1.24 s against 0.66 s). The LLM's decode step, 1 ms of GPU time, does not take it
  (`models/fused.py`, `decode_attention`).
- convolutions: each new HiFT input shape cost 1.3 MB and 64 ms. Their plan cache is an LRU whose size PyTorch reads
  from `TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT` when it is first used (default 10,000 plans, about 2 GB); the engine sets
  a smaller default, which a value already in the environment overrides, and pads HiFT batches to a few sizes so the
  plans in use stay cached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

CONV_PLAN_CACHE_ENV = "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT"
CONV_PLAN_CACHE_LIMIT = 2048  # plans (~200 KB each); the plans of a busy server's padded shapes are a few hundred

_capturing = 0  # threads inside `cudnn_attention` (the LLM and the vocoder thread may capture at the same time)
_enabled_before = False  # the switch as the first of them found it
_capturing_lock = threading.Lock()


def configure_backends() -> None:
    """Switch off cuDNN attention and bound cuDNN's convolution plan cache (see the module docstring). Idempotent;
    the cache bound takes effect only if no cuDNN convolution ran in this process before."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    if os.environ.setdefault(CONV_PLAN_CACHE_ENV, str(CONV_PLAN_CACHE_LIMIT)) != str(CONV_PLAN_CACHE_LIMIT):
        log.info("cuDNN convolution plan cache limit from the environment: %s", os.environ[CONV_PLAN_CACHE_ENV])


@contextlib.contextmanager
def cudnn_attention() -> Iterator[None]:
    """cuDNN attention allowed while a CUDA graph is warmed up and captured. The switch is process-wide, so the
    threads inside are counted: the last one out restores it as the first one in found it, whatever the order."""
    global _capturing, _enabled_before
    with _capturing_lock:
        if _capturing == 0:
            _enabled_before = torch.backends.cuda.cudnn_sdp_enabled()
        _capturing += 1
        torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        with _capturing_lock:
            _capturing -= 1
            if _capturing == 0:
                torch.backends.cuda.enable_cudnn_sdp(_enabled_before)
