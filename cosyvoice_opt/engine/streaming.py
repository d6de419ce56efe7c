"""Streaming token -> waveform pieces of upstream `CosyVoice2Model.tts` (reference §9.2), per request and pure.

* `HopSchedule`: which flow calls a request makes as its tokens arrive (first hop padded so prompt + hop ends
  on a 25-token chunk boundary, hops doubling up to 100, 3 look-ahead tokens). Unlike upstream, the hop lives
  in the request, so concurrent and later requests all start at 25.
* `HiftStreamState` + `vocode_chunks`: HiFT over each chunk's new mel with the previous chunk's 8 mel frames
  prepended, its last 3840 excitation samples reused and its last 3840 output samples cross-faded (Hamming).
  Output equals upstream's yielded chunks; several requests' chunks of equal shape share one HiFT batch. Every
  streaming chunk's shape has a CUDA graph (`HiftGraphs`, shapes from `hift_shapes`); whole clips run eagerly
  unless one is as short as a piece's first chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_opt.engine.hift_graphs import HiftGraphs
from cosyvoice_opt.engine.ladders import ladder
from cosyvoice_opt.models.hift import HiFT


@dataclass(frozen=True)
class StreamConfig:
    """Upstream `CosyVoice2Model` streaming constants (names as in upstream / `model_tts_config.json`)."""

    token_hop_len: int = 25
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    pre_lookahead_len: int = 3
    token_mel_ratio: int = 2
    mel_cache_len: int = 8
    source_cache_len: int = 3840  # mel_cache_len * 480 samples

    @classmethod
    def from_upstream(cls, cfg: dict[str, Any]) -> StreamConfig:
        """From a dict with upstream's attribute names; missing ones keep the defaults."""
        return cls(**{f.name: int(cfg[f.name]) for f in fields(cls) if f.name in cfg})


@dataclass(frozen=True)
class FlowCall:
    """One flow call: run on `tokens[:n_tokens_in]`, keep mel frames from `mel_offset` on (the new ones)."""

    n_tokens_in: int
    token_offset: int
    mel_offset: int
    streaming: bool  # chunk-causal attention; the final call is full attention like upstream
    finalize: bool


class HopSchedule:
    """Per-request streaming flow-call schedule. Call `next_call` whenever tokens arrive (it returns each ready
    chunk once), and `final_call` when the LLM has finished and `next_call` returns None."""

    def __init__(self, prompt_len: int, cfg: StreamConfig = StreamConfig()):
        self.cfg = cfg
        self.hop = cfg.token_hop_len
        self.offset = 0
        self.pad = -prompt_len % cfg.token_hop_len  # ceil(P / hop) * hop - P

    @property
    def tokens_needed(self) -> int:
        """Speech tokens (excluding the prompt) that must exist before the next streaming call can run."""
        return self.offset + self._this_hop() + self.cfg.pre_lookahead_len

    def _this_hop(self) -> int:
        return self.hop + self.pad if self.offset == 0 else self.hop

    def _call(self, n_tokens_in: int, streaming: bool, finalize: bool) -> FlowCall:
        return FlowCall(n_tokens_in, self.offset, self.offset * self.cfg.token_mel_ratio, streaming, finalize)

    def next_call(self, n_available: int, grow: bool = True) -> FlowCall | None:
        """The next streaming call if `n_available` tokens suffice (then the schedule advances), else None. After it
        the hop grows as upstream's (25, 50, 100 tokens) unless `grow` is False: a streamed text keeps its hop while
        its text arrives (`AudioWorker`)."""
        n_in = self.tokens_needed
        if n_available < n_in:
            return None
        call = self._call(n_in, streaming=True, finalize=False)
        self.offset += self._this_hop()
        if grow:
            self.hop = min(self.cfg.token_max_hop_len, self.hop * self.cfg.stream_scale_factor)
        return call

    def final_call(self, n_total: int) -> FlowCall:
        """The last call: all `n_total` tokens, full attention, the remaining frames."""
        return self._call(n_total, streaming=False, finalize=True)


def stream_calls(prompt_len: int, n_tokens: int, cfg: StreamConfig = StreamConfig()) -> list[FlowCall]:
    """All flow calls of a streaming request whose `n_tokens` tokens are all available (upstream's order)."""
    schedule = HopSchedule(prompt_len, cfg)
    calls = []
    while (call := schedule.next_call(n_tokens)) is not None:
        calls.append(call)
    return calls + [schedule.final_call(n_tokens)]


def hift_shapes(cfg: StreamConfig, max_rows: int) -> list[tuple[int, int, int]]:
    """Every (rows, mel frames, cached excitation samples) shape of a streaming chunk's HiFT call, as `vocode_chunks`
    runs them. Later hops' chunks (the cached mel frames before them: 25 tokens while a streamed text's text
    arrives, then upstream's 50 and 100) run at every power-of-two row count; every other chunk runs one row at a
    time, since their frame counts are many: a piece's first chunk (its hop plus the pad to the 25-token grid, nothing
    cached) or a piece that ends before it (fewer tokens), and a final chunk after a cache (the last call's look-ahead
    tokens and up to a whole hop less one more)."""
    la, ratio = cfg.pre_lookahead_len, cfg.token_mel_ratio
    hops, hop = [cfg.token_hop_len], cfg.token_hop_len  # the first hop again: a streamed text's while text arrives
    while hop < cfg.token_max_hop_len:
        hop = min(cfg.token_max_hop_len, hop * cfg.stream_scale_factor)
        hops.append(hop)
    batched = [(rows, cfg.mel_cache_len + ratio * hop, cfg.source_cache_len) for hop in hops
               for rows in ladder(max_rows)]
    uncached = [(1, ratio * n, 0) for n in range(1, 2 * cfg.token_hop_len - 1 + la)]
    finals = [(1, cfg.mel_cache_len + ratio * n, cfg.source_cache_len) for n in range(la, cfg.token_max_hop_len + la)
              if n not in hops]
    return uncached + batched + finals


def change_speed(mel: Tensor, speed: float) -> Tensor:
    """Upstream's non-streaming speed change: linear time interpolation of the mel [B,80,T] to int(T / speed)."""
    if speed == 1.0:
        return mel
    return F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")


@functools.cache
def _fade_window(n: int, device: torch.device) -> Tensor:
    return torch.from_numpy(np.hamming(2 * n)).to(device)  # float64, symmetric, like upstream


def fade_in_out(speech: Tensor, prev_tail: Tensor) -> Tensor:
    """Cross-fade the first n samples of `speech` [B,L] with `prev_tail` [B,n] by a Hamming(2n) window; computed in
    float64 and rounded, as upstream's float32-tensor * float64-numpy product is."""
    n = prev_tail.shape[-1]
    w = _fade_window(n, speech.device)
    head = speech[..., :n].double() * w[:n] + prev_tail.double() * w[n:]
    return torch.cat([head.to(speech.dtype), speech[..., n:]], dim=-1)


@dataclass
class HiftStreamState:
    """One request's HiFT caches between streaming chunks ([1,...] tensors; None before the first chunk)."""

    cfg: StreamConfig = StreamConfig()
    mel: Tensor | None = None  # [1,80,mel_cache_len]: last mel frames, vocoded again with the next chunk
    source: Tensor | None = None  # [1,1,source_cache_len]: their excitation, reused so the phase is continuous
    speech: Tensor | None = None  # [1,source_cache_len]: their audio, held back and cross-faded into the next

    def prepare(self, mel_new: Tensor) -> tuple[Tensor, Tensor | None]:
        """HiFT inputs for a chunk of new frames [1,80,T]: (cached mel ++ mel_new, cached excitation or None)."""
        if self.mel is None:
            return mel_new, None
        return torch.cat([self.mel, mel_new.to(self.mel.dtype)], dim=2), self.source

    def finish(self, mel_in: Tensor, speech: Tensor, source: Tensor, final: bool) -> Tensor:
        """Given HiFT's output for `prepare`'s inputs: cross-fade, update the caches, return the audio [1,L'] to
        emit now. The final chunk returns everything and clears the state."""
        if self.speech is not None:
            speech = fade_in_out(speech, self.speech)
        if final:
            self.mel = self.source = self.speech = None
            return speech
        n = self.cfg.source_cache_len
        self.mel = mel_in[:, :, -self.cfg.mel_cache_len:].clone()
        self.source = source[:, :, -n:].clone()
        self.speech = speech[:, -n:].clone()
        return speech[:, :-n]


def vocode_chunks(
    hift: HiFT, states: list[HiftStreamState], mels: list[Tensor], finals: list[bool],
    generators: list[torch.Generator] | None = None, graphs: HiftGraphs | None = None, max_rows: int = 64,
) -> list[Tensor]:
    """Vocode one chunk of new mel frames [1,80,T_i] per request; chunks whose HiFT inputs have equal shapes run
    as one batch of at most `max_rows`. Each request draws its excitation noise from its own generator in
    `generators` (so its audio does not depend on the batch), or all from the global RNG with None. With generators,
    a batch is padded to a power-of-two row count with rows that are thrown away: the graphs exist for those counts,
    and cuDNN builds and caches its convolution plans per input shape (measured on the H200: 64 ms and 1.3 MB of host
    memory for each new HiFT shape), so the batch sizes it sees are kept to a few. With generators and `graphs`, a
    streaming chunk runs through `graphs` as many rows at once as its shape takes (`HiftGraphs.rows_per_call`: later
    hops batched, other chunks one row at a time, see `hift_shapes`); whole clips have any length and run eagerly (a
    shape of the set, such as a clip as short as a first chunk, goes through its graph like a chunk). The
    states change only after every batch ran, so a failed call (out of memory) can be retried from the same states.
    Returns each request's audio [1,L_i] (float, in input order); a first chunk without frames gives [1,0]."""
    inputs = [state.prepare(mel) for state, mel in zip(states, mels, strict=True)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (mel_in, cache) in enumerate(inputs):
        groups.setdefault((mel_in.shape[2], 0 if cache is None else cache.shape[2]), []).append(i)
    out: list[Tensor | None] = [None] * len(states)
    decoded: dict[int, tuple[Tensor, Tensor]] = {}
    for (frames, cached), members in groups.items():
        if frames == 0:  # a piece that ended before its first frame (nothing cached either)
            for i in members:
                out[i] = inputs[i][0].new_zeros(1, 0)
            continue
        rows = graphs.rows_per_call(frames, cached) if graphs is not None and generators is not None else None
        size = min(rows or max_rows, max_rows)
        for start in range(0, len(members), size):
            idx = members[start : start + size]
            speech, source = _vocode_batch(hift, [inputs[i] for i in idx],
                                           None if generators is None else [generators[i] for i in idx],
                                           graphs if rows else None)
            for row, i in enumerate(idx):
                decoded[i] = speech[row : row + 1], source[row : row + 1]
    for i, (speech, source) in decoded.items():
        out[i] = states[i].finish(inputs[i][0], speech, source, finals[i])
    return out


def _vocode_batch(hift: HiFT, inputs: list[tuple[Tensor, Tensor | None]], generators: list[torch.Generator] | None,
                  graphs: HiftGraphs | None) -> tuple[Tensor, Tensor]:
    """One HiFT call over equal-shape inputs (padded to a power-of-two row count with generators)."""
    mel_in = torch.cat([mel for mel, _ in inputs])
    cache = None if inputs[0][1] is None else torch.cat([c for _, c in inputs])
    rows, pad = generators, (1 << (len(inputs) - 1).bit_length()) - len(inputs)
    if rows is not None and pad:  # padding rows draw from a generator of their own
        mel_in = torch.cat([mel_in, mel_in.new_zeros(pad, *mel_in.shape[1:])])
        cache = None if cache is None else torch.cat([cache, cache.new_zeros(pad, *cache.shape[1:])])
        rows = rows + [torch.Generator(mel_in.device)] * pad
    return (graphs.inference if graphs is not None else hift.inference)(mel_in, cache, rows)


def vocode_chunk(
    hift: HiFT, state: HiftStreamState, mel_new: Tensor, final: bool, generator: torch.Generator | None = None
) -> Tensor:
    """`vocode_chunks` for one request: new mel [1,80,T] -> audio [1,L] to emit."""
    return vocode_chunks(hift, [state], [mel_new], [final], None if generator is None else [generator])[0]
