"""CosyVoice3's vocoder in the engine (`engine/causal_streaming.py`): the chunks of several `CausalHiFT` streams,
batched by step through the static buffers of `CausalHiFTGraphs` (run eagerly on the CPU, replayed on a GPU), against
each stream alone through `CausalHiFT.stream` and against upstream's final call over the whole mel; the set of steps
against the streaming schedule; a retry after a failed call; and, on a GPU, the captured graphs while an engine serves.
The network is the tiny CausalHiFT of every CosyVoice3 parity set."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.causal_streaming import (
    CausalHiFTGraphs,
    causal_hift_shapes,
    vocode_causal_chunks,
)
from cosyvoice_opt.engine.streaming import HopSchedule, StreamConfig
from cosyvoice_opt.models.causal_hift import CausalHiFT, CausalHiFTStream
from cosyvoice_opt.types import SynthesisRequest
from tests.conftest import fixture_params
from tests.test_causal_hift import build
from tests.test_engine_cv3 import prompt_wav
from tests.tolerances import CAUSAL_GRAPH_VS_EAGER_WAVE, CAUSAL_WAVE, assert_close

SETS = fixture_params("parity-cv3")
CFG = StreamConfig()


@functools.cache
def tiny(folder: Path, device: str = "cpu", **quirks) -> CausalHiFT:
    """The set's CausalHiFT as the engine runs it (weight norm fused, the f0 predictor in float64)."""
    return build(folder, **quirks).fuse_weight_norm().to(device)


@dataclasses.dataclass(frozen=True)
class Script:
    """A streamed piece: joins at round `start`, its hops in tokens (the first padded by `pad` to the 25-token grid),
    then a final chunk of `final` tokens (look-ahead included). No hops: a piece that is one final chunk."""

    start: int
    pad: int
    hops: tuple[int, ...]
    final: int

    def frames(self) -> list[int]:
        hops = [h + self.pad * (i == 0) for i, h in enumerate(self.hops)]
        return [CFG.token_mel_ratio * n for n in [*hops, self.final]]


# Streams at different positions: two in step (their middle chunks batch), two streamed texts keeping their 25-token
# hops a round later and one more two rounds later (three of them batch, padded to 4 rows), a short piece, and a
# whole clip longer than any step of the set (eager, alone).
SCRIPTS = [Script(0, 0, (25, 50, 100), 7), Script(0, 0, (25, 50, 100), 40), Script(1, 13, (25, 25, 25, 50), 3),
           Script(1, 5, (25, 25, 25, 25), 20), Script(2, 24, (25, 25), 102), Script(0, 0, (), 30),
           Script(1, 0, (), 130)]


def mels_of(hift: CausalHiFT, seed: int) -> list[list[torch.Tensor]]:
    """Each script's chunks of new mel frames [1,80,T] (the fixtures' mel statistics: randn * 2 - 5)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, hift.cfg.in_channels, n, generator=g) * 2 - 5 for n in s.frames()] for s in SCRIPTS]


def rounds() -> list[list[tuple[int, int]]]:
    """Per vocoder round, the (stream, chunk) pairs that run in it: every active stream's next chunk."""
    out = []
    for r in itertools.count():
        now = [(i, r - s.start) for i, s in enumerate(SCRIPTS) if 0 <= r - s.start < len(s.frames())]
        if not now and r > max(s.start for s in SCRIPTS):
            return out
        out.append(now)


def new_streams(hift: CausalHiFT, gaussian: bool) -> list[CausalHiFTStream]:
    return [hift.new_stream(torch.Generator().manual_seed(i) if gaussian else None) for i in range(len(SCRIPTS))]


def alone(hift: CausalHiFT, mels: list[list[torch.Tensor]], gaussian: bool = False) -> list[list[torch.Tensor]]:
    """Each stream by itself through `CausalHiFT.stream`."""
    states = new_streams(hift, gaussian)
    return [[hift.stream(states[i], m, k == len(ms) - 1) for k, m in enumerate(ms)] for i, ms in enumerate(mels)]


def set_runner(hift: CausalHiFT, keys: list, monkeypatch) -> CausalHiFTGraphs:
    """A runner whose set of `keys` is 'captured' on the CPU without recording anything: each graph then runs
    eagerly from its static inputs, so the set's bookkeeping and the static-buffer path run without CUDA."""
    monkeypatch.setattr("cosyvoice_opt.engine.hift_graphs._HiftGraph.capture", lambda self, pool, stream: None)
    runner = CausalHiFTGraphs(hift, cuda_graphs=False)
    runner.graphs.capturing = True
    runner.capture_all(keys)
    return runner


def batched(hift: CausalHiFT, mels: list[list[torch.Tensor]], runner: CausalHiFTGraphs | None, max_rows: int = 8,
            gaussian: bool = False, fail_round: int | None = None) -> list[list[torch.Tensor]]:
    """The scripts' rounds through `vocode_causal_chunks`. `fail_round`: in that round the runner's second call (after
    a first batch ran) raises out of memory, and the round is retried from the same states."""
    states, out = new_streams(hift, gaussian), [[] for _ in SCRIPTS]
    calls = []
    if fail_round is not None:
        real = runner.call

        def failing(key, write):
            calls.append(key)
            if len(calls) == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted)")
            return real(key, write)

    for r, now in enumerate(rounds()):
        if r == fail_round:
            runner.call = failing
        args = ([states[i] for i, _ in now], [mels[i][k] for i, k in now],
                [k == len(SCRIPTS[i].frames()) - 1 for i, k in now], runner, max_rows)
        try:
            waves = vocode_causal_chunks(hift, *args)
        except torch.cuda.OutOfMemoryError:
            assert r == fail_round
            waves = vocode_causal_chunks(hift, *args)
        for (i, _), wave in zip(now, waves, strict=True):
            out[i].append(wave)
    assert fail_round is None or len(calls) > 2  # it failed, and the retry ran
    return out


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_batched_streams_equal_each_stream_alone(folder, monkeypatch):
    """Seven streams at different positions (first, middle and final chunks in one round, a short piece, a whole clip)
    through the runner: each stream's chunks are those of `CausalHiFT.stream` alone (the CPU rounds a batch's convs
    otherwise, within CAUSAL_WAVE; rows run alone are bit-equal), and each stream's audio is upstream's final call over
    all its mel. Middle chunks of streams in step ran as one batch (padded to a power of two), every call's step was
    in the set, and the whole clip, outside it, ran eagerly."""
    hift = tiny(folder)
    mels = mels_of(hift, 1)
    runner = set_runner(hift, causal_hift_shapes(hift, CFG, 8), monkeypatch)
    keys = []
    call = runner.call
    monkeypatch.setattr(runner, "call", lambda key, write: keys.append(key) or call(key, write))
    got, want = batched(hift, mels, runner), alone(hift, mels)
    for i, (g_chunks, w_chunks) in enumerate(zip(got, want, strict=True)):
        assert [g.shape for g in g_chunks] == [w.shape for w in w_chunks]
        for g, w in zip(g_chunks, w_chunks, strict=True):
            assert_close(g, w, CAUSAL_WAVE)
        whole = hift.inference(torch.cat(mels[i], dim=-1))[0]
        assert_close(torch.cat(g_chunks, dim=-1), whole, CAUSAL_WAVE)
    rows = Counter(rows for rows, _ in keys)
    assert rows[2] >= 3 and rows[4] >= 1  # pairs in step, and three streams' 25-token hops padded to 4 rows
    assert runner.graphs.misses == 0
    assert not any(key[1].frames == 2 * 130 for key in keys)  # the whole clip ran alone, eagerly
    # a stream that never shared a call: bit-equal
    assert all(torch.equal(g, w) for g, w in zip(got[5], want[5], strict=True))


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_a_row_changes_no_other_row(folder, monkeypatch):
    """Three streams' equal steps batched with a fourth whose mel is NaN give, bit for bit, the samples they give
    batched with a zero padding row: nothing in a step mixes rows (convs, pads, the STFT's reflection, overlap-add)."""
    hift = tiny(folder)
    runner = set_runner(hift, causal_hift_shapes(hift, CFG, 4), monkeypatch)
    g = torch.Generator().manual_seed(4)
    mels = [[torch.randn(1, hift.cfg.in_channels, n, generator=g) * 2 - 5 for n in (50 + 2 * i, 50)] for i in range(4)]
    mels[3] = [torch.full_like(m, float("nan")) for m in mels[3]]
    out = {}
    for n in (3, 4):
        states = [hift.new_stream() for _ in range(n)]
        for k in range(2):
            out[n] = vocode_causal_chunks(hift, states, [m[k] for m in mels[:n]], [False] * n, runner, 4)
    assert runner.graphs.misses == 0
    assert all(torch.equal(a, b) for a, b in zip(out[3], out[4][:3], strict=True))
    assert all(w.isfinite().all() for w in out[3]) and out[4][3].isnan().all()


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_a_batch_pads_to_its_ladders_row_count(folder, monkeypatch):
    """With a ladder up to 6 rows (1, 2, 4, 6), five streams in step run as one call of 6 rows, in the set, each row
    its stream's `CausalHiFT.stream` audio."""
    hift = tiny(folder)
    runner = set_runner(hift, causal_hift_shapes(hift, CFG, 6), monkeypatch)
    keys = []
    call = runner.call
    monkeypatch.setattr(runner, "call", lambda key, write: keys.append(key) or call(key, write))
    g = torch.Generator().manual_seed(5)
    mels = [[torch.randn(1, hift.cfg.in_channels, n, generator=g) * 2 - 5 for n in (50, 100)] for _ in range(5)]
    states = [hift.new_stream() for _ in mels]
    got = [vocode_causal_chunks(hift, states, [m[k] for m in mels], [False] * 5, runner, 64) for k in range(2)]
    ref = [hift.new_stream() for _ in mels]
    for k in range(2):
        for g_wave, state, m in zip(got[k], ref, mels, strict=True):
            assert_close(g_wave, hift.stream(state, m[k], False), CAUSAL_WAVE)
    assert [rows for rows, _ in keys] == [1] * 5 + [6] and runner.graphs.misses == 0


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_without_a_runner_each_stream_runs_alone(folder):
    """No graph set: every stream's call is `CausalHiFT.stream` itself, bit-equal."""
    hift = tiny(folder)
    mels = mels_of(hift, 2)
    for g_chunks, w_chunks in zip(batched(hift, mels, None), alone(hift, mels), strict=True):
        assert all(torch.equal(g, w) for g, w in zip(g_chunks, w_chunks, strict=True))


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("gaussian", [False, True], ids=["fixed-noise", "gaussian-noise"])
@torch.inference_mode()
def test_a_failed_call_retried_gives_the_same_audio(folder, gaussian, monkeypatch):
    """A call that fails part-way (out of memory after a first batch ran) leaves every state as it was: its retry
    gives each stream's audio, also with per-stream Gaussian noise (`fixed_noise` off), whose generators are wound
    back."""
    hift = tiny(folder, fixed_noise=not gaussian)
    mels = mels_of(hift, 3)
    keys = causal_hift_shapes(hift, CFG, 8)
    want = alone(hift, mels, gaussian)
    got = batched(hift, mels, set_runner(hift, keys, monkeypatch), gaussian=gaussian, fail_round=2)
    for g_chunks, w_chunks in zip(got, want, strict=True):
        for g, w in zip(g_chunks, w_chunks, strict=True):
            assert_close(g, w, CAUSAL_WAVE)


def _calls(prompt: int, n: int, paced: int) -> list:
    """The schedule's calls, the first `paced` ones keeping their hop (a streamed text while its text arrives)."""
    schedule, calls = HopSchedule(prompt, CFG), []
    while (call := schedule.next_call(n, grow=len(calls) >= paced)) is not None:
        calls.append(call)
    return calls + [schedule.final_call(n)]


@pytest.mark.parametrize("folder", SETS)
def test_steps_cover_every_streaming_chunk(folder):
    """For prompts of every pad and any number of tokens, with upstream's growing hops or a streamed text's kept ones,
    every streaming chunk's step is in the set: non-final chunks after a stream's first at every row count up to 64,
    every other chunk (first, final, a piece shorter than its first hop) one row at a time. The set is no larger than
    that."""
    hift = tiny(folder)
    keys = causal_hift_shapes(hift, CFG, 64)
    assert len(set(keys)) == len(keys)
    runner = CausalHiFTGraphs(hift, cuda_graphs=False)
    runner.capture_all(keys)
    seen = set()
    for prompt, paced in itertools.product(range(CFG.token_hop_len), (0, 3)):
        for n in range(1, 400):
            state = hift.new_stream()
            for k, call in enumerate(_calls(prompt, n, paced)):
                la = 0 if call.finalize else CFG.pre_lookahead_len
                step = hift.stream_step(state, CFG.token_mel_ratio * (call.n_tokens_in - la - call.token_offset),
                                        call.finalize)
                assert runner.rows_per_call(step) == (64 if k and not call.finalize else 1), (prompt, n, k)
                seen.add(step)
                state = dataclasses.replace(state, **dict(zip(
                    ("received", "mel_start", "source_start", "f0_frames", "emitted_frames"), step.after,
                    strict=True)))
    assert seen == {step for _, step in keys}
    assert Counter(rows for rows, _ in keys)[64] == 3  # the hops of 25, 50 and 100 tokens


def test_engine_streams_through_the_set_with_the_eager_audio(tmp_path, monkeypatch):
    """Through a CosyVoice3 engine (tiny random model, CPU, where its set runs eagerly from the static buffers): every
    streamed chunk goes through the vocoder's graph set, and the audio is bit-equal to the engine's vocoding each
    stream alone through `CausalHiFT.stream`. Each run has an engine of its own, so the flow takes the same path in
    both (a second request of the same prompt would start from its cached prefix)."""
    req = SynthesisRequest(text="Hello world, this is a test.", prompt_audio=prompt_wav(), prompt_text="a prompt",
                           seed=4, force_tokens=160)

    def run(graphs: bool) -> tuple[list, list]:
        e = Engine.from_model_dir(None, EngineConfig(random_size="tiny", family="cosyvoice3", device="cpu",
                                                     warmup=False, voices_dir=str(tmp_path / str(graphs))))
        try:
            runner, keys = e._parts.vocoder.hift_graphs, []
            call = runner.call
            monkeypatch.setattr(runner, "call", lambda key, write: keys.append(key) or call(key, write))
            if not graphs:
                monkeypatch.setattr(e.family, "vocode", lambda hift, states, mels, finals, *rest: [
                    hift.stream(state, mel, final) for state, mel, final in zip(states, mels, finals, strict=True)])
            chunks = list(e.stream(req))
            assert runner.graphs.misses == 0
            return chunks, keys
        finally:
            e.close()

    chunks, keys = run(graphs=True)
    assert len(keys) == len(chunks) >= 3
    eager, keys = run(graphs=False)
    assert not keys
    assert np.array_equal(np.concatenate([c.pcm for c in chunks]), np.concatenate([c.pcm for c in eager]))


# ---- on a GPU -------------------------------------------------------------------------------------------------
def _count_replays(runner: CausalHiFTGraphs) -> Counter:
    """Replays per key of the runner's captured graphs, counted from now on."""
    replays: Counter = Counter()
    for key, entry in runner.graphs.entries.items():
        replay = entry.graph.replay

        def counted(key=key, replay=replay):
            replays[key] += 1
            replay()

        entry.graph.replay = counted
    return replays


@pytest.mark.gpu  # CUDA graphs
@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_graph_replays_equal_each_stream_alone_on_cuda(folder):
    """Captured once per step, replayed for the scripts' rounds (twice, new mel the second time): each stream's chunks
    equal `CausalHiFT.stream` alone on the GPU within a capture's rounding (cuDNN may pick other algorithms for a
    capture), every batched call a replay, none a miss, none captured after start-up."""
    hift = tiny(folder, "cuda")
    runner = CausalHiFTGraphs(hift, cuda_graphs=True)
    runner.capture_all(causal_hift_shapes(hift, CFG, 8))
    captured = runner.graphs.captures
    assert captured == len(causal_hift_shapes(hift, CFG, 8))
    replays = _count_replays(runner)
    for seed in (1, 2):
        mels = [[m.cuda() for m in ms] for ms in mels_of(hift, seed)]
        for g_chunks, w_chunks in zip(batched(hift, mels, runner), alone(hift, mels), strict=True):
            for g, w in zip(g_chunks, w_chunks, strict=True):
                assert_close(g, w, CAUSAL_GRAPH_VS_EAGER_WAVE)
    assert runner.graphs.misses == 0 and runner.graphs.captures == captured
    assert any(rows > 1 for rows, _ in replays) and sum(replays.values()) > 2 * len(SCRIPTS)


@pytest.mark.gpu  # CUDA graphs
def test_cosyvoice3_engine_serves_from_graphs_captured_at_start_up(tmp_path):
    """A CosyVoice3 engine on CUDA captures a CausalHiFT graph for every key of its ladder at start-up; while it
    serves concurrent streams, every vocoder call of their chunks is a replay of one of those graphs, none misses and
    none is captured."""
    e = Engine.from_model_dir(None, EngineConfig(random_size="tiny", family="cosyvoice3", device="cuda",
                                                 warmup=False, voices_dir=str(tmp_path)))
    try:
        voc = e._parts.vocoder
        runner = voc.hift_graphs
        assert isinstance(runner, CausalHiFTGraphs)
        keys = e.family.hift_shapes(voc.max_rows, voc.hift)
        assert set(runner.graphs.entries) == set(keys) and e.stats()["hift_graph_captures"] == len(keys)
        replays = _count_replays(runner)
        calls = []
        call = runner.call
        runner.call = lambda key, write: calls.append(key) or call(key, write)
        reqs = [SynthesisRequest(text="Hello world, this is a test.", prompt_audio=prompt_wav(),
                                 prompt_text="a prompt", seed=s, force_tokens=160 + 10 * s) for s in range(6)]
        with ThreadPoolExecutor(len(reqs)) as pool:
            runs = list(pool.map(lambda r: list(e.stream(r)), reqs))
        stats = e.stats()
    finally:
        e.close()
    assert all(run[-1].is_last for run in runs)
    assert stats["hift_graph_misses"] == 0 and stats["hift_graph_captures"] == len(keys)
    assert len(calls) >= max(len(run) for run in runs)  # every chunk of a stream went through the runner...
    assert sum(replays.values()) == len(calls)  # ... as a replay
