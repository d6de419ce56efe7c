"""Inline tags in a user's text: which a family accepts, one clear error for any other, and shielding the accepted
ones from text normalisation.

A tag is `[name]` (a letter first, no spaces: `[breath]`, CosyVoice3's `[AH0]` and `[ǐ]`; `[1]` and `[ see ]` are
plain text) or one of the angle tags `<strong>`, `<laughter>` and their closing forms. Accepted tags reach the LLM as
their special ids. `<|...|>` tokens are structure the engine places itself (CosyVoice3's system prompt and
`<|endofprompt|>`), so a text never carries one.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.special_tokens import COSYVOICE2_TAGS, PHONEME_TOKENS, user_tags

_BRACKET_TAG = re.compile(r"\[[^\W\d_][^\[\]\s]*\]")
_ANGLE_TAG = re.compile(r"</?(?:strong|laughter)>")
_STRUCTURAL = re.compile(r"<\|[^\n]*?\|>")
# Accepted tags stand in for themselves during normalisation as private-use characters, which no rule touches.
_SHIELD_BASE = 0xE000
_PRIVATE_USE = re.compile(r"[\ue000-\uf8ff]")


def accepted_tags_text(family: Family) -> str:
    """The accepted tags, as an error message lists them."""
    text = "the tags " + ", ".join(COSYVOICE2_TAGS)
    if Family(family) == Family.COSYVOICE3:
        text += (", and the pronunciation tokens: pinyin initials and toned finals such as [j][ǐ] or [zh][ōng], "
                 "ARPAbet phones with optional stress such as [AH0] [K]")
    return text


def check_tags(text: str, family: Family, what: str = "text") -> str:
    """`text` with its tags in NFC form (how the tokenizer's specials are spelled), or an `InputError` naming the first
    `<|...|>` token or unknown `[tag]` and listing what is accepted."""
    text = _BRACKET_TAG.sub(lambda m: unicodedata.normalize("NFC", m[0]), text)
    structural = _STRUCTURAL.search(text)
    if structural:
        raise InputError(f"{what} contains {structural[0]}: <|...|> tokens are placed by the engine (the system prompt "
                         f"and <|endofprompt|>), never written in a text; accepted inline are "
                         f"{accepted_tags_text(family)}")
    accepted = user_tags(family)
    for m in _BRACKET_TAG.finditer(text):
        tag = m[0]
        if tag in accepted:
            continue
        hint = ""
        if tag in PHONEME_TOKENS:
            hint = " (pronunciation tokens need a CosyVoice3 model)"
        elif Family(family) == Family.COSYVOICE3 and (tag.upper() in accepted or tag.lower() in accepted):
            hint = f" (did you mean {tag.upper() if tag.upper() in accepted else tag.lower()}?)"
        raise InputError(f"unknown tag {tag} in {what}{hint}; accepted are {accepted_tags_text(family)}; "
                         f"to say brackets, write ( ) instead")
    return text


@functools.cache
def _shield_table(family: Family) -> tuple[tuple[str, ...], dict[str, int]]:
    order = tuple(sorted(user_tags(family)))
    return order, {tag: i for i, tag in enumerate(order)}


def shield_tags(text: str, family: Family) -> tuple[str, Callable[[str], str]]:
    """Replace each accepted tag by a private-use character (private-use characters already there are dropped:
    they cannot be spoken), and return the function that puts the tags back."""
    order, index = _shield_table(Family(family))
    text = _PRIVATE_USE.sub("", text)

    def shield(m: re.Match[str]) -> str:
        return chr(_SHIELD_BASE + index[m[0]]) if m[0] in index else m[0]

    shielded = _ANGLE_TAG.sub(shield, _BRACKET_TAG.sub(shield, text))

    def restore(s: str) -> str:
        return _PRIVATE_USE.sub(lambda m: order[ord(m[0]) - _SHIELD_BASE], s)

    return shielded, restore
