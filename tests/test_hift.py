"""HiFT vocoder parity against upstream outputs on every fixture set, plus checkpoint-key contract tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import HiFTConfig
from cosyvoice_opt.models.hift import HiFT, dft_bases, istft, normalize_hift_keys, stft
from cosyvoice_opt.random_model import random_model
from tests.conftest import REPO_ROOT, parity_params
from tests.tolerances import EXACT, F0, F0_BATCH, HIFT, PHASE, assert_close

SETS = parity_params()


@functools.cache
def load_set(folder: Path) -> tuple[HiFT, dict]:
    cfg = json.loads((folder / "hift_tiny_config.json").read_text())
    model = HiFT(HiFTConfig.from_upstream(cfg["hift"], cfg["f0_predictor"])).eval()
    model.load_state_dict(torch.load(folder / "hift_tiny_state_dict.pt", weights_only=True), strict=True)
    return model, torch.load(folder / "hift_io.pt", weights_only=True)


def draws(io: dict, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial phases and the sine noise upstream drew (the third draw is unused by inference)."""
    fns = [d["fn"] for d in io[key]]
    assert fns[:2] == ["rand", "randn_like"], fns
    return io[key][0]["value"], io[key][1]["value"]


@pytest.mark.parametrize("folder", SETS)
def test_derived_sizes(folder):
    """What upstream derived from the constructor args (`hift_derived`) holds for the model built from them."""
    model, _ = load_set(folder)
    derived = json.loads((folder / "hift_tiny_config.json").read_text())["hift_derived"]
    assert model.cfg.upsample_scale == derived["upsample_scale"] == derived["samples_per_mel_frame"]


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_f0(folder):
    model, io = load_set(folder)
    assert_close(model.f0(io["mel"]), io["f0"], F0)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_decode_fixed_source(folder):
    model, io = load_set(folder)
    assert_close(model.decode(io["mel"], io["s_fixed"]), io["speech_fixed"], HIFT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source_stft_and_window(folder):
    model, io = load_set(folder)
    assert_close(model.stft_window(io["source"]), io["stft_window"], EXACT)
    assert_close(model.source_stft(io["source"]), io["source_stft"], HIFT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source_and_speech_injected_draws(folder):
    model, io = load_set(folder)
    source = model.source(model.f0(io["mel"]), *draws(io, "rng_draws"))
    assert_close(source, io["source"], PHASE)
    assert_close(model.decode(io["mel"], io["source"]), io["speech"], HIFT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_cache_source_second_call(folder):
    model, io = load_set(folder)
    cache = io["cache_source"]
    n = cache.shape[-1]
    assert_close(cache, io["source"][..., -n:], EXACT)
    fresh = model.source(model.f0(io["mel2"]), *draws(io, "rng_draws2"))
    assert_close(fresh[..., n:], io["source2"][..., n:], PHASE)
    assert_close(model.decode(io["mel2"], io["source2"]), io["speech2"], HIFT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_inference_seeded_generator_matches_upstream_rng(folder):
    """A CPU generator seeded like upstream's `manual_seed` reproduces its draws in order, across two calls."""
    model, io = load_set(folder)
    gen = torch.Generator().manual_seed(int(io["seed"]))
    speech, source = model.inference(io["mel"], generator=gen)
    assert_close(source, io["source"], PHASE)
    assert_close(speech, io["speech"], PHASE)
    gen.manual_seed(int(io["seed2"]))
    speech2, source2 = model.inference(io["mel2"], io["cache_source"], generator=gen)
    assert_close(source2, io["source2"], PHASE)
    assert_close(speech2, io["speech2"], PHASE)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_batch_rows_match_single(folder):
    model, io = load_set(folder)
    mel = torch.cat([io["mel"], io["mel"].flip(-1)])
    phases, noise = draws(io, "rng_draws")
    phases, noise = torch.cat([phases, phases.roll(1, -1)]), torch.cat([noise, -noise])
    f0 = model.f0(mel)
    source = model.source(f0, phases, noise)
    speech = model.decode(mel, source)
    for row in range(2):
        r = slice(row, row + 1)
        assert_close(f0[r], model.f0(mel[r]), F0_BATCH)
        assert_close(source[r], model.source(f0[r], phases[r], noise[r]), HIFT)
        assert_close(speech[r], model.decode(mel[r], source[r]), HIFT)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_fuse_weight_norm_keeps_output(folder):
    model, io = load_set(folder)
    fused = HiFT(model.cfg).eval()
    fused.load_state_dict(model.state_dict())
    fused.fuse_weight_norm()
    assert not any("parametrizations" in k for k in fused.state_dict())
    assert_close(fused.decode(io["mel"], io["s_fixed"]), io["speech_fixed"], HIFT)
    assert_close(fused.f0(io["mel"]), io["f0"], F0)


TRANSFORM_DTYPES = [(torch.float64, 1e-13), (torch.float32, 1e-6)]  # max |error| / max |torch's output|


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype, tol", TRANSFORM_DTYPES)
@pytest.mark.parametrize("n_fft, hop", [(16, 4), (8, 2), (32, 8)])
@pytest.mark.parametrize("rows, length", [(1, 33), (1, 100), (2, 101), (3, 4803), (4, 12346)])
def test_stft_equals_torch_stft(dtype, tol, n_fft, hop, rows, length):
    """The DFT-matmul STFT is torch.stft's (center=True, reflect padding: torch's defaults), real then imaginary."""
    g = torch.Generator().manual_seed(length)
    x = torch.randn(rows, length, generator=g, dtype=dtype)
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).to(dtype)
    spec = torch.stft(x, n_fft, hop, n_fft, window=window, center=True, pad_mode="reflect", return_complex=True)
    want = torch.cat([spec.real, spec.imag], dim=1)
    got = stft(x, n_fft, hop, window)
    assert got.shape == want.shape == (rows, n_fft + 2, length // hop + 1)
    assert got.dtype == dtype
    assert relative_error(got, want) < tol


@pytest.mark.parametrize("dtype, tol", TRANSFORM_DTYPES)
@pytest.mark.parametrize("n_fft, hop", [(16, 4), (8, 2), (15, 4)])
@pytest.mark.parametrize("rows, frames", [(1, 2), (1, 5), (3, 401), (2, 2881)])
def test_istft_equals_torch_istft(dtype, tol, n_fft, hop, rows, frames):
    """The capturable iSTFT (inverse DFT as a matmul, no host-syncing check) is torch.istft's; the imaginary parts
    of bins 0 and n_fft/2 are ignored as irfft ignores them."""
    g = torch.Generator().manual_seed(frames)
    bins = (rows, n_fft // 2 + 1, frames)
    spec = torch.complex(torch.randn(bins, generator=g, dtype=dtype), torch.randn(bins, generator=g, dtype=dtype))
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).to(dtype)
    want = torch.istft(spec * 10, n_fft, hop, n_fft, window=window)
    got = istft(torch.cat([spec.real, spec.imag], dim=1) * 10, n_fft, hop, window)
    assert got.shape == want.shape == (rows, hop * (frames - 1) + n_fft % 2)
    assert got.dtype == dtype
    assert relative_error(got, want) < tol


def test_stft_istft_round_trip():
    model = HiFT(HiFTConfig(base_channels=16, f0_cond_channels=8))
    n, hop = model.cfg.istft_n_fft, model.cfg.istft_hop
    x = torch.randn(2, 480 * 3, dtype=torch.float64)
    torch.testing.assert_close(istft(stft(x, n, hop, model.stft_window(x)), n, hop, model.stft_window(x)), x)


def test_dft_bases_cached_and_usable_with_autograd():
    """Made once per (n_fft, device, dtype), as normal tensors even when first made under inference mode."""
    with torch.inference_mode():
        forward, inverse = dft_bases(12, torch.device("cpu"), torch.float32)
    assert not forward.is_inference() and not inverse.is_inference()
    assert dft_bases(12, torch.device("cpu"), torch.float32)[0] is forward
    assert forward.shape == inverse.shape == (14, 12)
    x = torch.randn(1, 40, requires_grad=True)
    stft(x, 12, 3, torch.hann_window(12)).sum().backward()
    assert x.grad is not None


def test_inference_calls_no_fft(monkeypatch):
    """HiFT runs no torch.stft/istft and no torch.fft: a CUDA graph of it replays no cuFFT plan."""
    hift = random_model("tiny", 0, "cpu").hift.eval()
    mel = torch.randn(2, hift.cfg.in_channels, 9)
    with torch.inference_mode():
        want = hift.inference(mel, generator=[torch.Generator().manual_seed(s) for s in (1, 2)])

    def forbidden(*args, **kwargs):
        raise AssertionError("HiFT called an FFT")

    monkeypatch.setattr(torch, "stft", forbidden)
    monkeypatch.setattr(torch, "istft", forbidden)
    for name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fftn", "rfftn", "irfftn"):
        monkeypatch.setattr(torch.fft, name, forbidden)
    with torch.inference_mode():
        got = hift.inference(mel, generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@torch.inference_mode()
def test_inference_with_given_draws_equals_drawing_them():
    """Random inputs drawn beforehand (`SourceModule.draw` per row, as a CUDA graph's caller does) give the audio
    that drawing them inside `inference` from the same generators gives."""
    model = HiFT(HiFTConfig(base_channels=16, f0_cond_channels=8)).eval()
    mel, cache = torch.randn(2, 80, 12), torch.randn(2, 1, 960) * 0.1
    drawn = [model.m_source.draw(1, 12 * model.cfg.upsample_scale, torch.Generator().manual_seed(s)) for s in (1, 2)]
    phases, noise = (torch.cat(t) for t in zip(*drawn, strict=True))
    given = model.inference(mel, cache, phases=phases, noise=noise)
    inside = model.inference(mel, cache, [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert all(torch.equal(a, b) for a, b in zip(given, inside, strict=True))


def test_normalize_hift_keys_legacy_spellings():
    sd = HiFT(HiFTConfig(base_channels=16, f0_cond_channels=8)).state_dict()
    legacy = {
        "generator." + k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in sd.items()
    }
    assert any(k.endswith(".weight_g") for k in legacy)
    out = normalize_hift_keys(legacy)
    assert list(out) == list(sd)
    assert all(out[k] is legacy[j] for k, j in zip(out, legacy, strict=True))
    assert normalize_hift_keys(sd).keys() == sd.keys()


def checkpoint_section(name: str) -> dict[str, tuple[int, ...]]:
    """key -> shape for one file's section of cosyvoice_opt/checkpoint_keys.txt."""
    lines = (REPO_ROOT / "cosyvoice_opt" / "checkpoint_keys.txt").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"### {name}"))
    out = {}
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.strip():
            continue
        key, shape, _dtype = line.split("\t")
        out[key] = tuple(int(s) for s in shape.split("x"))
    return out


def test_full_size_keys_and_shapes():
    expected = checkpoint_section("hift.pt")
    with torch.device("meta"):
        model = HiFT(HiFTConfig())
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected
