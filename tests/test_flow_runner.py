"""Paged flow (engine/flow_cache.py + flow_runner.py) equals the eager incremental flow on every fixture set of both
families: CosyVoice2's (conformer encoder, U-Net) and CosyVoice3's (pre-lookahead layer, DiT with RoPE)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.engine.flow_runner import FRAME_PAGES, FlowRunner, flow_prompt_key
from cosyvoice_opt.engine.ladders import ladder, round_up
from cosyvoice_opt.models.flow import FlowBase
from tests.conftest import fixture_params
from tests.test_flow import batch_requests, chunk_args, close, load_set, new_state
from tests.test_flow_dit import _load as load_dit
from tests.tolerances import PAGED


def _both_families() -> list:
    """Every set of both families' fixtures, named by kind (`parity-tiny-a`, `parity-cv3-tiny-a`)."""
    return [pytest.param(*p.values, marks=p.marks, id=f"{kind}-{p.id}")
            for kind in ("parity", "parity-cv3") for p in fixture_params(kind)]


PARITY = pytest.mark.parametrize("folder", _both_families())


def load_flow(folder: Path) -> tuple[FlowBase, dict]:
    """The set's flow (CosyVoice2's or CosyVoice3's, as its config names the class) and its inputs."""
    if json.loads((folder / "flow_tiny_config.json").read_text())["class"].endswith("WithDiT"):
        flow, _, io = load_dit(folder)
    else:
        flow, io, _ = load_set(folder)
    return flow, io


def solo_chunks(flow: FlowBase, req: dict) -> list[torch.Tensor]:
    state = new_state(flow, req)
    return [flow.stream_chunk(state, *chunk_args(flow, req, k)) for k in range(len(req["ends"]))]


def run_paged(runner: FlowRunner, reqs: list[dict], rounds: list[list[int]], prefixes: bool = False,
              ) -> list[list[torch.Tensor]]:
    """Each round's streams as one `runner.run` call; every stream is closed after its final chunk. With `prefixes`,
    streams are keyed by their prompt and start from cached prompt prefixes, as the vocoder runs them."""
    flow = runner.flow
    keys = [flow_prompt_key(r["prompt_token"], r["prompt_feat"], r["embedding"]) if prefixes else None for r in reqs]
    streams = [runner.open(new_state(flow, req), key, req["ends"][0]) for req, key in zip(reqs, keys, strict=True)]
    out: list[list[torch.Tensor]] = [[] for _ in reqs]
    for batch in rounds:
        if prefixes:
            runner.start_from_prefixes([streams[i] for i in batch])
        args = [chunk_args(flow, reqs[i], len(out[i])) for i in batch]
        mels = runner.run([streams[i] for i in batch], *map(list, zip(*args, strict=True)))
        for i, mel, (_, _, final) in zip(batch, mels, args, strict=True):
            out[i].append(mel)
            if final:
                runner.close(streams[i])
    return out


def lock_step(reqs: list[dict]) -> list[list[int]]:
    left, rounds = [len(r["ends"]) for r in reqs], []
    while any(left):
        rounds.append([i for i, n in enumerate(left) if n])
        left = [max(0, n - 1) for n in left]
    return rounds


@PARITY
@pytest.mark.parametrize("order", ["lock-step", "staggered"])
def test_paged_equals_eager(folder, order):
    """Different prompts, histories, chunk lengths and final chunks in one batch; pages all come back."""
    flow, io = load_flow(folder)
    reqs = batch_requests(flow, io)
    rounds = lock_step(reqs) if order == "lock-step" else [[1], [1, 0], [0, 2, 1], [0, 2], [0, 1]]
    runner = FlowRunner(flow, pages=64, slots=4, cuda_graphs=False)
    free = len(runner.pool.free_pages)
    paged = run_paged(runner, reqs, rounds)
    for req, chunks in zip(reqs, paged, strict=True):
        ref = solo_chunks(flow, req)
        assert len(chunks) == len(ref)
        for a, b in zip(chunks, ref, strict=True):
            close(a, b, PAGED)
    assert len(runner.pool.free_pages) == free and len(runner.pool.free_slots) == 4


@PARITY
def test_full_pool_takes_nothing_and_growing_keeps_streams(folder):
    flow, io = load_flow(folder)
    req = batch_requests(flow, io)[0]
    ref = solo_chunks(flow, req)
    runner = FlowRunner(flow, pages=1, slots=1, cuda_graphs=False)
    stream = runner.open(new_state(flow, req))
    assert runner.open(new_state(flow, req)) is None  # one slot
    first = chunk_args(flow, req, 0)
    assert runner.pages_needed(stream, first[0].shape[1], False) > 1
    with pytest.raises(RuntimeError, match="full"):
        runner.run([stream], *([a] for a in first))
    assert runner.pool.free_pages == [2] and stream.pages == []
    runner.grow(64, 2)
    stream = runner.open(new_state(flow, req))
    for k in range(len(req["ends"])):
        if k == 1:
            runner.grow(128, 4)  # mid-stream: contents are kept
        close(runner.run([stream], *([a] for a in chunk_args(flow, req, k)))[0], ref[k], PAGED)


@PARITY
def test_encoder_history_lives_in_the_pool(folder):
    """A paged stream keeps no tensor of its own: the encoder's history, like the estimator's, is in the pools (so
    a batch of any streams is a fixed set of index kernels, capturable), and the next chunk reads it from there."""
    flow, io = load_flow(folder)
    req = batch_requests(flow, io)[0]
    ref = solo_chunks(flow, req)
    # (pool, the stream's index in it): its conv history, and K/V where the encoder has attention (CosyVoice3's
    # encoder, a pre-lookahead layer, has none)
    parts = {"conv": lambda r, s: (r.encoder_pool.conv, s.slot)}
    if FlowRunner(flow, pages=1, slots=1, cuda_graphs=False).encoder_pool.rows_per_page:
        parts["kv"] = lambda r, s: (r.encoder_pool.kv, s.pages)
    for name, history in parts.items():
        runner = FlowRunner(flow, pages=64, slots=2, cuda_graphs=False)
        stream = runner.open(new_state(flow, req))
        close(runner.run([stream], *([a] for a in chunk_args(flow, req, 0)))[0], ref[0], PAGED)
        assert stream.state.nbytes == 0
        assert stream.state.tokens == req["prompt_token"].shape[1] + req["ends"][0]
        pool, index = history(runner, stream)
        assert pool[index].abs().sum() > 0, name
        pool[index] = 0  # its encoder history gone
        wiped = runner.run([stream], *([a] for a in chunk_args(flow, req, 1)))[0]
        assert wiped.shape == ref[1].shape and not torch.allclose(wiped, ref[1], atol=1e-3), name


@PARITY
def test_a_call_that_fails_half_way_leaves_the_streams_as_they_were(folder, monkeypatch):
    """A paged call that fails after the encoder and the CFM have written the streams' histories (out of memory while
    its output is copied out) gives its pages back and leaves the conv histories as they were, so the same chunk
    retried (after restoring the states, as the vocoder does) equals the eager flow."""
    flow, io = load_flow(folder)
    reqs = batch_requests(flow, io)[:2]
    runner = FlowRunner(flow, pages=64, slots=4, cuda_graphs=False)
    streams = [runner.open(new_state(flow, r)) for r in reqs]
    out = runner.run(streams, *map(list, zip(*(chunk_args(flow, r, 0) for r in reqs), strict=True)))
    free, snapshots = len(runner.pool.free_pages), [s.state.snapshot() for s in streams]
    second = list(map(list, zip(*(chunk_args(flow, r, 1) for r in reqs), strict=True)))
    with monkeypatch.context() as m:
        m.setattr(runner.flow, "finish_chunks", lambda *a: (_ for _ in ()).throw(
            torch.cuda.OutOfMemoryError("CUDA out of memory")))
        with pytest.raises(torch.cuda.OutOfMemoryError):
            runner.run(streams, *second)
    assert len(runner.pool.free_pages) == free
    for s, snapshot in zip(streams, snapshots, strict=True):
        s.state.restore(snapshot)
    again = runner.run(streams, *second)
    for r, first, mel in zip(reqs, out, again, strict=True):
        ref = solo_chunks(flow, r)
        close(first, ref[0], PAGED)
        close(mel, ref[1], PAGED)


def test_ladders():
    assert ladder(64) == [1, 2, 4, 8, 16, 32, 64] and ladder(81, 2) == [2, 4, 8, 16, 32, 64, 81] and ladder(1) == [1]
    assert ladder(81, 2, halves=True) == [2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 81] and ladder(9, 2, halves=True) == [
        2, 4, 6, 8, 9]
    assert [round_up(n, [0, 2, 4, 8]) for n in (0, 1, 2, 3, 8, 9)] == [0, 2, 2, 4, 8, None]


@pytest.mark.gpu  # CUDA graphs
@PARITY
def test_graph_replay_equals_eager(folder, monkeypatch):
    """Captured graphs replay the eager paged flow; with prefixes they equal the list-carry flow. TF32 is off: it
    rounds convs to ~1e-3, and the prefix path's batches have other shapes (other kernels) than the reference's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    flow, io = load_flow(folder)
    reqs = [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in req.items()}
            for req in batch_requests(flow, io)]
    flow = copy.deepcopy(flow).cuda()
    eager = run_paged(FlowRunner(flow, 64, 4, cuda_graphs=False), reqs, lock_step(reqs))
    graphs = FlowRunner(flow, 64, 4, cuda_graphs=True)
    graphs.capture_all()  # as the engine does at start-up: serving never captures
    assert graphs.graphs.captures == len(graphs.graph_keys()) > 0, "a graph was not captured"
    for _ in range(2):
        for a_chunks, b_chunks in zip(run_paged(graphs, reqs, lock_step(reqs)), eager, strict=True):
            for a, b in zip(a_chunks, b_chunks, strict=True):
                close(a, b, PAGED)
    shared = [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
              for r in shared_prompt_requests(flow, [0, 0, 1], prompt_tokens=long_prompt_tokens(graphs))]
    for _ in range(2):  # computing the prefixes, then adopting them
        for chunks, req in zip(run_paged(graphs, shared, lock_step(shared), prefixes=True), shared, strict=True):
            for a, b in zip(chunks, solo_chunks(flow, req), strict=True):
                close(a, b, PAGED)
    assert graphs.prefix_hits == 1 + 3
    assert graphs.graphs.misses == 0  # every call replayed a captured graph, none ran eagerly


def _set_runner(flow: FlowBase, monkeypatch, capture=lambda self, pool, stream: None, **kw) -> FlowRunner:
    """A runner whose graph set is 'captured' on the CPU with `capture` (default: nothing recorded, each graph then
    steps eagerly), so the set's bookkeeping runs without CUDA."""
    monkeypatch.setattr("cosyvoice_opt.engine.flow_runner._CfmGraph.capture", capture)
    runner = FlowRunner(flow, 64, 8, cuda_graphs=False, **kw)
    runner.graphs.capturing = True
    runner.capture_all()
    return runner


@PARITY
def test_every_chunk_shape_is_in_the_graph_set(folder, monkeypatch):
    """Streams with and without cached prefixes, in lock-step and staggered, first, middle and final chunks, and a
    prompt long enough to be consumed in several pieces: every batch's shape is one of the graphs captured at
    start-up (none is captured later, no call runs outside the set), and the chunks equal the eager flow."""
    flow, io = load_flow(folder)
    runner = _set_runner(flow, monkeypatch, max_tokens=512)
    keys = runner.graph_keys()
    assert runner.graphs.captures == len(keys) == len(set(keys))
    assert len(keys) == len(runner.row_ladder) * len(FRAME_PAGES) * len(runner.hist_ladder)
    page = runner.pool.page  # history is padded by at most a half: 5 pages to 6, 9 to 12
    assert [runner._key(1, page, h)[2] for h in (0, 1, 5, 9)] == [0, 2, 6, 12]
    reqs = batch_requests(flow, io)
    for rounds in (lock_step(reqs), [[1], [1, 0], [0, 2, 1], [0, 2], [0, 1]]):
        for req, chunks in zip(reqs, run_paged(runner, reqs, rounds), strict=True):
            for a, b in zip(chunks, solo_chunks(flow, req), strict=True):
                close(a, b, PAGED)
    chunk = flow.chunk_tokens
    long_prompt = shared_prompt_requests(flow, [0, 1], prompt_tokens=runner.call_tokens + 7 * chunk + 2)
    for req, chunks in zip(long_prompt, run_paged(runner, long_prompt, lock_step(long_prompt), prefixes=True),
                           strict=True):
        for a, b in zip(chunks, solo_chunks(flow, req), strict=True):
            close(a, b, PAGED)
    assert runner.graphs.misses == 0 and runner.graphs.captures == len(keys)


@PARITY
def test_a_shape_that_fails_to_capture_runs_eagerly(folder, monkeypatch, caplog):
    """A capture that fails at start-up (a driver or library that cannot capture a shape) leaves that shape out of
    the set: its calls run eagerly with the same chunks and are counted, never captured later. Out of memory twice,
    start-up fails with that error."""
    flow, io = load_flow(folder)
    reqs = batch_requests(flow, io)
    eager = run_paged(FlowRunner(flow, 64, 4, cuda_graphs=False), reqs, lock_step(reqs))

    def fail(self, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = _set_runner(flow, monkeypatch, fail)
    assert runner.graphs.captures == 0 and not runner.graphs.entries and "it runs eagerly" in caplog.text
    for got, want in zip(run_paged(runner, reqs, lock_step(reqs)), eager, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert runner.graphs.misses > 0 and runner.graphs.captures == 0

    def out_of_memory(self, pool, stream):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        _set_runner(flow, monkeypatch, out_of_memory)


def shared_prompt_requests(flow: FlowBase, prompts: list[int], seed: int = 3, prompt_tokens: int = 60) -> list[dict]:
    """Requests whose prompts are given by index: equal index, equal prompt; 3 non-final chunks and a final one
    each."""
    g = torch.Generator().manual_seed(seed)
    cfg, n = flow.cfg, prompt_tokens
    c, la = flow.chunk_tokens, cfg.pre_lookahead_len
    voices = {k: (torch.randint(0, cfg.vocab_size, (1, n), generator=g),
                  torch.randn(1, cfg.token_mel_ratio * n, cfg.output_size, generator=g),
                  torch.randn(1, cfg.spk_embed_dim, generator=g)) for k in set(prompts)}
    reqs = []
    for k in prompts:
        first = -n % c + c
        tokens = torch.randint(0, flow.cfg.vocab_size, (1, first + 2 * c + la + 7), generator=g)
        reqs.append({"prompt_token": voices[k][0], "prompt_feat": voices[k][1], "embedding": voices[k][2],
                     "token": tokens, "ends": [first, first + c, first + 2 * c, tokens.shape[1]]})
    return reqs


def long_prompt_tokens(runner: FlowRunner) -> int:
    """A prompt too long to go along with its first chunk in one call."""
    c = runner.flow.chunk_tokens
    return runner.call_tokens + 2 * c + 2


@PARITY
def test_a_new_short_prompt_goes_along_with_its_first_chunk(folder):
    """A new voice whose prompt fits one call with its first chunk's tokens costs no flow call of its own: nothing
    is computed before the first chunk and nothing is cached. When the voice comes back, its prefix is computed and
    cached once, and the next request adopts it. Every chunk equals the eager flow."""
    flow, _ = load_flow(folder)
    runner = FlowRunner(flow, pages=64, slots=8, cuda_graphs=False)
    reqs = shared_prompt_requests(flow, [0, 1, 0, 0])

    def serve(ids: list[int]) -> None:
        some = [reqs[i] for i in ids]
        for chunks, req in zip(run_paged(runner, some, lock_step(some), prefixes=True), some, strict=True):
            for a, b in zip(chunks, solo_chunks(flow, req), strict=True):
                close(a, b, PAGED)

    serve([0, 1])
    assert runner.counters.prefix_calls == 0 and len(runner.pool.free_pages) == 64
    serve([2])  # voice 0 again: its prefix is computed and cached
    assert runner.counters.prefix_calls > 0 and runner.prefix_hits == 0 and len(runner.pool.free_pages) < 64
    calls = runner.counters.prefix_calls
    serve([3])
    assert runner.prefix_hits == 1 and runner.counters.prefix_calls == calls


@PARITY
def test_cached_prompt_prefix_equals_computing_it(folder):
    """Three streams of one long prompt and one of another: one stream per prompt computes its prefix (the voice
    that comes three times: its whole chunks with prompt look-ahead; the new one: the fewest whole chunks that leave
    the rest and the first chunk within one call), the others adopt it; later streams adopt it too. Every chunk
    equals the eager flow without caching, and once the cache is dropped every page is free."""
    flow, _ = load_flow(folder)
    runner = FlowRunner(flow, pages=64, slots=8, cuda_graphs=False)
    n = long_prompt_tokens(runner)
    reqs = shared_prompt_requests(flow, [0, 0, 1, 0], prompt_tokens=n)
    chunk, la, first = flow.chunk_tokens, flow.cfg.pre_lookahead_len, reqs[0]["ends"][0]
    probe = runner.open(new_state(flow, reqs[0]), b"k", first)
    prefix = runner.prefix_tokens(probe)
    runner.close(probe)
    assert prefix % chunk == 0 and 0 < prefix <= n - la
    assert n - prefix + first <= runner.call_tokens < n - prefix + chunk + first
    staggered = [[0, 2], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [1, 3]]
    for rounds, hits in ((lock_step(reqs), 2), (staggered, 4)):  # the second pass finds both prefixes cached
        before = runner.prefix_hits
        for chunks, req in zip(run_paged(runner, reqs, rounds, prefixes=True), reqs, strict=True):
            for a, b in zip(chunks, solo_chunks(flow, req), strict=True):
                close(a, b, PAGED)
        assert runner.prefix_hits - before == hits
    pages = runner.pages_for_tokens((n - la) // chunk * chunk) + runner.pages_for_tokens(prefix)
    assert len(runner.pool.free_pages) == 64 - pages  # the two cached prefixes
    assert runner.evict_prefixes() == pages and len(runner.pool.free_pages) == 64


@PARITY
def test_a_new_prompts_prefix_rides_along_with_another_streams_chunk(folder, monkeypatch):
    """A new voice whose prompt needs a prefix pass computes it as one more row of another stream's flow call: no
    prefix call of its own, every chunk of every stream equals the eager flow, and the prefix is cached for the next
    request with that voice. Riders take no more pages than given; a call that fails leaves its rider fresh and as
    it was, to be resolved later."""
    flow, _ = load_flow(folder)
    runner = FlowRunner(flow, pages=64, slots=8, cuda_graphs=False)
    reqs = shared_prompt_requests(flow, [0, 1, 2, 1], prompt_tokens=long_prompt_tokens(runner))

    def open_stream(r: dict):
        key = flow_prompt_key(r["prompt_token"], r["prompt_feat"], r["embedding"])
        return runner.open(new_state(flow, r), key, r["ends"][0])

    a, b, c = (open_stream(r) for r in reqs[:3])
    runner.start_from_prefixes([a])
    calls, pending = runner.counters.prefix_calls, c.state.pending
    assert calls == 1 and runner.ride_along([c], rows=4, pages=0) == [] and c.fresh  # no pages to spare

    def fail(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with monkeypatch.context() as m:
        m.setattr(runner.flow, "prepare_chunks", fail)
        rides = runner.ride_along([c], rows=4, pages=64)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            runner.run([a], *([x] for x in chunk_args(flow, reqs[0], 0)), riders=rides)
    assert c.fresh and c.state.pending is pending and c.pages == [] and runner.counters.prefix_rides == 0
    rides = runner.ride_along([b], rows=4, pages=64)
    assert [r.stream for r in rides] == [b] and not b.fresh
    out = [runner.run([a], *([x] for x in chunk_args(flow, reqs[0], 0)), riders=rides), [], []]
    assert runner.counters.prefix_calls == calls and runner.counters.prefix_rides == 1 and b.state.tokens > 0
    runner.start_from_prefixes([c])  # after its failed ride: as a voice seen before
    streams = [a, b, c]
    while live := [i for i in range(3) if len(out[i]) < len(reqs[i]["ends"])]:
        args = [chunk_args(flow, reqs[i], len(out[i])) for i in live]
        for i, mel in zip(live, runner.run([streams[i] for i in live], *map(list, zip(*args, strict=True))),
                          strict=True):
            out[i].append(mel)
    for req, chunks in zip(reqs[:3], out, strict=True):
        for got, want in zip(chunks, solo_chunks(flow, req), strict=True):
            close(got, want, PAGED)
    again = open_stream(reqs[3])  # b's voice comes back: it adopts the prefix that rode along
    hits, calls = runner.prefix_hits, runner.counters.prefix_calls
    runner.start_from_prefixes([again])
    assert runner.prefix_hits == hits + 1 and runner.counters.prefix_calls == calls
