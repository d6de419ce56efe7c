"""CosyVoice3's silent-token rule against upstream's `llm_job` on every CosyVoice3 fixture set, and by example."""

from __future__ import annotations

import json

import pytest
import torch

from cosyvoice_opt.models.silent_tokens import MAX_SILENT_RUN, SILENT_TOKENS, SilentRunFilter, drop_long_silences
from tests.conftest import fixture_params


@pytest.mark.parametrize("folder", fixture_params("parity-cv3"))
def test_flow_tokens_are_upstreams(folder):
    """The stub LLM stream filtered with the set's silent ids and run length is the token list upstream's flow got."""
    cfg = json.loads((folder / "model_tts_config.json").read_text())
    io = torch.load(folder / "model_tts_io.pt", weights_only=True)
    got = drop_long_silences(io["llm_tokens"][0].tolist(), cfg["silent_tokens"], cfg["max_silent_token_num"])
    assert got == io["tokens"][0].tolist()
    assert len(got) < io["llm_tokens"].shape[1]


def test_released_constants():
    assert SILENT_TOKENS == (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
    assert MAX_SILENT_RUN == 5


def test_runs_keep_their_first_five_and_reset():
    """A run of 8 different silent ids keeps 5; any other id resets the count; a run of exactly 5 is whole."""
    run8 = [1, 2, 28, 29, 55, 248, 494, 2241]
    tokens = [7, *run8, 9, *run8[:5], 10, 2323]
    assert drop_long_silences(tokens) == [7, *run8[:5], 9, *run8[:5], 10, 2323]
    rule = SilentRunFilter(max_run=2)
    assert [rule.keep(t) for t in (1, 1, 1, 3, 1)] == [True, True, False, True, True]
