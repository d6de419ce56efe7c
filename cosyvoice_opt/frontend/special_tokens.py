"""The text specials each family's tokenizer adds to Qwen2's vocabulary, as data (upstream's `CosyVoice2Tokenizer`
and `CosyVoice3Tokenizer` lists, in their order: the added tokens take consecutive ids after `<|im_end|>` in this order,
so `<|endofprompt|>` is 151646 in both families).

CosyVoice3 adds `<|endofsystem|>` and 260 phoneme tokens used inline for pronunciation inpainting: 84 ARPAbet phones
(`[AH0]`) and 176 pinyin initials and toned finals (`[j][ǐ]`).
"""

from __future__ import annotations

import functools

from cosyvoice_opt.config import Family

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
ENDOFSYSTEM = "<|endofsystem|>"
QWEN2_SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
# Inline tags a user writes in the text (both families).
COSYVOICE2_TAGS = (
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip
COSYVOICE2_SPECIAL_TOKENS = (ENDOFPROMPT, *COSYVOICE2_TAGS)

ARPABET_PHONES = (
    "AA", "AA0", "AA1", "AA2", "AE", "AE0", "AE1", "AE2", "AH", "AH0", "AH1", "AH2", "AO", "AO0", "AO1", "AO2",
    "AW", "AW0", "AW1", "AW2", "AY", "AY0", "AY1", "AY2", "B", "CH", "D", "DH", "EH", "EH0", "EH1", "EH2", "ER",
    "ER0", "ER1", "ER2", "EY", "EY0", "EY1", "EY2", "F", "G", "HH", "IH", "IH0", "IH1", "IH2", "IY", "IY0", "IY1",
    "IY2", "JH", "K", "L", "M", "N", "NG", "OW", "OW0", "OW1", "OW2", "OY", "OY0", "OY1", "OY2", "P", "R", "S",
    "SH", "T", "TH", "UH", "UH0", "UH1", "UH2", "UW", "UW0", "UW1", "UW2", "V", "W", "Y", "Z", "ZH",
)  # fmt: skip
PINYIN_PHONES = (
    "a", "ai", "an", "ang", "ao", "b", "c", "ch", "d", "e", "ei", "en", "eng", "f", "g", "h", "i", "ian", "in",
    "ing", "iu", "ià", "iàn", "iàng", "iào", "iá", "ián", "iáng", "iáo", "iè", "ié", "iòng", "ióng", "iù", "iú",
    "iā", "iān", "iāng", "iāo", "iē", "iě", "iōng", "iū", "iǎ", "iǎn", "iǎng", "iǎo", "iǒng", "iǔ", "j", "k", "l",
    "m", "n", "o", "ong", "ou", "p", "q", "r", "s", "sh", "t", "u", "uang", "ue", "un", "uo", "uà", "uài", "uàn",
    "uàng", "uá", "uái", "uán", "uáng", "uè", "ué", "uì", "uí", "uò", "uó", "uā", "uāi", "uān", "uāng", "uē", "uě",
    "uī", "uō", "uǎ", "uǎi", "uǎn", "uǎng", "uǐ", "uǒ", "vè", "w", "x", "y", "z", "zh", "à", "ài", "àn", "àng",
    "ào", "á", "ái", "án", "áng", "áo", "è", "èi", "èn", "èng", "èr", "é", "éi", "én", "éng", "ér", "ì", "ìn",
    "ìng", "í", "ín", "íng", "ò", "òng", "òu", "ó", "óng", "óu", "ù", "ùn", "ú", "ún", "ā", "āi", "ān", "āng",
    "āo", "ē", "ēi", "ēn", "ēng", "ě", "ěi", "ěn", "ěng", "ěr", "ī", "īn", "īng", "ō", "ōng", "ōu", "ū", "ūn", "ǎ",
    "ǎi", "ǎn", "ǎng", "ǎo", "ǐ", "ǐn", "ǐng", "ǒ", "ǒng", "ǒu", "ǔ", "ǔn", "ǘ", "ǚ", "ǜ",
)  # fmt: skip
PHONEME_TOKENS = tuple(f"[{p}]" for p in ARPABET_PHONES + PINYIN_PHONES)
COSYVOICE3_SPECIAL_TOKENS = (*COSYVOICE2_SPECIAL_TOKENS, ENDOFSYSTEM, *PHONEME_TOKENS)


def added_special_tokens(family: Family) -> tuple[str, ...]:
    """The tokens a family's tokenizer adds after Qwen2's three, in id order (17 or 278)."""
    return COSYVOICE3_SPECIAL_TOKENS if Family(family) == Family.COSYVOICE3 else COSYVOICE2_SPECIAL_TOKENS


@functools.cache
def user_tags(family: Family) -> frozenset[str]:
    """The specials a user may write inline in a text: the tags, and CosyVoice3's phoneme tokens. The `<|...|>`
    tokens are structure the engine places itself, never the user."""
    return frozenset(COSYVOICE2_TAGS + (PHONEME_TOKENS if Family(family) == Family.COSYVOICE3 else ()))
