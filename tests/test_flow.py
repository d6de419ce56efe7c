"""Flow (tokens -> mel) parity with upstream on every fixture set, incremental streaming, full-size key layout."""

from __future__ import annotations

import copy
import dataclasses
import json
from functools import cache
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import FlowConfig, ModelConfig
from cosyvoice_opt.models.flow import CausalCFM, Flow, FlowBase
from tests.conftest import REPO_ROOT, parity_params
from tests.tolerances import BATCH, CFM, EXACT, NETWORK, NOISE, Tol, assert_close


def flow_config(cfg: dict) -> FlowConfig:
    """Every flow setting the set's `flow_tiny_config.json` states: the constructor args, the CFM step count and the
    fixed-noise table's length."""
    flow_cfg = FlowConfig.from_upstream(cfg["flow"], cfg["encoder"], cfg["decoder"], cfg["estimator"])
    return dataclasses.replace(flow_cfg, n_timesteps=int(cfg["n_timesteps"]),
                               noise_frames=int(cfg["cfm_rand_noise"]["shape"][-1]))


@cache
def load_set(folder: Path) -> tuple[Flow, dict, dict]:
    cfg = json.loads((folder / "flow_tiny_config.json").read_text())
    flow = Flow(flow_config(cfg)).eval()
    flow.load_state_dict(torch.load(folder / "flow_tiny_state_dict.pt", weights_only=True), strict=True)
    return flow, torch.load(folder / "flow_io.pt", weights_only=True), cfg


def close(a: torch.Tensor, b: torch.Tensor, tol: Tol = NETWORK) -> None:
    assert_close(a, b, tol)


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
        close(cond, io["nonstream_cond"], EXACT)
        mu_causal, _, _ = flow.prepare(io["token"], io["prompt_token"], io["prompt_feat"], io["embedding"],
                                       streaming=True, finalize=True)
        close(mu_causal, io["stream_final_all_mu"])
    assert not torch.allclose(mu, mu_causal, **NETWORK.kwargs()), "streaming must change the encoder's attention"


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
    close(CausalCFM.t_span(len(flow.decoder.steps)), io["cfm_t_span"], EXACT)
    z = io["cfm_z"]
    close(flow.decoder.noise(0, z.shape[-1], z), z, NOISE)
    with torch.inference_mode():
        out = flow.decoder.solve(z, io["nonstream_mu"], io["spks_proj"], io["nonstream_cond"], streaming=False)
    close(out, io["nonstream_decoder_out"], CFM)


def test_noise_leaves_global_rng_alone():
    cfm = CausalCFM(ModelConfig.tiny().flow, torch.nn.Identity())
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    cfm.init_noise()
    assert torch.equal(torch.rand(4), expected)
    assert cfm.rand_noise.shape == (1, 80, ModelConfig.tiny().flow.noise_frames)


@PARITY
def test_full_inference(folder):
    flow, io, _ = load_set(folder)
    close(run(flow, io, streaming=False, finalize=True), io["nonstream_mel"], CFM)
    close(run(flow, io, streaming=True, finalize=True), io["stream_final_all_mel"], CFM)


@PARITY
def test_upstream_stream_calls(folder):
    """Every call of upstream's streaming schedule, made the upstream way (prompt + all tokens so far)."""
    flow, io, _ = load_set(folder)
    for c in io["stream_chunks"]:
        n, off = int(c["n_tokens_in"]), int(c["token_offset"])
        mel = run(flow, io, n, streaming=bool(c["streaming"]), finalize=bool(c["finalize"]))
        close(mel, c["mel_full"], CFM)
        close(mel[:, :, flow.cfg.token_mel_ratio * off :], c["mel_new"], CFM)


def stream(flow: Flow, io: dict, ends: list[int]) -> list[torch.Tensor]:
    """Incremental chunks of the target tokens ending at `ends` (the last one finalizes)."""
    state = flow.new_stream(io["prompt_token"], io["prompt_feat"], io["embedding"])
    tok, la, start, out = io["token"], flow.cfg.pre_lookahead_len, 0, []
    for i, end in enumerate(ends):
        final = i == len(ends) - 1
        out.append(flow.stream_chunk(state, tok[:, start:end], None if final else tok[:, end : end + la], final))
        assert state.frames == flow.cfg.token_mel_ratio * (io["prompt_token"].shape[1] + end)
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
    ratio, first = flow.cfg.token_mel_ratio, -p % c + c
    tok = torch.randint(0, flow.cfg.vocab_size, (1, first + c + la), generator=torch.Generator().manual_seed(0))
    state = flow.new_stream(io["prompt_token"], io["prompt_feat"], io["embedding"])
    with pytest.raises(ValueError, match="boundary"):
        flow.stream_chunk(state, tok[:, : first - 1], tok[:, first - 1 : first - 1 + la])
    with pytest.raises(ValueError, match="look-ahead"):
        flow.stream_chunk(state, tok[:, :first], tok[:, first : first + 1])
    assert flow.stream_chunk(state, tok[:, :first], tok[:, first : first + la]).shape[-1] == ratio * (p + first) - (
        io["prompt_feat"].shape[1]
    )
    size = state.nbytes
    assert flow.stream_chunk(state, tok[:, first : first + c], tok[:, first + c :]).shape[-1] == ratio * c
    assert state.nbytes - size == flow.stream_bytes_per_token(torch.finfo(torch.float32).bits // 8) * c
    assert flow.stream_chunk(state, tok[:, :0], finalize=True).shape == (1, flow.cfg.output_size, 0)
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


def batch_requests(flow: FlowBase, io: dict) -> list[dict]:
    """Three streams with different prompts (the set's, a shorter one, none) and token counts: 3 non-final chunks
    and a longer final one; 3 non-final and a final one of another length; 1 non-final and a short final one."""
    p, c, la = io["prompt_token"].shape[1], flow.chunk_tokens, flow.cfg.pre_lookahead_len
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (prompt, extra) in enumerate([(p, 2 * c + la + 5), (p // 2, 3 * c + la + 4), (0, c // 2 + la)]):
        first = -prompt % c + c
        tokens = torch.randint(0, flow.cfg.vocab_size, (1, first + extra), generator=g)
        frames = min(io["prompt_feat"].shape[1], flow.cfg.token_mel_ratio * prompt)
        out.append({"prompt_token": io["prompt_token"][:, :prompt], "prompt_feat": io["prompt_feat"][:, :frames],
                    "embedding": io["embedding"] * (1 - i), "token": tokens})
        ends, end = [], first
        while end + la <= tokens.shape[1] and len(ends) < 3:
            ends.append(end)
            end += c
        out[-1]["ends"] = [*ends, tokens.shape[1]]
    return out


def new_state(flow: FlowBase, req: dict):
    return flow.new_stream(req["prompt_token"], req["prompt_feat"], req["embedding"])


def chunk_args(flow: FlowBase, req: dict, k: int) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    ends, la = req["ends"], flow.cfg.pre_lookahead_len
    start, end, final = ends[k - 1] if k else 0, ends[k], k == len(ends) - 1
    return req["token"][:, start:end], None if final else req["token"][:, end : end + la], final


def assert_same_state(a, b) -> None:
    """What a batch stored for a stream == what its own calls stored (same tensors, no padding)."""
    assert (a.tokens, a.frames, a.finished, a.nbytes) == (b.tokens, b.frames, b.finished, b.nbytes)
    for ca, cb in zip([a.encoder, *a.steps], [b.encoder, *b.steps], strict=True):
        assert len(ca.slots) == len(cb.slots)
        for ta, tb in zip(ca.slots, cb.slots, strict=True):
            close(ta, tb, BATCH)


def run_batched(flow: Flow, reqs: list[dict], rounds: list[list[int]]) -> None:
    """Run `rounds` (the streams whose next chunk goes into each `stream_chunks` call) and check every chunk and
    every final state against the streams run one at a time."""
    solo = []
    for req in reqs:
        state = new_state(flow, req)
        solo.append(([flow.stream_chunk(state, *chunk_args(flow, req, k)) for k in range(len(req["ends"]))], state))
    states, done = [new_state(flow, req) for req in reqs], [0] * len(reqs)
    for batch in rounds:
        args = [chunk_args(flow, reqs[i], done[i]) for i in batch]
        mels = flow.stream_chunks([states[i] for i in batch], *map(list, zip(*args, strict=True)))
        for i, mel in zip(batch, mels, strict=True):
            close(mel, solo[i][0][done[i]], BATCH)
            done[i] += 1
    assert done == [len(r["ends"]) for r in reqs]
    for state, (_, ref) in zip(states, solo, strict=True):
        assert_same_state(state, ref)


@PARITY
def test_batched_first_chunks_different_prompts(folder):
    """(a) Every stream at its first chunk with a different prompt length, then lock-step to the end."""
    flow, io, _ = load_set(folder)
    reqs = batch_requests(flow, io)
    left = [len(r["ends"]) for r in reqs]
    rounds = []
    while any(left):
        rounds.append([i for i, n in enumerate(left) if n])
        left = [max(0, n - 1) for n in left]
    run_batched(flow, reqs, rounds)


@PARITY
def test_batched_streams_at_different_chunks(folder):
    """(b) One stream at chunk 0 batched with one at chunk 2 (different histories and chunk grids)."""
    flow, io, _ = load_set(folder)
    a, b, _ = batch_requests(flow, io)
    assert len(b["ends"]) > 3
    rounds = [[1], [1], [0, 1], *([i] for i in [0] * (len(a["ends"]) - 1) + [1] * (len(b["ends"]) - 3))]
    run_batched(flow, [a, b], rounds)


@PARITY
def test_batched_final_and_nonfinal_chunks(folder):
    """(c) Final chunks (of any length, one of them empty) batched with non-final ones of other lengths."""
    flow, io, _ = load_set(folder)
    reqs = batch_requests(flow, io)
    a, b, c = (r["ends"] for r in reqs)
    assert len(a) == 4 and len(c) == 2
    reqs[1]["ends"] = [*b[:2], b[1]]  # two non-final chunks, then an empty final one
    run_batched(flow, reqs, [[0, 2], [2, 1, 0], [1, 0], [1, 0]])


@PARITY
def test_batched_rejects_before_changing_any_state(folder):
    flow, io, _ = load_set(folder)
    a, b, _ = batch_requests(flow, io)
    sa, sb = new_state(flow, a), new_state(flow, b)
    tokens, _, _ = chunk_args(flow, b, 0)
    with pytest.raises(ValueError, match="look-ahead"):
        flow.stream_chunks([sa, sb], [chunk_args(flow, a, 0)[0], tokens], [chunk_args(flow, a, 0)[1], None],
                           [False, False])
    assert sa.tokens == sb.tokens == 0 and sa.pending.shape[1] == a["prompt_token"].shape[1]
    with pytest.raises(ValueError, match="once"):
        flow.stream_chunks([sa, sa], [tokens, tokens], [None, None], [True, True])


@PARITY
def test_fused_kv_projections_equal_unfused(folder):
    """`fuse_projections_` keeps the state-dict keys and memory and gives the same chunks; moving the model after it
    is refused until fused again."""
    flow, io, _ = load_set(folder)
    fused = copy.deepcopy(flow).fuse_projections_()
    assert list(fused.state_dict()) == list(flow.state_dict())
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in flow.parameters())
    reqs = batch_requests(flow, io)
    for req in reqs:
        a, b = new_state(flow, req), new_state(fused, req)
        for k in range(len(req["ends"])):
            close(fused.stream_chunk(b, *chunk_args(fused, req, k)), flow.stream_chunk(a, *chunk_args(flow, req, k)))
    fused.double()
    with pytest.raises(RuntimeError, match="fuse_projections_"):
        fused.stream_chunk(new_state(fused, reqs[0]), *chunk_args(flow, reqs[0], 0))
