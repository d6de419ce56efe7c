"""The LLM side of the engine: static KV cache, per-slot decode state on the device, batched decode + sampling.

Running requests always occupy KV slots `0..B-1` (a leaving request's slot is filled by moving the last one
in), so decode reads the cache as a view, never a gather. Everything a decode step needs per row (last token,
position, step, seed, min length, the repetition window) lives in one device tensor `state[slot]`, and its sampling
uniforms for every step in `uniforms[slot]` (written at prefill); a step reads and updates them in place, so the host
only names how many rows are live and reads back the new tokens (one sync per step). The whole step (embedding,
24 layers, head, masking, sampling, state update) is captured in one CUDA graph per (batch bucket, attention-length
bucket). The step holds kernels only, in one chain: such a graph launches in about 3 us of host time on the H200
whatever its length, while nodes of other kinds (cuDNN's attention, a sort's memory sets) make a launch cost grow with
the graph's length (1.2 ms for a step's ~360 nodes with both, 0.55 ms with the sort alone). So decode attention is
`fused.decode_attention` and the sampling one kernel, `fused.ras_sample` (no sort), and the step is bound by its GPU
time (0.91 ms at one row).
With `compile` (opt-in), the step is compiled by Inductor before capture, which fuses norms, rope and activations,
and traces as one graph (tests/test_engine.py), compiled at most six times whatever the buckets (batch 1, batch and
length below or at the cache's full extent). Start-up is its cost: on the H200 one slot compiles and captures its 4
graphs in 109 s (2.5 s uncompiled) for a first packet of 137 vs 146 ms, and 64 slots take minutes
(docs/benchmarks.md).
Newcomers are prefilled together: their prefixes packed into one sequence per forward (block-diagonal causal
mask), their state rows written with one copy. A lone newcomer (the case below full load) whose prefix fits
`PREFILL_BUCKETS` replays a captured forward instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from cosyvoice_opt.config import LLMConfig
from cosyvoice_opt.engine.graph_capture import capture
from cosyvoice_opt.engine.ladders import ladder, round_up
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.llm import SpeechLLM
from cosyvoice_opt.models.sampling import push_history, ras_sample, sampling_uniforms

log = logging.getLogger(__name__)

# columns of `state`
TOK, POS, STEP, SEED, MIN_LEN, FORCE, RECENT = range(7)

# Prefix tokens packed into one prefill forward. Its mask is quadratic in this (bf16 full model: 7 query heads per kv
# head x 2048^2 x 2 bytes = 59 MB) and attention also computes the masked-out blocks, so larger packs waste more
# than they save in launches.
PREFILL_TOKENS = 2048
# Streamed-text inputs (a 5-token text block, a final input) fed in one forward per bucket of these lengths: one
# forward of 64 rows costs about what one row's does (launch-bound), and a short block is not padded to a long final
# input. The first bucket (every text block) replays a captured forward per (batch bucket, attention-length bucket).
EXTEND_BUCKETS = [8, 32, 128]
# A lone newcomer's prefix replays a captured forward per length bucket, fed as an extend of its empty slot with the
# rows padded by repeating the last input (`SpeechLLM.padded_rows`: the padding writes the last position's keys and
# values again). Eager, one 200-token prefill launches ~500 kernels and 97 cuBLAS calls: 21 ms of host time on the
# H200 (41 ms beside the vocoder thread) for about 1 ms of GPU time, on every new request's way to its first audio.
PREFILL_BUCKETS = [64, 128, 192, 256, 320, 384, 448, 512]


def _pack(lengths: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `lengths` grouped so each group sums to at most `limit` (a longer one goes alone)."""
    groups, total = [], 0
    for i, length in enumerate(lengths):
        if not groups or total + length > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += length
    return groups


class LLMRunner:
    """Owns the KV cache and the decode graphs. Used only from the engine thread."""

    def __init__(
        self, llm: SpeechLLM, num_slots: int, max_seq: int, dtype: torch.dtype, device: torch.device,
        cuda_graphs: bool, compile: bool = False,
    ) -> None:
        self.llm = llm
        self.cfg: LLMConfig = llm.cfg
        self.device = device
        self.dtype = dtype
        self.max_seq = max_seq
        self.use_graphs = cuda_graphs and device.type == "cuda"
        compiled = compile and self.use_graphs
        self._step = torch.compile(self._decode_rows, dynamic=True) if compiled else self._decode_rows
        self.win = self.cfg.sampling.win_size
        self._stop_ids = torch.tensor(self.cfg.stop_token_ids, device=device)
        self.kv_buckets = ladder(max_seq, min(256, max_seq))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._extend_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.prefill_buckets = [t for t in PREFILL_BUCKETS if t <= max_seq]
        self._pool = None
        # one stream for every warm-up and capture: blocks freed on a stream are reused only on that stream, so the
        # graphs share their pool (largest first), and a fresh stream from PyTorch's small pool could be another
        # thread's (the vocoder's), whose work would then be recorded into a decode graph
        self._capture_stream = torch.cuda.Stream(device) if self.use_graphs else None
        self._n_live = torch.zeros((), dtype=torch.long, device=device)
        self._parked = torch.zeros(0, dtype=torch.bool, device=device)  # rows that hold a slot but do not decode
        self._any_parked = False
        self.cache: KVCache | None = None
        self.state = torch.empty(0, RECENT + self.win, dtype=torch.long, device=device)
        self.uniforms = torch.empty(0, max_seq, 2, device=device)
        self.resize(num_slots)

    @staticmethod
    def bytes_per_slot(cfg: LLMConfig, max_seq: int, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_slot(cfg.qwen2, max_seq, dtype)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    def resize(self, num_slots: int) -> None:
        """(Re)allocate cache and state for `num_slots`, keeping the live contents; recaptures graphs."""
        old_cache, old_state, old_uniforms = self.cache, self.state, self.uniforms
        self._graphs.clear()
        self._extend_graphs.clear()
        self._prefill_graphs.clear()
        self._pool = None  # graphs of the old cache are gone; capture into a fresh private pool
        self.cache = None
        cache = KVCache(self.cfg.qwen2, num_slots, self.max_seq, self.dtype, self.device)
        state = torch.zeros(num_slots, RECENT + self.win, dtype=torch.long, device=self.device)
        uniforms = torch.zeros(num_slots, self.max_seq, 2, device=self.device)
        self._parked, self._any_parked = torch.zeros(num_slots, dtype=torch.bool, device=self.device), False
        if old_cache is not None:
            n = min(old_cache.num_slots, num_slots)
            cache.data[:, :, :n].copy_(old_cache.data[:, :, :n])
            state[:n].copy_(old_state[:n])
            uniforms[:n].copy_(old_uniforms[:n])
        del old_cache
        self.cache, self.state, self.uniforms = cache, state, uniforms
        # the graphed extends' inputs (`_extend_rows`): rows padded to EXTEND_BUCKETS[0], positions, slots
        t, hidden = EXTEND_BUCKETS[0], self.cfg.qwen2.hidden_size
        self._ext_x = torch.zeros(num_slots, t, hidden, dtype=self.dtype, device=self.device)
        self._ext_index = torch.zeros(num_slots * (t + 1), dtype=torch.long, device=self.device)
        # the graphed prefills' inputs (`_prefill_one`): one row of the longest bucket, its positions, its slot
        longest = self.prefill_buckets[-1] if self.prefill_buckets else 0
        self._pre_x = torch.zeros(1, longest, hidden, dtype=self.dtype, device=self.device)
        self._pre_index = torch.zeros(longest + 1, dtype=torch.long, device=self.device)
        self.batch_buckets = ladder(num_slots)
        if self.use_graphs:
            self._capture_all()

    # ---- per-row math shared by prefill (eager) and decode (graph) ------------------------------------------
    def _sample_and_advance(self, logp: Tensor, state: Tensor, live: Tensor | None, uniforms: Tensor) -> Tensor:
        """Mask stop ids per row, sample with `uniforms [B, 2]`, write token/position/step/window back into `state`
        rows."""
        step = state[:, STEP]
        # forced rows (benchmarks) may not stop at all; others follow upstream (below min_len only the family's
        # `min_len_masked_ids`: CosyVoice2's eos, id 6561 in both families)
        force = state[:, FORCE].bool()[:, None]
        logp = logp.index_copy(1, self._stop_ids, logp[:, self._stop_ids].masked_fill(force, float("-inf")))
        tok = ras_sample(logp, uniforms, state[:, RECENT:], step < state[:, MIN_LEN], self.cfg.min_len_masked_ids,
                         self.cfg.sampling)
        new = torch.cat([tok[:, None], state[:, POS:STEP + 1] + 1, state[:, SEED:RECENT],
                         push_history(state[:, RECENT:], tok)], dim=1)
        if live is not None:
            new = torch.where(live[:, None], new, state)
        state.copy_(new)
        return tok

    def _decode_rows(self, b: int, kv_len: int) -> Tensor:
        state = self.state[:b]
        in_batch = torch.arange(b, device=self.device) < self._n_live
        live = in_batch & ~self._parked[:b]
        # a parked row writes at its next position, which its next input overwrites before anything reads it
        pos = torch.where(in_batch, state[:, POS], 0)
        logp = self.llm.decode(state[:, TOK], self.cache, None, pos, kv_len)
        step = state[:, STEP].clamp(max=self.max_seq - 1)[:, None, None].expand(-1, 1, 2)
        return self._sample_and_advance(logp, state, live, self.uniforms[:b].gather(1, step)[:, 0])

    # ---- public steps -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_many(
        self, slots: Sequence[int], lm_inputs: Sequence[Tensor], seeds: Sequence[int], min_lens: Sequence[int],
        forces: Sequence[bool],
    ) -> Tensor:
        """Prefixes `[1, L_i, H]` into `slots`, packed into as few forwards as `PREFILL_TOKENS` allows; samples each
        request's first token. Returns them as a device tensor `[n]` (no sync)."""
        lengths = [x.shape[1] for x in lm_inputs]
        logp = []
        for group in _pack(lengths, PREFILL_TOKENS):
            bucket = round_up(lengths[group[0]], self.prefill_buckets) if len(group) == 1 else None
            if bucket in self._prefill_graphs:
                logp.append(self._prefill_one(lm_inputs[group[0]].to(self.dtype), slots[group[0]], bucket))
            else:
                logp.append(self.llm.prefill(torch.cat([lm_inputs[i] for i in group], dim=1).to(self.dtype),
                                             self.cache, [slots[i] for i in group], [lengths[i] for i in group]))
        logp = torch.cat(logp)
        rows = torch.zeros(len(slots), RECENT + self.win, dtype=torch.long)
        rows[:, POS] = torch.tensor(lengths) - 1  # advanced to the length by the sampling step below
        rows[:, SEED] = torch.tensor(seeds)
        rows[:, MIN_LEN] = torch.tensor(min_lens)
        rows[:, FORCE] = torch.tensor(forces)
        rows[:, RECENT:] = -1
        rows = rows.to(self.device, non_blocking=True)  # a blocking host-to-device copy would wait for the GPU
        # every step's uniforms of the newcomers at once: decode then reads its row's pair (one gather) instead of
        # hashing (about 45 kernels of a step's ~600)
        table = sampling_uniforms(rows[:, SEED, None], torch.arange(self.max_seq, device=self.device)[None])
        index = torch.tensor(slots).to(self.device, non_blocking=True)
        self.uniforms.index_copy_(0, index, table)
        tokens = self._sample_and_advance(logp, rows, None, table[:, 0])
        self.state.index_copy_(0, index, rows)
        return tokens

    @torch.inference_mode()
    def extend_many(self, slots: Sequence[int], lm_inputs: Sequence[Tensor], starts: Sequence[int],
                    steps: Sequence[int], recent: Sequence[Sequence[int]], forces: Sequence[bool]) -> Tensor:
        """Inputs `[1, L_i, H]` fed into live slots after their first `starts[i]` positions (a streamed-text
        request's next text block or its final input), as one forward per length bucket (`EXTEND_BUCKETS`: rows
        are padded to the longest of theirs); samples each one's next token as its `steps[i]`-th (its uniform, seed
        kept) with `recent[i]` as the repetition window. The row's state is set from these host values, so a
        speculative step the row ran before does not count. Returns the tokens `[n]` on the device (no sync)."""
        groups: dict[int, list[int]] = {}
        for i, x in enumerate(lm_inputs):
            groups.setdefault(round_up(x.shape[1], EXTEND_BUCKETS) or x.shape[1], []).append(i)
        logp = torch.cat([self._extend_rows([lm_inputs[i].to(self.dtype) for i in group], [slots[i] for i in group],
                                            [starts[i] for i in group], t)
                          for t, group in groups.items()])
        if len(groups) > 1:  # back to the callers' order
            order = torch.tensor([i for group in groups.values() for i in group]).argsort()
            logp = logp[order.to(logp.device, non_blocking=True)]
        rows = torch.zeros(len(slots), RECENT + self.win, dtype=torch.long)
        rows[:, POS] = torch.tensor([s + x.shape[1] - 1 for s, x in zip(starts, lm_inputs, strict=True)])
        rows[:, STEP] = torch.tensor(steps)
        rows[:, FORCE] = torch.tensor(forces)
        windows = [list(r[-self.win:]) for r in recent]
        rows[:, RECENT:] = torch.tensor([[-1] * (self.win - len(w)) + w for w in windows])
        index = torch.tensor(slots).to(self.device, non_blocking=True)
        rows = rows.to(self.device, non_blocking=True)
        rows[:, SEED] = self.state.index_select(0, index)[:, SEED]
        step = rows[:, STEP].clamp(max=self.max_seq - 1)
        tokens = self._sample_and_advance(logp, rows, None, self.uniforms[index, step])
        self.state.index_copy_(0, index, rows)
        return tokens

    def _extend_rows(self, inputs: list[Tensor], slots: list[int], starts: list[int], t: int) -> Tensor:
        """`SpeechLLM.extend_rows`, from a captured graph when the rows are of the first bucket's length and one was
        captured for their shape (the rows padded to its batch bucket: `SpeechLLM.padded_rows`)."""
        n = len(inputs)
        b = round_up(n, self.batch_buckets)
        s = round_up(max(st + x.shape[1] for st, x in zip(starts, inputs, strict=True)), self.kv_buckets)
        graph = self._extend_graphs.get((b, s)) if t == EXTEND_BUCKETS[0] else None
        if graph is None:
            return self.llm.extend_rows(inputs, self.cache, slots, starts)
        x, index = self.llm.padded_rows(inputs, slots, starts, t, b)
        self._ext_x[:b].copy_(x)
        self._ext_index[: index.numel()].copy_(index, non_blocking=True)
        graph[0].replay()
        return graph[1][:n]

    def _prefill_one(self, x: Tensor, slot: int, t: int) -> Tensor:
        """One prefix `[1, L, H]` into `slot` by the captured forward of its length bucket `t` -> log-probs
        `[1, V]` (the graph's output: read before the next replay)."""
        padded, index = self.llm.padded_rows([x], [slot], [0], t, 1)
        self._pre_x[:, :t].copy_(padded)
        self._pre_index[: t + 1].copy_(index, non_blocking=True)
        graph, out = self._prefill_graphs[t]
        graph.replay()
        return out

    def _prefill_graph_inputs(self, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """Views of the graphed prefills' inputs for a bucket of `t`: x [1, t, H], positions [1, t], slot [1]."""
        return self._pre_x[:, :t], self._pre_index[:t].view(1, t), self._pre_index[t : t + 1]


    def _extend_graph_inputs(self, b: int) -> tuple[Tensor, Tensor, Tensor]:
        """Views of the graphed extends' inputs for `b` rows: x [b, t, H], positions [b, t], slots [b]."""
        t = EXTEND_BUCKETS[0]
        return self._ext_x[:b], self._ext_index[: b * t].view(b, t), self._ext_index[b * t : b * (t + 1)]

    def _rows_step(self, inputs: tuple[Tensor, Tensor, Tensor], s: int) -> Tensor:
        """The graphed forward of extends and prefills: rows `inputs` (x, positions, slots) attending to `s`
        positions -> the log-probs of each row's last column."""
        x, positions, slots = inputs
        return self.llm.log_probs(self.llm.backbone.extend_rows(x, self.cache, slots, positions, s)[:, -1])

    def _capture_rows(self, stream: torch.cuda.Stream, inputs: tuple[Tensor, Tensor, Tensor],
                      s: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """`_rows_step` warmed up once on the capture stream, then captured into the shared pool."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._rows_step(inputs, s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self._pool, stream):
            out = self._rows_step(inputs, s)
        return graph, out

    @torch.inference_mode()
    def decode(self, n_live: int, kv_needed: int, parked: Sequence[bool] = ()) -> Tensor:
        """One step for rows `0..n_live-1` whose longest sequence needs `kv_needed` positions -> tokens `[n_live]`
        on the device. Rows marked in `parked` keep their state and their tokens mean nothing."""
        if any(parked) or self._any_parked:
            self._parked.zero_()
            self._parked[:len(parked)].copy_(torch.tensor(parked), non_blocking=True)
            self._any_parked = any(parked)
        if not self.use_graphs:
            self._n_live.fill_(n_live)
            return self._step(n_live, kv_needed)
        b = round_up(n_live, self.batch_buckets)
        s = round_up(kv_needed, self.kv_buckets)
        self._n_live.fill_(n_live)
        if (b, s) not in self._graphs:  # a capture failed (see `_capture_all`): correct, only slower
            return self._step(b, s)[:n_live]
        graph, out = self._graphs[(b, s)]
        graph.replay()
        return out[:n_live]

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Relocate a live request from slot `src` to `dst` (keeps live rows contiguous)."""
        self.cache.copy_slot(src, dst, length)
        self.state[dst].copy_(self.state[src])
        self.uniforms[dst].copy_(self.uniforms[src])

    def _warm_step(self, b: int, s: int) -> None:
        """One uncaptured step; if compiling it fails (no Triton, no C compiler for its launcher), the runner goes on
        with the uncompiled step: slower, same result."""
        if self._step == self._decode_rows:
            self._decode_rows(b, s)
            return
        try:
            self._step(b, s)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run uncompiled
            log.warning("torch.compile of the decode step failed (%s: %s); decoding uncompiled", type(e).__name__, e)
            self._step = self._decode_rows
            self._decode_rows(b, s)

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        # stream syncs only, and thread-local capture: the vocoder thread keeps running (and capturing) flow work
        torch.cuda.current_stream(self.device).synchronize()
        stream = self._capture_stream
        with torch.inference_mode():  # no cuDNN attention: its kernels make every launch of a graph slow (backends.py)
            saved = self.state.clone()
            for b in reversed(self.batch_buckets):  # largest first: the shared pool fits the smaller ones
                for s in reversed(self.kv_buckets):
                    self._n_live.fill_(b)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm up (and compile) outside the graph
                            self._warm_step(b, s)
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    self.state.copy_(saved)  # the warm-up advanced every row
                    graph = torch.cuda.CUDAGraph()
                    with capture(graph, self._pool, stream):
                        out = self._step(b, s)
                    self._graphs[(b, s)] = (graph, out)
            self.state.copy_(saved)
            self._capture_extends(stream)
            self._capture_prefills(stream)
        torch.cuda.current_stream(self.device).synchronize()
        log.info("captured %d decode, %d extend and %d prefill graphs (batch %s x kv %s; prefixes %s) in %.2f s",
                 len(self._graphs), len(self._extend_graphs), len(self._prefill_graphs), self.batch_buckets,
                 self.kv_buckets, self.prefill_buckets, time.perf_counter() - t0)

    def _capture_prefills(self, stream: torch.cuda.Stream) -> None:
        """The graphed prefills, one per length bucket. Their warm-up writes slot 0's keys and values at its next
        position, as an extend's does (a running request's next input overwrites it; a free slot holds nothing)."""
        for t in reversed(self.prefill_buckets):
            inputs = x, positions, slots = self._prefill_graph_inputs(t)
            x.zero_()
            slots.zero_()
            positions.copy_(self.state[:1, POS, None].clamp(max=self.max_seq - 1).expand(1, t))
            self._prefill_graphs[t] = self._capture_rows(stream, inputs, t)

    def _capture_extends(self, stream: torch.cuda.Stream) -> None:
        """The graphed extends, one per (batch, attention length) bucket. Their warm-up writes each row's keys and
        values at its slot's next position (a running request's next input overwrites it; a free slot holds
        nothing), as a decode step does."""
        t = EXTEND_BUCKETS[0]
        for b in reversed(self.batch_buckets):
            inputs = x, positions, slots = self._extend_graph_inputs(b)
            x.zero_()
            slots.copy_(torch.arange(b, device=self.device))
            positions.copy_(self.state[:b, POS, None].clamp(max=self.max_seq - 1).expand(b, t))
            for s in reversed(self.kv_buckets):
                self._extend_graphs[(b, s)] = self._capture_rows(stream, inputs, s)
