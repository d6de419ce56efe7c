"""HiFT vocoder parity against upstream outputs on every fixture set, plus checkpoint-key contract tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import HiFTConfig
from cosyvoice_opt.models.hift import HiFT, istft, normalize_hift_keys
from tests.conftest import REPO_ROOT, parity_params

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
    torch.testing.assert_close(model.f0(io["mel"]), io["f0"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_decode_fixed_source(folder):
    model, io = load_set(folder)
    torch.testing.assert_close(model.decode(io["mel"], io["s_fixed"]), io["speech_fixed"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source_stft_and_window(folder):
    model, io = load_set(folder)
    torch.testing.assert_close(model.stft_window(io["source"]), io["stft_window"], rtol=0, atol=0)
    torch.testing.assert_close(model.source_stft(io["source"]), io["source_stft"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_source_and_speech_injected_draws(folder):
    model, io = load_set(folder)
    source = model.source(model.f0(io["mel"]), *draws(io, "rng_draws"))
    torch.testing.assert_close(source, io["source"], rtol=0, atol=1e-3)
    torch.testing.assert_close(model.decode(io["mel"], io["source"]), io["speech"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_cache_source_second_call(folder):
    model, io = load_set(folder)
    cache = io["cache_source"]
    n = cache.shape[-1]
    torch.testing.assert_close(cache, io["source"][..., -n:], rtol=0, atol=0)
    fresh = model.source(model.f0(io["mel2"]), *draws(io, "rng_draws2"))
    torch.testing.assert_close(fresh[..., n:], io["source2"][..., n:], rtol=0, atol=1e-3)
    torch.testing.assert_close(model.decode(io["mel2"], io["source2"]), io["speech2"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_inference_seeded_generator_matches_upstream_rng(folder):
    """A CPU generator seeded like upstream's `manual_seed` reproduces its draws in order, across two calls."""
    model, io = load_set(folder)
    gen = torch.Generator().manual_seed(int(io["seed"]))
    speech, source = model.inference(io["mel"], generator=gen)
    torch.testing.assert_close(source, io["source"], rtol=0, atol=1e-3)
    torch.testing.assert_close(speech, io["speech"], rtol=0, atol=1e-3)
    gen.manual_seed(int(io["seed2"]))
    speech2, source2 = model.inference(io["mel2"], io["cache_source"], generator=gen)
    torch.testing.assert_close(source2, io["source2"], rtol=0, atol=1e-3)
    torch.testing.assert_close(speech2, io["speech2"], rtol=0, atol=1e-3)


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
        # rtol 1e-4: the CPU may run a batch's convs with another algorithm than one row's (4e-5 apart measured)
        torch.testing.assert_close(f0[r], model.f0(mel[r]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(source[r], model.source(f0[r], phases[r], noise[r]), rtol=0, atol=1e-5)
        torch.testing.assert_close(speech[r], model.decode(mel[r], source[r]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_fuse_weight_norm_keeps_output(folder):
    model, io = load_set(folder)
    fused = HiFT(model.cfg).eval()
    fused.load_state_dict(model.state_dict())
    fused.fuse_weight_norm()
    assert not any("parametrizations" in k for k in fused.state_dict())
    torch.testing.assert_close(fused.decode(io["mel"], io["s_fixed"]), io["speech_fixed"], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused.f0(io["mel"]), io["f0"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows, frames", [(1, 2), (1, 5), (3, 401), (2, 2881)])
def test_istft_equals_torch_istft(rows, frames):
    """The capturable iSTFT is torch.istft's computation without its host-syncing check: bit-equal on the CPU."""
    model = HiFT(HiFTConfig(base_channels=16, f0_cond_channels=8))
    n, hop = model.cfg.istft_n_fft, model.cfg.istft_hop
    g = torch.Generator().manual_seed(frames)
    bins = (rows, n // 2 + 1, frames)
    spec = torch.complex(torch.randn(bins, generator=g), torch.randn(bins, generator=g)) * 10
    window = model.stft_window(spec.real)
    want = torch.istft(spec, n, hop, n, window=window)
    got = istft(spec, n, hop, window)
    assert got.shape == want.shape == (rows, hop * (frames - 1))
    assert torch.equal(got, want)


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
