"""Text normalisation: upstream CosyVoice2's rule-based path plus our own extended rules, and input checks.

Upstream (`CosyVoiceFrontEnd.text_normalize`) runs a TN back-end (ttsfrd / wetext) that is unavailable offline, then a
few rules; `extended=False` reproduces exactly what it does without a back-end (parity). `extended=True` (the
product's default) first applies `ZH_RULES` / `EN_RULES` below, which read numbers, dates, currencies, percentages and
common symbols out loud, so the LLM never sees raw digits (offline upstream leaves Chinese digits untouched), and
drops pieces that are only punctuation and spaces (upstream keeps e.g. " !").
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.tags import check_tags, shield_tags
from cosyvoice_opt.frontend.text_split import has_speakable, is_only_punctuation, split_paragraph
from cosyvoice_opt.limits import MAX_TEXT_CHARS

Tokenize = Callable[[str], list[int]]
Rule = tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]

_CHINESE = re.compile(r"[\u4e00-\u9fff]")


def contains_chinese(text: str) -> bool:
    return _CHINESE.search(text) is not None


@functools.cache
def _inflect():
    import inflect  # slow import (~2 s): only when English text is first normalised

    return inflect.engine()


# ---------------------------------------------------------------- upstream-equivalent steps (no TN back-end)

_ZH_REPLACEMENTS = (
    ("²", "平方"), ("³", "立方"), (".", "。"), (" - ", "，"),
    ("（", ""), ("）", ""), ("【", ""), ("】", ""), ("`", ""), ("——", " "),
)  # fmt: skip
_ZH_TRAILING_COMMAS = re.compile(r"[，,、]+$")


def _remove_blanks(text: str) -> str:
    """Drop every space unless both neighbours are non-space ASCII (keeps spaces between English words)."""

    def keep(i: int) -> bool:
        return all(0 <= j < len(text) and text[j].isascii() and text[j] != " " for j in (i - 1, i + 1))

    return "".join(c for i, c in enumerate(text) if c != " " or keep(i))


def _upstream_zh(text: str) -> str:
    text = _remove_blanks(text.replace("\n", ""))
    for old, new in _ZH_REPLACEMENTS:
        text = text.replace(old, new)
    return _ZH_TRAILING_COMMAS.sub("。", text)


def _upstream_en(text: str) -> str:
    """Spell out every maximal run of (Unicode) digits with inflect, as upstream's `spell_out_number`."""
    out: list[str] = []
    start = None
    for i, c in enumerate(text + "\0"):  # sentinel flushes a trailing run
        if c.isdigit():
            start = i if start is None else start
            continue
        if start is not None:
            out.append(_inflect().number_to_words(text[start:i]))
            start = None
        out.append(c)
    return "".join(out[:-1])


# ---------------------------------------------------------------- extended rules (ours)

_FULLWIDTH = str.maketrans(
    {chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F) if chr(c - 0xFEE0).isalnum() or chr(c - 0xFEE0) in "%$&+"}
    | {"\u3000": " "}
)
_EN_PUNCTUATION = str.maketrans("，。！？；：", ",.!?;:")
_SPACES = re.compile(r"[ \t]{2,}")

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")  # fmt: skip
_EN_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
                "£": ("pound", "pounds", "penny", "pence")}  # fmt: skip
_ZH_CURRENCY = {"$": "美元", "€": "欧元", "£": "英镑", "¥": "元", "￥": "元"}
_ZH_DIGITS = "零一二三四五六七八九"
_ZH_BIG_UNITS = ("", "万", "亿", "万亿")

_NUM = r"(?<![0-9.])[0-9]+(?:\.[0-9]+)?(?![0-9])"  # integer or decimal
_THOUSANDS = re.compile(r"(?<![0-9,])[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])")
_DATE = re.compile(r"(?<![0-9])([0-9]{4})([-/.])([0-9]{1,2})\2([0-9]{1,2})(?![0-9])")
_DECIMAL = re.compile(r"(?<![0-9.])([0-9]+)\.([0-9]+)(?!\.?[0-9])")


def _date_valid(m: re.Match[str]) -> bool:
    return 1 <= int(m[3]) <= 12 and 1 <= int(m[4]) <= 31


def _words(n: int | str) -> str:
    return _inflect().number_to_words(str(n))


def _en_year(y: int) -> str:
    """1999 -> nineteen ninety-nine, 2005 -> two thousand five, 1905 -> nineteen oh five, 1900 -> nineteen hundred."""
    hi, lo = divmod(y, 100)
    if 2000 <= y <= 2009:
        return _inflect().number_to_words(y, andword="")
    if lo == 0:
        return f"{_words(hi)} hundred"
    return f"{_words(hi)} {'oh ' if lo < 10 else ''}{_words(lo)}"


def _en_ordinal(digits: str) -> str:
    return _inflect().number_to_words(_inflect().ordinal(int(digits)))


def _en_decimal(int_part: str, frac: str) -> str:
    return f"{_words(int_part)} point {' '.join(_words(d) for d in frac)}"


def _en_date(m: re.Match[str]) -> str:
    if not _date_valid(m):
        return m[0]
    return f"{_MONTHS[int(m[3]) - 1]} {_en_ordinal(m[4])}, {_en_year(int(m[1]))}"


def _en_money(m: re.Match[str]) -> str:
    one, many, sub_one, sub_many = _EN_CURRENCY[m[1]]
    whole, cents = int(m[2]), int((m[3] or "0").ljust(2, "0"))
    text = f"{_words(whole)} {one if whole == 1 else many}"
    if cents:
        text += f" and {_words(cents)} {sub_one if cents == 1 else sub_many}"
    return text


def _zh_group(n: int) -> str:
    """0 < n < 10000 as 千百十 digits, one 零 per run of inner zeros."""
    out, zero = "", False
    for value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = n // value % 10
        if d == 0:
            zero = bool(out)
            continue
        out += ("零" if zero else "") + _ZH_DIGITS[d] + unit
        zero = False
    return out


def _zh_digits(s: str) -> str:
    return "".join(_ZH_DIGITS[int(d)] for d in s)


def _zh_integer(s: str) -> str:
    """Cardinal reading (123 -> 一百二十三, 10 -> 十); numbers with a leading zero or over 12 digits digit by digit."""
    if (len(s) > 1 and s[0] == "0") or len(s) > 12:
        return _zh_digits(s)
    n = int(s)
    if n == 0:
        return "零"
    groups = []
    while n:
        n, g = divmod(n, 10000)
        groups.append(g)
    out, gap = "", False
    for idx in reversed(range(len(groups))):
        g = groups[idx]
        if g == 0:
            gap = bool(out)
            continue
        if out and (gap or g < 1000):
            out += "零"
        out += _zh_group(g) + _ZH_BIG_UNITS[idx]
        gap = False
    return out[1:] if out.startswith("一十") else out


def _zh_number(s: str) -> str:
    """Integer or decimal: 3.5 -> 三点五."""
    int_part, _, frac = s.partition(".")
    return _zh_integer(int_part) + ("点" + _zh_digits(frac) if frac else "")


def _zh_date(m: re.Match[str]) -> str:
    if not _date_valid(m):
        return m[0]
    return f"{_zh_digits(m[1])}年{_zh_integer(str(int(m[3])))}月{_zh_integer(str(int(m[4])))}日"


def _sub(pattern: str | re.Pattern[str], repl: str | Callable[[re.Match[str]], str]) -> Rule:
    return re.compile(pattern), repl


# Applied in order. Each rule is tested on its own in tests/test_text_frontend.py.
EN_RULES: tuple[Rule, ...] = (
    _sub(r"[，。！？；：]+", lambda m: m[0].translate(_EN_PUNCTUATION) + " "),  # full-width punctuation (CJK keyboards)
    _sub(_THOUSANDS, lambda m: m[0].replace(",", "")),  # 1,000,000 -> 1000000
    _sub(_DATE, _en_date),  # 2024-05-01 -> May first, twenty twenty-four
    _sub(r"([$€£])\s?([0-9]+)(?:\.([0-9]{1,2}))?(?![0-9])", _en_money),  # $12.50 -> twelve dollars and fifty cents
    _sub(rf"({_NUM})\s?%", r"\1 percent"),
    _sub(r"\s?(?:°\s?C|℃)(?![A-Za-z])", " degrees Celsius"),
    _sub(r"\s?(?:°\s?F|℉)(?![A-Za-z])", " degrees Fahrenheit"),
    _sub(r"\s?°", " degrees"),
    _sub(r"(?<![0-9])([0-9]+)(?:st|nd|rd|th)\b", lambda m: _en_ordinal(m[1])),
    _sub(r"(?i)\b(in|since|until|year)\s+(1[1-9][0-9]{2}|20[0-9]{2})\b", lambda m: f"{m[1]} {_en_year(int(m[2]))}"),
    _sub(r"(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])", " "),  # world123 -> world 123 (after ordinals)
    _sub(_DECIMAL, lambda m: _en_decimal(m[1], m[2])),  # 3.14 -> three point one four
    _sub(r"\s*&\s*", " and "),
    _sub(r"\s*\+\s*", " plus "),
    _sub(r"\s*@\s*", " at "),
    _sub(r"²", " squared"),
    _sub(r"³", " cubed"),
    _sub(_SPACES, " "),
)

ZH_RULES: tuple[Rule, ...] = (
    _sub(_THOUSANDS, lambda m: m[0].replace(",", "")),
    _sub(_DATE, _zh_date),  # 2024-05-01 -> 二零二四年五月一日
    _sub(r"(?<![0-9])([0-9]{4})\s?年", lambda m: _zh_digits(m[1]) + "年"),  # 2024年 -> 二零二四年
    _sub(rf"([$€£¥￥])\s?({_NUM})", lambda m: _zh_number(m[2]) + _ZH_CURRENCY[m[1]]),  # $5 -> 五美元
    _sub(rf"({_NUM})\s?%", lambda m: "百分之" + _zh_number(m[1])),  # 50% -> 百分之五十
    _sub(rf"({_NUM})\s?(?:°\s?C|℃)", lambda m: _zh_number(m[1]) + "摄氏度"),
    _sub(rf"({_NUM})\s?(?:°\s?F|℉)", lambda m: _zh_number(m[1]) + "华氏度"),
    _sub(rf"({_NUM})\s?°", lambda m: _zh_number(m[1]) + "度"),
    _sub(_DECIMAL, lambda m: _zh_number(m[0])),  # 3.5 -> 三点五
    _sub(r"(?<=[0-9])\.(?=[0-9])", "点"),  # version numbers: 1.2.3 -> 1点2点3 (upstream would make 。 of each dot)
    _sub(r"[0-9]+", lambda m: _zh_integer(m[0])),  # 123 -> 一百二十三
    _sub(r"&", "和"),
    _sub(r"\+", "加"),
)


def _apply_rules(text: str, rules: tuple[Rule, ...]) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text


def extended_normalize(text: str) -> str:
    """Our rules only (full-width letters/digits to ASCII, then the Chinese or English table)."""
    text = text.translate(_FULLWIDTH)
    return _apply_rules(text, ZH_RULES) if contains_chinese(text) else _apply_rules(text, EN_RULES).strip()


# ---------------------------------------------------------------- public API


def text_normalize(text: str, tokenize: Tokenize, split: bool = True, extended: bool = True,
                   family: Family = Family.COSYVOICE2) -> list[str] | str:
    """Upstream `text_normalize(text, split, text_frontend=True)` without a TN back-end (+ our rules if `extended`).

    Text holding `<|...|>` markup is returned untouched, as upstream. The family's inline tags (`[breath]`,
    CosyVoice3's `[AH0]`, `[j][ǐ]`) pass through unchanged (upstream would spell out the digit of `[AH0]`).
    `tokenize` measures English piece lengths. Returns the speakable pieces if `split`, else the normalised string.
    """
    if not text or ("<|" in text and "|>" in text):
        return [text] if split else text
    text, restore = shield_tags(text.strip(), family)
    if extended:
        text = extended_normalize(text)
    lang = "zh" if contains_chinese(text) else "en"
    text = _upstream_zh(restore(text)) if lang == "zh" else restore(_upstream_en(text))
    if not split:
        return text
    pieces = split_paragraph(text, tokenize, lang)
    if extended:  # upstream keeps pieces like " !" or ", ,." (punctuation and spaces); ours keep only speakable ones
        return [p for p in pieces if has_speakable(p)]
    return [p for p in pieces if not is_only_punctuation(p)]


_WHITESPACE_CONTROLS = str.maketrans({"\t": " ", "\r": "\n", "\v": "\n", "\f": "\n"})


def clean_text(text: str, what: str = "text", max_chars: int = MAX_TEXT_CHARS) -> str:
    """Strip control and invisible format characters (tabs become spaces); reject empty or over-long input."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise InputError(f"{what} is too long: {len(text)} characters, the limit is {max_chars}")
    text = text.replace("\r\n", "\n").translate(_WHITESPACE_CONTROLS)
    text = "".join(c for c in text if c == "\n" or unicodedata.category(c) not in ("Cc", "Cf"))
    if not text.strip():
        raise InputError(f"{what} is empty")
    return text


def split_text(text: str, tokenize: Tokenize, extended: bool = True, max_chars: int = MAX_TEXT_CHARS,
               family: Family = Family.COSYVOICE2) -> list[str]:
    """The product's entry point: check and clean `text` (tags included), normalise it and cut it into pieces
    synthesised one by one."""
    text = check_tags(clean_text(text, max_chars=max_chars), family)
    pieces = text_normalize(text, tokenize, split=True, extended=extended, family=family)
    if not any(has_speakable(p) for p in pieces):  # decided after normalisation: "50%" is speakable, "?!, --" is not
        raise InputError("text has nothing to speak: it contains only punctuation, symbols, spaces or emoji; "
                         "write at least one word")
    return pieces
