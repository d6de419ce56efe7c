"""CosyVoice3's streaming vocoder in the engine: the chunks of many `CausalHiFT` streams, batched by step and replayed
from CUDA graphs captured at start-up (`CausalHiFTGraphs`, through the machinery of `engine/hift_graphs.py`).

A `CausalHiFT.stream` call splits into its host part (`stream_step`: positions only), a fixed-shape part
(`stream_compute`: f0 in float64, the excitation from the carried float64 phase sum, the decode over the context
window) and the state update (`stream_advance`). Streams whose calls have equal steps (equal offsets into their mel
and excitation tails, whatever their absolute position) run `stream_compute` as one batch, each row in a graph row of
its own: the rows never mix (every conv, pad, STFT reflection and overlap-add is per row), so a padding row changes
no real row's samples. What depends on a stream's absolute position is gathered eagerly into the static inputs: its
mel tail and carried excitation, its phase sum, and its rows of the fixed noise (`noise_rows` of its own samples; or
its Gaussian draw with `fixed_noise` off). A graph captures all of f0, excitation and decode, so the audio is
`CausalHiFT.stream`'s (bit-equal on the CPU at one row; a batch may round its convolutions otherwise).

The set of steps (`causal_hift_shapes`) follows CosyVoice2's policy (`streaming.hift_shapes`): a stream is past its
first chunk's transient after one chunk (its first chunk has at least `decode_context_frames` + the 8 held-back
frames: 50 mel frames or more against 38), so every later non-final chunk is one of a few steps (the hops of 25, 50
and 100 tokens), captured at each row count of the ladder (powers of two up to the vocoder's batch size); a piece's
first chunk (one step per padded first hop), a piece that ends before it, and a final chunk (one step per remaining
token count) run one row at a time. A whole clip has any length: its steps outside the set run eagerly, one stream
at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import Tensor

from cosyvoice_opt.engine.hift_graphs import VocoderGraphs
from cosyvoice_opt.engine.ladders import ladder, round_up
from cosyvoice_opt.engine.streaming import StreamConfig
from cosyvoice_opt.models.causal_hift import CausalHiFT, CausalHiFTStream, StreamStep

_POSITION = ("received", "mel_start", "source_start", "f0_frames", "emitted_frames")


class CausalHiFTGraphs(VocoderGraphs):
    """`CausalHiFT.stream_compute` of several streams' equal steps, a key per (rows, step)."""

    label = "the CausalHiFT graph for %d rows of %s"
    hift: CausalHiFT

    def _inputs(self, key: tuple[int, StreamStep]) -> dict[str, Tensor]:
        rows, step = key
        cfg, dim = self.hift.cfg, self.hift.m_source.dim
        inputs = {"mel": self._buffer("mel", (rows, cfg.in_channels, step.frames)),
                  "cycles": self._buffer("cycles", (rows, dim), torch.float64)}
        if step.tail:
            inputs["source"] = self._buffer("source", (rows, 1, step.tail * cfg.upsample_scale))
        if step.f0_new:
            inputs["noise"] = self._buffer("noise", (rows, step.f0_new * cfg.upsample_scale, dim))
        return inputs

    def _body(self, key: tuple[int, StreamStep], mel: Tensor, cycles: Tensor, source: Tensor | None = None,
              noise: Tensor | None = None) -> tuple[Tensor | None, ...]:
        return self.hift.stream_compute(key[1], mel, source, cycles, noise)


def causal_hift_shapes(hift: CausalHiFT, cfg: StreamConfig, max_rows: int) -> list[tuple[int, StreamStep]]:
    """Every (rows, step) of a streaming chunk's `CausalHiFT.stream` call under the schedule `cfg`, as
    `vocode_causal_chunks` runs them: the steps of non-final chunks after a stream's first, at each row count of
    `ladder(max_rows)`; those of first chunks, of pieces that end before their first chunk and of final
    chunks, at one row. Found by walking the schedule's chunk sizes over the stream positions they reach (positions
    equal up to where they start give equal steps, so the walk ends after a few chunks)."""
    la, ratio, hop = cfg.pre_lookahead_len, cfg.token_mel_ratio, cfg.token_hop_len
    hops = [hop]  # the first hop again: a streamed text's while its text arrives
    while hops[-1] < cfg.token_max_hop_len:
        hops.append(min(cfg.token_max_hop_len, hops[-1] * cfg.stream_scale_factor))
    fresh = hift.new_stream()
    single = {hift.stream_step(fresh, ratio * n, True) for n in range(1, 2 * hop - 1 + la)}  # short pieces
    batched: set[StreamStep] = set()
    frontier, seen = [], set()
    for pad in range(hop):  # a piece's first chunk: its hop plus the pad to the 25-token grid
        step = hift.stream_step(fresh, ratio * (hop + pad), False)
        single.add(step)
        frontier.append(_after(fresh, step))
    while frontier:
        state = frontier.pop()
        if _layout(state) in seen:
            continue
        seen.add(_layout(state))
        single.update(hift.stream_step(state, ratio * n, True) for n in range(la, cfg.token_max_hop_len + la))
        for n in hops:
            step = hift.stream_step(state, ratio * n, False)
            batched.add(step)
            frontier.append(_after(state, step))
    return ([(rows, step) for step in sorted(batched) for rows in ladder(max_rows)]
            + [(1, step) for step in sorted(single - batched)])


def _after(state: CausalHiFTStream, step: StreamStep) -> CausalHiFTStream:
    """The positions of `state` past `step` (no tensors: for walking the schedule)."""
    return dataclasses.replace(state, **dict(zip(_POSITION, step.after, strict=True)), finished=step.finalize)


def _layout(state: CausalHiFTStream) -> tuple:
    """The positions relative to the mel tail's start; two states of one layout make equal steps (past the start,
    where `stream_step`'s clamps at frame 0 no longer act, a state is its layout shifted)."""
    return (*(getattr(state, name) - state.mel_start for name in _POSITION), state.mel_start > 0)


def vocode_causal_chunks(hift: CausalHiFT, states: list[CausalHiFTStream], mels: list[Tensor], finals: list[bool],
                         graphs: CausalHiFTGraphs | None = None, max_rows: int = 64) -> list[Tensor]:
    """`CausalHiFT.stream(state, mel, final)` for each stream ([1,80,T_i] new frames each): streams whose steps are
    equal run as one batch through `graphs` when the step is in its set (at most as many rows as the step takes and
    `max_rows`, padded to a row count of its ladder), else each alone and eagerly. The states change only once every
    batch ran (a Gaussian noise generator is wound back otherwise), so a failed call (out of memory) can be retried
    from the same states. Returns each stream's new samples [1,L_i] in input order."""
    steps = [hift.stream_step(state, mel.shape[-1], final) for state, mel, final in zip(states, mels, finals,
                                                                                         strict=True)]
    generators = [state.generator for state in states if state.generator is not None]
    drawn = [g.get_state() for g in generators]
    try:
        inputs = [hift.stream_mel(state, mel) for state, mel in zip(states, mels, strict=True)]
        groups: dict[StreamStep, list[int]] = {}
        for i, step in enumerate(steps):
            groups.setdefault(step, []).append(i)
        results: dict[int, tuple[Tensor | None, ...]] = {}
        for step, members in groups.items():
            rows = graphs.rows_per_call(step) if graphs is not None else None
            size = min(rows, max_rows) if rows else 1
            for start in range(0, len(members), size):
                idx = members[start:start + size]
                out = (_batch(hift, graphs, step, round_up(len(idx), ladder(rows)), [states[i] for i in idx],
                              [steps[i] for i in idx], [inputs[i] for i in idx]) if rows else
                       _alone(hift, states[idx[0]], steps[idx[0]], inputs[idx[0]]))
                for row, i in enumerate(idx):
                    results[i] = tuple(None if t is None else t[row:row + 1] for t in out)
    except BaseException:
        for g, state in zip(generators, drawn, strict=True):
            g.set_state(state)
        raise
    waves = []
    for i, (wave, source, cycles) in sorted(results.items()):
        hift.stream_advance(states[i], steps[i], inputs[i], source, cycles)
        waves.append(wave)
    return waves


def _noise(hift: CausalHiFT, state: CausalHiFTStream, step: StreamStep, ref: Tensor) -> Tensor | None:
    """A stream's noise for `step`'s new frames: its own rows of the fixed noise, or its own Gaussian draw."""
    if not step.f0_new:
        return None
    return hift.m_source.noise(1, step.noise_from, step.f0_new, state.generator, ref.device, ref.dtype)


def _alone(hift: CausalHiFT, state: CausalHiFTStream, step: StreamStep, mel: Tensor) -> tuple[Tensor | None, ...]:
    """One stream's step eagerly, exactly as `CausalHiFT.stream`."""
    return hift.stream_compute(step, mel, state.source, state.cycles, _noise(hift, state, step, mel))


def _batch(hift: CausalHiFT, graphs: CausalHiFTGraphs, step: StreamStep, rows: int, states: list[CausalHiFTStream],
           steps: list[StreamStep], mels: list[Tensor]) -> tuple[Tensor | None, ...]:
    """Several streams' equal `step` through its graph of `rows` rows, the rows past theirs zeros."""
    noises = [_noise(hift, state, own, mel) for state, own, mel in zip(states, steps, mels, strict=True)]

    def write(inputs: dict[str, Tensor]) -> None:
        _fill(inputs["mel"], mels)
        _fill(inputs["cycles"], [state.cycles if state.cycles is not None else
                                 inputs["cycles"].new_zeros(1, inputs["cycles"].shape[1]) for state in states])
        if step.tail:
            _fill(inputs["source"], [state.source for state in states])
        if step.f0_new:
            _fill(inputs["noise"], noises)

    return graphs.call((rows, step), write)


def _fill(buffer: Tensor, rows: Iterable[Tensor]) -> None:
    """Write `rows` ([1,...] each) into the first rows of `buffer` and zeros into the rest (one kernel)."""
    rows = [row.to(buffer.dtype) for row in rows]
    pad = buffer.shape[0] - len(rows)
    if pad:
        rows.append(buffer.new_zeros(pad, *buffer.shape[1:]))
    torch.cat(rows, out=buffer)
