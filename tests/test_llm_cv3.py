"""CosyVoice3 speech LLM (`SpeechLLM` with `family="cosyvoice3"`) against upstream `CosyVoice3LM`, every set under
`$COSYVOICE_PARITY_CV3_DIR`: lm_input layout, hidden states, log-probs (teacher forced and KV-cache decode), the RAS
sampling cases with their draws made explicit, and the decoding loop replayed from upstream's inference runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import COSYVOICE3, ENDOFPROMPT, LLMConfig, Qwen2Config
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.llm import SpeechLLM
from cosyvoice_opt.models.sampling import nucleus, ras_sample
from tests.conftest import REPO_ROOT, fixture_params
from tests.test_llm import _history, _midpoint_uniform, _repeated
from tests.tolerances import EXACT, NETWORK, NETWORK_PEAK, assert_close


def _load(set_dir: Path, **overrides) -> tuple[SpeechLLM, dict, dict]:
    cfg_json = json.loads((set_dir / "llm_tiny_config.json").read_text())
    assert cfg_json["class"].endswith(".CosyVoice3LM")
    cfg = LLMConfig.from_upstream(cfg_json, cfg_json["qwen2_config"], family=COSYVOICE3)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    model = SpeechLLM(cfg).eval()
    model.load_state_dict(torch.load(set_dir / "llm_tiny_state_dict.pt", weights_only=True), strict=True)
    return model, cfg_json, torch.load(set_dir / "llm_io.pt", weights_only=True)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_layout_hidden_and_log_probs(set_dir: Path) -> None:
    model, cfg_json, io = _load(set_dir)
    special, cfg = cfg_json["special_ids"], model.cfg
    assert cfg.sos_task_rows == (special["sos"], special["task_id"])
    assert (cfg.eos_token, cfg.fill_token) == (special["eos_token"], special["fill_token"])
    assert cfg.stop_token_ids == tuple(range(*special["stop_token_ids_range"]))
    assert cfg.min_len_masked_ids == range(special["ignore_eos_masks_id"], special["ignore_eos_masks_id"] + 1)
    assert cfg.num_speech_rows == special["speech_embedding_rows"] == special["llm_decoder_out_features"]
    assert (model.llm_decoder.bias is not None) == special["llm_decoder_bias"]
    assert cfg.required_text_id == special["endofprompt_text_id"]
    assert not hasattr(model, "llm_embedding")
    assert model.llm.model.lm_head.weight is model.backbone.embed_tokens.weight

    p = int(io["prefix_len"])
    prefix = model.prefix(io["text"], io["prompt_text"], io["prompt_speech_token"])
    assert_close(prefix, io["lm_input"][:, :p], EXACT)  # embedding rows: copies
    assert_close(model.embed_speech(io["target_speech_token"]), io["lm_input"][:, p:], EXACT)
    assert_close(model.backbone(io["lm_input"]), io["hidden"], NETWORK)
    assert_close(model(io["lm_input"]), io["logp_full"], NETWORK)
    assert model.length_bounds(io["text"].shape[1]) == (int(io["min_len"]), int(io["max_len"]))


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_kv_cache_decode_matches_upstream_steps(set_dir: Path) -> None:
    model, _, io = _load(set_dir)
    targets = io["target_speech_token"][0].long()
    p, length = int(io["prefix_len"]), io["lm_input"].shape[1]
    cache = KVCache(model.cfg.qwen2, num_slots=2, max_seq=length + 3)
    cache.data.normal_()  # stale entries past the sequence must never be read
    slot = torch.tensor([1])
    steps = [model.prefill(io["lm_input"][:, :p], cache, [1], [p])]
    for k in range(targets.numel()):
        steps.append(model.decode(targets[k : k + 1], cache, slot, torch.tensor([p + k])))
    assert_close(torch.cat(steps)[None], io["logp_steps"], NETWORK)


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
@torch.no_grad()
def test_endofprompt_is_required(set_dir: Path) -> None:
    """Upstream asserts `<|endofprompt|>` in prompt_text ++ text; ours refuses with a clear error, wherever it is."""
    model, _, io = _load(set_dir)
    text, prompt_text = io["text"], io["prompt_text"]
    both = torch.cat((prompt_text, text), dim=1)
    assert int((both == ENDOFPROMPT).sum()) >= 1
    with pytest.raises(ValueError, match="endofprompt"):
        model.prefix(text.masked_fill(text == ENDOFPROMPT, 0), prompt_text.masked_fill(prompt_text == ENDOFPROMPT, 0))
    # cross-lingual layout: no prompt text, the marker inside the text
    model.prefix(torch.cat((text[:, :1], torch.tensor([[ENDOFPROMPT]], dtype=text.dtype)), dim=1))


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_sampling_cases(set_dir: Path) -> None:
    """Every case's explicit draws: the nucleus (ids and probabilities after the min_len mask), the multinomial
    position, the repetition count and branch, the fallback; and our inverse-CDF sampler returns the same id."""
    model, cfg_json, io = _load(set_dir)
    cfg, sc = model.cfg, model.cfg.sampling
    masked = cfg.min_len_masked_ids
    assert cfg_json["sampling_cases"]
    for case in cfg_json["sampling_cases"]:
        logp = io["logp_full"][0, case["row"]].clone()
        if case["ignore_eos"]:
            logp[masked.start : masked.stop] = float("-inf")
        ids, p, kept = nucleus(logp.softmax(-1)[None], sc.top_p, sc.top_k)
        ids, p = ids[0][kept[0]], p[0][kept[0]]
        assert ids.tolist() == case["nucleus_ids"]
        assert_close(p, torch.tensor(case["nucleus_probs"]), NETWORK_PEAK)
        torch.manual_seed(case["seed"])
        pos = int(p.multinomial(1, replacement=True))
        assert pos == case["nucleus_draw_pos"] and int(ids[pos]) == case["nucleus_id"]
        history = _history(case["decoded_tokens"], sc.win_size)
        assert int((history == case["nucleus_id"]).sum()) == case["repetition_count"]
        assert _repeated(case["nucleus_id"], history, sc) == case["repetition_branch_taken"]
        fallback = case["fallback_id"]
        if case["repetition_branch_taken"]:
            redraw = logp.clone()
            redraw[case["nucleus_id"]] = float("-inf")
            assert int(redraw.softmax(-1).multinomial(1, replacement=True)) == fallback == case["sampling_ids_result"]
            u1 = _midpoint_uniform(redraw.softmax(-1), fallback)
        else:
            assert case["nucleus_id"] == case["sampling_ids_result"] and fallback is None
            u1 = 0.5
        u = torch.tensor([[_midpoint_uniform(p, pos), u1]])
        ignore = torch.tensor([case["ignore_eos"]])
        raw = io["logp_full"][0, case["row"]][None]  # ras_sample applies the mask itself
        assert int(ras_sample(raw, u, history[None], ignore, masked, sc)) == case["sampling_ids_result"]


def _replay(model: SpeechLLM, io: dict, run: dict) -> tuple[list[int], list[torch.Tensor]]:
    """`generate` with a sampler that returns the run's sampled ids in order; (yielded ids, log-probs it saw)."""
    sampled, seen = iter(run["sampled_ids"]), []

    def scripted(logp: torch.Tensor, decoded: list[int]) -> int:
        seen.append(logp.clone())
        return next(sampled)

    text = torch.tensor([run["text"]])
    return list(model.generate(text, io["prompt_text"], io["prompt_speech_token"], scripted)), seen


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_inference_runs_replayed(set_dir: Path) -> None:
    """Upstream's loop, replayed: the same ids yielded, stop at the first special (before min_len too: only 6561 is
    masked), max_len from the text, the min_len mask on exactly the first min_len steps."""
    model, cfg_json, io = _load(set_dir)
    cfg = model.cfg
    runs = cfg_json["inference_runs"]
    assert runs
    for run in runs:
        assert model.length_bounds(len(run["text"])) == (run["min_len"], run["max_len"])
        tokens, seen = _replay(model, io, run)
        assert tokens == run["tokens"]
        assert len(seen) == run["n_steps"]
        masked_steps = [bool(torch.isinf(logp[cfg.min_len_masked_ids.start])) for logp in seen]
        assert masked_steps == [i < run["min_len"] for i in range(len(seen))]
        assert sum(masked_steps) == run["sos_masked_steps"]
        if run["stop_id"] is None:
            assert len(tokens) == run["max_len"]
        else:
            assert run["sampled_ids"][-1] == run["stop_id"] and run["stop_id"] in cfg.stop_token_ids
            assert torch.isfinite(seen[-1][run["stop_id"]])  # upstream let it through
        if run["kind"] == "early_stop_below_min_len":
            assert len(tokens) < run["min_len"] and run["stop_id"] != cfg.min_len_masked_ids.start


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_min_len_fix_masks_every_stop_id(set_dir: Path) -> None:
    """The opt-in fix masks all 200 specials below min_len: upstream's early stop can no longer happen, and the
    sampler never returns a special there."""
    model, cfg_json, io = _load(set_dir, min_len_masks_all_stops=True)
    cfg = model.cfg
    assert cfg.min_len_masked_ids == range(cfg.stop_token_ids[0], cfg.stop_token_ids[-1] + 1)
    early = [r for r in cfg_json["inference_runs"] if r["stop_id"] is not None and r["n_steps"] <= r["min_len"]]
    for run in early:
        _, seen = _replay(model, io, run)  # the scripted ids ignore the mask; what the sampler was shown does not
        stops = torch.tensor(cfg.stop_token_ids)
        assert len(seen) == run["n_steps"] and all(bool(torch.isinf(logp[stops]).all()) for logp in seen)
    # sampling with the fix: a row whose mass sits on the specials still yields a speech code
    logp = io["logp_full"][0, -1].clone()
    logp[: cfg.speech_token_size] -= 30.0
    logp = logp.log_softmax(-1)
    u = torch.rand(64, 2, generator=torch.Generator().manual_seed(0)).clamp(1e-6, 1 - 1e-6)
    hist = torch.full((64, cfg.sampling.win_size), -1)
    ignore = torch.ones(64, dtype=torch.bool)
    fixed = ras_sample(logp.expand(64, -1), u, hist, ignore, cfg.min_len_masked_ids, cfg.sampling)
    quirk = ras_sample(logp.expand(64, -1), u, hist, ignore, cfg.speech_token_size, cfg.sampling)
    assert bool((fixed < cfg.speech_token_size).all())
    assert bool((quirk > cfg.speech_token_size).any())


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_generate_with_ras_is_deterministic_and_bounded(set_dir: Path) -> None:
    """The default sampler (RAS from per-(seed, step) uniforms): the same seed gives the same ids, within max_len,
    never a special."""
    model, cfg_json, io = _load(set_dir)
    run = cfg_json["inference_runs"][-1]
    text = torch.tensor([run["text"]])
    a = list(model.generate(text, io["prompt_text"], io["prompt_speech_token"], seed=3))
    b = list(model.generate(text, io["prompt_text"], io["prompt_speech_token"], seed=3))
    assert a == b and len(a) <= run["max_len"]
    assert all(0 <= t < model.cfg.speech_token_size for t in a)


def cv3_checkpoint_shapes(file: str) -> dict[str, tuple[int, ...]]:
    """key -> shape of one file's section (`llm.pt`, `flow.pt`, `hift.pt`) of cosyvoice_opt/checkpoint_keys_cv3.txt."""
    shapes, section = {}, None
    for line in (REPO_ROOT / "cosyvoice_opt" / "checkpoint_keys_cv3.txt").read_text().splitlines():
        if line.startswith("### "):
            section = line.split()[1]
        elif section == file and line and not line.startswith("#"):
            key, shape, _ = line.split("\t")
            shapes[key] = tuple(int(n) for n in shape.split("x"))
    assert shapes, f"no {file} section"
    return shapes


def test_full_size_keys_and_shapes() -> None:
    """The released llm.pt's keys and shapes (Qwen2.5-0.5B backbone, as the listing assumes)."""
    with torch.device("meta"):
        model = SpeechLLM(LLMConfig(qwen2=Qwen2Config(), family=COSYVOICE3))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == cv3_checkpoint_shapes("llm.pt")


@pytest.mark.parametrize("set_dir", fixture_params("parity-cv3"))
def test_inference_runs_with_upstreams_draws(set_dir: Path) -> None:
    """With upstream's RNG calls (multinomial over the kept nucleus, the full-softmax redraw on a repetition) after
    `torch.manual_seed(seed)`, our KV-cache decode yields upstream's very tokens, run after run."""
    model, cfg_json, io = _load(set_dir)
    sc = model.cfg.sampling

    def upstream_ras(logp: torch.Tensor, decoded: list[int]) -> int:
        ids, p, kept = nucleus(logp.softmax(-1)[None], sc.top_p, sc.top_k)
        top = int(ids[0][kept[0]][p[0][kept[0]].multinomial(1, replacement=True)])
        if _repeated(top, _history(decoded, sc.win_size), sc):
            redraw = logp.clone()
            redraw[top] = float("-inf")
            top = int(redraw.softmax(-1).multinomial(1, replacement=True))
        return top

    for run in cfg_json["inference_runs"]:
        torch.manual_seed(run["seed"])
        text = torch.tensor([run["text"]])
        assert list(model.generate(text, io["prompt_text"], io["prompt_speech_token"], upstream_ras)) == run["tokens"]
