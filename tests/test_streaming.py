"""Streaming schedule and HiFT chunk caches/cross-fade against upstream `CosyVoice2Model.tts` on every fixture set."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.engine.streaming import (
    HiftStreamState,
    HopSchedule,
    StreamConfig,
    change_speed,
    fade_in_out,
    stream_calls,
    vocode_chunk,
    vocode_chunks,
)
from cosyvoice_opt.random_model import random_model
from tests.conftest import fixture_params, parity_params
from tests.test_flow import load_set as load_flow_set
from tests.test_hift import load_set
from tests.tolerances import E2E, ELEMENTWISE, EXACT, HIFT, PHASE, assert_close

SETS = parity_params()


@functools.cache
def load_tts(folder: Path) -> tuple[dict, StreamConfig, dict]:
    cfg = json.loads((folder / "model_tts_config.json").read_text())
    return cfg, StreamConfig.from_upstream(cfg), torch.load(folder / "model_tts_io.pt", weights_only=True)


def as_tuples(calls) -> list[tuple]:
    return [(c.n_tokens_in, c.token_offset, c.streaming, c.finalize) for c in calls]


def recorded(cfg: dict, mode: str) -> list[tuple]:
    return [(c["n_tokens_in"], c["token_offset"], c["streaming"], c["finalize"]) for c in cfg[mode]["calls"]]


def new_mels(calls: list[dict], sc: StreamConfig) -> list[torch.Tensor]:
    """The flow output each chunk added: HiFT's recorded input without the cached frames."""
    return [c["mel_in"][:, :, 0 if i == 0 else sc.mel_cache_len:] for i, c in enumerate(calls)]


@pytest.mark.parametrize("folder", SETS)
def test_schedule_all_tokens_available(folder):
    cfg, sc, _ = load_tts(folder)
    prompt, n = cfg["inputs"]["prompt_tokens"], cfg["inputs"]["target_tokens"]
    calls = stream_calls(prompt, n, sc)
    assert as_tuples(calls) == recorded(cfg, "stream")
    assert all(c.mel_offset == c.token_offset * sc.token_mel_ratio for c in calls)
    # HiFT input lengths: flow returns the hop's frames (streaming drops the look-ahead) plus 8 cached frames.
    frames = [
        (c.n_tokens_in - c.token_offset - (0 if c.finalize else sc.pre_lookahead_len)) * sc.token_mel_ratio
        + (sc.mel_cache_len if i else 0)
        for i, c in enumerate(calls)
    ]
    assert frames == cfg["stream"]["hift_mel_in_frames"]


@pytest.mark.parametrize("folder", SETS)
def test_schedule_tokens_arriving_one_by_one(folder):
    """Polled as tokens arrive, each request's schedule makes upstream's calls; a second request is unaffected
    by the first (upstream's shared, never reset hop would start it at 100)."""
    cfg, sc, _ = load_tts(folder)
    prompt, n = cfg["inputs"]["prompt_tokens"], cfg["inputs"]["target_tokens"]
    for _request in range(2):
        schedule, calls = HopSchedule(prompt, sc), []
        for available in range(n + 1):
            if available >= schedule.tokens_needed:
                calls.append(schedule.next_call(available))
            assert schedule.next_call(available) is None
        calls.append(schedule.final_call(n))
        assert as_tuples(calls) == recorded(cfg, "stream")


def upstream_hop_calls(cfg: dict, prompt: int, n: int) -> list[tuple]:
    """The calls of a stream whose `n` tokens are all there, by the set's `hop_rule` (upstream's `CosyVoice2Model`):
    the first hop is `token_hop_len` plus the prompt's pad to a whole hop; after each streaming call the hop becomes
    `min(token_max_hop_len, hop * stream_scale_factor)`; calls go on while a hop and the look-ahead are there."""
    hop, la, offset, calls = cfg["token_hop_len"], cfg["pre_lookahead_len"], 0, []
    pad = -prompt % hop
    while n - offset >= (this := hop + pad if offset == 0 else hop) + la:
        calls.append((offset + this + la, offset, True, False))
        offset += this
        hop = min(cfg["token_max_hop_len"], hop * cfg["stream_scale_factor"])
    return [*calls, (n, offset, False, True)]


@pytest.mark.parametrize("folder", SETS)
def test_schedule_reaches_upstreams_hop_cap(folder):
    """A stream long enough to grow its hop to the cap and stay there (25 -> 50 -> 100, then 100 at upstream's
    constants): the set's own constants and the engine's defaults both make upstream's calls. The fixture's streams
    end before the cap, so only this test sees it."""
    cfg, sc, _ = load_tts(folder)
    prompt, cap = cfg["inputs"]["prompt_tokens"], cfg["token_max_hop_len"]
    assert StreamConfig() == sc  # the engine streams with upstream's constants
    n = 5 * cap + cfg["token_hop_len"]
    want = upstream_hop_calls(cfg, prompt, n)
    hops = [b[1] - a[1] for a, b in zip(want, want[1:], strict=False)]  # tokens each streaming call made
    grown = [min(cap, cfg["token_hop_len"] * cfg["stream_scale_factor"] ** k) for k in (1, 2)]
    assert hops[1:3] == grown and hops.count(cap) >= 3, hops  # it grew, reached the cap and kept it
    assert as_tuples(stream_calls(prompt, n, sc)) == want
    assert as_tuples(stream_calls(prompt, n)) == want


def test_a_schedule_that_does_not_grow_keeps_its_hop():
    """Calls made with `grow=False` keep the hop (a streamed text while its text arrives); the calls after grow it
    from there as upstream's."""
    sc = StreamConfig()
    schedule, offsets = HopSchedule(10, sc), []
    for k in range(6):
        call = schedule.next_call(1000, grow=k >= 3)
        offsets.append(call.token_offset)
    pad = -10 % sc.token_hop_len
    first = sc.token_hop_len + pad
    assert offsets == [0, first, first + 25, first + 50, first + 75, first + 125]


@pytest.mark.parametrize("folder", SETS)
def test_fade_window_and_formula(folder):
    _, sc, io = load_tts(folder)
    calls, n = io["stream_hift_calls"], sc.source_cache_len
    assert io["speech_window"].shape[0] == 2 * n
    cur, prev = calls[1]["speech_out"], calls[0]["speech_out"][:, -n:]
    w = io["speech_window"]
    expect = cur.clone()
    expect[:, :n] = cur[:, :n] * w[:n] + prev * w[n:]
    out = fade_in_out(cur, prev)
    assert out.dtype == cur.dtype and out.shape == cur.shape
    assert_close(out, expect, ELEMENTWISE)


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("mode", ["stream", "nonstream"])
def test_state_with_recorded_hift_io(folder, mode):
    """Caches and cross-fade alone: upstream's HiFT inputs and outputs in, upstream's yielded chunks out."""
    cfg, sc, io = load_tts(folder)
    calls = io[f"{mode}_hift_calls"]
    state, chunks = HiftStreamState(sc), []
    for i, (call, mel) in enumerate(zip(calls, new_mels(calls, sc), strict=True)):
        mel_in, cache = state.prepare(mel)
        assert_close(mel_in, call["mel_in"], EXACT)
        if call["cache_source"].shape[-1]:
            assert_close(cache, call["cache_source"], EXACT)
        else:
            assert cache is None
        chunks.append(state.finish(mel_in, call["speech_out"], call["source_out"], final=i == len(calls) - 1))
    assert [c.shape[-1] for c in chunks] == cfg[mode]["yielded_samples"]
    for got, want in zip(chunks, io[f"{mode}_speech_chunks"], strict=True):
        assert_close(got, want, ELEMENTWISE)
    assert state.mel is None and state.speech is None
    samples_per_frame = load_set(folder)[0].cfg.upsample_scale
    assert samples_per_frame == cfg["samples_per_mel_frame"]
    assert sum(c.shape[-1] for c in chunks) == io["tokens"].shape[1] * sc.token_mel_ratio * samples_per_frame


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("mode", ["stream", "nonstream"])
@torch.inference_mode()
def test_hift_with_recorded_sources(folder, mode):
    """Our HiFT decode + caches/fade on upstream's excitation: tight."""
    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    calls = io[f"{mode}_hift_calls"]
    state = HiftStreamState(sc)
    for i, (call, mel, want) in enumerate(zip(calls, new_mels(calls, sc), io[f"{mode}_speech_chunks"], strict=True)):
        mel_in, _ = state.prepare(mel)
        got = state.finish(mel_in, hift.decode(mel_in, call["source_out"]), call["source_out"], i == len(calls) - 1)
        assert_close(got, want, HIFT)


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("mode", ["stream", "nonstream"])
@torch.inference_mode()
def test_vocode_chunk_seeded_like_upstream(folder, mode):
    """The whole chunk path with upstream's seed (HiFT noise is its only RNG use): yielded audio within 1e-3."""
    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    calls = io[f"{mode}_hift_calls"]
    state, gen = HiftStreamState(sc), torch.Generator().manual_seed(int(io["seed"]))
    chunks = [vocode_chunk(hift, state, mel, i == len(calls) - 1, gen) for i, mel in enumerate(new_mels(calls, sc))]
    for got, want in zip(chunks, io[f"{mode}_speech_chunks"], strict=True):
        assert_close(got, want, PHASE)
    n = io["tokens"].shape[1]
    assert sum(c.shape[-1] for c in chunks) == n * sc.token_mel_ratio * hift.cfg.upsample_scale


class RecordedSourceHiFT:
    """Our HiFT decode, excitation looked up from upstream's calls by mel input (the noise is random)."""

    def __init__(self, hift, calls):
        self.hift, self.calls = hift, calls

    def inference(self, mel, cache_source, generator):
        rows = [next(c["source_out"] for c in self.calls if torch.equal(c["mel_in"], m[None])) for m in mel]
        source = torch.cat(rows)
        return self.hift.decode(mel, source), source


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_vocode_chunks_batches_requests(folder):
    """Two streaming requests and a non-streaming one vocoded together give each its own upstream chunks."""
    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    stream, nonstream = io["stream_hift_calls"], io["nonstream_hift_calls"]
    fake = RecordedSourceHiFT(hift, stream + nonstream)
    states = [HiftStreamState(sc) for _ in range(3)]
    got = {0: [], 1: [], 2: []}
    mels = {0: new_mels(stream, sc), 1: new_mels(stream, sc), 2: new_mels(nonstream, sc)}
    for step in range(len(stream)):
        active = [r for r in got if step < len(mels[r])]
        outs = vocode_chunks(
            fake, [states[r] for r in active], [mels[r][step] for r in active],
            [step == len(mels[r]) - 1 for r in active],
        )
        for r, out in zip(active, outs, strict=True):
            got[r].append(out)
    for r, want in ((0, "stream"), (1, "stream"), (2, "nonstream")):
        for g, w in zip(got[r], io[f"{want}_speech_chunks"], strict=True):
            assert_close(g, w, HIFT)



@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("mode", ["stream", "nonstream"])
@torch.inference_mode()
def test_end_to_end_upstream_flow_calls(folder, mode):
    """Schedule -> upstream-style `Flow.inference` calls -> new frames -> HiFT chunks, seeded like upstream."""
    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    flow, fio, _ = load_flow_set(folder)
    tokens, prompt = io["tokens"], fio["prompt_token"]
    n, p = tokens.shape[1], prompt.shape[1]
    calls = stream_calls(p, n, sc) if mode == "stream" else [HopSchedule(p, sc).final_call(n)]
    state, gen = HiftStreamState(sc), torch.Generator().manual_seed(int(io["seed"]))
    for call, want in zip(calls, io[f"{mode}_speech_chunks"], strict=True):
        mel = flow.inference(tokens[:, : call.n_tokens_in], prompt, fio["prompt_feat"], fio["embedding"],
                             streaming=call.streaming, finalize=call.finalize)[:, :, call.mel_offset :]
        assert_close(vocode_chunk(hift, state, mel, call.finalize, gen), want, E2E)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_end_to_end_incremental_flow(folder):
    """The schedule's calls fit `Flow.stream_chunk`'s chunk-boundary contract; its non-final chunks equal
    upstream's audio. Its final chunk stays block-causal (upstream's is full attention), so only its length is
    compared."""
    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    flow, fio, _ = load_flow_set(folder)
    tokens, la = io["tokens"], sc.pre_lookahead_len
    stream = flow.new_stream(fio["prompt_token"], fio["prompt_feat"], fio["embedding"])
    state, gen = HiftStreamState(sc), torch.Generator().manual_seed(int(io["seed"]))
    calls = stream_calls(fio["prompt_token"].shape[1], tokens.shape[1], sc)
    for call, want in zip(calls, io["stream_speech_chunks"], strict=True):
        end = call.n_tokens_in if call.finalize else call.n_tokens_in - la
        lookahead = None if call.finalize else tokens[:, end : call.n_tokens_in]
        mel = flow.stream_chunk(stream, tokens[:, call.token_offset : end], lookahead, finalize=call.finalize)
        got = vocode_chunk(hift, state, mel, call.finalize, gen)
        assert got.shape == want.shape
        if not call.finalize:
            assert_close(got, want, E2E)


def test_change_speed_length():
    mel = torch.randn(1, 80, 50)
    assert change_speed(mel, 1.0) is mel
    assert change_speed(mel, 1.5).shape == (1, 80, 33)
    slow = change_speed(mel, 0.5)
    assert slow.shape == (1, 80, 100)
    torch.testing.assert_close(slow[..., 0], mel[..., 0])


@torch.inference_mode()
def test_vocode_chunks_pads_a_batch_to_a_bucket_without_changing_any_row():
    """Five chunks of one shape go through HiFT as one batch of eight (a power of two: the graphs exist for those
    counts, and cuDNN plans are per shape); every request gets the audio of the same five rows without padding, and
    the padding rows touch no generator."""
    hift = random_model("tiny", 0, "cpu").hift.eval()
    batches = []
    real_inference = hift.inference

    def spy(mel, cache_source=None, generator=None):
        batches.append(mel.shape[0])
        return real_inference(mel, cache_source, generator)

    hift.inference = spy
    mels = [torch.randn(1, hift.cfg.in_channels, 30) for _ in range(5)]
    seeded = [torch.Generator().manual_seed(i) for i in range(5)]
    together = vocode_chunks(hift, [HiftStreamState() for _ in mels], mels, [True] * 5, seeded)
    assert batches == [8]
    after = [g.get_state() for g in seeded]
    unpadded = [torch.Generator().manual_seed(i) for i in range(5)]
    want, _ = real_inference(torch.cat(mels), None, unpadded)  # the same five rows without the padding row
    for i in range(5):
        # batch 8 vs 5 reorders float sums (4e-5 seen here), which the excitation integrates: see E2E
        assert_close(together[i], want[i : i + 1], E2E)
        assert torch.equal(after[i], unpadded[i].get_state())  # each drew exactly its own numbers
    vocode_chunks(hift, [HiftStreamState() for _ in range(4)], mels[:4], [True] * 4, seeded[:4])
    assert batches[-1] == 4  # a bucket already: no padding


@pytest.mark.parametrize("folder", fixture_params("parity-cv3"))
def test_speed_change_is_upstreams(folder):
    """Upstream's non-streaming speed change (the same rule in CosyVoice2Model and CosyVoice3Model; the CosyVoice3
    sets hold its output): our `change_speed` of upstream's mel is upstream's stretched HiFT input."""
    io = torch.load(folder / "model_tts_io.pt", weights_only=True)
    (call,), (stretched,) = io["nonstream_hift_calls"], io["nonstream_speed_hift_calls"]
    speed = float(io["speed"])
    assert speed != 1.0
    assert_close(change_speed(call["mel_in"], speed), stretched["mel_in"], ELEMENTWISE)


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("speed", [1.0, 1.5])
@torch.inference_mode()
def test_engine_whole_clip_is_upstreams_non_streaming_audio(folder, speed):
    """A whole-clip request through the engine's vocoder (the fixture set's flow and HiFT, its tokens, upstream's
    seed) gives upstream's non-streaming `tts` audio: full-attention flow over prompt and tokens, then HiFT over the
    whole mel. With a speed change, the mel is stretched first, as upstream does."""
    import numpy as np

    from cosyvoice_opt.engine.audio_worker import AudioWorker
    from cosyvoice_opt.engine.precision import FallbackCounter, PrecisionPolicy
    from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, TextPiece
    from cosyvoice_opt.models.hift import HiFT

    _, sc, io = load_tts(folder)
    hift, _ = load_set(folder)
    flow, fio, _ = load_flow_set(folder)
    tokens = io["tokens"]
    policy = PrecisionPolicy.resolve("fp32", torch.device("cpu"))
    # fuse a fresh copy: `load_set`'s model is cached and shared with the HiFT tests, which need its weight norm (a
    # deep copy would share the parametrized classes, whose removal strips the original's weights too)
    fused = HiFT(hift.cfg).eval()
    fused.load_state_dict(hift.state_dict())
    voc = AudioWorker(flow, fused.fuse_weight_norm(), policy, FallbackCounter(), 24000, stream_cfg=sc)
    piece = TextPiece(torch.arange(4), None, 0, tokens.shape[1], tokens=tokens[0].tolist(), done=True)
    prompt = FlowPrompt(fio["prompt_token"], fio["prompt_feat"], fio["embedding"])
    req = Request([piece], prompt, stream=False, speed=speed, seed=int(io["seed"]), force_tokens=None, arrival=0.0,
                  frontend_s=0.0)
    voc.start(lambda r, ok: None)
    try:
        voc.add(req)
        got = req.out.get(timeout=300)
    finally:
        voc.stop()
    assert got.is_last and got.index == 0
    if speed == 1.0:
        want = torch.cat(io["nonstream_speech_chunks"], dim=-1)[0]
    else:  # upstream's mel (its non-streaming HiFT input) stretched by upstream's rule (test_speed_change_is_upstreams)
        (call,) = io["nonstream_hift_calls"]
        want = vocode_chunk(hift, HiftStreamState(sc), change_speed(call["mel_in"], speed), True,
                            torch.Generator().manual_seed(int(io["seed"])))[0]
    want = (want.clamp(-1, 1) * 32767).round().numpy()
    assert got.pcm.shape == want.shape
    assert np.abs(got.pcm.astype(np.float64) - want).max() <= E2E.atol * 32767
