"""`HiftGraphs` (HiFT of streaming chunks from static buffers / CUDA graphs) against the eager `HiFT.inference` with
the same per-row generators: directly, through `vocode_chunks`, through the engine, and replayed on a GPU."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.hift_graphs import HiftGraphs
from cosyvoice_opt.engine.token2wav import HiftStreamState, StreamConfig, vocode_chunks
from cosyvoice_opt.models.hift import HiFT
from cosyvoice_opt.random_model import random_model
from tests.test_engine import request


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


@torch.inference_mode()
def test_runner_equals_eager_inference_and_reuses_its_buffers():
    """Bit-exact on the CPU: the same draws from each row's generator, the same ops on the same batch size. Every
    shape is run twice with new inputs (the second time from the first time's buffers), and earlier outputs are the
    caller's: later calls leave them as they were."""
    hift = tiny_hift()
    runner = HiftGraphs(hift, cuda_graphs=True)  # no CUDA here: the static-buffer code runs eagerly
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
        if seed == 1:
            first = dict(runner.graphs.entries)
    assert list(runner.graphs.entries) == SHAPES
    assert all(runner.graphs.entries[key] is graph for key, graph in first.items())  # the second round reused them
    assert runner.graphs.captures == 0
    for got, snapshot in kept:
        assert all(torch.equal(a, b) for a, b in zip(got, snapshot, strict=True))


@torch.inference_mode()
def test_runner_needs_a_generator_per_row_and_keeps_at_most_max_graphs():
    hift = tiny_hift()
    runner = HiftGraphs(hift, cuda_graphs=False, max_graphs=2)
    mel, cache, generators = inputs(hift, *SHAPES[0], seed=1)
    with pytest.raises(ValueError, match="one generator per row"):
        runner.inference(mel, cache, generators()[:-1])
    for shape in SHAPES:
        mel, cache, generators = inputs(hift, *shape, seed=1)
        runner.inference(mel, cache, generators())
    assert list(runner.graphs.entries) == SHAPES[1:]  # the least recently used went


@torch.inference_mode()
def test_a_shape_that_fails_to_capture_runs_eagerly(monkeypatch):
    """A failed capture leaves that shape eager from its static inputs: the same audio, not counted, not tried again."""
    hift = tiny_hift()
    runner = HiftGraphs(hift, cuda_graphs=False)
    runner.graphs.capturing = True  # the capturing path, on the CPU
    tries = []

    def fail(self, pool, stream):
        tries.append(self)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("cosyvoice_opt.engine.hift_graphs._HiftGraph.capture", fail)
    monkeypatch.setattr(runner, "_keep_fft_plans", lambda: None)
    for seed in (1, 2):
        mel, cache, generators = inputs(hift, *SHAPES[1], seed)
        got, want = runner.inference(mel, cache, generators()), hift.inference(mel, cache, generators())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(tries) == 1 and runner.graphs.captures == 0 and runner.graphs.entries[SHAPES[1]].graph is None


@torch.inference_mode()
def test_shapes_share_their_input_buffers():
    """The static inputs of all shapes are views of one buffer per input (64 rows x 208 frames of noise alone are
    230 MB): a smaller shape reuses the buffer, a larger one gets a buffer at least twice as large, and the shapes
    made before keep working from theirs."""
    hift = tiny_hift()
    runner = HiftGraphs(hift, cuda_graphs=False)
    keys = [(3, 70, 480), (2, 30, 480), (4, 90, 480), (3, 70, 480)]
    for rows, frames, cached in keys:
        mel, cache, generators = inputs(hift, rows, frames, cached, seed=rows)
        got, want = runner.inference(mel, cache, generators()), hift.inference(mel, cache, generators())
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    first, smaller, larger = (runner.graphs.entries[k] for k in keys[:3])
    for name in ("mel", "cache", "phases", "noise"):
        ptr = [getattr(g, name).untyped_storage().data_ptr() for g in (first, smaller, larger)]
        assert ptr[0] == ptr[1] != ptr[2]
        assert getattr(larger, name).untyped_storage().nbytes() >= 2 * getattr(first, name).untyped_storage().nbytes()


@torch.inference_mode()
def test_vocode_chunks_through_the_runner_equals_eager():
    """Five streams of three chunks each (first, middle, final: batches of five padded to six), vocoded with and
    without the runner from equally seeded generators: the same audio, bit for bit; only non-final chunks went
    through the runner."""
    hift, cfg = tiny_hift(), StreamConfig()
    frames = [50, 100, 37]  # new mel frames per chunk: the first hop, the second, a final remainder
    mels = [[torch.randn(1, hift.cfg.in_channels, n) for n in frames] for _ in range(5)]
    runner = HiftGraphs(hift, cuda_graphs=False)
    audio = {}
    for graphs in (runner, None):
        states = [HiftStreamState(cfg) for _ in range(5)]
        gens = [torch.Generator().manual_seed(s) for s in range(5)]
        audio[graphs is None] = [
            vocode_chunks(hift, states, [m[step] for m in mels], [step == 2] * 5, gens, graphs)
            for step in range(len(frames))
        ]
    for with_graphs, eager in zip(audio[False], audio[True], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(with_graphs, eager, strict=True))
    assert list(runner.graphs.entries) == [(6, 50, 0), (6, 100 + cfg.mel_cache_len, cfg.source_cache_len)]


def test_engine_streaming_audio_is_the_eager_audio(tmp_path):
    """Through the whole engine (tiny random model, CPU): a streamed request sounds the same with the runner as
    with eager HiFT. The first request fills the prompt's cached flow prefix, so both compared ones start from it."""
    e = Engine.from_model_dir(None, EngineConfig(random_size="tiny", device="cpu", warmup=False,
                                                 voices_dir=str(tmp_path / "voices")))
    try:
        req = request(force_tokens=160, seed=4)
        runner = e._parts.vocoder.hift_graphs
        streamed = [np.concatenate([c.pcm for c in e.stream(req)]) for _ in range(2)]
        assert runner.graphs.entries  # its non-final chunks went through the runner
        e._parts.vocoder.hift_graphs = None
        eager = np.concatenate([c.pcm for c in e.stream(req)])
    finally:
        e.close()
    assert np.array_equal(streamed[1], eager)


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replay_equals_eager_on_cuda():
    """Captured once per shape, replayed with new inputs: equal to eager HiFT within fp32 rounding (cuDNN may pick
    other convolution algorithms for a capture: 1.1e-5 apart on the H200; 5e-5 is under two int16 steps). When
    cuFFT's plan cache nears full (its evictions would destroy plans the graphs replay), the graphs are dropped and
    captured again."""
    hift = tiny_hift("cuda")
    runner = HiftGraphs(hift, cuda_graphs=True)

    def check(seed: int) -> None:
        for shape in SHAPES:
            mel, cache, generators = inputs(hift, *shape, seed, device="cuda")
            got = runner.inference(mel, cache, generators())
            want = hift.inference(mel, cache, generators())
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=5e-5)

    check(1)
    assert runner.graphs.captures == len(SHAPES)
    check(2)  # replays only
    assert runner.graphs.captures == len(SHAPES)
    plans = torch.backends.cuda.cufft_plan_cache[torch.cuda.current_device()]
    limit = plans.max_size
    try:
        plans.max_size = plans.size + 4  # two new eager shapes (two plans each) fill it
        for frames in (41, 43):
            hift.inference(torch.randn(1, hift.cfg.in_channels, frames, device="cuda"), None,
                           [torch.Generator("cuda")])
        check(3)
        assert runner.graphs.captures == 2 * len(SHAPES)
    finally:
        plans.max_size = limit
