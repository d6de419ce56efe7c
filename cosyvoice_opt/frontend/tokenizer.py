"""The text tokenizer (Qwen2 byte-level BPE + the family's added specials) and the per-mode LLM text layout.

Loaded with transformers' Qwen2 tokenizer from `CosyVoice-BlankEN/` (vocab.json + merges.txt), strictly offline.
CosyVoice2 adds 17 specials, CosyVoice3 278 (`special_tokens`). `random_model.write_random_tokenizer_folder` writes a
small real tokenizer of the same format for random models.
"""

from __future__ import annotations

from pathlib import Path

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import CheckpointError, InputError, first_sentence
from cosyvoice_opt.frontend.instructions import INSTRUCTIONS_BY_NAME, SYSTEM_PROMPT, resolve_instruction
from cosyvoice_opt.frontend.special_tokens import ENDOFPROMPT, ENDOFTEXT, QWEN2_SPECIAL_TOKENS, added_special_tokens
from cosyvoice_opt.frontend.tags import check_tags
from cosyvoice_opt.frontend.text_normalize import clean_text, text_normalize
from cosyvoice_opt.types import Mode


class TextTokenizer:
    """Text -> Qwen2 token ids, with the family's special tokens (inline tags become single ids)."""

    def __init__(self, hf_tokenizer, family: Family = Family.COSYVOICE2) -> None:
        self._hf = hf_tokenizer
        self.family = Family(family)
        tokens = QWEN2_SPECIAL_TOKENS + added_special_tokens(self.family)
        ids = [self._hf.convert_tokens_to_ids(t) for t in tokens]
        if None in ids:
            raise CheckpointError("tokenizer lacks Qwen2's special tokens <|endoftext|>, <|im_start|>, <|im_end|>")
        self.special_ids: dict[str, int] = dict(zip(tokens, ids, strict=True))
        self.endoftext_id = self.special_ids[ENDOFTEXT]
        self.endofprompt_id = self.special_ids[ENDOFPROMPT]
        self.num_ids = len(self._hf)  # ids are 0..num_ids-1; the LLM's embedding table may have more (padding) rows
        base, added = ids[: len(QWEN2_SPECIAL_TOKENS)], ids[len(QWEN2_SPECIAL_TOKENS) :]
        if added != list(range(added[0], added[0] + len(added))) or added[0] <= max(base):
            raise CheckpointError(f"tokenizer: the {self.family.value} special tokens got ids {added[0]}..{added[-1]}, "
                                  "not new consecutive ids after Qwen2's")
        if self.family == Family.COSYVOICE3 and self.endofprompt_id != self.endoftext_id + 3:
            # upstream's CosyVoice3 LLM looks for <|endofprompt|> by its id (151646 = <|endoftext|> 151643 + 3)
            raise CheckpointError(f"tokenizer: <|endofprompt|> is id {self.endofprompt_id}, not <|endoftext|> + 3 = "
                                  f"{self.endoftext_id + 3} as CosyVoice3 needs: the tokenizer folder holds extra "
                                  "special tokens")
        if self.encode("") or set(self.encode("a")) & set(ids):
            raise CheckpointError("tokenizer adds BOS/EOS tokens; CosyVoice expects a Qwen2 tokenizer that adds none")
        for token, i in self.special_ids.items():
            if self.encode(token) != [i]:
                raise CheckpointError(f"tokenizer: special token {token} does not encode to its single id {i}")

    @classmethod
    def from_folder(cls, path: str | Path, family: Family = Family.COSYVOICE2) -> TextTokenizer:
        """Load `CosyVoice-BlankEN/` (or a random model's tokenizer folder) with the family's specials, without
        touching the network."""
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
        hf.add_special_tokens(specials | {"additional_special_tokens": list(added_special_tokens(family))})
        return cls(hf, family)

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
    """Token ids the LLM reads between sos and task_id for one target piece, and the length that sets its min/max
    speech tokens: `prompt_ids` ++ piece.

    The length is the target's own, except in CosyVoice3's cross-lingual and SFT modes, where upstream's system
    prompt is part of the target text (`"You are a helpful assistant.<|endofprompt|>" + text`) and counts.
    """
    text_ids = tokenizer.encode(text_piece)
    if not text_ids:
        raise InputError("text piece is empty")
    prefix = prompt_ids(mode, tokenizer, prompt_text, instruct_text, extended)
    counted = tokenizer.family == Family.COSYVOICE3 and Mode(mode) in (Mode.CROSS_LINGUAL, Mode.SFT)
    return prefix + text_ids, len(text_ids) + (len(prefix) if counted else 0)


def prompt_ids(
    mode: Mode | str, tokenizer: TextTokenizer, prompt_text: str = "", instruct_text: str = "", extended: bool = True
) -> list[int]:
    """The ids the LLM reads before the target text: `build_text_inputs`'s prefix, and the start of the text cache
    when the target text streams in."""
    return tokenizer.encode(prompt_text_for(mode, tokenizer.family, prompt_text, instruct_text, extended))


def prompt_text_for(mode: Mode | str, family: Family, prompt_text: str = "", instruct_text: str = "",
                    extended: bool = True) -> str:
    """The text before the target text, laid out as upstream's examples for the family (S = "You are a helpful
    assistant.", E = `<|endofprompt|>`):

    | mode          | CosyVoice2              | CosyVoice3                  |
    |---------------|-------------------------|-----------------------------|
    | zero-shot     | transcript              | S E transcript              |
    | cross-lingual | (nothing)               | S E                         |
    | instruct2     | instruction E           | S + " " + instruction E     |
    | SFT           | (nothing)               | S E                         |

    The transcript is normalised (CosyVoice3 upstream leaves it raw, as its prompt text holds `<|...|>`: so does
    `extended=False`); an instruction never is. Users type neither S nor E, but upstream's own spellings are
    accepted verbatim: a prompt text `system E transcript` (its system text replaces S) and an instruction ending in
    E (CosyVoice3: starting with S too). A CosyVoice3 instruction may be a preset's name (`instructions`).
    """
    mode, family = Mode(mode), Family(family)
    v3 = family == Family.COSYVOICE3
    if mode == Mode.ZERO_SHOT:
        no_transcript = InputError("zero-shot cloning needs the transcript of the prompt audio as prompt text "
                                   "(use cross-lingual mode when there is none)")
        if not prompt_text.strip():
            raise no_transcript
        system, transcript = _split_system(clean_text(prompt_text, "prompt text"), family, "prompt text")
        if not transcript.strip():
            raise no_transcript
        transcript = check_tags(transcript, family, "prompt text")
        if extended or (system is None and not v3):  # as upstream, which normalises no text holding <|...|>
            transcript = text_normalize(transcript, _no_split, split=False, extended=extended, family=family)
        if system is None:
            return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}" if v3 else transcript
        return f"{system}{ENDOFPROMPT}{transcript}"
    if mode == Mode.INSTRUCT2:
        if not instruct_text.strip():
            presets = f"a preset ({', '.join(INSTRUCTIONS_BY_NAME)}) or " if v3 else ""
            raise InputError(f'instruct2 mode needs an instruction: {presets}free text such as "speak happily"')
        system, rest = _split_system(clean_text(instruct_text, "instruction"), family, "instruction")
        if system is not None and rest.strip():
            raise InputError("an instruction ends at <|endofprompt|>; put the text to speak in the text, not after it")
        instruct = (rest if system is None else system).strip()
        if v3:
            instruct = resolve_instruction(instruct.removeprefix(SYSTEM_PROMPT).strip())
        if not instruct:
            raise InputError('the instruction is empty; write one, e.g. "speak happily"')
        instruct = check_tags(instruct, family, "instruction")
        return f"{SYSTEM_PROMPT} {instruct}{ENDOFPROMPT}" if v3 else f"{instruct}{ENDOFPROMPT}"
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}" if v3 else ""


def _split_system(text: str, family: Family, what: str) -> tuple[str | None, str]:
    """Upstream's spelling `system<|endofprompt|>rest` -> (system, rest); a text without `<|endofprompt|>` ->
    (None, text). Any other `<|...|>` is refused by `check_tags`."""
    if ENDOFPROMPT not in text:
        return None, text
    system, _, rest = text.partition(ENDOFPROMPT)
    return check_tags(system.strip(), family, what), rest


def _no_split(text: str) -> list[int]:
    """`text_normalize` measures pieces only when it splits; prompt texts are never split."""
    raise AssertionError("prompt texts are not split")
