"""`engine.graph_capture`: a capture while serving leaves the allocator's caches alone and records the work; out of
memory it hands the cache back and tries once more; any other failure leaves the shape eager."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_opt.engine.graph_capture import GraphSet, capture, capture_or_eager


@pytest.mark.gpu  # CUDA graphs
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


def test_capture_or_eager_retries_once_out_of_memory_and_gives_up_on_other_errors(monkeypatch, caplog):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def attempts(*errors):
        left = list(errors)

        def fn():
            if left:
                raise left.pop(0)
        return fn

    oom = torch.cuda.OutOfMemoryError
    assert capture_or_eager(attempts(), "x") and not emptied
    assert capture_or_eager(attempts(oom("CUDA out of memory")), "x") and emptied == [1]
    with pytest.raises(oom):
        capture_or_eager(attempts(oom("first"), oom("second")), "x")
    assert not capture_or_eager(attempts(RuntimeError("not capturable")), "the flow graph for (1, 64, 0)")
    assert not capture_or_eager(attempts(oom("first"), RuntimeError("not capturable")), "x")
    assert "capturing the flow graph for (1, 64, 0) failed (RuntimeError: not capturable)" in caplog.text


def test_a_failed_capture_leaves_the_next_ones_a_fresh_pool(monkeypatch):
    """A capture that fails may leave its memory pool marked as recording (PyTorch ends the pool's recording only after
    the capture ended well), and every later capture into that pool would then fail: the set's next graphs take a new
    pool, the ones captured before keep theirs."""
    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(pools)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "stream")

    class Graph:
        def __init__(self, key: int) -> None:
            self.key, self.pool = key, None

        def capture(self, pool, stream) -> None:
            self.pool = pool
            if self.key == 2:
                raise RuntimeError("operation not permitted when stream is capturing")

    made: list[Graph] = []
    graphs = GraphSet("the test graph for %s", torch.device("cpu"), capturing=True)
    graphs.capture_all([1, 2, 3, 4], lambda key: made.append(Graph(key)) or made[-1])
    assert sorted(graphs.entries) == [1, 3, 4] and graphs.captures == 3
    pools = [g.pool for g in made]
    assert pools[0] == pools[1] != pools[2] == pools[3]
