"""The text frontend per family: CosyVoice3's 278 tokenizer specials, pronunciation tokens and tags through
normalisation, clear errors for bad tags, and each mode's layout around `<|endofprompt|>`."""

from __future__ import annotations

import json
import unicodedata

import pytest

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend.instructions import INSTRUCTIONS, SYSTEM_PROMPT
from cosyvoice_opt.frontend.special_tokens import (
    ARPABET_PHONES,
    COSYVOICE2_SPECIAL_TOKENS,
    COSYVOICE3_SPECIAL_TOKENS,
    ENDOFPROMPT,
    ENDOFSYSTEM,
    PINYIN_PHONES,
    QWEN2_SPECIAL_TOKENS,
)
from cosyvoice_opt.frontend.text_normalize import split_text, text_normalize
from cosyvoice_opt.frontend.tokenizer import TextTokenizer, build_text_inputs, prompt_text_for
from cosyvoice_opt.random_model import write_random_tokenizer_folder
from cosyvoice_opt.types import Mode

V2, V3 = Family.COSYVOICE2, Family.COSYVOICE3
S = "You are a helpful assistant."  # upstream's system text in every CosyVoice3 example


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_tokenizer_folder(tmp_path_factory.mktemp("tok3"), 2048, family=V3)


@pytest.fixture(scope="module")
def tok3(folder) -> TextTokenizer:
    return TextTokenizer.from_folder(folder, V3)


@pytest.fixture(scope="module")
def tok2(folder) -> TextTokenizer:
    return TextTokenizer.from_folder(folder, V2)


# ---------------------------------------------------------------------------------------------------- tokenizer

# Ids of the released tokenizer (cosyvoice3-reference.md §4.1), as offsets from <|endoftext|> = 151643.
REFERENCE_IDS = {"<|endofprompt|>": 151646, "[breath]": 151647, "[mn]": 151662, "<|endofsystem|>": 151663,
                 "[AA]": 151664, "[ZH]": 151747, "[a]": 151748, "[ǜ]": 151923}


def test_cosyvoice3_specials_as_the_reference_lists_them():
    assert len(COSYVOICE3_SPECIAL_TOKENS) == 278 == len(set(COSYVOICE3_SPECIAL_TOKENS))
    assert COSYVOICE3_SPECIAL_TOKENS[:17] == COSYVOICE2_SPECIAL_TOKENS and COSYVOICE3_SPECIAL_TOKENS[17] == ENDOFSYSTEM
    assert (len(ARPABET_PHONES), len(PINYIN_PHONES)) == (84, 176)
    assert (ARPABET_PHONES[0], ARPABET_PHONES[-1], PINYIN_PHONES[0], PINYIN_PHONES[-1]) == ("AA", "ZH", "a", "ǜ")
    assert all(unicodedata.is_normalized("NFC", p) for p in PINYIN_PHONES)
    # Upstream's two lists are each in code-point order: a swapped phone would move the ids of both.
    assert list(ARPABET_PHONES) == sorted(ARPABET_PHONES) and list(PINYIN_PHONES) == sorted(PINYIN_PHONES)


def test_cosyvoice3_tokenizer_ids(folder, tok3):
    bpe_size = len(json.loads((folder / "vocab.json").read_text()))
    tokens = QWEN2_SPECIAL_TOKENS + COSYVOICE3_SPECIAL_TOKENS
    assert [tok3.special_ids[t] for t in tokens] == list(range(bpe_size, bpe_size + 281))
    assert tok3.num_ids == bpe_size + 281 <= 2048 and tok3.family == V3
    for token, released in REFERENCE_IDS.items():
        assert tok3.special_ids[token] - tok3.endoftext_id + 151643 == released, token
    assert tok3.endofprompt_id == tok3.endoftext_id + 3
    for token in COSYVOICE3_SPECIAL_TOKENS:
        assert tok3.encode(token) == [tok3.special_ids[token]], token


def test_pronunciation_tokens_are_single_ids_only_in_cosyvoice3(tok2, tok3):
    ids = tok3.encode("对报道[j][ǐ]予好评 [HH][AH0][L][OW1]")
    for phone in ("[j]", "[ǐ]", "[HH]", "[AH0]", "[L]", "[OW1]"):
        assert ids.count(tok3.special_ids[phone]) == 1, phone
    assert "[ǐ]" not in tok2.special_ids and len(tok2.encode("[AH0]")) > 1
    assert tok2.special_ids["[mn]"] == tok2.num_ids - 1  # CosyVoice2's 17 on the same folder


def test_cosyvoice3_needs_endofprompt_right_after_qwen2s_specials(tmp_path):
    folder = write_random_tokenizer_folder(tmp_path, 2048, family=V3)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    extra = max(int(i) for i in decoder) + 1
    decoder[str(extra)] = decoder[str(extra - 1)] | {"content": "<|extra|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    TextTokenizer.from_folder(folder, V2)  # CosyVoice2 finds its specials by name
    with pytest.raises(CheckpointError, match=r"<\|endofprompt\|> is id \d+, not <\|endoftext\|> \+ 3"):
        TextTokenizer.from_folder(folder, V3)


def test_random_folder_needs_room_for_the_family(tmp_path):
    write_random_tokenizer_folder(tmp_path / "v2", 300)  # 256 bytes + 20 specials fit
    with pytest.raises(ValueError, match="too small.*537"):
        write_random_tokenizer_folder(tmp_path / "v3", 300, family=V3)


# ---------------------------------------------------------------------------------------------------- tags


def _bytes(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("extended", [True, False])
def test_pronunciation_tokens_survive_normalisation(tok3, extended):
    english = split_text("Please say [AH0] 2 times.", tok3.encode, extended, family=V3)
    chinese = split_text("高管也通过电话对报道[j][ǐ]予好评。", tok3.encode, extended, family=V3)
    assert english == ["Please say [AH0] two times."]  # the digit outside the tag is spelled out
    assert chinese == ["高管也通过电话对报道[j][ǐ]予好评。"]
    pieces = english + chinese
    ids = [i for p in pieces for i in build_text_inputs(Mode.CROSS_LINGUAL, tok3, p)[0]]
    assert {tok3.special_ids[t] for t in ("[AH0]", "[j]", "[ǐ]")} <= set(ids)


def test_tags_survive_normalisation_in_both_families():
    for family in (V2, V3):
        text = "[breath]He said 3 words[laughter], <strong>twice</strong> [vocalized-noise]."
        assert text_normalize(text, _bytes, split=False, family=family) == (
            "[breath]He said three words[laughter], <strong>twice</strong> [vocalized-noise].")
    zh = "因为他们那一辈人[breath]在乡里面住的要习惯一点，[quick_breath]邻居都很活络，"
    assert text_normalize(zh, _bytes, split=False, extended=False, family=V3) == (
        "因为他们那一辈人[breath]在乡里面住的要习惯一点，[quick_breath]邻居都很活络。")


def test_decomposed_pinyin_is_recognised(tok3):
    decomposed = unicodedata.normalize("NFD", "[ǐ]")
    assert decomposed != "[ǐ]"
    (piece,) = split_text(f"对报道[j]{decomposed}予好评。", tok3.encode, family=V3)
    assert tok3.special_ids["[ǐ]"] in tok3.encode(piece)


def test_plain_brackets_are_text_and_private_use_characters_are_dropped():
    assert split_text("See note [1] and [ this ].", _bytes, family=V3) == ["See note [one] and [ this ]."]
    assert split_text("Hi\ue000 there[breath].", _bytes, family=V2) == ["Hi there[breath]."]


@pytest.mark.parametrize("family", [V2, V3])
def test_unknown_tag_is_a_clear_error(family):
    with pytest.raises(InputError, match=r"unknown tag \[xx\] in text.*accepted are the tags \[breath\].*\[mn\]"):
        split_text("Hello [xx] world.", _bytes, family=family)


def test_tag_errors_say_what_is_accepted():
    with pytest.raises(InputError, match=r"\[AH0\].*need a CosyVoice3 model"):
        split_text("Say [AH0].", _bytes, family=V2)
    with pytest.raises(InputError, match=r"unknown tag \[ah0\].*did you mean \[AH0\]\?.*pinyin.*ARPAbet"):
        split_text("Say [ah0].", _bytes, family=V3)
    for family in (V2, V3):
        for token in (ENDOFPROMPT, "<|endoftext|>", "<|im_start|>", ENDOFSYSTEM, "<|anything|>"):
            with pytest.raises(InputError, match=rf"text contains {token.replace('|', '[|]')}: .*placed by the engine"):
                split_text(f"{S}{token}Hello.", _bytes, family=family)


# ---------------------------------------------------------------------------------------------------- modes


@pytest.mark.parametrize(("mode", "v2", "v3"), [
    (Mode.ZERO_SHOT, "hello there", f"{S}{ENDOFPROMPT}hello there"),
    (Mode.CROSS_LINGUAL, "", f"{S}{ENDOFPROMPT}"),
    (Mode.INSTRUCT2, f"speak fast{ENDOFPROMPT}", f"{S} speak fast{ENDOFPROMPT}"),
    (Mode.SFT, "", f"{S}{ENDOFPROMPT}"),
])  # fmt: skip
def test_prompt_layout_per_mode_and_family(mode, v2, v3):
    args = dict(prompt_text="hello there", instruct_text="speak fast", extended=False)
    assert prompt_text_for(mode, V2, **args) == v2
    assert prompt_text_for(mode, V3, **args) == v3


@pytest.mark.parametrize("mode", list(Mode))
def test_every_cosyvoice3_mode_gives_the_llm_one_endofprompt(tok2, tok3, mode):
    """CosyVoice3LM asserts that 151646 is in prompt_text ++ text; a user never types it."""
    args = dict(prompt_text="希望你以后能够做的比我还好呦。", instruct_text="请用广东话表达。")
    ids, n = build_text_inputs(mode, tok3, "收到好友的礼物。", **args)
    assert ids.count(tok3.endofprompt_id) == 1
    target = tok3.encode("收到好友的礼物。")
    assert ids[-len(target):] == target
    # The target alone sets min/max length, except where upstream's target text carries the system prompt.
    assert n == (len(ids) if mode in (Mode.CROSS_LINGUAL, Mode.SFT) else len(target))
    ids2, n2 = build_text_inputs(mode, tok2, "收到好友的礼物。", **args)
    assert ids2.count(tok2.endofprompt_id) == (mode == Mode.INSTRUCT2) and n2 == len(target)


def test_cosyvoice3_layouts_equal_upstream_examples(tok3):
    """The strings upstream's CosyVoice3 examples pass, encoded whole, equal our prefix ++ piece."""
    piece = "[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点。"
    ids, _ = build_text_inputs(Mode.CROSS_LINGUAL, tok3, piece, extended=False)
    assert ids == tok3.encode(f"{S}{ENDOFPROMPT}{piece}")
    prompt = "希望你以后能够做的比我还好呦。"
    ids, _ = build_text_inputs(Mode.ZERO_SHOT, tok3, "八百标兵奔北坡。", prompt, extended=False)
    assert ids == tok3.encode(f"{S}{ENDOFPROMPT}{prompt}") + tok3.encode("八百标兵奔北坡。")
    upstream_instruct = f"{S} 请用广东话表达。{ENDOFPROMPT}"
    ids, _ = build_text_inputs(Mode.INSTRUCT2, tok3, "好少咯。", instruct_text="请用广东话表达。")
    assert ids == tok3.encode(upstream_instruct) + tok3.encode("好少咯。")


def test_upstream_spellings_are_accepted_verbatim():
    for instruct in ("请用广东话表达。", "cantonese", f"{S} 请用广东话表达。{ENDOFPROMPT}", f"{S}请用广东话表达。"):
        assert prompt_text_for(Mode.INSTRUCT2, V3, instruct_text=instruct) == f"{S} 请用广东话表达。{ENDOFPROMPT}"
    assert prompt_text_for(Mode.INSTRUCT2, V2, instruct_text=f"用四川话说这句话{ENDOFPROMPT}") == (
        f"用四川话说这句话{ENDOFPROMPT}")
    transcript = "希望你以后能够做的比我还好呦。"
    for prompt in (transcript, f"{S}{ENDOFPROMPT}{transcript}"):
        expected = f"{S}{ENDOFPROMPT}{transcript}"
        assert prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text=prompt, extended=False) == expected
    custom = f"You are a helpful assistant. 请用广东话表达。{ENDOFPROMPT}{transcript}"  # a system text of one's own
    assert prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text=custom, extended=False) == custom


def test_cosyvoice3_prompt_text_normalised_only_when_extended():
    """Upstream never normalises a CosyVoice3 prompt text (it holds <|endofprompt|>); our extended rules do."""
    raw = prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text="我有3个苹果 ,", extended=False)
    assert raw == f"{S}{ENDOFPROMPT}我有3个苹果 ,"
    assert prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text="我有3个苹果 ,") == f"{S}{ENDOFPROMPT}我有三个苹果。"
    assert prompt_text_for(Mode.ZERO_SHOT, V2, prompt_text="我有3个苹果 ,", extended=False) == "我有3个苹果。"


def test_instruction_presets_are_upstreams_list():
    kinds = [i.kind for i in INSTRUCTIONS]
    assert [kinds.count(k) for k in ("dialect", "volume", "speed", "emotion", "role")] == [17, 2, 2, 3, 2]
    assert len({i.name for i in INSTRUCTIONS}) == len({i.text for i in INSTRUCTIONS}) == 26
    assert SYSTEM_PROMPT == S
    for preset in INSTRUCTIONS:  # the frame is upstream's: system text, one space, instruction, <|endofprompt|>
        framed = prompt_text_for(Mode.INSTRUCT2, V3, instruct_text=preset.name)
        assert framed == f"{S} {preset.text}{ENDOFPROMPT}"
    fast = prompt_text_for(Mode.INSTRUCT2, V3, instruct_text="fast")
    assert fast == "You are a helpful assistant. 请用尽可能快地语速说一句话。<|endofprompt|>"  # upstream's example.py
    free = prompt_text_for(Mode.INSTRUCT2, V3, instruct_text="Speak like a pirate.")
    assert free == f"{S} Speak like a pirate.{ENDOFPROMPT}"


def test_mode_text_errors():
    with pytest.raises(InputError, match="needs an instruction: a preset .*sichuanese.*or free text"):
        prompt_text_for(Mode.INSTRUCT2, V3, instruct_text="  ")
    with pytest.raises(InputError, match="ends at <[|]endofprompt[|]>"):
        prompt_text_for(Mode.INSTRUCT2, V3, instruct_text=f"快一点{ENDOFPROMPT}要说的话")
    with pytest.raises(InputError, match="instruction contains <[|]im_start[|]>"):
        prompt_text_for(Mode.INSTRUCT2, V3, instruct_text="<|im_start|>快一点")
    with pytest.raises(InputError, match=r"unknown tag \[xx\] in prompt text"):
        prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text="你好[xx]")
    with pytest.raises(InputError, match="zero-shot cloning needs the transcript"):
        prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text=f"{S}{ENDOFPROMPT}  ")
    with pytest.raises(InputError, match="prompt text contains <[|]endofsystem[|]>"):
        prompt_text_for(Mode.ZERO_SHOT, V3, prompt_text=f"{S}{ENDOFPROMPT}你好{ENDOFSYSTEM}")
