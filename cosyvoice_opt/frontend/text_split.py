"""Sentence splitting exactly as upstream CosyVoice2 (`split_paragraph`), quirks included, so pieces match parity."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import regex

ZH_ENDERS = frozenset("。？！；：、.?!;")
EN_ENDERS = frozenset(".?!;:")
COMMAS = frozenset("，,")
CLOSING_QUOTES = frozenset('"”')

_ONLY_PUNCTUATION = regex.compile(r"[\p{P}\p{S}]*")


def is_only_punctuation(text: str) -> bool:
    """True for empty strings and strings made only of Unicode punctuation/symbols (emoji included)."""
    return _ONLY_PUNCTUATION.fullmatch(text) is not None


def has_speakable(text: str) -> bool:
    """True when `text` holds a letter or a digit (any script): punctuation, symbols, emoji, spaces and lone marks
    give the model nothing to read, so a text or piece without one is not worth synthesising."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


def split_paragraph(
    text: str,
    tokenize: Callable[[str], list[int]],
    lang: str = "zh",
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
) -> list[str]:
    """Cut `text` at sentence enders, then greedily merge sentences into pieces of about token_min_n..token_max_n.

    Length is characters for "zh" and `len(tokenize(piece))` otherwise. A leftover shorter than merge_len is glued
    onto the previous piece. A closing quote after an ender stays with its sentence.
    """
    if not text:
        return []

    def length(s: str) -> int:
        return len(s) if lang == "zh" else len(tokenize(s))

    enders = ZH_ENDERS if lang == "zh" else EN_ENDERS
    if comma_split:
        enders = enders | COMMAS
    if text[-1] not in enders:
        text += "。" if lang == "zh" else "."

    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in enders:
            continue
        if i > start:
            sentences.append(text[start:i] + c)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            # Upstream glues the quote onto the last sentence even when this ender emitted nothing (and crashes if
            # there is none yet); we glue it when there is one and otherwise drop it.
            if sentences:
                sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    pieces: list[str] = []
    cur = ""
    for s in sentences:
        if length(cur + s) > token_max_n and length(cur) > token_min_n:
            pieces.append(cur)
            cur = ""
        cur += s
    if cur:
        if length(cur) < merge_len and pieces:
            pieces[-1] += cur
        else:
            pieces.append(cur)
    return pieces
