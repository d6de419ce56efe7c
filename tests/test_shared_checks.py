"""Checks every entry point shares: the HTTP API, the engine and the text frontend accept exactly the same speeds,
seeds and text lengths (`cosyvoice_opt.limits`), and text with nothing speakable is refused by the frontend."""

from __future__ import annotations

import math

import pytest

from cosyvoice_opt import limits
from cosyvoice_opt.engine import check_request
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.text_normalize import split_text, text_normalize
from cosyvoice_opt.frontend.text_split import has_speakable
from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.parsing import parse_speech
from cosyvoice_opt.types import SynthesisRequest


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _accepts(check) -> bool:
    try:
        check()
    except (ApiError, InputError):
        return False
    return True


def _api(**fields) -> bool:
    return _accepts(lambda: parse_speech({"input": "Hello.", "voice": "v", **fields}, ["v"], []))


def _engine(**fields) -> bool:
    return _accepts(lambda: check_request(SynthesisRequest(**{"text": "Hello.", "voice": "v", "stream": False,
                                                               **fields})))


LO, HI = limits.SPEED_RANGE


@pytest.mark.parametrize("speed", [LO - 0.01, LO, 1.0, HI, HI + 0.01, 0, -1, 0.25, 4.0, math.nan, math.inf, 10**9])
def test_api_and_engine_accept_the_same_speeds(speed):
    expected = LO <= speed <= HI
    assert _api(speed=speed) is _engine(speed=speed) is expected


def test_a_refused_speed_names_the_param_and_the_range():
    with pytest.raises(ApiError) as info:
        parse_speech({"input": "Hello.", "voice": "v", "speed": 4.0}, ["v"], [])
    assert info.value.param == "speed" and f"from {LO} to {HI}" in str(info.value)


@pytest.mark.parametrize("seed", [-1, 0, 12345, limits.MAX_SEED, limits.MAX_SEED + 1, 2**70])
def test_api_and_engine_accept_the_same_seeds(seed):
    assert _api(seed=seed) is _engine(seed=seed) is (0 <= seed <= limits.MAX_SEED)


@pytest.mark.parametrize("length", [1, limits.MAX_TEXT_CHARS - 1, limits.MAX_TEXT_CHARS, limits.MAX_TEXT_CHARS + 1])
def test_api_and_text_frontend_accept_the_same_lengths(length):
    text = "a" * length
    frontend = _accepts(lambda: split_text(text, _bytes))  # what the engine and the WebUI run
    assert _api(input=text) is frontend is (length <= limits.MAX_TEXT_CHARS)


# ---- nothing to speak --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["?!...", ", ,", "?!... ,,, ---", "。。！！…", "，，、", "😀 🎉 🚀", "- — –",
                                  "* # ~ ^", "(\u0301)"])
def test_text_without_anything_speakable_is_refused(text):
    with pytest.raises(InputError, match="text has nothing to speak: it contains only punctuation, symbols, spaces "
                                         "or emoji; write at least one word"):
        split_text(text, _bytes)


@pytest.mark.parametrize(("text", "pieces"), [
    ("50%", ["fifty percent."]),  # judged after normalisation: symbols that are read out count
    ("Hello , , world.", ["Hello , , world."]),
    ("你好，，", ["你好。"]),
    ("3", ["three."]),
])
def test_text_with_something_speakable_passes(text, pieces):
    assert split_text(text, _bytes) == pieces


def test_unspeakable_pieces_are_dropped_between_speakable_ones():
    """With the product's rules a piece like ", ,." between two sentences reaches no model; upstream's rules (parity)
    keep it, as upstream does."""
    text = "First sentence here. , , . Second sentence here."

    def long_sentences(piece: str) -> list[int]:  # 70 tokens a sentence: each sentence becomes a piece of its own
        return [0] * (70 * piece.count("."))

    assert text_normalize(text, long_sentences, split=True, extended=False) == \
        ["First sentence here.", " , , .", " Second sentence here."]
    assert text_normalize(text, long_sentences, split=True, extended=True) == \
        ["First sentence here.", " Second sentence here."]


@pytest.mark.parametrize(("text", "speakable"), [("a", True), ("٣", True), ("ー", True), ("中", True), ("!?", False),
                                                 ("  \t", False), ("\u0301", False), ("🎉", False), ("", False)])
def test_has_speakable(text, speakable):
    assert has_speakable(text) is speakable
