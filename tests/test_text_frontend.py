"""Text frontend: upstream parity of normalisation/splitting, the tokenizer, our extended rules, input checks."""

from __future__ import annotations

import json

import pytest

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend.special_tokens import COSYVOICE2_SPECIAL_TOKENS, ENDOFPROMPT, QWEN2_SPECIAL_TOKENS
from cosyvoice_opt.frontend.text_normalize import (
    EN_RULES,
    MAX_TEXT_CHARS,
    ZH_RULES,
    clean_text,
    extended_normalize,
    split_text,
    text_normalize,
)
from cosyvoice_opt.frontend.text_split import split_paragraph
from cosyvoice_opt.frontend.tokenizer import TextTokenizer, build_text_inputs
from cosyvoice_opt.random_model import write_random_tokenizer_folder
from cosyvoice_opt.types import Mode
from tests.conftest import missing_sets_param, parity_params, parity_sets


def utf8_len_tokenize(text: str) -> list[int]:
    """The fixtures' stand-in English tokenizer: one id per UTF-8 byte."""
    return list(text.encode())


class ByteTokenizer:
    """Stand-in with the `encode` the fixtures' frontend used (ids = UTF-8 bytes), of CosyVoice2 (the fixtures')."""

    family = Family.COSYVOICE2
    encode = staticmethod(utf8_len_tokenize)


def _text_cases() -> list:
    params = []
    for set_dir in parity_sets():
        cases = json.loads((set_dir / "frontend_text_cases.json").read_text())["cases"]
        params += [pytest.param(case, id=f"{set_dir.name}-{i}") for i, case in enumerate(cases)]
    return params or [missing_sets_param("parity")]


# ---------------------------------------------------------------- upstream parity


@pytest.mark.parametrize("case", _text_cases())
def test_text_normalize_matches_upstream(case):
    out = text_normalize(case["input"], utf8_len_tokenize, split=case["split"], extended=False)
    assert out == case["output"]


@pytest.mark.parametrize("set_dir", parity_params())
def test_text_layout_per_mode_matches_upstream(set_dir):
    spec = json.loads((set_dir / "frontend_text_cases.json").read_text())
    assert "UTF-8 bytes" in spec["note"], f"the set's stand-in tokenizer is not ByteTokenizer's: {spec['note']}"
    args, by_mode = spec["model_input_by_mode_args"], spec["model_input_by_mode"]
    assert set(by_mode) == {m.value for m in Mode}
    for mode, keys in by_mode.items():
        ids, target_len = build_text_inputs(
            mode, ByteTokenizer(), args["tts_text"], args["prompt_text"], args["instruct_text"], extended=False
        )
        text_len = keys["text"][0][1]
        prefix_len = keys["prompt_text"][0][1] if "prompt_text" in keys else 0
        assert (len(ids), target_len) == (prefix_len + text_len, text_len), mode
        assert ids[prefix_len:] == utf8_len_tokenize(args["tts_text"])


def test_split_paragraph_quirks():
    a = "这是一句很长的话" * 8 + "。"  # 65 characters
    b = "另一句也很长的话" * 3 + "。"  # 25
    # A closing quote stays with its sentence; a piece is cut when adding would pass 80 and it already has > 60.
    assert split_paragraph(a + "他说：“好！”" + b, len, "zh") == [a + "他说：“好！”", b]
    # A leftover shorter than merge_len (20) joins the previous piece; a missing final ender is added.
    assert split_paragraph(a + "短" * 18, len, "zh") == [a + "短" * 18 + "。"]
    # Upstream crashes on a quote after an ender with no sentence before it; we drop the quote.
    assert split_paragraph('."Hi there', utf8_len_tokenize, "en") == ["Hi there."]
    assert split_paragraph(" Hello. World", utf8_len_tokenize, "en") == [" Hello. World."]


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def random_folder(tmp_path_factory):
    return write_random_tokenizer_folder(tmp_path_factory.mktemp("tok"), 2048)


@pytest.fixture(scope="module")
def random_tokenizer(random_folder) -> TextTokenizer:
    return TextTokenizer.from_folder(random_folder)


def test_random_tokenizer_special_ids(random_folder, random_tokenizer):
    tok = random_tokenizer
    bpe_size = len(json.loads((random_folder / "vocab.json").read_text()))
    expected = range(bpe_size, bpe_size + len(QWEN2_SPECIAL_TOKENS) + len(COSYVOICE2_SPECIAL_TOKENS))
    assert [tok.special_ids[t] for t in QWEN2_SPECIAL_TOKENS + COSYVOICE2_SPECIAL_TOKENS] == list(expected)
    assert tok.endoftext_id == bpe_size and tok.endofprompt_id == bpe_size + 3
    assert tok.encode(ENDOFPROMPT) == [tok.endofprompt_id]
    assert tok.num_ids == expected.stop <= 2048
    assert bpe_size > 256 + 300  # a real BPE with a few hundred merges, not bytes only


def test_random_tokenizer_round_trip(random_tokenizer):
    tok = random_tokenizer
    for text in [
        "Good morning, the weather is lovely today!",
        "今天的天气真不错，我们去爬山吧。",
        "Mixed 中英文 text 123.",
    ]:
        ids = tok.encode(text)
        assert ids and max(ids) < tok.num_ids
        assert tok.decode(ids) == text
    assert tok.encode("") == []
    # Inline tags are single ids; the instruction terminator too.
    ids = tok.encode("用开心的语气说<|endofprompt|>你好[laughter]呀")
    assert ids.count(tok.endofprompt_id) == 1 and ids.count(tok.special_ids["[laughter]"]) == 1
    assert len(tok.encode("你好")) < len("你好".encode())  # merges are used


@pytest.mark.parametrize("vocab_size", [300, 151936])
def test_random_tokenizer_vocab_sizes(tmp_path, vocab_size):
    tok = TextTokenizer.from_folder(write_random_tokenizer_folder(tmp_path, vocab_size))
    assert tok.num_ids <= vocab_size
    assert tok.special_ids["[mn]"] == tok.num_ids - 1


def test_random_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        write_random_tokenizer_folder(tmp_path, 200)
    with pytest.raises(CheckpointError, match="lacks vocab.json, merges.txt"):
        TextTokenizer.from_folder(tmp_path)


def test_build_text_inputs_with_real_tokenizer(random_tokenizer):
    tok = random_tokenizer
    piece = "你好，世界。"
    text_ids = tok.encode(piece)
    ids, n = build_text_inputs(Mode.INSTRUCT2, tok, piece, instruct_text="用四川话说这句话")
    assert n == len(text_ids) and ids[-n:] == text_ids and ids[-n - 1] == tok.endofprompt_id
    ids2, _ = build_text_inputs(Mode.INSTRUCT2, tok, piece, instruct_text="用四川话说这句话" + ENDOFPROMPT)
    assert ids2 == ids  # not appended twice
    ids, n = build_text_inputs(Mode.ZERO_SHOT, tok, piece, prompt_text="我有3个苹果")
    assert ids == tok.encode("我有三个苹果") + text_ids  # prompt text normalised (extended)
    for mode in (Mode.CROSS_LINGUAL, Mode.SFT):
        assert build_text_inputs(mode, tok, piece, "ignored prompt", "ignored") == (text_ids, len(text_ids))


# ---------------------------------------------------------------- extended rules (one spec example per rule at least)

ZH_EXAMPLES = [
    ("价格是1,000元", "价格是一千元"),
    ("日期2024-05-01", "日期二零二四年五月一日"),
    ("2024/12/31到期", "二零二四年十二月三十一日到期"),
    ("今年是2024年", "今年是二零二四年"),
    ("花了$5", "花了五美元"),
    ("花了￥12.5", "花了十二点五元"),
    ("增长50%", "增长百分之五十"),
    ("降低3.5％", "降低百分之三点五"),
    ("气温25°C", "气温二十五摄氏度"),
    ("气温25℃", "气温二十五摄氏度"),
    ("体温98°F", "体温九十八华氏度"),
    ("角度90°", "角度九十度"),
    ("圆周率3.14", "圆周率三点一四"),
    ("版本1.2.3", "版本一点二点三"),
    ("共123个", "共一百二十三个"),
    ("有10个", "有十个"),
    ("人数100010人", "人数十万零一十人"),
    ("编号1001号", "编号一千零一号"),
    ("编号007", "编号零零七"),
    ("总计1000000001元", "总计十亿零一元"),
    ("猫&狗", "猫和狗"),
    ("一+一", "一加一"),
    ("共１２３个", "共一百二十三个"),  # full-width digits
]

EN_EXAMPLES = [
    ("Ｈｅｌｌｏ ｗｏｒｌｄ", "Hello world"),  # full-width letters
    ("Yes！Fine。", "Yes! Fine."),
    ("1,000,000 people", "1000000 people"),
    ("Due 2024-05-01", "Due May first, twenty twenty-four"),
    ("It costs $12.50", "It costs twelve dollars and fifty cents"),
    ("Only $1", "Only one dollar"),
    ("It was £3.5", "It was three pounds and fifty pence"),
    ("Up 50%", "Up 50 percent"),
    ("It is 25°C", "It is 25 degrees Celsius"),
    ("It is 77 °F", "It is 77 degrees Fahrenheit"),
    ("Turn 90°", "Turn 90 degrees"),
    ("The 1st and 22nd", "The first and twenty-second"),
    ("Born in 1999", "Born in nineteen ninety-nine"),
    ("Since 2005", "Since two thousand five"),
    ("in 1905", "in nineteen oh five"),
    ("until 1900", "until nineteen hundred"),
    ("MP3 at 3pm", "MP 3 at 3 pm"),
    ("Pi is 3.14.", "Pi is three point one four."),
    ("Tom & Jerry", "Tom and Jerry"),
    ("1+1", "1 plus 1"),
    ("me@home", "me at home"),
    ("5 m²", "5 m squared"),
    ("2 m³", "2 m cubed"),
    ("a  lot   of   space", "a lot of space"),
]


@pytest.mark.parametrize(("text", "expected"), ZH_EXAMPLES + EN_EXAMPLES)
def test_extended_rule(text, expected):
    assert extended_normalize(text) == expected


def test_every_extended_rule_is_exercised():
    """Each table entry changes at least one example (so a new rule needs a new example)."""
    for rules, examples in ((ZH_RULES, ZH_EXAMPLES), (EN_RULES, EN_EXAMPLES)):
        used = set()
        for text, _ in examples:
            for i, (pattern, repl) in enumerate(rules):
                new = pattern.sub(repl, text)
                used |= {i} if new != text else set()
                text = new
        assert used == set(range(len(rules)))


def test_extended_full_pipeline():
    # Our rules run before the upstream steps: Chinese numbers are read (upstream leaves digits), English as before.
    text = "今天是2024年5月1日，温度是25.5°C，增长了50%。"
    assert text_normalize(text, utf8_len_tokenize, split=False, extended=False).count("2024") == 1
    assert text_normalize(text, utf8_len_tokenize) == [
        "今天是二零二四年五月一日，温度是二十五点五摄氏度，增长了百分之五十。"
    ]
    assert text_normalize("It's 3.5% on 2024-05-01", utf8_len_tokenize) == [
        "It's three point five percent on May first, twenty twenty-four."
    ]


# ---------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "text is empty"),
        ("   \n\t ", "text is empty"),
        ("\x00\x07\u200b", "text is empty"),
        ("😀🎉👍", "nothing to speak"),
        ("。。！！…", "nothing to speak"),
        ("a" * (MAX_TEXT_CHARS + 1), f"too long: {MAX_TEXT_CHARS + 1} characters, the limit is {MAX_TEXT_CHARS}"),
        (None, "text must be a string"),
    ],
)
def test_bad_text_is_rejected(text, message):
    with pytest.raises(InputError, match=message):
        split_text(text, utf8_len_tokenize)


def test_control_characters_are_stripped():
    assert clean_text("he\x00llo\u200b\tworld\r\n") == "hello world\n"
    assert split_text("Hello\x07 world\x1b", utf8_len_tokenize) == ["Hello world."]


def test_build_text_inputs_rejects_missing_prompt_parts():
    with pytest.raises(InputError, match="transcript of the prompt audio"):
        build_text_inputs(Mode.ZERO_SHOT, ByteTokenizer(), "hi.", prompt_text="  ")
    with pytest.raises(InputError, match="needs an instruction"):
        build_text_inputs(Mode.INSTRUCT2, ByteTokenizer(), "hi.", instruct_text="")
    with pytest.raises(InputError, match="prompt text is too long"):
        build_text_inputs(Mode.ZERO_SHOT, ByteTokenizer(), "hi.", prompt_text="x" * (MAX_TEXT_CHARS + 1))
