"""Bidirectional streaming (upstream `Qwen2LM.inference_bistream`): text arrives in pieces while speech comes out.

The LLM input interleaves blocks of `mix_ratio = (5, 15)`: `sos, [5 text, 15 prompt speech]..., 5 text, 15 generated
speech, fill, 5 text, 15 speech, fill, ..., remaining text, task_id, speech until eos` (the layout CosyVoice2 was
trained on). The fill token (6563) is forced after every 15 generated speech tokens and means "feed me 5 more text
tokens"; it is never emitted as speech.

`BistreamPlan` is the control flow alone, over token ids: what to feed next and what a sampled token means. Both
drivers use it: `bistream_calls` here (one request, its own KV cache: the reference and the parity test) and the
engine's scheduler (many requests in continuous batching).

Upstream quirks, reproduced by default (`BistreamFixes()`), each with an opt-in fix:

* `no_refeed`: a text-phase decode cycle ends on a fill and leaves `lm_input` as it was, so the first final-phase
  forward feeds the last speech embedding a second time (it sits in the KV cache twice). The fix feeds only the
  remaining text and task_id, as in training.
* `every_text_block`: at most one 5-token text block (one decode cycle) is consumed per arriving item; further
  cached text waits for the next item or the end of the text, where all of it is fed at once. Upstream's own
  frontend yields one token per item, so there the cache stays below 5; callers that push several tokens per item
  (or a client that sends fast) lose the interleaving. The fix starts another cycle while 5 text tokens are cached.
* `full_block_fill`: the first forced fill comes at `(floor(P/15) + 1) * 15 - P`, which for a prompt of a positive
  multiple of 15 speech tokens is 15, although the last prompt block is already full; training puts the fill first
  (index 0). The fix forces the fill at the first forward.
* `keep_prompt_speech`: text that ends before all prompt speech is interleaved drops the remaining prompt speech
  tokens from the final input. The fix appends them after task_id, as in training (`remaining text, task_id,
  remaining speech`).

Not quirks but rules: in the text phase upstream samples with eos masked, accepts a sampled fill (it ends the cycle
and restarts the 16-step fill schedule) and raises `ValueError` on another stop id; in the final phase it samples
until eos (no length limit) and raises on any other stop id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyvoice_opt.config import LLMConfig
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.llm import SpeechLLM

SOS, TASK, TEXT, SPEECH = "sos", "task_id", "text", "speech"
Segment = tuple[str, tuple[int, ...]]  # (kind, ids): ids are empty for sos / task_id


@dataclass(frozen=True)
class BistreamFixes:
    """Which upstream quirks to fix (module docstring); all False is upstream's behaviour."""

    no_refeed: bool = False
    every_text_block: bool = False
    full_block_fill: bool = False
    keep_prompt_speech: bool = False


UPSTREAM = BistreamFixes()

class BistreamPlan:
    """Upstream's bistream control flow over ids, with no model: `push` an arriving text item, then while `input()`
    is not None, run the model on it and `accept` the token (`forced()` first: when it is not None the token is
    that, not sampled); at the end of the text `finish()` and go on the same way until `done`.

    `out` is upstream's `out_tokens` (speech ids, every fill and the final eos); `phase` is "text" (sample with eos
    masked) or "final" (eos allowed).
    """

    def __init__(self, cfg: LLMConfig, prompt_text: Sequence[int] = (), prompt_speech: Sequence[int] = (),
                 fixes: BistreamFixes = UPSTREAM) -> None:
        self.n_text, self.n_speech = cfg.mix_ratio
        self.fill, self.eos, self.n_ids = cfg.fill_token, cfg.eos_token, cfg.speech_token_size
        self.fixes = fixes
        self.text = list(prompt_text)  # upstream's text_cache: prompt text first
        self.pending = list(prompt_speech)  # prompt speech not yet interleaved
        p = len(self.pending)
        self.next_fill = 0 if fixes.full_block_fill and p and p % self.n_speech == 0 \
            else (p // self.n_speech + 1) * self.n_speech - p
        self.x: list[Segment] = [(SOS, ())]  # upstream's lm_input
        self.fed = False  # x has been run through the model already
        self.decoding = False  # inside a decode cycle (or the final phase)
        self.phase = "text"
        self.out: list[int] = []

    @property
    def done(self) -> bool:
        return self.phase == "done"

    def input(self) -> list[Segment] | None:
        """What the next forward feeds, or None while waiting for text (or when done)."""
        return self.x if self.decoding and not self.fed else None

    def push(self, ids: Sequence[int]) -> None:
        """One arriving text item (upstream: one generator item, one token from its frontend)."""
        if self.phase != "text":
            raise RuntimeError("text pushed after the end of the text")
        self.text += ids
        while self.pending and len(self.text) >= self.n_text:
            self.x = self.x + [(TEXT, tuple(self.text[:self.n_text])), (SPEECH, tuple(self.pending[:self.n_speech]))]
            del self.text[:self.n_text], self.pending[:self.n_speech]
        if not self.pending and not self.decoding:
            self._start_cycle()

    def _start_cycle(self) -> None:
        after_fill = bool(self.out) and self.out[-1] == self.fill
        if after_fill or (not self.out and len(self.x) == 1):
            if len(self.text) < self.n_text:
                return  # wait for more text
            block = (TEXT, tuple(self.text[:self.n_text]))
            del self.text[:self.n_text]
            self.x = [block] if after_fill else self.x + [block]
            self.fed = False
        self.decoding = True

    def forced(self) -> int | None:
        """The fill token when the next output index is the forced fill's, else None (sample)."""
        return self.fill if self.phase == "text" and len(self.out) == self.next_fill else None

    def accept(self, token: int) -> bool:
        """The token of the forward just run on `input()`; True when it is speech (emitted and fed back next)."""
        self.fed = True
        if self.phase == "text" and token == self.fill:
            self.next_fill = len(self.out) + self.n_speech + 1
        self.out.append(token)
        if token >= self.n_ids:
            if self.phase == "text" and token == self.fill:
                self.decoding = False
                if self.fixes.every_text_block:
                    self._start_cycle()
                return False
            if self.phase == "final" and token == self.eos:
                self.decoding, self.phase = False, "done"
                return False
            raise ValueError(f"should not get token {token} in the {self.phase} phase")
        self.x, self.fed = [(SPEECH, (token,))], False
        return True

    def finish(self) -> None:
        """The text has ended: feed the rest of it and task_id, then decode until eos."""
        if self.phase != "text":
            return
        x = [] if self.fixes.no_refeed and self.fed else self.x
        x = x + [(TEXT, tuple(self.text)), (TASK, ())]
        if self.fixes.keep_prompt_speech and self.pending:
            x.append((SPEECH, tuple(self.pending)))
        self.text, self.pending = [], []
        self.x = [s for s in x if s[1] or s[0] in (SOS, TASK)]
        self.fed, self.decoding, self.phase = False, True, "final"


def input_length(segments: Sequence[Segment]) -> int:
    """Positions a plan's input takes in the KV cache."""
    return sum(len(ids) or kind in (SOS, TASK) for kind, ids in segments)


def embed_segments(llm: SpeechLLM, segments: Sequence[Segment], device: torch.device | None = None) -> Tensor:
    """The embeddings `[1, n, H]` of a plan's input."""
    parts = []
    for kind, ids in segments:
        if kind in (SOS, TASK):
            parts.append(llm.special_embedding(llm.SOS if kind == SOS else llm.TASK_ID))
        else:
            t = torch.tensor(ids, dtype=torch.long, device=device or llm.speech_embedding.weight.device)
            parts.append((llm.embed_text(t) if kind == TEXT else llm.embed_speech(t))[None])
    return torch.cat(parts, dim=1)


# (log-probs [V], out tokens so far, ignore_eos) -> id: upstream's `sampling_ids` signature
Sampler = Callable[[Tensor, list[int], bool], int]


@dataclass
class BistreamCall:
    """One forward of `bistream_calls`: its input and output, and what became of the token."""

    phase: str
    lm_input: Tensor  # [1, n_new, H]
    cache_len_before: int
    hidden: Tensor  # [H] last position, after the final norm
    logp: Tensor  # [V]
    token: int
    forced: bool
    emitted: bool


def _ids(item: Sequence[int] | Tensor) -> list[int]:
    return item.reshape(-1).tolist() if isinstance(item, Tensor) else [int(i) for i in item]


@torch.inference_mode()
def bistream_calls(llm: SpeechLLM, text: Iterable[Sequence[int] | Tensor], sample: Sampler,
                   prompt_text: Sequence[int] | Tensor = (), prompt_speech: Sequence[int] | Tensor = (),
                   fixes: BistreamFixes = UPSTREAM, max_seq: int = 4096) -> Iterator[BistreamCall]:
    """Upstream's `inference_bistream` on one request: every forward, as it happens. `text` yields token-id items
    (upstream's frontend yields one id per item); `max_seq` bounds the KV cache (ValueError beyond it)."""
    weight = llm.speech_embedding.weight
    plan = BistreamPlan(llm.cfg, _ids(prompt_text), _ids(prompt_speech), fixes)
    cache = KVCache(llm.cfg.qwen2, 1, max_seq, weight.dtype, weight.device)
    length = 0

    def run() -> Iterator[BistreamCall]:
        nonlocal length
        while (segments := plan.input()) is not None:
            x = embed_segments(llm, segments)
            hidden, logp = llm.extend(x, cache, 0, length)
            forced = plan.forced()
            token = forced if forced is not None else int(sample(logp, plan.out, plan.phase == "text"))
            phase = plan.phase
            emitted = plan.accept(token)
            yield BistreamCall(phase, x, length, hidden, logp, token, forced is not None, emitted)
            length += x.shape[1]

    for item in text:
        plan.push(_ids(item))
        yield from run()
    plan.finish()
    yield from run()


def inference_bistream(llm: SpeechLLM, text: Iterable[Sequence[int] | Tensor], sample: Sampler,
                       prompt_text: Sequence[int] | Tensor = (), prompt_speech: Sequence[int] | Tensor = (),
                       fixes: BistreamFixes = UPSTREAM, max_seq: int = 4096) -> Iterator[int]:
    """The speech tokens, as upstream's generator yields them."""
    for call in bistream_calls(llm, text, sample, prompt_text, prompt_speech, fixes, max_seq):
        if call.emitted:
            yield call.token
