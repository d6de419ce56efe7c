"""CosyVoice2's text tokenizer (Qwen2 byte-level BPE + 17 special tokens) and the per-mode LLM text layout.

Loaded with transformers' Qwen2 tokenizer from `CosyVoice-BlankEN/` (vocab.json + merges.txt), strictly offline.
`random_model.write_random_tokenizer_folder` writes a small real tokenizer of the same format for random models.
"""

from __future__ import annotations

from pathlib import Path

from cosyvoice_opt.errors import CheckpointError, InputError, first_sentence
from cosyvoice_opt.frontend.text_normalize import clean_text, text_normalize
from cosyvoice_opt.types import Mode

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
QWEN2_SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
# Added by upstream's CosyVoice2Tokenizer, in this order (ids follow <|im_end|> consecutively).
COSYVOICE2_SPECIAL_TOKENS = (
    ENDOFPROMPT, "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip


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
        """Load `CosyVoice-BlankEN/` (or a random model's tokenizer folder) without touching the network."""
        path = Path(path)
        missing = [f for f in ("vocab.json", "merges.txt") if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"tokenizer folder {path.name}/ lacks {', '.join(missing)}")
        from transformers import AutoTokenizer  # heavy import, needed only here

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt vocab.json or merges.txt
            first = first_sentence(e)
            raise CheckpointError(f"tokenizer folder {path.name}/ cannot be loaded: vocab.json or merges.txt is "
                                  f"corrupt ({first}); re-download it") from None
        specials = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT}
        hf.add_special_tokens(specials | {"additional_special_tokens": list(COSYVOICE2_SPECIAL_TOKENS)})
        return cls(hf)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Ids back to text, special tokens dropped (as upstream; only for debugging and tests)."""
        return self._hf.decode(ids, skip_special_tokens=True)


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
    text_ids = tokenizer.encode(text_piece)
    if not text_ids:
        raise InputError("text piece is empty")
    return prompt_ids(mode, tokenizer, prompt_text, instruct_text, extended) + text_ids, len(text_ids)


def prompt_ids(
    mode: Mode | str, tokenizer: TextTokenizer, prompt_text: str = "", instruct_text: str = "", extended: bool = True
) -> list[int]:
    """The ids the LLM reads before the target text (empty for cross-lingual and SFT): `build_text_inputs`'s prefix,
    and the start of the text cache when the target text streams in."""
    mode = Mode(mode)
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
    return prefix
