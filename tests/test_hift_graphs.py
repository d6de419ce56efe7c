"""`HiftGraphs` (HiFT of streaming chunks from static buffers / CUDA graphs) against the eager `HiFT.inference` with
the same per-row generators: directly, through `vocode_chunks`, through the engine, and replayed on a GPU."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.hift_graphs import HiftGraphs
from cosyvoice_opt.engine.streaming import (
    HiftStreamState,
    HopSchedule,
    StreamConfig,
    hift_shapes,
    vocode_chunks,
)
from cosyvoice_opt.models.hift import HiFT
from cosyvoice_opt.random_model import random_model
from tests.test_engine import request
from tests.tolerances import E2E, GRAPH_VS_EAGER_WAVE, assert_close


@functools.cache
def tiny_hift(device: str = "cpu") -> HiFT:
    return random_model("tiny", 0, device).hift.eval().fuse_weight_norm()


def inputs(hift: HiFT, rows: int, frames: int, cached: int, seed: int, device: str = "cpu"):
    """A padded batch as `vocode_chunks` makes it: real rows with their own seeded generators, the last row
    padding (zeros, a throw-away generator); and a second set of generators seeded alike for the reference."""
    g = torch.Generator().manual_seed(seed)
    mel = torch.randn(rows, hift.cfg.in_channels, frames, generator=g).to(device)
    cache = torch.randn(rows, 1, cached, generator=g).mul(0.1).to(device) if cached else None
    mel[-1] = 0
    if cache is not None:
        cache[-1] = 0

    def generators():
        real = [torch.Generator(device).manual_seed(seed * 100 + r) for r in range(rows - 1)]
        return real + [torch.Generator(device)]

    return mel, cache, generators


SHAPES = [(2, 30, 0), (4, 38, 8 * 480), (3, 70, 8 * 480)]  # (rows, mel frames, cached samples)


def set_runner(hift: HiFT, keys: list[tuple[int, int, int]], monkeypatch,
               capture=lambda self, pool, stream: None) -> HiftGraphs:
    """A runner whose graph set of `keys` is 'captured' on the CPU with `capture` (default: nothing recorded, each
    graph then runs eagerly from its static inputs), so the set's bookkeeping runs without CUDA."""
    monkeypatch.setattr("cosyvoice_opt.engine.hift_graphs._HiftGraph.capture", capture)
    runner = HiftGraphs(hift, cuda_graphs=False)
    runner.graphs.capturing = True
    runner.capture_all(keys)
    return runner


@torch.inference_mode()
def test_runner_equals_eager_inference_and_reuses_its_buffers(monkeypatch):
    """Bit-exact on the CPU: the same draws from each row's generator, the same ops on the same batch size. Every
    shape is run twice with new inputs (the second time from the first time's buffers), and earlier outputs are the
    caller's: later calls leave them as they were."""
    hift = tiny_hift()
    runner = set_runner(hift, SHAPES, monkeypatch)
    made = dict(runner.graphs.entries)
    kept = []
    for seed in (1, 2):
        for rows, frames, cached in SHAPES:
            mel, cache, generators = inputs(hift, rows, frames, cached, seed)
            gens, ref_gens = generators(), generators()
            got = runner.inference(mel, cache, gens)
            want = hift.inference(mel, cache, ref_gens)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)
            for g, r in zip(gens[:-1], ref_gens[:-1], strict=True):
                assert torch.equal(g.get_state(), r.get_state())  # each row drew exactly what eager draws
            kept.append((got, [t.clone() for t in got]))
    assert sorted(runner.graphs.entries) == sorted(SHAPES) and runner.graphs.entries == made
    assert runner.graphs.captures == len(SHAPES) and runner.graphs.misses == 0
    for got, snapshot in kept:
        assert all(torch.equal(a, b) for a, b in zip(got, snapshot, strict=True))


@torch.inference_mode()
def test_a_shape_outside_the_set_runs_eagerly_and_is_counted(monkeypatch):
    hift = tiny_hift()
    runner = set_runner(hift, SHAPES[:1], monkeypatch)
    mel, cache, generators = inputs(hift, *SHAPES[0], seed=1)
    with pytest.raises(ValueError, match="one generator per row"):
        runner.inference(mel, cache, generators()[:-1])
    mel, cache, generators = inputs(hift, *SHAPES[1], seed=1)
    got, want = runner.inference(mel, cache, generators()), hift.inference(mel, cache, generators())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert runner.graphs.misses == 1 and list(runner.graphs.entries) == SHAPES[:1] and runner.graphs.captures == 1


@torch.inference_mode()
def test_a_shape_that_fails_to_capture_runs_eagerly(monkeypatch):
    """A capture that fails at start-up leaves that shape out of the set: eager from its static inputs, the same
    audio, counted."""
    hift = tiny_hift()

    def fail(self, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = set_runner(hift, SHAPES[1:2], monkeypatch, fail)
    assert runner.graphs.captures == 0 and not runner.graphs.entries
    for seed in (1, 2):
        mel, cache, generators = inputs(hift, *SHAPES[1], seed)
        got, want = runner.inference(mel, cache, generators()), hift.inference(mel, cache, generators())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert runner.graphs.misses == 2


@torch.inference_mode()
def test_shapes_share_their_input_buffers(monkeypatch):
    """The static inputs of all shapes are views of one buffer per input (64 rows x 208 frames of noise alone are
    230 MB): a smaller shape reuses the buffer, a larger one gets a buffer at least twice as large, and the shapes
    made before keep working from theirs."""
    hift = tiny_hift()
    keys = [(3, 70, 480), (2, 30, 480), (4, 90, 480)]
    runner = HiftGraphs(hift, cuda_graphs=False)
    monkeypatch.setattr("cosyvoice_opt.engine.hift_graphs._HiftGraph.capture", lambda self, pool, stream: None)
    runner.graphs.capturing = True
    for key in keys:  # in this order: the buffers grow once, at the third
        runner.capture_all([key])
    for rows, frames, cached in [*keys, keys[0]]:
        mel, cache, generators = inputs(hift, rows, frames, cached, seed=rows)
        got, want = runner.inference(mel, cache, generators()), hift.inference(mel, cache, generators())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    first, smaller, larger = (runner.graphs.entries[k] for k in keys)
    for name in ("mel", "cache", "phases", "noise"):
        ptr = [g.inputs[name].untyped_storage().data_ptr() for g in (first, smaller, larger)]
        assert ptr[0] == ptr[1] != ptr[2]
        assert larger.inputs[name].untyped_storage().nbytes() >= 2 * first.inputs[name].untyped_storage().nbytes()


def _calls(prompt: int, n: int, cfg: StreamConfig, paced: int) -> list:
    """`stream_calls`, the first `paced` calls keeping their hop (a streamed text while its text arrives)."""
    schedule, calls = HopSchedule(prompt, cfg), []
    while (call := schedule.next_call(n, grow=len(calls) >= paced)) is not None:
        calls.append(call)
    return calls + [schedule.final_call(n)]


def test_hift_shapes_cover_every_streaming_chunk():
    """For prompts of every length and any number of tokens, with upstream's growing hops or a streamed text's kept
    ones, every streaming chunk's HiFT input is in the set: later hops at any row count up to 64 (padded to a power of
    two), every other chunk (first, final, a piece shorter than its first hop) one row at a time. The set is no larger
    than that."""
    cfg = StreamConfig()
    shapes = hift_shapes(cfg, 64)
    assert len(set(shapes)) == len(shapes)
    runner = HiftGraphs(tiny_hift(), cuda_graphs=False)
    runner.capture_all(shapes)
    seen = set()
    for prompt, paced in itertools.product(range(3 * cfg.token_hop_len), (0, 3)):
        for n in range(0, 400):
            for k, call in enumerate(_calls(prompt, n, cfg, paced)):
                la = 0 if call.finalize else cfg.pre_lookahead_len
                frames = cfg.token_mel_ratio * (call.n_tokens_in - la - call.token_offset)
                cached = cfg.source_cache_len if k else 0
                frames += cfg.mel_cache_len if k else 0
                if frames == cfg.mel_cache_len * bool(k):
                    continue  # no new frames: no HiFT call
                later_hop = k and frames - cfg.mel_cache_len in (50, 100, 200)  # hops of 25, 50 and 100 tokens
                assert runner.rows_per_call(frames, cached) == (64 if later_hop else 1), (prompt, n, k)
                seen.add((frames, cached))
    assert seen == {(frames, cached) for _, frames, cached in shapes}


@torch.inference_mode()
def test_vocode_chunks_through_the_runner_equals_eager(monkeypatch):
    """Five streams of three chunks each (first, middle, final), vocoded with and without the runner from equally
    seeded generators: the same audio within rounding (first and final chunks go through 1-row graphs one at a time,
    eagerly they are one batch), and every call's shape is in the set: middle ones as one batch padded to 8 rows."""
    hift, cfg = tiny_hift(), StreamConfig()
    frames = [50, 100, 38]  # new mel frames per chunk: the first hop, the second, a final remainder
    mels = [[torch.randn(1, hift.cfg.in_channels, n) for n in frames] for _ in range(5)]
    runner = set_runner(hift, hift_shapes(cfg, 8), monkeypatch)
    audio = {}
    for graphs in (runner, None):
        states = [HiftStreamState(cfg) for _ in range(5)]
        gens = [torch.Generator().manual_seed(s) for s in range(5)]
        audio[graphs is None] = [
            vocode_chunks(hift, states, [m[step] for m in mels], [step == 2] * 5, gens, graphs, max_rows=8)
            for step in range(len(frames))
        ]
    for with_graphs, eager in zip(audio[False], audio[True], strict=True):
        for a, b in zip(with_graphs, eager, strict=True):  # the CPU's convs round per batch size (1 vs 8 rows)
            assert_close(a, b, E2E)
    assert runner.graphs.misses == 0


def test_engine_streaming_audio_is_the_eager_audio(tmp_path, monkeypatch):
    """Through the whole engine (tiny random model, CPU): a streamed request sounds the same with the runner as
    with eager HiFT. The first request fills the prompt's cached flow prefix, so both compared ones start from it."""
    e = Engine.from_model_dir(None, EngineConfig(random_size="tiny", device="cpu", warmup=False,
                                                 voices_dir=str(tmp_path / "voices")))
    try:
        req = request(force_tokens=160, seed=4)
        runner = e._parts.vocoder.hift_graphs
        calls = []
        real = runner.inference
        monkeypatch.setattr(runner, "inference", lambda *a: (calls.append(a[0].shape), real(*a))[1])
        streamed = [np.concatenate([c.pcm for c in e.stream(req)]) for _ in range(2)]
        assert calls  # its non-final chunks went through the runner
        e._parts.vocoder.hift_graphs = None
        eager = np.concatenate([c.pcm for c in e.stream(req)])
    finally:
        e.close()
    assert np.array_equal(streamed[1], eager)


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replay_equals_eager_on_cuda():
    """Captured once per shape, replayed with new inputs: equal to eager HiFT within fp32 rounding (cuDNN may pick
    other convolution algorithms for a capture: 1.1e-5 apart on the H200; 5e-5 is under two int16 steps). Eager calls
    of other shapes in between (final chunks, whole clips) leave the replays as they were."""
    hift = tiny_hift("cuda")
    runner = HiftGraphs(hift, cuda_graphs=True)
    runner.capture_all(SHAPES)

    def check(seed: int) -> None:
        for shape in SHAPES:
            mel, cache, generators = inputs(hift, *shape, seed, device="cuda")
            got = runner.inference(mel, cache, generators())
            want = hift.inference(mel, cache, generators())
            for g, w in zip(got, want, strict=True):
                assert_close(g, w, GRAPH_VS_EAGER_WAVE)

    check(1)
    for frames in range(41, 141, 7):  # eager calls of many other shapes
        hift.inference(torch.randn(1, hift.cfg.in_channels, frames, device="cuda"), None, [torch.Generator("cuda")])
    check(2)
    assert runner.graphs.captures == len(SHAPES) and runner.graphs.misses == 0
