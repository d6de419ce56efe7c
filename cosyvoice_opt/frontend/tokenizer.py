"""CosyVoice2's text tokenizer (Qwen2 byte-level BPE + 17 special tokens) and the per-mode LLM text layout.

Loaded with transformers' Qwen2 tokenizer from `CosyVoice-BlankEN/` (vocab.json + merges.txt), strictly offline.
`write_random_tokenizer_folder` writes a small real tokenizer of the same format for random-weight models.
"""

from __future__ import annotations

import json
from pathlib import Path

from cosyvoice_opt.engine.types import Mode
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend.text_normalize import clean_text, text_normalize

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
QWEN2_SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
# Added by upstream's CosyVoice2Tokenizer, in this order (ids follow <|im_end|> consecutively).
COSYVOICE2_SPECIAL_TOKENS = (
    ENDOFPROMPT, "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip

_QWEN2_PRETOKENIZE = (  # Qwen2's pre-tokenizer split pattern
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test of the speech synthesis system.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "How are you doing today? I am fine, thank you. What would you like to talk about?",
    "Streaming text to speech turns written words into natural sounding audio in real time.",
    "Please speak a little more slowly, with a happy voice, like a friendly teacher reading a story.",
    "One, two, three, four, five, six, seven, eight, nine, ten. Numbers and dates are read out loud.",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "今天天气很好，我们一起去公园散步吧。春天来了，花开了，小鸟在树上唱歌。",
    "希望你以后能够做的比我还好呦。这是一个语音合成系统的测试，请用四川话说这句话。",
    "夏天的时候，我们一起去海边游泳，晒太阳，吃西瓜，真是太开心了！秋天，树叶黄了。",
    "我们的声音克隆只需要三秒钟的提示音频，就可以用同样的声音说出任何文字。",
)


class TextTokenizer:
    """Text -> Qwen2 token ids, with CosyVoice2's special tokens (inline tags become single ids)."""

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        tokens = QWEN2_SPECIAL_TOKENS + COSYVOICE2_SPECIAL_TOKENS
        ids = [self._hf.convert_tokens_to_ids(t) for t in tokens]
        if None in ids:
            raise CheckpointError("tokenizer lacks Qwen2's special tokens <|endoftext|>, <|im_start|>, <|im_end|>")
        self.special_ids: dict[str, int] = dict(zip(tokens, ids, strict=True))
        self.endoftext_id = self.special_ids[ENDOFTEXT]
        self.endofprompt_id = self.special_ids[ENDOFPROMPT]
        self.num_ids = len(self._hf)  # ids are 0..num_ids-1; the LLM's embedding table may have more (padding) rows
        base, added = ids[: len(QWEN2_SPECIAL_TOKENS)], ids[len(QWEN2_SPECIAL_TOKENS) :]
        if added != list(range(added[0], added[0] + len(added))) or added[0] <= max(base):
            raise CheckpointError(f"tokenizer: CosyVoice2 special tokens got ids {added}, not new consecutive ids")
        if self.encode("") or set(self.encode("a")) & set(ids):
            raise CheckpointError("tokenizer adds BOS/EOS tokens; CosyVoice2 expects a Qwen2 tokenizer that adds none")
        for token, i in self.special_ids.items():
            if self.encode(token) != [i]:
                raise CheckpointError(f"tokenizer: special token {token} does not encode to its single id {i}")

    @classmethod
    def from_folder(cls, path: str | Path) -> TextTokenizer:
        """Load `CosyVoice-BlankEN/` (or a folder from `write_random_tokenizer_folder`) without touching the network."""
        path = Path(path)
        missing = [f for f in ("vocab.json", "merges.txt") if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"tokenizer folder {path.name}/ lacks {', '.join(missing)}")
        from transformers import AutoTokenizer  # heavy import, needed only here

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        specials = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT}
        hf.add_special_tokens(specials | {"additional_special_tokens": list(COSYVOICE2_SPECIAL_TOKENS)})
        return cls(hf)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Ids back to text, special tokens dropped (as upstream; only for debugging and tests)."""
        return self._hf.decode(ids, skip_special_tokens=True)


def write_random_tokenizer_folder(path: str | Path, vocab_size: int, num_merges: int = 400) -> Path:
    """Write a small real Qwen2-format tokenizer (vocab.json, merges.txt, tokenizer_config.json) for random models.

    A byte-level BPE is trained offline on built-in English and Chinese text; the three Qwen2 specials follow the
    BPE vocab and the 17 CosyVoice2 specials follow them when loaded, so every id stays below `vocab_size`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    n_specials = len(QWEN2_SPECIAL_TOKENS) + len(COSYVOICE2_SPECIAL_TOKENS)
    num_merges = min(num_merges, vocab_size - 256 - n_specials)
    if num_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level tokenizer needs {256 + n_specials} ids")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    tok.decoder = decoders.ByteLevel()

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(path))  # vocab.json + merges.txt
    first = tok.get_vocab_size()
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": {str(first + i): {"content": t, **flags} for i, t in enumerate(QWEN2_SPECIAL_TOKENS)},
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path


def build_text_inputs(
    mode: Mode | str,
    tokenizer: TextTokenizer,
    text_piece: str,
    prompt_text: str = "",
    instruct_text: str = "",
    extended: bool = True,
) -> tuple[list[int], int]:
    """Token ids the LLM reads between sos and task_id for one target piece, and the target's own length.

    zero-shot: normalised prompt text ++ piece; cross-lingual and SFT: piece only; instruct2: the instruction (not
    normalised, `<|endofprompt|>` appended if missing) ++ piece. The target length alone sets min/max speech tokens.
    """
    mode = Mode(mode)
    text_ids = tokenizer.encode(text_piece)
    if not text_ids:
        raise InputError("text piece is empty")
    if mode == Mode.ZERO_SHOT:
        if not prompt_text.strip():
            raise InputError(
                "zero-shot cloning needs the transcript of the prompt audio as prompt text "
                "(use cross-lingual mode when there is none)"
            )
        prompt = clean_text(prompt_text, "prompt text")
        prefix = tokenizer.encode(text_normalize(prompt, tokenizer.encode, split=False, extended=extended))
    elif mode == Mode.INSTRUCT2:
        if not instruct_text.strip():
            raise InputError('instruct2 mode needs an instruction, e.g. "speak happily"')
        instruct = clean_text(instruct_text, "instruction").strip()
        if not instruct.endswith(ENDOFPROMPT):
            instruct += ENDOFPROMPT
        prefix = tokenizer.encode(instruct)
    else:
        prefix = []
    return prefix + text_ids, len(text_ids)
