"""`engine.graph_capture.capture`: a capture while serving leaves the allocator's caches alone and records the work."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_opt.engine.graph_capture import capture


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_records_the_work_and_keeps_the_allocator_cache():
    """`torch.cuda.graph` would empty the caching allocator first (freeing the 64 MB block below): `capture` must not,
    and the graph must replay the captured work on new input values."""
    x = torch.ones(4, device="cuda")
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # freed at once: a cached, unused block
    reserved = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, torch.cuda.graph_pool_handle(), torch.cuda.Stream()):
        y = x * 2
    assert torch.cuda.memory_reserved() >= reserved
    x.fill_(3)
    graph.replay()
    assert y.tolist() == [6.0] * 4
