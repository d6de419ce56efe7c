"""Speech LLM parity (every fixture set), static KV cache decode, RAS sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import LLMConfig, Qwen2Config, SamplingConfig
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.llm import SpeechLLM
from cosyvoice_opt.models.sampling import nucleus, push_history, ras_sample, sampling_uniforms
from tests.conftest import REPO_ROOT, parity_params
from tests.tolerances import BATCH, EXACT, NETWORK, assert_close


def _load(set_dir: Path) -> tuple[SpeechLLM, dict, dict]:
    cfg_json = json.loads((set_dir / "llm_tiny_config.json").read_text())
    model = SpeechLLM(LLMConfig.from_upstream(cfg_json, cfg_json["qwen2_config"])).eval()
    model.load_state_dict(torch.load(set_dir / "llm_tiny_state_dict.pt", weights_only=True), strict=True)
    return model, cfg_json, torch.load(set_dir / "llm_io.pt", weights_only=True)


def _repeated(token: int, history: torch.Tensor, sc: SamplingConfig) -> bool:
    """RAS's repetition rule (the set's win_size and tau_r): the id occurs >= win_size * tau_r times in the window."""
    return int((history == token).sum()) >= sc.win_size * sc.tau_r


def _history(decoded: list[int], win_size: int) -> torch.Tensor:
    last = decoded[-win_size:]
    return torch.tensor([-1] * (win_size - len(last)) + last, dtype=torch.long)


# ---------------------------------------------------------------- parity with upstream (all fixture sets)


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_full_forward_and_prefix(set_dir: Path) -> None:
    model, cfg_json, io = _load(set_dir)
    special = cfg_json["special_ids"]
    assert model.cfg.eos_token == special["eos_token"]
    assert model.cfg.stop_token_ids == tuple(special["stop_token_ids"])
    assert model.cfg.num_speech_rows == special["speech_embedding_rows"] == special["llm_decoder_out_features"]
    assert model.llm.model.lm_head.weight is model.backbone.embed_tokens.weight
    hidden = model.backbone(io["lm_input"])
    assert_close(hidden, io["hidden"], NETWORK)
    assert_close(model(io["lm_input"]), io["logp_full"], NETWORK)

    p = int(io["prefix_len"])
    prefix = model.prefix(io["text"], io["prompt_text"], io["prompt_speech_token"])
    assert_close(prefix, io["lm_input"][:, :p], EXACT)
    assert_close(model.embed_speech(io["target_speech_token"]), io["lm_input"][:, p:], EXACT)
    assert model.length_bounds(io["text"].shape[1]) == (int(io["min_len"]), int(io["max_len"]))


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_prefill_decode_matches_upstream_steps(set_dir: Path) -> None:
    model, _, io = _load(set_dir)
    targets = io["target_speech_token"][0].long()
    p, length = int(io["prefix_len"]), io["lm_input"].shape[1]
    cache = KVCache(model.cfg.qwen2, num_slots=3, max_seq=length + 5)
    cache.data.normal_()  # stale garbage beyond each row's length must never be read
    slot = torch.tensor([2])
    steps = [model.prefill(io["lm_input"][:, :p], cache, [2], [p])]
    for k in range(targets.numel()):
        steps.append(model.decode(targets[k : k + 1], cache, slot, torch.tensor([p + k])))
    assert_close(torch.cat(steps)[None], io["logp_steps"], NETWORK)


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_batched_decode_equals_single_rows(set_dir: Path) -> None:
    """Two requests of different lengths in arbitrary slots decode together exactly as each alone."""
    model, _, io = _load(set_dir)
    cfg = model.cfg.qwen2
    targets = io["target_speech_token"][0].long()
    a = io["lm_input"][:, : int(io["prefix_len"])]
    b = model.prefix(io["text"][:, :-2], None, io["prompt_speech_token"][:, 3:])  # shorter, different request
    n = min(6, targets.numel())
    toks = torch.stack([targets[:n], targets.flip(0)[:n]], dim=1)  # [n, 2]
    max_seq = a.shape[1] + n + 1

    def single(prefix: torch.Tensor, col: int) -> torch.Tensor:
        cache = KVCache(cfg, num_slots=1, max_seq=max_seq)
        out = [model.prefill(prefix, cache, [0], [prefix.shape[1]])]
        for k in range(n):
            out.append(model.decode(toks[k, col : col + 1], cache, None, torch.tensor([prefix.shape[1] + k])))
        return torch.cat(out)

    ref = torch.stack([single(a, 0), single(b, 1)], dim=1)  # [n+1, 2, V]

    def batched(slots: list[int], gather: bool, kv_len: int | None) -> torch.Tensor:
        cache = KVCache(cfg, num_slots=4, max_seq=max_seq)
        cache.data.normal_()
        out = [model.prefill(torch.cat([a, b], dim=1), cache, slots, [a.shape[1], b.shape[1]])]  # packed
        slot_t = torch.tensor(slots) if gather else None
        pos = torch.tensor([a.shape[1], b.shape[1]])
        for k in range(n):
            out.append(model.decode(toks[k], cache, slot_t, pos + k, kv_len))
        return torch.stack(out)

    assert_close(batched([3, 1], True, None), ref, NETWORK)
    assert_close(batched([0, 1], False, None), ref, NETWORK)
    assert_close(batched([2, 0], True, a.shape[1] + n), ref, NETWORK)
    # and both equal teacher forcing on the full sequence
    full_a = model(torch.cat([a, model.embed_speech(toks[:, 0])[None]], dim=1))[0, a.shape[1] - 1 :]
    assert_close(ref[:, 0], full_a, NETWORK)


def _requests(model: SpeechLLM, io: dict) -> list[torch.Tensor]:
    """Four prefixes (of different lengths, for the fixture sizes) made from the fixture's inputs."""
    text, prompt_text, speech = io["text"], io["prompt_text"], io["prompt_speech_token"]
    return [io["lm_input"][:, : int(io["prefix_len"])], model.prefix(text[:, :-2], None, speech[:, 3:]),
            model.prefix(text[:, 1:], prompt_text, None), model.prefix(text[:, :1])]


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_packed_prefill_equals_one_at_a_time(set_dir: Path) -> None:
    """Requests packed into one prefill (into non-contiguous slots) give each request's log-probs and KV entries
    exactly as prefilling it alone, and touch nothing else in the cache."""
    model, _, io = _load(set_dir)
    prefixes = _requests(model, io)
    lengths = [x.shape[1] for x in prefixes]
    slots = [5, 1, 3, 0]
    alone = KVCache(model.cfg.qwen2, num_slots=6, max_seq=max(lengths) + 3)
    alone.data.normal_()
    packed = KVCache(model.cfg.qwen2, num_slots=6, max_seq=max(lengths) + 3)
    packed.data.copy_(alone.data)
    ref = torch.cat([model.prefill(x, alone, [s], [x.shape[1]]) for x, s in zip(prefixes, slots, strict=True)])
    out = model.prefill(torch.cat(prefixes, dim=1), packed, slots, lengths)
    assert_close(out, ref, NETWORK)
    assert_close(packed.data, alone.data, BATCH)
    assert torch.equal(packed.data[:, :, [2, 4]], alone.data[:, :, [2, 4]])  # untouched slots
    for s, length in zip(slots, lengths, strict=True):  # untouched positions past each prefix
        assert torch.equal(packed.data[:, :, s, :, length:], alone.data[:, :, s, :, length:])
    # the last position of each request equals teacher forcing of that request alone
    full = torch.cat([model(x)[:, -1] for x in prefixes])
    assert_close(out, full, NETWORK)


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_extend_rows_equal_one_at_a_time(set_dir: Path) -> None:
    """Inputs of different lengths fed after different cached lengths, in one forward (rows padded by repeating their
    last input), give each request's log-probs and KV entries exactly as extending it alone, and write nothing past
    each request's new positions; each equals teacher forcing of its whole sequence."""
    model, _, io = _load(set_dir)
    prefixes = _requests(model, io)[:3]
    inputs = [model.embed_speech(torch.arange(n)[None] % 7) for n in (5, 1, 3)]  # e.g. text blocks of any length
    slots = [4, 0, 2]
    lengths = [x.shape[1] for x in prefixes]
    alone = KVCache(model.cfg.qwen2, num_slots=5, max_seq=max(lengths) + 8)
    alone.data.normal_()
    for x, s in zip(prefixes, slots, strict=True):
        model.prefill(x, alone, [s], [x.shape[1]])
    rows = KVCache(model.cfg.qwen2, num_slots=5, max_seq=alone.max_seq)
    rows.data.copy_(alone.data)
    before = alone.data.clone()
    ref = torch.stack([model.extend(x, alone, s, n)[1] for x, s, n in zip(inputs, slots, lengths, strict=True)])
    out = model.extend_rows(inputs, rows, slots, lengths)
    assert_close(out, ref, NETWORK)
    assert_close(rows.data, alone.data, BATCH)
    for s, n, x in zip(slots, lengths, inputs, strict=True):  # untouched positions past each request's inputs
        assert torch.equal(rows.data[:, :, s, :, n + x.shape[1]:], alone.data[:, :, s, :, n + x.shape[1]:])
    full = torch.cat([model(torch.cat((p, x), dim=1))[:, -1] for p, x in zip(prefixes, inputs, strict=True)])
    assert_close(out, full, NETWORK)
    # padded to 5 rows of 8 (a captured shape): the extra rows repeat the first, which changes nothing
    padded = KVCache(model.cfg.qwen2, num_slots=5, max_seq=alone.max_seq)
    padded.data.copy_(before)
    x, index = model.padded_rows(inputs, slots, lengths, 8, 5)
    hidden = model.backbone.extend_rows(x, padded, index[40:], index[:40].view(5, 8), padded.max_seq)
    assert_close(model.log_probs(hidden[:3, -1]), out, NETWORK)
    assert_close(padded.data, rows.data, BATCH)


def _param_storage(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("set_dir", parity_params())
@torch.no_grad()
def test_fused_projections_equal_unfused(set_dir: Path) -> None:
    """Fusing q/k/v and gate/up keeps the parameters (same objects, keys, values and memory), reproduces upstream
    and the unfused model, follows a later load_state_dict, and refuses to run once a move broke the aliasing."""
    model, _, io = _load(set_dir)
    fused = _load(set_dir)[0]
    params = dict(fused.named_parameters())
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    storage = _param_storage(fused)
    fused.backbone.fuse_projections_()
    assert dict(fused.named_parameters()) == params  # the same Parameter objects
    after = fused.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert _param_storage(fused) == storage  # views into the fused tensors, nothing doubled
    attn, mlp = fused.backbone.layers[0].self_attn, fused.backbone.layers[0].mlp
    for a, b in ((attn.q_proj.weight, attn.v_proj.weight), (attn.q_proj.bias, attn.k_proj.bias),
                 (mlp.gate_proj.weight, mlp.up_proj.weight)):
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def outputs(m: SpeechLLM) -> list[torch.Tensor]:
        prefixes = _requests(m, io)
        cache = KVCache(m.cfg.qwen2, num_slots=4, max_seq=io["lm_input"].shape[1] + 2)
        first = m.prefill(torch.cat(prefixes, dim=1), cache, [3, 0, 2, 1], [x.shape[1] for x in prefixes])
        targets = io["target_speech_token"][0].long()
        tok = targets[torch.arange(4) % targets.numel()]
        pos = torch.tensor([x.shape[1] for x in prefixes])
        return [m(io["lm_input"]), first, m.decode(tok, cache, torch.tensor([3, 0, 2, 1]), pos)]

    ref = outputs(model)
    for a, b in zip(outputs(fused), ref, strict=True):
        assert_close(a, b, BATCH)
    assert_close(ref[0], io["logp_full"], NETWORK)

    # loading copies into the parameters, hence into the fused tensors
    torch.manual_seed(1)
    other = SpeechLLM(model.cfg).eval()
    fused.load_state_dict(other.state_dict())
    for a, b in zip(outputs(fused), outputs(other), strict=True):
        assert_close(a, b, BATCH)
    # a move after fusing gives the parameters new storage: refused, until fused again
    fused.double()
    with pytest.raises(RuntimeError, match="fuse_projections_"):
        fused(io["lm_input"].double())
    fused.backbone.fuse_projections_()
    torch.testing.assert_close(fused(io["lm_input"].double()), other.double()(io["lm_input"].double()),
                               atol=1e-10, rtol=0)


@torch.no_grad()
def test_kv_cache_size_and_copy_slot() -> None:
    cfg = LLMConfig(qwen2=Qwen2Config(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8,
                                      intermediate_size=64, vocab_size=100))
    torch.manual_seed(0)
    model = SpeechLLM(cfg).eval()
    cache = KVCache(cfg.qwen2, num_slots=3, max_seq=16)
    assert cache.data.numel() * cache.data.element_size() == 3 * KVCache.bytes_per_slot(cfg.qwen2, 16, torch.float32)
    prefix = model.prefix(torch.tensor([5, 6, 7]), None, torch.tensor([1, 2]))
    model.prefill(prefix, cache, [0], [prefix.shape[1]])
    cache.copy_slot(0, 2, length=prefix.shape[1])
    tok, pos = torch.tensor([9, 9]), torch.tensor([prefix.shape[1]] * 2)
    out = model.decode(tok, cache, torch.tensor([0, 2]), pos)
    assert_close(out[0], out[1], EXACT)
    too_long = torch.cat([prefix] * 3, dim=1)  # 21 positions, the cache holds 16
    for args in ((too_long, [1], [21]), (prefix, [1], [6]), (prefix, [3], [7]), (prefix, [0, 1], [7])):
        with pytest.raises(ValueError):
            model.prefill(args[0], cache, *args[1:])


def test_state_dict_matches_full_checkpoint_keys() -> None:
    with torch.device("meta"):
        model = SpeechLLM(LLMConfig())
    expected, section = {}, False
    for line in (REPO_ROOT / "cosyvoice_opt" / "checkpoint_keys.txt").read_text().splitlines():
        if line.startswith("###"):
            section = line.startswith("### llm.pt")
        elif section and line and not line.startswith("#"):
            key, shape, _ = line.split("\t")
            expected[key] = tuple(int(s) for s in shape.split("x"))
    assert expected
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected


# ---------------------------------------------------------------- sampling


def _reference_nucleus(probs: torch.Tensor, top_p: float, top_k: int) -> list[int]:
    """The rule in words: walk the stable descending order, take while cum < top_p and fewer than top_k."""
    values, order = probs.sort(descending=True, stable=True)
    taken, cum = [], 0.0
    for value, idx in zip(values.tolist(), order.tolist(), strict=True):
        if not (cum < top_p and len(taken) < top_k):
            break
        cum += value
        taken.append(idx)
    return taken


def test_nucleus_orders_equal_probabilities_by_id() -> None:
    """Ties (bf16 logits make many) are taken in a stable sort's order, lower id first, at the top-k cut too."""
    g = torch.Generator().manual_seed(0)
    probs = torch.randint(0, 6, (3, 300), generator=g).float().softmax(-1)  # six distinct values, many ties each
    probs[1, 7] = 0.0
    for top_p, top_k in ((0.8, 25), (0.99, 280), (0.1, 5)):
        ids, p, kept = nucleus(probs, top_p, top_k)
        for row in range(3):
            want = _reference_nucleus(probs[row], top_p, top_k)
            assert ids[row][kept[row]].tolist() == want
            assert torch.equal(p[row], probs[row, ids[row]])
            assert ids[row].tolist() == probs[row].sort(descending=True, stable=True).indices[:top_k].tolist()


def _midpoint_uniform(weights: torch.Tensor, index: int) -> float:
    """A uniform that the inverse-CDF draw over `weights` maps to `index`."""
    cdf = weights.double().cumsum(0)
    lo = 0.0 if index == 0 else float(cdf[index - 1])
    return (lo + float(cdf[index])) / 2 / float(cdf[-1])


@pytest.mark.parametrize("set_dir", parity_params())
def test_sampling_cases(set_dir: Path) -> None:
    model, cfg_json, io = _load(set_dir)
    sc = model.cfg.sampling
    eos = model.cfg.eos_token
    for case in cfg_json["sampling_cases"]:
        logp = io["logp_full"][0, case["row"]]
        probs = logp.softmax(-1)
        ids, p, kept = nucleus(probs[None], sc.top_p, sc.top_k)
        ids, p = ids[0][kept[0]], p[0][kept[0]]
        assert ids.tolist() == _reference_nucleus(probs, sc.top_p, sc.top_k)
        history = _history(case["decoded_tokens"], sc.win_size)
        in_history = [i for i in ids.tolist() if _repeated(i, history, sc)]
        want = case["ras_sampling_id"]
        no_eos = torch.tensor([False])

        # upstream's exact draw: torch.multinomial over our kept (unnormalised) probabilities
        torch.manual_seed(case["seed"])
        draw = int(ids[p.multinomial(1, replacement=True)])
        assert _repeated(draw, history, sc) == case["repetition_branch_taken"]
        if case["repetition_branch_taken"]:
            redraw = logp.clone()
            redraw[draw] = float("-inf")
            assert int(redraw.softmax(-1).multinomial(1, replacement=True)) == want
            assert want != draw and in_history
        else:
            assert want == draw and not _repeated(want, history, sc)

        # our sampler: a nucleus draw of `want` is returned as is; a draw from the history is redrawn
        if not case["repetition_branch_taken"]:
            u = torch.tensor([[_midpoint_uniform(p, ids.tolist().index(want)), 0.5]])
            assert int(ras_sample(logp[None], u, history[None], no_eos, eos, sc)) == want
        for repeated in in_history:
            masked = logp.clone()
            masked[repeated] = float("-inf")
            target = want if want != repeated else int(ids[0] if ids[0] != repeated else ids[-1])
            u = torch.tensor([[_midpoint_uniform(p, ids.tolist().index(repeated)),
                               _midpoint_uniform(masked.softmax(-1), target)]])
            assert int(ras_sample(logp[None], u, history[None], no_eos, eos, sc)) == target


def _peaked_logp(probs_head: list[float], vocab: int) -> torch.Tensor:
    """Log-probs with the given leading probabilities and the rest spread uniformly."""
    head = torch.tensor(probs_head, dtype=torch.float64)
    rest = (1 - head.sum()) / (vocab - head.numel())
    return torch.cat([head, torch.full((vocab - head.numel(),), float(rest), dtype=torch.float64)]).log().float()


def _chi2_ok(counts: torch.Tensor, expected_p: torch.Tensor) -> bool:
    n = counts.sum()
    exp = expected_p.double() * n
    stat = float(((counts.double() - exp) ** 2 / exp).sum())
    df = counts.numel() - 1
    return stat < df + 6 * (2 * df) ** 0.5


def test_sampling_distribution_matches_rule() -> None:
    sc, vocab, eos, n = SamplingConfig(), 200, 197, 40000  # the rule does not depend on the vocabulary size
    logp = _peaked_logp([0.30, 0.20, 0.12, 0.09, 0.07, 0.05, 0.04], vocab)[None].expand(n, vocab)
    probs = logp[0].softmax(-1)
    ids, p, kept = nucleus(probs[None], sc.top_p, sc.top_k)
    nuc, q = ids[0][kept[0]], p[0][kept[0]].double()
    assert nuc.tolist() == _reference_nucleus(probs, sc.top_p, sc.top_k) == [0, 1, 2, 3, 4, 5]
    q = q / q.sum()
    u = sampling_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))
    no_eos = torch.zeros(n, dtype=torch.bool)

    # empty history: the normalised nucleus
    out = ras_sample(logp, u, torch.full((n, sc.win_size), -1), no_eos, eos, sc)
    assert set(out.tolist()) <= set(nuc.tolist())
    assert _chi2_ok(torch.stack([(out == i).sum() for i in nuc]), q)

    # id 0 in the history: its mass goes to a redraw from the softmax without id 0
    history = push_history(torch.full((n, sc.win_size), -1), torch.zeros(n, dtype=torch.long))
    out = ras_sample(logp, u, history, no_eos, eos, sc)
    redraw = probs.double().clone()
    redraw[0] = 0
    redraw /= redraw.sum()
    expected = q[0] * redraw
    expected[nuc[1:]] += q[1:]
    bins = nuc.tolist()[1:]
    counts = torch.stack([(out == i).sum() for i in bins] + [(~torch.isin(out, torch.tensor(bins))).sum()])
    assert int((out == 0).sum()) == 0
    assert _chi2_ok(counts, torch.cat([expected[bins], 1 - expected[bins].sum()[None]]))


def test_ignore_eos_masks_only_eos() -> None:
    sc, vocab, eos, n = SamplingConfig(), 64, 61, 4000
    logp = torch.full((vocab,), -20.0)
    logp[eos], logp[eos + 1], logp[7] = 0.0, -0.5, -1.0
    logp = logp.log_softmax(-1)[None].expand(n, vocab)
    u = sampling_uniforms(torch.full((n,), 3), torch.arange(n))
    history = torch.full((n, sc.win_size), -1)
    masked = ras_sample(logp, u, history, torch.ones(n, dtype=torch.bool), eos, sc)
    free = ras_sample(logp, u, history, torch.zeros(n, dtype=torch.bool), eos, sc)
    assert not (masked == eos).any() and (masked == eos + 1).any()
    assert (free == eos).any()


def test_per_request_determinism() -> None:
    sc, vocab, eos = SamplingConfig(), 6564, 6561
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(6, vocab, generator=gen) * 3).log_softmax(-1)
    seeds = torch.tensor([11, 11, 12, -5, 2**40 + 3, 7])
    steps = torch.tensor([0, 1, 0, 4, 9, 0])
    history = torch.randint(0, vocab, (6, sc.win_size), generator=gen)
    ignore = torch.tensor([True, False, True, False, False, True])

    u = sampling_uniforms(seeds, steps)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert len(set(u.flatten().tolist())) == u.numel()  # seed, step and both streams all matter
    out = ras_sample(logp, u, history, ignore, eos, sc)

    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    out_perm = ras_sample(logp[perm], sampling_uniforms(seeds[perm], steps[perm]), history[perm], ignore[perm], eos, sc)
    assert_close(out_perm, out[perm], EXACT)
    for i in range(6):
        one = ras_sample(logp[i : i + 1], sampling_uniforms(seeds[i : i + 1], steps[i : i + 1]), history[i : i + 1],
                         ignore[i : i + 1], eos, sc)
        assert int(one) == int(out[i])
    # other rows changing does not change row 0
    other = logp.roll(1, dims=0)
    other[0] = logp[0]
    assert int(ras_sample(other, u, history, ignore, eos, sc)[0]) == int(out[0])
