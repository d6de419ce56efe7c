"""Bidirectional streaming (text in, speech out, both streaming): upstream parity of the LLM procedure on every
bistream fixture set, and the opt-in fixes of upstream's quirks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import LLMConfig
from cosyvoice_opt.models.bistream import (
    SPEECH,
    TASK,
    TEXT,
    UPSTREAM,
    BistreamFixes,
    BistreamPlan,
    bistream_calls,
)
from cosyvoice_opt.models.llm import SpeechLLM
from tests.conftest import bistream_params
from tests.tolerances import EXACT, NETWORK, assert_close


def _load_set(set_dir: Path) -> tuple[SpeechLLM, dict]:
    """The set's LLM, built from the files its config names (paths relative to the set folder)."""
    cfg = json.loads((set_dir / "bistream_config.json").read_text())
    state_path = set_dir / cfg["llm_state_dict"]
    assert hashlib.sha256(state_path.read_bytes()).hexdigest() == cfg["llm_state_dict_sha256"]
    llm_json = json.loads((set_dir / cfg["llm_config"]).read_text())
    llm_cfg = LLMConfig.from_upstream({**llm_json, "mix_ratio": cfg["mix_ratio"], "special_ids": cfg["special_ids"]},
                                      llm_json["qwen2_config"])
    model = SpeechLLM(llm_cfg).eval()
    model.load_state_dict(torch.load(state_path, weights_only=True), strict=True)
    return model, cfg


def _cases(set_dir: Path, cfg: dict) -> list[dict]:
    return [torch.load(set_dir / c["file"], weights_only=True) for c in cfg["cases"]]


class StandIn:
    """The fixtures' deterministic stand-in for `sampling_ids`: argmax over the speech ids in the text phase; in the
    final phase argmax for the first `k_final` calls, then eos."""

    def __init__(self, n_speech_ids: int, eos: int, k_final: int) -> None:
        self.n, self.eos, self.k_final, self.final_calls = n_speech_ids, eos, k_final, 0

    def __call__(self, logp: torch.Tensor, out: list[int], ignore_eos: bool) -> int:
        if not ignore_eos:
            self.final_calls += 1
            if self.final_calls > self.k_final:
                return self.eos
        return int(logp[: self.n].argmax())


def _run(model: SpeechLLM, cfg: dict, case: dict, fixes: BistreamFixes = UPSTREAM) -> tuple[list, list[int]]:
    """Every call of the case, and per call the index of the last text item consumed (-1 once the text ended)."""
    special = cfg["special_ids"]
    sampler = StandIn(special["speech_token_size"], special["eos_token"], int(case["K_final"]))
    current = [-1]

    def items():
        for i, chunk in enumerate(case["text_chunks"]):
            current[0] = i
            yield chunk
        current[0] = -1

    calls, chunk_of_call = [], []
    for call in bistream_calls(model, items(), sampler, case["prompt_text"], case["prompt_speech_token"], fixes):
        calls.append(call)
        chunk_of_call.append(current[0])
    return calls, chunk_of_call


@pytest.mark.parametrize("set_dir", bistream_params())
def test_bistream_matches_upstream(set_dir: Path) -> None:
    model, cfg = _load_set(set_dir)
    assert model.cfg.fill_token == cfg["special_ids"]["fill_token"]
    assert model.cfg.eos_token == cfg["special_ids"]["eos_token"]
    assert list(model.cfg.mix_ratio) == cfg["mix_ratio"]
    for case in _cases(set_dir, cfg):
        assert [int(n) for n in case["mix_ratio"]] == list(model.cfg.mix_ratio)
        calls, chunk_of_call = _run(model, cfg, case)
        assert [c.token for c in calls] == list(case["out_tokens"])
        assert [c.token for c in calls if c.emitted] == list(case["yielded_tokens"])
        assert [chunk_of_call[i] for i, c in enumerate(calls) if c.emitted] == list(case["yield_after_chunk"])
        assert len(calls) == case["n_calls"]
        for call, ref in zip(calls, case["calls"], strict=True):
            assert (call.phase, call.cache_len_before, call.lm_input.shape[1]) == \
                (ref["phase"], ref["cache_len_before"], ref["n_new"])
            assert call.forced == (ref["decision"] == "forced_fill")
            assert_close(call.lm_input, ref["lm_input"], EXACT)
        assert_close(torch.stack([c.logp for c in calls]), case["logp_last"], NETWORK)
        assert_close(torch.stack([c.hidden for c in calls]), case["hidden_last"], NETWORK)
        assert calls[-1].cache_len_before + calls[-1].lm_input.shape[1] == case["total_positions"]


@pytest.mark.parametrize("set_dir", bistream_params())
def test_no_refeed_fix_feeds_the_last_speech_token_once(set_dir: Path) -> None:
    model, cfg = _load_set(set_dir)
    for case in _cases(set_dir, cfg):
        first = int(case["final_first_call"])
        calls, _ = _run(model, cfg, case, BistreamFixes(no_refeed=True))
        assert [c.token for c in calls[:first]] == list(case["out_tokens"][:first])
        ref = case["calls"][first]["lm_input"]
        skip = int(case["quirk_refeed_n_positions"]) if case["quirk_refeed"] else 0
        assert skip > 0  # every shipped case ends its text phase on a fill
        assert_close(calls[first].lm_input, ref[:, skip:], EXACT)


# ---------------------------------------------------------------- the control flow alone (no model)

CFG = LLMConfig()
N_TEXT, N_SPEECH = CFG.mix_ratio


def _drive(plan: BistreamPlan, items: list[list[int]]) -> list[list]:
    """Push `items`, then finish; every forward's input, with a sampler that emits speech id 7 and eos after 3 final
    steps. Returns the inputs fed, in order."""
    fed, final_steps = [], 0

    def run() -> None:
        nonlocal final_steps
        while (x := plan.input()) is not None:
            fed.append(x)
            token = plan.forced()
            if token is None:
                final_steps += plan.phase == "final"
                token = CFG.eos_token if final_steps > 3 else 7
            plan.accept(token)

    for item in items:
        plan.push(item)
        run()
    plan.finish()
    run()
    assert plan.done
    return fed


def _text_blocks(fed: list[list]) -> list[int]:
    return [len(ids) for x in fed for kind, ids in x if kind == TEXT]


def test_one_text_block_per_item_unless_fixed() -> None:
    items = [list(range(100, 112)), list(range(200, 212))]  # 12 text tokens per item, no prompt
    upstream = _drive(BistreamPlan(CFG), items)
    assert _text_blocks(upstream) == [5, 5, 14]  # one block per item, the other 14 tokens all at the end
    fixed = _drive(BistreamPlan(CFG, fixes=BistreamFixes(every_text_block=True)), items)
    assert _text_blocks(fixed) == [5, 5, 5, 5, 4]
    assert sum(_text_blocks(fixed)) == sum(_text_blocks(upstream)) == 24


@pytest.mark.parametrize("p", [N_SPEECH, 2 * N_SPEECH])
def test_full_prompt_block_fill_position(p: int) -> None:
    def first_fill(fixes: BistreamFixes) -> int:
        plan = BistreamPlan(CFG, list(range(10, 10 + p // N_SPEECH * N_TEXT)), [3] * p, fixes)
        plan.push([1])  # enough text for every prompt block: decoding starts
        fills = []
        while plan.input() is not None and not fills:
            token = plan.forced()
            plan.accept(7 if token is None else token)
            fills = [i for i, t in enumerate(plan.out) if t == CFG.fill_token]
        return fills[0]

    assert first_fill(BistreamFixes()) == N_SPEECH  # upstream: 15 more speech tokens before the first fill
    assert first_fill(BistreamFixes(full_block_fill=True)) == 0  # the last prompt block is full already


def test_prompt_speech_left_when_text_ends_early() -> None:
    prompt_speech = list(range(40, 40 + 2 * N_SPEECH + 4))  # three blocks' worth, text for one only

    def final_input(fixes: BistreamFixes) -> list:
        plan = BistreamPlan(CFG, [1] * N_TEXT, prompt_speech, fixes)
        fed = _drive(plan, [[2, 3]])
        return fed[0]  # the text ended before any decoding: the final input is the first forward

    upstream = final_input(BistreamFixes())
    assert [k for k, _ in upstream][-1] == TASK
    assert sum(len(ids) for k, ids in upstream if k == SPEECH) == N_SPEECH  # the other 19 are dropped
    fixed = final_input(BistreamFixes(keep_prompt_speech=True))
    assert fixed[-1] == (SPEECH, tuple(prompt_speech[N_SPEECH:]))
    assert fixed[-2][0] == TASK


def test_text_after_the_end_is_refused() -> None:
    plan = BistreamPlan(CFG)
    plan.finish()
    with pytest.raises(RuntimeError):
        plan.push([1])
