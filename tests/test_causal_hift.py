"""CausalHiFT (CosyVoice3's vocoder) parity against upstream outputs on every CosyVoice3 fixture set: f0 (float64 and
float32), the fixed-noise source, the waveform of final and non-final calls, the growing-prefix re-runs, and the
incremental stream against those re-runs; plus the upstream quirks' switches and the checkpoint layout."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import CausalHiFTConfig
from cosyvoice_opt.models.causal_hift import F0_LOOK_RIGHT, CausalHiFT, fixed_noise
from tests.conftest import fixture_params
from tests.test_llm_cv3 import cv3_checkpoint_shapes
from tests.tolerances import (
    CAUSAL_SOURCE,
    CAUSAL_WAVE,
    ELEMENTWISE,
    EXACT,
    F0_FLOAT32,
    F0_FLOAT64,
    SINE,
    assert_close,
)

SETS = fixture_params("parity-cv3")


def build(folder: Path, **quirks) -> CausalHiFT:
    cfg = json.loads((folder / "hift_tiny_config.json").read_text())
    config = CausalHiFTConfig.from_upstream(cfg["hift"], cfg["f0_predictor"], cfg["fixed_noise"])
    model = CausalHiFT(dataclasses.replace(config, **quirks)).eval()
    model.load_state_dict(torch.load(folder / "hift_tiny_state_dict.pt", weights_only=True), strict=True)
    return model


@functools.cache
def load_set(folder: Path) -> tuple[CausalHiFT, dict]:
    return build(folder), torch.load(folder / "hift_io.pt", weights_only=True)


@functools.cache
def load_tts(folder: Path) -> dict:
    return torch.load(folder / "model_tts_io.pt", weights_only=True)


def close_wave(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close(got, want, CAUSAL_WAVE)


def close_source(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close(got, want, CAUSAL_SOURCE)


@pytest.mark.parametrize("folder", SETS)
def test_state_dict_is_upstreams(folder):
    """Strict load; the same keys, in the same order, with the same shapes as upstream's state dict."""
    model, _ = load_set(folder)
    sd = torch.load(folder / "hift_tiny_state_dict.pt", weights_only=True)
    got = model.state_dict()
    assert list(got) == list(sd)
    assert all(got[k].shape == v.shape and got[k].dtype == v.dtype for k, v in sd.items())
    assert any(k.endswith("parametrizations.weight.original0") for k in sd)


def test_full_size_keys_and_shapes():
    """The released hift.pt's keys and shapes (cosyvoice_opt/checkpoint_keys_cv3.txt): conv_pre kernel 5, ups as
    Conv1d [out,in,k] with g [out,1,1], f0 condnet.0 kernel 4."""
    with torch.device("meta"):
        model = CausalHiFT(CausalHiFTConfig())
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == cv3_checkpoint_shapes("hift.pt")
    assert model.hold_back_frames == 8


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_f0_float64(folder):
    """f0 runs in float64 from float64 g and v (upstream), final and non-final; `f0()` casts it to float32."""
    model, io = load_set(folder)
    mel = io["mel"]
    for finalize, key in ((True, "f0_f64"), (False, "f0_nonfinal_f64")):
        got = model.f0_predictor(mel, finalize, torch.float64)
        assert got.dtype == torch.float64
        assert_close(got, io[key], F0_FLOAT64)
    f0 = model.f0(mel)
    assert f0.dtype == torch.float32
    assert_close(f0, io["f0"], ELEMENTWISE)
    assert model.f0(mel, finalize=False).shape[-1] == mel.shape[-1] - F0_LOOK_RIGHT


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_f0_float64_switch(folder):
    """`f0_float64=False` runs the predictor in the parameters' dtype: close to upstream's f0, not equal to it."""
    model, io = load_set(folder)
    fast = build(folder, f0_float64=False)
    got = fast.f0(io["mel"])
    assert_close(got, model.f0_predictor(io["mel"], dtype=torch.float32), EXACT)  # the same computation
    assert_close(got, io["f0"], F0_FLOAT32)
    assert not torch.equal(got, io["f0"])


@pytest.mark.parametrize("folder", SETS)
def test_fixed_noise_recipe(folder):
    """The noise is upstream's: seed, rand(1, 9), then the first rows of rand(1, N, 9); a longer draw keeps them."""
    model, io = load_set(folder)
    assert model.cfg.noise_seed == int(io["noise_seed"])
    rows = io["sine_noise"].shape[1]
    # torch.rand's floats are the generator's integers scaled by 2**-24: no rounding, the same on every CPU
    assert_close(fixed_noise(model.cfg.noise_seed, rows, model.m_source.dim), io["sine_noise"], EXACT)
    source = model.m_source
    source._noise = None
    head = source.noise_rows(0, 100, torch.device("cpu"), torch.float32)
    assert_close(head, io["sine_noise"][:, :100], EXACT)
    assert_close(source.noise_rows(rows - 7, rows, torch.device("cpu"), torch.float32), io["sine_noise"][:, -7:], EXACT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source(folder):
    """Staircase harmonics + the fixed uniform noise, from the fixture's f0, for each call's f0."""
    model, io = load_set(folder)
    close_source(model.source(io["f0"])[0], io["source"])
    close_source(model.source(model.f0(io["mel2"]))[0], io["source2"])
    close_source(model.source(model.f0(io["mel"], finalize=False))[0], io["source_nonfinal"])


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source_from_a_later_frame(folder):
    """Frames from k on, given the phase sum after frame k-1, are the same samples as a call from frame 0: the
    phase is carried and sample n takes noise row n."""
    model, io = load_set(folder)
    f0, scale = io["f0"], model.cfg.upsample_scale
    whole, end_cycles = model.source(f0)
    k = f0.shape[-1] // 3
    _, cycles = model.source(f0[:, :k])
    tail, tail_cycles = model.source(f0[:, k:], k, cycles)
    # exact: the same kernels on the same carried sums, in one process
    assert_close(tail, whole[..., k * scale:], EXACT)
    assert_close(tail_cycles, end_cycles, EXACT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_decode_fixed_source(folder):
    """The deterministic decode: final on all frames, non-final on all but the last 3."""
    model, io = load_set(folder)
    mel, s = io["mel"], io["s_fixed"]
    close_wave(model.decode(mel, s), io["speech_fixed"])
    t = mel.shape[-1] - F0_LOOK_RIGHT
    close_wave(model.decode(mel[..., :t], s[..., : t * model.cfg.upsample_scale], False), io["speech_fixed_nonfinal"])


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_inference(folder):
    """`inference` final and non-final on mel, final on mel2: waveform and excitation."""
    model, io = load_set(folder)
    for mel, finalize, speech, source in (
        (io["mel"], True, "speech", "source"),
        (io["mel"], False, "speech_nonfinal", "source_nonfinal"),
        (io["mel2"], True, "speech2", "source2"),
    ):
        got_speech, got_source = model.inference(mel, finalize)
        close_wave(got_speech, io[speech])
        close_source(got_source, io[source])


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_growing_prefix_calls(folder):
    """Upstream's re-runs over growing prefixes (as CosyVoice3Model streams): each call's whole output."""
    model, io = load_set(folder)
    for call in io["stream_calls"]:
        speech, _ = model.inference(io["mel"][..., : int(call["mel_frames"])], bool(call["finalize"]))
        close_wave(speech, call["speech_out"])


def run_stream(model: CausalHiFT, mels: list[torch.Tensor], finals: list[bool]) -> list[torch.Tensor]:
    """Each chunk through one stream; checks the state stays bounded (no re-run over the whole utterance)."""
    state, out = model.new_stream(), []
    bound = model.decode_context_frames() + model.hold_back_frames + model.f0_predictor.left_context
    for mel, final in zip(mels, finals, strict=True):
        out.append(model.stream(state, mel, final))
        assert state.mel.shape[-1] <= bound
        if state.source is not None:
            assert state.source.shape[-1] <= bound * model.cfg.upsample_scale
    return out


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_stream_equals_growing_prefix_calls(folder):
    """The incremental stream returns, chunk by chunk, upstream's new samples of each growing-prefix re-run."""
    model, io = load_set(folder)
    calls, starts = io["stream_calls"], [0] + [int(c["mel_frames"]) for c in io["stream_calls"]]
    mels = [io["mel"][..., a:b] for a, b in zip(starts, starts[1:], strict=False)]
    for got, call in zip(run_stream(model, mels, [bool(c["finalize"]) for c in calls]), calls, strict=True):
        close_wave(got, call["speech_new"])


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("chunk", [1, 5, 9, 23])
@torch.inference_mode()
def test_stream_any_chunking_equals_final_call(folder, chunk):
    """Chunks of any size, ones that make no audio included, add up to the final call's waveform."""
    model, io = load_set(folder)
    mel = io["mel"]
    pieces = list(mel.split(chunk, dim=-1))
    got = run_stream(model, pieces, [False] * (len(pieces) - 1) + [True])
    close_wave(torch.cat(got, dim=-1), io["speech"])


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_stream_equals_model_tts_hift_calls(folder):
    """CosyVoice3Model.tts(stream=True)'s HiFT calls (`model_tts_io.pt`): the stream fed each call's new mel frames
    yields that call's chunk; the non-stream and speed-changed calls are one final `inference`."""
    model, _ = load_set(folder)
    tts = load_tts(folder)
    calls = tts["stream_hift_calls"]
    frames = [0] + [c["mel_in"].shape[-1] for c in calls]
    mels = [calls[-1]["mel_in"][..., a:b] for a, b in zip(frames, frames[1:], strict=False)]
    for i, call in enumerate(calls[:-1]):  # each call's mel is a prefix of the next one's
        assert_close(call["mel_in"], calls[i + 1]["mel_in"][..., : frames[i + 1]], EXACT)
    got = run_stream(model, mels, [bool(c["finalize"]) for c in calls])
    for chunk, want, call in zip(got, tts["stream_speech_chunks"], calls, strict=True):
        close_wave(chunk, want)
        close_wave(chunk, call["speech_out"][:, int(call["speech_offset"]):])
    for kind in ("nonstream", "nonstream_speed"):
        (call,), (want,) = tts[f"{kind}_hift_calls"], tts[f"{kind}_speech_chunks"]
        close_wave(model.inference(call["mel_in"], bool(call["finalize"]))[0], want)


@torch.inference_mode()
def test_stream_after_final_call_refused():
    model = CausalHiFT(CausalHiFTConfig(base_channels=16, f0_cond_channels=8)).eval()
    state = model.new_stream()
    model.stream(state, torch.randn(1, 80, 12), True)
    with pytest.raises(ValueError, match="finished"):
        model.stream(state, torch.randn(1, 80, 3), False)


@torch.inference_mode()
def test_noise_longer_than_upstreams_refused():
    """Upstream's noise covers 300 s; a longer utterance is a clear error, not a shape mismatch."""
    model = CausalHiFT(CausalHiFTConfig(base_channels=16, f0_cond_channels=8, noise_samples=480 * 10)).eval()
    model.inference(torch.randn(1, 80, 10))
    with pytest.raises(ValueError, match="fixed noise covers 4800 samples"):
        model.inference(torch.randn(1, 80, 11))


def one_harmonic(model: CausalHiFT) -> CausalHiFT:
    """Only the fundamental reaches the excitation, unscaled: source = tanh(harmonic 1 + its noise)."""
    with torch.no_grad():
        model.m_source.l_linear.weight.zero_()
        model.m_source.l_linear.weight[0, 0] = 1.0
        model.m_source.l_linear.bias.zero_()
    return model.eval()


@torch.inference_mode()
def test_staircase_source_switch():
    """Default (upstream): the harmonic is constant over each mel frame, moving only by the voiced noise
    (0.003 * U[0,1)). `staircase_source=False`: a sinusoid at f0, equal to the staircase at each frame's last
    sample."""
    cfg = CausalHiFTConfig(base_channels=16, f0_cond_channels=8)
    scale, f = cfg.upsample_scale, 210.0
    f0 = torch.full((1, 6), f)
    stairs = one_harmonic(CausalHiFT(cfg)).source(f0)[0].atanh().reshape(6, scale)
    smooth = one_harmonic(CausalHiFT(dataclasses.replace(cfg, staircase_source=False))).source(f0)[0].atanh()
    assert (stairs.amax(1) - stairs.amin(1)).max() <= cfg.nsf_sigma
    n = torch.arange(1, 6 * scale + 1, dtype=torch.float64)
    want = cfg.nsf_alpha * torch.sin(2 * torch.pi * ((f / cfg.sampling_rate * n) % 1))
    # not a rounding bound: the voiced noise's amplitude (nsf_sigma), plus 1% for the float32 phase, and rtol for
    # the rounding of the sine's own values
    torch.testing.assert_close(smooth[0, 0].double(), want, rtol=1e-5, atol=cfg.nsf_sigma * 1.01)
    assert_close(smooth.reshape(6, scale)[:, -1], stairs[:, -1], SINE)


@torch.inference_mode()
def test_fixed_noise_switch():
    """Default (upstream): unvoiced noise is uniform [0,1) (mean 1/2, times alpha/3) and every call reuses it.
    `fixed_noise=False`: zero-mean Gaussian, drawn per call from the caller's generator."""
    cfg = CausalHiFTConfig(base_channels=16, f0_cond_channels=8)
    f0 = torch.zeros(1, 40)  # unvoiced
    fixed = one_harmonic(CausalHiFT(cfg))
    first, again = fixed.source(f0)[0], fixed.source(f0)[0]
    assert torch.equal(first, again)
    noise = first.atanh() / (cfg.nsf_alpha / 3)
    assert noise.min() >= 0 and abs(noise.mean().item() - 0.5) < 0.01
    drawn = one_harmonic(CausalHiFT(dataclasses.replace(cfg, fixed_noise=False)))
    a = drawn.source(f0, generator=torch.Generator().manual_seed(1))[0]
    b = drawn.source(f0, generator=torch.Generator().manual_seed(2))[0]
    assert not torch.equal(a, b)
    assert torch.equal(a, drawn.source(f0, generator=torch.Generator().manual_seed(1))[0])
    gauss = a.atanh() / (cfg.nsf_alpha / 3)
    assert abs(gauss.mean().item()) < 0.05 and abs(gauss.std().item() - 1) < 0.05  # 19200 draws: 7 sigma


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_fuse_weight_norm_keeps_output(folder):
    """Fused weights (the f0 predictor's in float64) give the same f0 and waveform."""
    model, io = load_set(folder)
    fused = build(folder).fuse_weight_norm()
    assert not any("parametrizations" in k for k in fused.state_dict())
    assert_close(fused.f0_predictor(io["mel"], True, torch.float64), io["f0_f64"], F0_FLOAT64)
    close_wave(fused.inference(io["mel"])[0], io["speech"])


@torch.inference_mode()
def test_stream_work_per_chunk_is_bounded(monkeypatch):
    """A long utterance in 25-frame chunks: every decode sees at most the context, the chunk and the look-ahead
    (no re-run over all the mel so far), every f0 call at most its context, the chunk and the look-ahead; the audio
    is the final call's. Two rows in one stream are the rows streamed alone."""
    torch.manual_seed(0)
    model = CausalHiFT(CausalHiFTConfig(base_channels=16, f0_cond_channels=8)).eval()
    mel = torch.randn(2, 80, 160) * 2 - 5
    chunk = 25
    decoded, predicted = [], []
    decode, predict = model.decode, model.f0

    def spy_decode(x, *args, **kwargs):
        decoded.append(x.shape[-1])
        return decode(x, *args, **kwargs)

    def spy_f0(x, *args, **kwargs):
        predicted.append(x.shape[-1])
        return predict(x, *args, **kwargs)

    monkeypatch.setattr(model, "decode", spy_decode)
    monkeypatch.setattr(model, "f0", spy_f0)
    pieces = list(mel.split(chunk, dim=-1))
    got = torch.cat(run_stream(model, pieces, [False] * (len(pieces) - 1) + [True]), dim=-1)
    hold = model.hold_back_frames
    assert len(decoded) == len(pieces) and max(decoded) <= model.decode_context_frames() + chunk + hold
    assert max(predicted) <= model.f0_predictor.left_context + chunk + F0_LOOK_RIGHT
    monkeypatch.undo()
    close_wave(got, model.inference(mel)[0])
    for row in range(2):
        alone = torch.cat(run_stream(model, list(mel[row:row + 1].split(chunk, dim=-1)),
                                     [False] * (len(pieces) - 1) + [True]), dim=-1)
        close_wave(got[row:row + 1], alone)


def test_default_noise_is_upstream_loaders():
    """Without a seed, the noise is what upstream's loader draws (cosyvoice3-reference.md 8.2): seed 0, the CFM's
    noise, the flow's embedding and speaker projection, the f0 predictor, then rand(1, 9) and rand(1, N, 9)."""
    cfg = CausalHiFTConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.randn(1, 80, 15000)
        torch.nn.Embedding(6561, 80)
        torch.nn.Linear(192, 80)
        for c_in, k in ((80, 4), (512, 3), (512, 3), (512, 3), (512, 3)):
            torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(c_in, 512, k))
        torch.nn.Linear(512, 1)
        torch.rand(1, 9)
        want = torch.rand(1, 1000, 9)
    with torch.device("meta"):
        model = CausalHiFT(cfg)
    assert cfg.noise_seed is None
    got = model.m_source.noise_rows(0, 1000, torch.device("cpu"), torch.float32)
    assert_close(got, want, EXACT)  # torch.rand: see test_fixed_noise_recipe
