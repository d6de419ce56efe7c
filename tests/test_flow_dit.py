"""CosyVoice3 flow (`FlowDiT`: token embedding, pre-lookahead, DiT, the shared CFM) against upstream
`CausalMaskedDiffWithDiT`, every set under `$COSYVOICE_PARITY_CV3_DIR`: the speaker projection, token embedding, CFM
inputs, the DiT call in both mask modes with its intermediates, the CFM solve, upstream's calls (non-stream, stream
over everything, the streaming schedule's calls) and our incremental streaming against the same chunks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import FlowDiTConfig
from cosyvoice_opt.models.flow import CausalCFM
from cosyvoice_opt.models.flow_dit import FlowDiT
from tests.conftest import fixture_params
from tests.test_llm_cv3 import cv3_checkpoint_shapes
from tests.tolerances import BATCH, BF16, CFM_PEAK, ELEMENTWISE, EXACT, NETWORK_PEAK, NOISE, assert_close


def _load(set_dir: Path) -> tuple[FlowDiT, dict, dict]:
    cfg = json.loads((set_dir / "flow_tiny_config.json").read_text())
    assert cfg["class"].endswith(".CausalMaskedDiffWithDiT")
    flow_cfg = FlowDiTConfig.from_upstream(cfg["flow"], cfg["pre_lookahead_layer"], cfg["decoder"], cfg["estimator"],
                                           cfg["n_timesteps"])
    model = FlowDiT(flow_cfg).eval()
    model.load_state_dict(torch.load(set_dir / "flow_tiny_state_dict.pt", weights_only=True), strict=True)
    return model, cfg, torch.load(set_dir / "flow_io.pt", weights_only=True)


def _prompt(io: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return io["prompt_token"], io["prompt_feat"], io["embedding"]


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_structure_from_the_set(set_dir: Path) -> None:
    model, cfg, _ = _load(set_dir)
    est, derived = model.cfg.estimator, cfg["estimator_derived"]
    assert est.inner_dim == derived["attention_inner_dim"]
    assert est.dim * est.ff_mult == derived["ff_inner_dim"]
    assert model.cfg.chunk_tokens * model.cfg.token_mel_ratio == cfg["estimator"]["static_chunk_size"]
    assert len(model.decoder.steps) == cfg["n_timesteps"]
    rotary = model.decoder.estimator.rotary_embed
    # the angles come from a float32 recomputation (not the buffer): it must be the set's buffer, to the last bit
    # that a vectorised pow may round apart
    assert_close(rotary.frequencies(), rotary.inv_freq, ELEMENTWISE)
    assert rotary.inv_freq.shape == (est.dim_head // 2,)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_speaker_embedding_and_cfm_inputs(set_dir: Path) -> None:
    model, cfg, io = _load(set_dir)
    prompt_token, prompt_feat, embedding = _prompt(io)
    assert_close(model.speaker(embedding), io["spks_proj"], NETWORK_PEAK)
    ids = torch.cat((prompt_token, io["token"]), dim=1)
    assert_close(model.input_embedding(ids.long()), io["token_embedding"], NETWORK_PEAK)
    mu, cond, spks = model.prepare(io["token"], prompt_token, prompt_feat, embedding, False, True)
    assert_close(mu, io["nonstream_mu"], NETWORK_PEAK)
    assert_close(mu, io["stream_final_all_mu"], NETWORK_PEAK)  # no encoder: mu does not depend on the mask mode
    assert_close(cond, io["nonstream_cond"], EXACT)  # the prompt's mel copied in, zeros after
    assert bool((io["nonstream_mask"] == 1).all()) and io["nonstream_mask"].shape[-1] == mu.shape[-1]
    for call in io["stream_chunks"]:  # non-final calls: the last 3 tokens are look-ahead only
        n = int(call["n_tokens_in"])
        mu, cond, _ = model.prepare(io["token"][:, :n], prompt_token, prompt_feat, embedding, bool(call["streaming"]),
                                    bool(call["finalize"]))
        assert_close(mu, call["mu"], NETWORK_PEAK)
        assert_close(cond, call["cond"], EXACT)


def _capture_dit(model: FlowDiT, io: dict, streaming: bool) -> tuple[torch.Tensor, dict]:
    """One DiT call in the fixture's CFG layout, with the time embedding, input embedding and block outputs."""
    est, seen, hooks = model.decoder.estimator, {"blocks": []}, []
    hooks.append(est.time_embed.register_forward_hook(lambda m, a, out: seen.__setitem__("time", out)))
    hooks.append(est.input_embed.register_forward_hook(lambda m, a, out: seen.__setitem__("input", out)))
    # a block returns its residual stream and its gated output unsummed, (x, (y, gate)): upstream's output is x + gate·y
    hooks += [b.register_forward_hook(lambda m, a, out: seen["blocks"].append(out[0] + out[1][1] * out[1][0]))
              for b in est.transformer_blocks]
    try:
        out = est(io["est_x"], io["est_mask"], io["est_mu"], io["est_t"], io["est_spks"], io["est_cond"], streaming)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_dit_call_both_mask_modes(set_dir: Path) -> None:
    model, cfg, io = _load(set_dir)
    assert torch.equal(io["est_t"], torch.full_like(io["est_t"], cfg["inputs"]["estimator_t"]))
    for streaming, key in ((False, "nonstream"), (True, "stream")):
        out, seen = _capture_dit(model, io, streaming)
        assert_close(seen["time"], io["est_time_embed"], NETWORK_PEAK)
        assert_close(seen["input"], io["est_input_embed"], NETWORK_PEAK)
        assert len(seen["blocks"]) == len(io[f"est_{key}_block_out"]) == model.cfg.estimator.depth
        for got, want in zip(seen["blocks"], io[f"est_{key}_block_out"], strict=True):
            assert_close(got, want, NETWORK_PEAK)
        assert_close(out, io[f"est_out_{key}"], NETWORK_PEAK)
    # the two modes differ where a frame's chunk ends before the sequence does (else the test above proves nothing)
    chunk = model.cfg.estimator.static_chunk_size
    if io["est_x"].shape[-1] > chunk:
        stream, nonstream = io["est_out_stream"][..., :chunk], io["est_out_nonstream"][..., :chunk]
        assert not torch.allclose(stream, nonstream, **NETWORK_PEAK.kwargs(nonstream))


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_padding_mask_hides_the_padded_frames(set_dir: Path) -> None:
    """A row padded past its length (mask 0) gives, on its real frames, what the row alone at that length gives."""
    model, _, io = _load(set_dir)
    est, n = model.decoder.estimator, io["est_x"].shape[-1]
    real = max(1, n - 30)
    mask = io["est_mask"].clone()
    mask[1, :, real:] = 0
    names = ("est_x", "est_mu", "est_t", "est_spks", "est_cond")
    x, mu, t, spks, cond = (io[k] for k in names)
    for streaming in (False, True):
        padded = est(x, mask, mu, t, spks, cond, streaming)
        alone = est(x[1:, :, :real], mask[1:, :, :real], mu[1:, :, :real], t[1:], spks[1:], cond[1:, :, :real],
                    streaming)
        assert_close(padded[1:, :, :real], alone, BATCH)
        assert_close(padded[:1], est(x[:1], mask[:1], mu[:1], t[:1], spks[:1], cond[:1], streaming), BATCH)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_cfm_solve(set_dir: Path) -> None:
    model, cfg, io = _load(set_dir)
    t = io["cfm_z"].shape[-1]
    assert_close(CausalCFM.t_span(cfg["n_timesteps"]), io["cfm_t_span"], ELEMENTWISE)
    assert_close(model.decoder.noise(0, t, io["cfm_z"]), io["cfm_z"], NOISE)
    spks = model.speaker(io["embedding"])
    for streaming, key in ((False, "nonstream"), (True, "stream_final_all")):
        out = model.decoder.solve(io["cfm_z"], io[f"{key}_mu"], spks, io["nonstream_cond"], streaming)
        assert_close(out, io[f"{key}_decoder_out"], CFM_PEAK)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_inference_calls(set_dir: Path) -> None:
    """Upstream's calls: non-stream, streaming over everything, and each call of the streaming schedule."""
    model, cfg, io = _load(set_dir)
    prompt = _prompt(io)
    assert_close(model.inference(io["token"], *prompt, streaming=False, finalize=True), io["nonstream_mel"], CFM_PEAK)
    assert_close(model.inference(io["token"], *prompt, streaming=True, finalize=True), io["stream_final_all_mel"],
                 CFM_PEAK)
    schedule = cfg["stream_schedule"]["calls"]
    assert len(schedule) == len(io["stream_chunks"])
    for plan, call in zip(schedule, io["stream_chunks"], strict=True):
        assert int(call["n_tokens_in"]) == plan["n_tokens_in"] and int(call["token_offset"]) == plan["token_offset"]
        mel = model.inference(io["token"][:, : plan["n_tokens_in"]], *prompt, streaming=plan["streaming"],
                              finalize=plan["finalize"])
        assert_close(mel, call["mel_full"], CFM_PEAK)
        ratio = model.cfg.token_mel_ratio
        assert_close(mel[:, :, ratio * plan["token_offset"] :], call["mel_new"], CFM_PEAK)


def _chunks(model: FlowDiT, cfg: dict, io: dict) -> list[tuple[torch.Tensor, torch.Tensor | None, bool]]:
    """The schedule's calls as incremental chunks: (new tokens, look-ahead, finalize)."""
    la, out, done = model.cfg.pre_lookahead_len, [], 0
    for plan in cfg["stream_schedule"]["calls"]:
        n = plan["n_tokens_in"]
        end = n if plan["finalize"] else n - la
        out.append((io["token"][:, done:end], None if plan["finalize"] else io["token"][:, end:n], plan["finalize"]))
        done = end
    return out


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_incremental_streaming_equals_upstream_chunks(set_dir: Path) -> None:
    """Chunk by chunk over a carried history (each frame's K/V computed once): every non-final chunk equals upstream's
    `mel_new`; the final chunk stays block-causal, so it equals the same frames of upstream's streaming run over
    everything (upstream's own last call switches to full attention)."""
    model, cfg, io = _load(set_dir)
    prompt_token, prompt_feat, embedding = _prompt(io)
    state = model.new_stream(prompt_token, prompt_feat, embedding)
    mels, ratio, grown = [], model.cfg.token_mel_ratio, []
    for (new, ahead, final), call in zip(_chunks(model, cfg, io), io["stream_chunks"], strict=True):
        before = state.nbytes
        mel = model.stream_chunk(state, new, ahead, final)
        if not final:
            assert_close(mel, call["mel_new"], CFM_PEAK)
        mels.append(mel)
        grown.append((new.shape[1], state.nbytes - before))
    for tokens, nbytes in grown[1:]:  # past the first chunk (conv histories appear), K/V only: what the engine sizes
        assert nbytes == tokens * model.stream_bytes_per_token(4)
    full = torch.cat(mels, dim=-1)
    assert full.shape == io["stream_final_all_mel"].shape
    assert_close(full, io["stream_final_all_mel"], CFM_PEAK)
    last = int(io["stream_chunks"][-1]["token_offset"]) * ratio
    assert state.nbytes > 0 and state.finished
    assert mels[-1].shape[-1] == io["stream_chunks"][-1]["mel_new"].shape[-1] == full.shape[-1] - last


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_batched_streams_equal_their_own_calls(set_dir: Path) -> None:
    """Two streams at different points (different histories and chunk lengths, one final) in one padded batch give
    each stream's own chunk. Stream b runs the schedule's first two chunks as one, so both have a history."""
    model, cfg, io = _load(set_dir)
    chunks = _chunks(model, cfg, io)
    if len(chunks) < 2:
        pytest.skip("the set's schedule has a single call")
    prompt = _prompt(io)
    first_a, next_a = chunks[0], chunks[1]
    first_b, next_b = None, chunks[0]
    if len(chunks) >= 3:
        first_b = (torch.cat((chunks[0][0], chunks[1][0]), dim=1), chunks[1][1], False)
        next_b = chunks[2]
    streams = []
    for _ in range(2):  # alone, then batched
        a, b = model.new_stream(*prompt), model.new_stream(*prompt)
        model.stream_chunk(a, *first_a)
        if first_b is not None:
            model.stream_chunk(b, *first_b)
        streams.append((a, b))
    a, b = streams[0]
    want = [model.stream_chunk(a, *next_a), model.stream_chunk(b, *next_b)]
    new, ahead, final = zip(next_a, next_b, strict=True)
    got = model.stream_chunks(list(streams[1]), list(new), list(ahead), list(final))
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, BATCH)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_fused_projections_equal_unfused(set_dir: Path) -> None:
    """`fuse_projections_` (each attention's q/k/v, every AdaLN-Zero projection: one matmul each) keeps the state-dict
    keys and memory and gives upstream's chunks; moving the model after it is refused until fused again."""
    model, cfg, io = _load(set_dir)
    fused = copy.deepcopy(model).fuse_projections_()
    assert list(fused.state_dict()) == list(model.state_dict())
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())
    state = fused.new_stream(*_prompt(io))
    for (new, ahead, final), call in zip(_chunks(fused, cfg, io), io["stream_chunks"], strict=True):
        mel = fused.stream_chunk(state, new, ahead, final)
        if not final:
            assert_close(mel, call["mel_new"], CFM_PEAK)
    fused.double()
    with pytest.raises(RuntimeError, match="fuse_projections_"):
        fused.stream_chunk(fused.new_stream(*_prompt(io)), *_chunks(fused, cfg, io)[0])


@torch.no_grad()
def test_streaming_consistent_when_dim_differs_from_attention_width() -> None:
    """A DiT whose width differs from heads * dim_head (and other ff_mult, pre-lookahead width, prompt length):
    chunk-by-chunk streaming over the carried K/V equals one block-causal run over everything, seams included."""
    from cosyvoice_opt.config import DiTConfig

    cfg = FlowDiTConfig(pre_lookahead_channels=24, estimator=DiTConfig(dim=48, depth=2, heads=2, dim_head=16,
                                                                       ff_mult=3, conv_pos_groups=4))
    torch.manual_seed(0)
    model = FlowDiT(cfg).eval()
    for p in model.parameters():  # the fixtures' recipe: N / sqrt(fan-in), 1-D 0.1 N
        p.normal_(0, 1 / p[0].numel() ** 0.5 if p.dim() > 1 else 0.1)
    prompt_token, tokens = torch.randint(0, 6561, (1, 7)), torch.randint(0, 6561, (1, 80))
    prompt_feat, embedding = torch.randn(1, 14, 80), torch.randn(1, 192)
    full = model.inference(tokens, prompt_token, prompt_feat, embedding, streaming=True, finalize=True)
    state = model.new_stream(prompt_token, prompt_feat, embedding)
    step, la = cfg.chunk_tokens, cfg.pre_lookahead_len
    ends = [step - 7, 2 * step - 7]  # non-final chunks end on chunk boundaries, prompt included
    mels, done = [], 0
    for end in ends:
        mels.append(model.stream_chunk(state, tokens[:, done:end], tokens[:, end : end + la]))
        done = end
    mels.append(model.stream_chunk(state, tokens[:, done:], finalize=True))
    assert_close(torch.cat(mels, dim=-1), full, BATCH)


def test_full_size_keys_and_shapes() -> None:
    """The released flow.pt's keys and shapes (the rotary `inv_freq` buffer included, the CFM_PEAK noise not)."""
    with torch.device("meta"):
        model = FlowDiT(FlowDiTConfig())
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == cv3_checkpoint_shapes("flow.pt")


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_bf16_keeps_time_and_rope_angles_in_float32(set_dir: Path) -> None:
    """Cast to bf16 (as the engine serves it), the RoPE angles stay float32 (positions reach thousands of frames), the
    CFM_PEAK hands the estimator t in float32, and the DiT call stays within bf16 rounding of upstream's."""
    model, _, io = _load(set_dir)
    rotary = model.decoder.estimator.rotary_embed
    positions = torch.arange(model.cfg.noise_frames)
    want = rotary(positions)
    model.to(torch.bfloat16)
    for got, ref in zip(rotary(positions), want, strict=True):
        assert_close(got, ref, EXACT)  # the same float32 computation before and after the cast
    # t stays float32 (as `CausalCFM.solve` passes it): its sinusoid is of 1000·t
    args = [io[k].to(torch.bfloat16) for k in ("est_x", "est_mask", "est_mu")]
    args += [io["est_t"], io["est_spks"].to(torch.bfloat16), io["est_cond"].to(torch.bfloat16)]
    assert_close(model.decoder.estimator(*args, True).float(), io["est_out_stream"], BF16)
    seen = []
    model.decoder.estimator.register_forward_hook(lambda m, a, out: seen.append(a[3].dtype))
    model.decoder.solve(io["cfm_z"].bfloat16(), io["nonstream_mu"].bfloat16(), io["spks_proj"].bfloat16(),
                        io["nonstream_cond"].bfloat16(), False)
    assert seen == [torch.float32] * model.cfg.n_timesteps
