"""Flow (tokens -> mel) parity with upstream on every fixture set, incremental streaming, full-size key layout."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import FlowConfig, ModelConfig
from cosyvoice_opt.models.flow import CausalCFM, Flow
from tests.conftest import REPO_ROOT, parity_params

ATOL = 1e-4  # encoder / estimator / chunked-vs-full
ATOL_MEL = 5e-4  # full 10-step CFM


@cache
def load_set(folder: Path) -> tuple[Flow, dict, dict]:
    cfg = json.loads((folder / "flow_tiny_config.json").read_text())
    flow = Flow(FlowConfig.from_upstream(cfg["flow"], cfg["encoder"], cfg["decoder"], cfg["estimator"])).eval()
    flow.load_state_dict(torch.load(folder / "flow_tiny_state_dict.pt", weights_only=True), strict=True)
    return flow, torch.load(folder / "flow_io.pt", weights_only=True), cfg


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def run(flow: Flow, io: dict, n_tokens: int | None = None, **flags: bool) -> torch.Tensor:
    return flow.inference(io["token"][:, :n_tokens], io["prompt_token"], io["prompt_feat"], io["embedding"], **flags)


PARITY = pytest.mark.parametrize("folder", parity_params())


@PARITY
def test_strict_load_and_patched_widths(folder):
    flow, _, cfg = load_set(folder)
    sd = torch.load(folder / "flow_tiny_state_dict.pt", weights_only=True)
    assert set(flow.state_dict()) == set(sd)
    patched = cfg["encoder_patched_submodules"]
    assert flow.encoder.pre_lookahead_layer.conv1.in_channels == patched["pre_lookahead_layer"]["in_channels"]
    assert flow.encoder.up_layer.conv.out_channels == patched["up_layer"]["out_channels"]
    assert flow.encoder.up_layer.stride == patched["up_layer"]["stride"]


@PARITY
def test_speaker_encoder_cond(folder):
    flow, io, _ = load_set(folder)
    with torch.inference_mode():
        close(flow.speaker(io["embedding"]), io["spks_proj"])
        mu, cond, spks = flow.prepare(io["token"], io["prompt_token"], io["prompt_feat"], io["embedding"],
                                      streaming=False, finalize=True)
        close(mu, io["nonstream_mu"])
        close(cond, io["nonstream_cond"], atol=0)
        mu_causal, _, _ = flow.prepare(io["token"], io["prompt_token"], io["prompt_feat"], io["embedding"],
                                       streaming=True, finalize=True)
        close(mu_causal, io["stream_final_all_mu"])
    assert not torch.allclose(mu, mu_causal, atol=ATOL), "streaming must change the encoder's attention"


@PARITY
@pytest.mark.parametrize("streaming", [False, True])
def test_estimator(folder, streaming):
    flow, io, _ = load_set(folder)
    args = [io[k] for k in ("est_x", "est_mask", "est_mu", "est_t", "est_spks", "est_cond")]
    with torch.inference_mode():
        out = flow.decoder.estimator(*args, streaming=streaming)
    close(out, io["est_out_stream" if streaming else "est_out_nonstream"])


@PARITY
def test_cfm_grid_noise_and_solve(folder):
    flow, io, _ = load_set(folder)
    close(CausalCFM.t_span(len(flow.decoder.steps)), io["cfm_t_span"], atol=0)
    z = io["cfm_z"]
    close(flow.decoder.noise(0, z.shape[-1], z), z, atol=0)
    with torch.inference_mode():
        out = flow.decoder.solve(z, io["nonstream_mu"], io["spks_proj"], io["nonstream_cond"], streaming=False)
    close(out, io["nonstream_decoder_out"], ATOL_MEL)


def test_noise_leaves_global_rng_alone():
    cfm = CausalCFM(ModelConfig.tiny().flow)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    cfm.init_noise()
    assert torch.equal(torch.rand(4), expected)
    assert cfm.rand_noise.shape == (1, 80, ModelConfig.tiny().flow.noise_frames)


@PARITY
def test_full_inference(folder):
    flow, io, _ = load_set(folder)
    close(run(flow, io, streaming=False, finalize=True), io["nonstream_mel"], ATOL_MEL)
    close(run(flow, io, streaming=True, finalize=True), io["stream_final_all_mel"], ATOL_MEL)


@PARITY
def test_upstream_stream_calls(folder):
    """Every call of upstream's streaming schedule, made the upstream way (prompt + all tokens so far)."""
    flow, io, _ = load_set(folder)
    for c in io["stream_chunks"]:
        n, off = int(c["n_tokens_in"]), int(c["token_offset"])
        mel = run(flow, io, n, streaming=bool(c["streaming"]), finalize=bool(c["finalize"]))
        close(mel, c["mel_full"], ATOL_MEL)
        close(mel[:, :, 2 * off :], c["mel_new"], ATOL_MEL)


def stream(flow: Flow, io: dict, ends: list[int]) -> list[torch.Tensor]:
    """Incremental chunks of the target tokens ending at `ends` (the last one finalizes)."""
    state = flow.new_stream(io["prompt_token"], io["prompt_feat"], io["embedding"])
    tok, la, start, out = io["token"], flow.cfg.pre_lookahead_len, 0, []
    for i, end in enumerate(ends):
        final = i == len(ends) - 1
        out.append(flow.stream_chunk(state, tok[:, start:end], None if final else tok[:, end : end + la], final))
        assert state.frames == 2 * (io["prompt_token"].shape[1] + end)
        start = end
    assert state.finished
    return out


@PARITY
def test_incremental_stream_upstream_schedule(folder):
    """Chunk by chunk with caches == one block-causal run; non-final chunks == upstream's chunks."""
    flow, io, cfg = load_set(folder)
    calls = io["stream_chunks"]
    ends = [int(c["n_tokens_in"]) - flow.cfg.pre_lookahead_len for c in calls[:-1]] + [io["token"].shape[1]]
    assert [int(c["token_offset"]) for c in calls[1:]] == ends[:-1]
    assert [c["n_tokens_in"] for c in cfg["stream_schedule"]["calls"]] == [int(c["n_tokens_in"]) for c in calls]
    chunks = stream(flow, io, ends)
    for chunk, call in zip(chunks[:-1], calls[:-1], strict=True):
        close(chunk, call["mel_new"])
    close(torch.cat(chunks, dim=-1), io["stream_final_all_mel"])


@PARITY
def test_incremental_stream_other_schedule(folder):
    """One-chunk (25-token) steps after the aligned first one (at most 3), then the rest."""
    flow, io, _ = load_set(folder)
    p, n, c = io["prompt_token"].shape[1], io["token"].shape[1], flow.cfg.encoder.static_chunk_size
    ends, end = [], -p % c + c
    while end + flow.cfg.pre_lookahead_len <= n and len(ends) < 3:
        ends.append(end)
        end += c
    chunks = stream(flow, io, [*ends, n])
    close(torch.cat(chunks, dim=-1), io["stream_final_all_mel"])


@PARITY
def test_stream_rules_and_memory(folder):
    flow, io, _ = load_set(folder)
    p, c, la = io["prompt_token"].shape[1], flow.cfg.encoder.static_chunk_size, flow.cfg.pre_lookahead_len
    first = -p % c + c
    tok = torch.randint(0, flow.cfg.vocab_size, (1, first + c + la), generator=torch.Generator().manual_seed(0))
    state = flow.new_stream(io["prompt_token"], io["prompt_feat"], io["embedding"])
    with pytest.raises(ValueError, match="boundary"):
        flow.stream_chunk(state, tok[:, : first - 1], tok[:, first - 1 : first - 1 + la])
    with pytest.raises(ValueError, match="look-ahead"):
        flow.stream_chunk(state, tok[:, :first], tok[:, first : first + 1])
    assert flow.stream_chunk(state, tok[:, :first], tok[:, first : first + la]).shape[-1] == 2 * (p + first) - (
        io["prompt_feat"].shape[1]
    )
    size = state.nbytes
    assert flow.stream_chunk(state, tok[:, first : first + c], tok[:, first + c :]).shape[-1] == 2 * c
    assert state.nbytes - size == flow.stream_bytes_per_token(torch.finfo(torch.float32).bits // 8) * c
    assert flow.stream_chunk(state, tok[:, :0], finalize=True).shape == (1, 80, 0)
    with pytest.raises(ValueError, match="finalized"):
        flow.stream_chunk(state, tok[:, :1], finalize=True)


def checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    shapes, section = {}, None
    for line in (REPO_ROOT / "cosyvoice_opt" / "checkpoint_keys.txt").read_text().splitlines():
        if line.startswith("### "):
            section = line.split()[1]
        elif section == "flow.pt" and line and not line.startswith("#"):
            key, shape, _ = line.split("\t")
            shapes[key] = tuple(int(s) for s in shape.split("x"))
    return shapes


def test_full_size_keys_and_shapes():
    with torch.device("meta"):
        flow = Flow(FlowConfig())
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    assert ours == checkpoint_shapes()
    assert len(ours) == 1121
