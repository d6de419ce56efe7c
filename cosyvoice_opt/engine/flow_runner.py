"""Flow chunks of many streams at once, from the page pool through CUDA graphs of fixed batch shapes: one for the
encoder (its history in `engine/encoder_cache.py`) and one for an Euler step of the CFM (10 estimator passes, ~10^4
kernels; its history in `engine/flow_cache.py`). Both families' flows run here: CosyVoice2's (conformer encoder,
U-Net estimator) and CosyVoice3's (token embedding and pre-lookahead layer, DiT estimator); what each caches is its
`CacheLayout` and `EncoderLayout`.

A batch is padded to a shape of a fixed ladder (rows: a power of two up to `max_rows`; new frames: 2, 4 or 6 pages;
history: 0, 2, 4, 6, 8, 12, 16, 24, ... pages up to the longest accepted piece, the powers of two and the rungs
halfway between them, since at many rows the history's attention and K/V are much of a call), and the graphs of
every shape of the ladder are captured at start-up (`capture_all`), so serving never captures: neither the encoder
nor the CFM launches a kernel of its own while serving, so a call of a few rows costs its graphs' replays and little
host time. What keeps new frames within 6 pages: a first chunk's prompt tokens are consumed before it as far as they
would not fit (`start_from_prefixes`, in pieces of at most 6 pages), later chunks hold at most 100 tokens, and a
final chunk at most the last hop and its look-ahead. A CFM graph is one Euler step, replayed once per step. The
graphs share one memory pool, which is safe because they run one at a time and their output is copied out before the
next run.
A prompt's whole 25-token chunks whose look-ahead is still prompt come out the same for every request with that prompt,
so they can be computed once, before the first chunk (`start_from_prefixes`, while the LLM makes the first chunk's
tokens), and cached per prompt (content hash): a fresh stream adopts the cached pages (shared, read-only: estimator and
encoder history) and conv states, and its first chunk computes only the rest. That pays for a voice that comes back (a
saved voice, a text's later pieces). A new voice's prompt goes along with its first chunk instead, when the two fit one
call's frames (prompts up to about 5 s): it costs no flow call of its own; of a longer one, only as many chunks as leave
the rest within that call are computed first, and cached.
Without CUDA (tests, CPU) the same code runs eagerly. The paged chunks equal `FlowBase.stream_chunks` (the eager,
list-of-tensors path) up to rounding, for either family: see tests/test_flow_runner.py.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cosyvoice_opt.engine.backends import cudnn_attention
from cosyvoice_opt.engine.counters import VocoderCounters
from cosyvoice_opt.engine.encoder_cache import EncoderLayout, EncoderPool, PagedEncoderCarry
from cosyvoice_opt.engine.flow_cache import CacheLayout, PagedBatch, PagedCarry, PagePool
from cosyvoice_opt.engine.graph_capture import GraphSet, capture
from cosyvoice_opt.engine.ladders import ladder, round_up
from cosyvoice_opt.models.flow import FlowBase, FlowStreamState

log = logging.getLogger(__name__)


FRAME_PAGES = (2, 4, 6)  # new frames of a chunk, in pages (see the module docstring)
# A prompt prefix is computed in pieces of at most this many pages: the ladder's most new frames, since each piece
# is a launch-bound flow call of about the same cost whatever its size.
PREFIX_PAGES = FRAME_PAGES[-1]
SEEN_PROMPTS = 1024  # prompt keys remembered to tell a repeated voice (worth a cached prefix) from a new one


def flow_prompt_key(tokens: Tensor, feat: Tensor, embedding: Tensor) -> bytes:
    """Content hash of a flow prompt: requests with equal prompts share its cached prefix."""
    h = hashlib.blake2b(digest_size=16)
    for t in (tokens, feat, embedding):
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{t.numel()};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass
class PagedStream:
    """A flow stream whose estimator history lives in the page pool."""

    state: FlowStreamState
    slot: int
    pages: list[int] = field(default_factory=list)
    key: bytes | None = None  # its prompt's `flow_prompt_key`
    first_new: int = 0  # speech tokens its first chunk brings (with what is left of the prompt)
    repeat: bool = False  # its prompt was seen before (`start_from_prefixes`)
    fresh: bool = True  # its prompt prefix is not resolved yet (`start_from_prefixes`)


@dataclass
class PrefixRide:
    """A new prompt's prefix computed as one more row of the caller's next `run` (`ride_along`)."""

    stream: PagedStream
    prompt: Tensor  # [1, P] the whole prompt
    tokens: int  # its first `tokens` make the prefix
    snapshot: tuple  # the stream's state before


@dataclass
class _Prefix:
    """A prompt's cached prefix: the flow state after its first `tokens` tokens."""

    tokens: int
    frames: int
    pages: list[int]  # one owner's share; adopting streams add theirs
    slot: int  # conv histories (a slot reserved for the cache)


class _CfmGraph:
    """Static inputs and index tensors of one bucket, and (on CUDA) its captured encoder and Euler step.

    One step is captured, not the whole CFM: the step index lives on the device (`PagedBatch.step`, advanced by the
    step itself), so ten replays of one graph make the CFM. A graph holds ~8 KB of host memory per kernel node, and a
    whole CFM is ~13k nodes (measured on the H200: 105-145 MB of RSS per bucket, so about 8 GB for a full LRU of 64);
    one step is a tenth of that (measured: 13-32 MB).
    The guided inputs (each row's conditioning, then a zero row) are the same at every step: `run` writes them once.
    The encoder graph reads the token ids and their real-mask from static inputs too (`encode`).
    """

    def __init__(self, flow: FlowBase, pool: PagePool, encoder_pool: EncoderPool, rows: int, frames: int,
                 hist_pages: int) -> None:
        self.flow, self.rows, self.frames = flow, rows, frames
        ref = flow.spk_embed_affine_layer.weight
        mels = flow.cfg.output_size
        ids = frames // flow.cfg.token_mel_ratio + flow.cfg.pre_lookahead_len
        self.ids = torch.zeros(rows, ids, dtype=torch.long, device=ref.device)
        self.real = torch.ones(rows, ids, dtype=torch.bool, device=ref.device)
        self.x = ref.new_zeros(rows, mels, frames)
        # (mu, spks, cond) as `CausalCFM.guided_inputs`: conditional rows at even indices, the odd ones stay zero
        self.inputs = flow.decoder.guided_inputs(ref.new_zeros(rows, mels, frames), ref.new_zeros(rows, mels),
                                                 ref.new_zeros(rows, mels, frames))
        self.grid = torch.tensor(flow.decoder.steps, dtype=torch.float32, device=ref.device)  # (t, dt) per step
        self.batch = PagedBatch(rows, frames, hist_pages, pool.page, ref.device)
        self.carry = PagedCarry(pool, self.batch)
        self.encoder_carry = PagedEncoderCarry(encoder_pool, self.batch)
        self.mu = ref.new_zeros(rows, mels, frames)  # the encoder's output (the graph's own tensor once captured)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.encoder_graph: torch.cuda.CUDAGraph | None = None

    def encoder_pass(self) -> None:
        """The encoder over the static ids of every row (their history in the encoder pool) -> `mu`."""
        self.mu = self.flow.encode(self.ids, self.real, True, self.encoder_carry)

    def step(self) -> None:
        """Euler step `batch.step` of every row, in place (x += dt · guided velocity; the product is rounded once,
        as `CausalCFM.solve` rounds it). t stays float32 in any model dtype, as `CausalCFM.solve` passes it."""
        decoder, x = self.flow.decoder, self.x
        t, dt = self.grid[self.batch.step][0].unbind()
        v = decoder.velocity(x, t.expand(2 * self.rows), self.inputs, True, carry=self.carry)
        x.add_((dt * v.float()).to(x.dtype))
        self.batch.step.add_(1)

    def capture(self, mempool, side: torch.cuda.Stream) -> None:
        """Warm up and capture on `side` (this runner's own stream: the LLM thread may capture at the same time)."""
        device = self.x.device
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph (padding rows: trash writes only)
            self.encoder_pass()
        encoder, graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # CosyVoice2's encoder attention has a full score bias (relative positions): the backends that run it eagerly
        with capture(encoder, mempool, side):  # the LLM thread keeps launching its own work meanwhile
            self.encoder_pass()
        with cudnn_attention():  # the estimator's masked attention at fixed shapes: see engine/backends.py
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(device).wait_stream(side)
            with capture(graph, mempool, side):
                self.step()
        self.encoder_graph, self.graph = encoder, graph  # only once both captured: else this shape stays eager

    def encode(self, ids: Tensor, real: Tensor | None) -> Tensor:
        """The encoder over ids [B,width] (`real`: the ids that exist, None = all), after `batch.load` -> mu
        [B,80,frames of width - look-ahead], valid until this graph runs again."""
        b, width = ids.shape
        self.ids.zero_()
        self.ids[:b, :width].copy_(ids)
        self.real.fill_(True)  # padding rows: every position real (finite, and written to the trash)
        self.real[:b, width:].fill_(False)
        if real is not None:
            self.real[:b, :width].copy_(real)
        if self.encoder_graph is None:
            self.encoder_pass()
        else:
            self.encoder_graph.replay()
        la = self.flow.cfg.pre_lookahead_len
        return self.mu[:b, :, : (width - la) * self.flow.cfg.token_mel_ratio]

    def run(self, z: Tensor, mu: Tensor, cond: Tensor, spks: Tensor) -> Tensor:
        """The CFM from noise `z` for the batch's real rows (after `encode`: the Euler step starts at 0); the result
        stays valid until this graph runs again."""
        b = mu.shape[0]
        self.x.zero_()
        self.x[:b, :, : z.shape[-1]].copy_(z)
        for dst, src in zip(self.inputs, (mu, spks, cond), strict=True):
            dst.zero_()
            dst[0 : 2 * b : 2, ..., : src.shape[-1]].copy_(src)
        for _ in range(len(self.grid)):
            if self.graph is None:
                self.step()
            else:
                self.graph.replay()
        return self.x


class FlowRunner:
    """Owns the page pool and the CFM graphs; used only from the vocoder thread."""

    def __init__(self, flow: FlowBase, pages: int, slots: int, cuda_graphs: bool, max_rows: int = 64,
                 max_tokens: int = 2048, max_prefixes: int = 32, counters: VocoderCounters | None = None) -> None:
        """`max_tokens`: the longest piece, prompt included, that a stream can hold (sets the history ladder)."""
        self.flow = flow
        self.counters = counters or VocoderCounters()
        ref = flow.spk_embed_affine_layer.weight
        self.device = ref.device
        est = flow.decoder.estimator
        if est.chunk != flow.chunk_tokens * flow.cfg.token_mel_ratio:
            raise ValueError("paged flow needs the estimator chunk to be the flow's streaming chunk in frames")
        self.max_prefixes = max_prefixes
        self.pool = PagePool(CacheLayout.of(est), len(flow.decoder.steps), pages, slots + max_prefixes, ref.dtype,
                             self.device)
        self.encoder_pool = EncoderPool(EncoderLayout.of(flow), pages, slots + max_prefixes, ref.dtype, self.device)
        self._prefix_slots = [self.pool.take_slot() for _ in range(max_prefixes)]  # streams never take these
        self._prefixes: OrderedDict[bytes, _Prefix] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # recent prompt keys, oldest first
        self.prefix_hits = 0
        self.max_rows = max_rows
        self.row_ladder = ladder(max_rows)
        self.hist_ladder = [0, *ladder(max(2, self.pages_for_tokens(max_tokens)), 2, halves=True)]
        self.graphs: GraphSet[_CfmGraph] = GraphSet(
            "the flow graph for %d rows x %d frames after %d history pages", self.device,
            cuda_graphs and self.device.type == "cuda")

    @staticmethod
    def bytes_per_page(flow: FlowBase, dtype: torch.dtype) -> int:
        """Estimator and encoder history of one page (the conv slots are per stream, not per page)."""
        return (CacheLayout.of(flow.decoder.estimator).bytes_per_page(len(flow.decoder.steps), dtype)
                + EncoderLayout.of(flow).bytes_per_page(dtype))

    # ---- streams -------------------------------------------------------------------------------------------
    def open(self, state: FlowStreamState, key: bytes | None = None, first_new: int = 0) -> PagedStream | None:
        """A paged stream for a fresh state (of a prompt with `flow_prompt_key` `key`, whose first chunk brings
        `first_new` speech tokens), or None when no slot is free (the caller keeps it eager)."""
        slot = self.pool.take_slot()
        return None if slot is None else PagedStream(state, slot, key=key, first_new=first_new)

    def close(self, stream: PagedStream) -> None:
        self.pool.give_back(stream.pages, stream.slot)
        stream.pages = []

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages of history that `n_tokens` tokens (prompt included) can fill."""
        return n_tokens * self.flow.cfg.token_mel_ratio // self.pool.page

    def pages_needed(self, stream: PagedStream, n_tokens: int, final: bool) -> int:
        """Pages a chunk of `n_tokens` new tokens (plus the stream's pending prompt tokens) takes."""
        if final:
            return 0
        return self.pages_for_tokens(stream.state.pending.shape[1] + n_tokens)

    def grow(self, pages: int, slots: int) -> None:
        """More room (graphs that point at the old pools are dropped and captured again)."""
        slots += self.max_prefixes
        if pages > self.pool.num_pages or slots > self.pool.num_slots:
            self.pool.grow(pages, slots)
            self.encoder_pool.grow(pages, slots)
            if self.graphs.entries:
                self.graphs.clear()
                self.capture_all()

    # ---- graphs --------------------------------------------------------------------------------------------
    def graph_keys(self) -> list[tuple[int, int, int]]:
        """Every (rows, new frames, history pages) shape a batch is padded to, largest first (the shared pool is
        sized by the first capture)."""
        page = self.pool.page
        return [(r, f * page, h) for r in reversed(self.row_ladder) for f in reversed(FRAME_PAGES)
                for h in reversed(self.hist_ladder)]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the graph of every shape of the ladder (CUDA only; start-up and after the pool grew)."""
        self.graphs.capture_all(self.graph_keys(), self._make_graph)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One eager flow call of the ladder's smallest shape (padding rows: trash writes only), so that every kernel
        a call launches is compiled and loaded: a Triton kernel's first launch loads its module, which breaks a graph
        capture running in another thread at that moment (the HiFT graphs are captured beside the flow's)."""
        graph = self._make_graph(self.graph_keys()[0])
        graph.batch.load(graph.batch.defaults())
        graph.encoder_pass()
        with cudnn_attention():
            graph.step()

    def _key(self, rows: int, frames: int, hist_pages: int) -> tuple[int, int, int]:
        """The ladder's shape for a batch; beyond the ladder (a shape no request should bring), the exact sizes."""
        page = self.pool.page
        pages = -(-frames // page)
        return (round_up(rows, self.row_ladder) or rows, (round_up(pages, list(FRAME_PAGES)) or pages) * page,
                round_up(hist_pages, self.hist_ladder) or hist_pages)

    # ---- prompt prefixes -----------------------------------------------------------------------------------
    @property
    def call_tokens(self) -> int:
        """The most tokens, prompt included, that one row of a flow call takes (the ladder's most new frames)."""
        return FRAME_PAGES[-1] * self.pool.page // self.flow.cfg.token_mel_ratio

    def prefix_tokens(self, stream: PagedStream) -> int:
        """Tokens of a fresh stream's prompt computed before its first chunk. A prompt seen before (`repeat`): its
        whole chunks whose look-ahead is prompt, cached for the next requests with it. A new one: the fewest whole
        chunks that leave the rest and the first chunk's tokens within one call (none for a prompt of up to ~5 s)."""
        state = stream.state
        if state.tokens:
            return 0
        chunk, la = self.flow.chunk_tokens, self.flow.cfg.pre_lookahead_len
        prompt = state.pending.shape[1]
        whole = max(0, (prompt - la) // chunk * chunk)
        if stream.repeat:
            return whole
        over = prompt + stream.first_new - self.call_tokens  # what the first chunk's call cannot take
        return min(whole, -(-over // chunk) * chunk) if over > 0 else 0

    @torch.inference_mode()
    def ride_along(self, streams: list[PagedStream], rows: int, pages: int) -> list[PrefixRide]:
        """Of fresh streams, up to `rows` new prompts (not cached, not seen before, not shared with another fresh
        stream) whose prefix is one pass of at most `pages` pages in all: their prefixes, as rows to add to the
        caller's next `run` (`riders`). A flow call costs about the same with a few more rows, so a new voice's
        prefix then costs no call of its own. The streams are resolved (not fresh) from here on; the others are left
        as they are, for `start_from_prefixes`."""
        if not self.max_prefixes:
            return []
        keys = Counter(s.key for s in streams if s.fresh)
        rides: list[PrefixRide] = []
        for s in streams:
            if len(rides) >= rows:
                break
            if not s.fresh or s.key is None or keys[s.key] > 1 or s.key in self._prefixes or s.key in self._seen:
                continue
            n = self.prefix_tokens(s)
            need = self.pages_for_tokens(n)
            if not 0 < n <= self.call_tokens or need > pages:
                continue
            pages -= need
            s.fresh = False
            self._remember(s.key)
            prompt, snapshot = s.state.pending, s.state.snapshot()
            s.state.pending = prompt[:, :n]
            rides.append(PrefixRide(s, prompt, n, snapshot))
        return rides

    def _remember(self, key: bytes) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > SEEN_PROMPTS:
            self._seen.popitem(last=False)

    @torch.inference_mode()
    def start_from_prefixes(self, streams: list[PagedStream]) -> None:
        """Fresh streams start after their prompt's cached prefix, if their prompt needs one (`prefix_tokens`). For
        prompts not cached yet, one stream each computes it (batched) and it is cached; out of memory, nothing is
        cached and the streams start from zero."""
        fresh = [s for s in streams if s.fresh]
        for s in fresh:
            s.fresh = False
        if not self.max_prefixes:
            return
        fresh = [s for s in fresh if s.key is not None]
        burst = Counter(s.key for s in fresh)
        for s in fresh:
            s.repeat = s.key in self._seen or burst[s.key] > 1
            self._remember(s.key)
        fresh = [s for s in fresh if s.key in self._prefixes or self.prefix_tokens(s)]
        leaders: dict[bytes, PagedStream] = {}
        for s in fresh:
            if s.key not in self._prefixes:
                leaders.setdefault(s.key, s)
        leaders_list = list(leaders.values())
        for i in range(0, len(leaders_list), self.max_rows):
            self._compute_prefixes(leaders_list[i : i + self.max_rows])
        for s in fresh:
            entry = self._prefixes.get(s.key)
            if entry is not None and s.state.tokens == 0:
                self._adopt(s, entry)

    def _compute_prefixes(self, leaders: list[PagedStream]) -> None:
        """Each leader's prompt prefix, in passes of at most `PREFIX_PAGES` pages (so its shapes stay on the
        ladder, and a burst of long prompts is as many short flow calls), then cached. Short of pages, cached
        prefixes are evicted first; still short or out of memory, nothing is cached and the streams start from zero."""
        la = self.flow.cfg.pre_lookahead_len
        step = PREFIX_PAGES * self.pool.page // self.flow.cfg.token_mel_ratio
        counts = [self.prefix_tokens(s) for s in leaders]
        prompts = [s.state.pending for s in leaders]
        snapshots = [(s.state.snapshot(), len(s.pages)) for s in leaders]
        need = sum(self.pages_for_tokens(n) for n in counts)
        if need > len(self.pool.free_pages):
            self.evict_prefixes()
            if need > len(self.pool.free_pages):
                return
        done = [0] * len(leaders)
        try:
            while rows := [i for i, (d, n) in enumerate(zip(done, counts, strict=True)) if d < n]:
                ends = [min(counts[i], done[i] + step) for i in rows]
                for i, e in zip(rows, ends, strict=True):
                    leaders[i].state.pending = prompts[i][:, done[i] : e]
                self.counters.prefix_calls += 1
                self.run([leaders[i] for i in rows], [prompts[i][:, e:e] for i, e in zip(rows, ends, strict=True)],
                         [prompts[i][:, e : e + la] for i, e in zip(rows, ends, strict=True)], [False] * len(rows))
                for i, e in zip(rows, ends, strict=True):
                    done[i] = e
        except torch.cuda.OutOfMemoryError:
            log.warning("out of GPU memory computing %d prompt prefixes: not cached", len(leaders))
            for s, (snapshot, pages) in zip(leaders, snapshots, strict=True):
                s.state.restore(snapshot)
                self.pool.give_back(s.pages[pages:])
                del s.pages[pages:]
            return
        for s, n, p in zip(leaders, counts, prompts, strict=True):
            s.state.pending = p[:, n:]
            self._cache(s)

    def _cache(self, s: PagedStream) -> None:
        if not self._prefix_slots:
            self._evict(next(iter(self._prefixes)))
        slot = self._prefix_slots.pop()
        self._copy_slot(s.slot, slot)
        self.pool.share(s.pages)
        self._prefixes[s.key] = _Prefix(s.state.tokens, s.state.frames, list(s.pages), slot)

    def _adopt(self, s: PagedStream, entry: _Prefix) -> None:
        self._prefixes.move_to_end(s.key)
        self.pool.share(entry.pages)
        self._copy_slot(entry.slot, s.slot)
        s.pages = list(entry.pages)
        state = s.state
        state.encoder.pos = entry.tokens
        state.frames, state.pending = entry.frames, state.pending[:, entry.tokens :]
        self.prefix_hits += 1

    def _evict(self, key: bytes) -> int:
        entry = self._prefixes.pop(key)
        self._prefix_slots.append(entry.slot)
        return self.pool.give_back(entry.pages)

    def evict_prefixes(self) -> int:
        """Drop every cached prefix (the pool is short of pages); returns the pages that became free."""
        return sum(self._evict(key) for key in list(self._prefixes))

    # ---- chunks --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, streams: list[PagedStream], new_tokens: list[Tensor], lookahead: list[Tensor | None],
            finalize: list[bool], riders: Sequence[PrefixRide] = ()) -> list[Tensor]:
        """`FlowBase.stream_chunks` for paged streams (at most `max_rows` with the riders); the caller checked
        `pages_needed` fits. `riders` (`ride_along`) compute their prefixes in the same call, and are cached; if the
        call fails, they are fresh again."""
        if riders:
            la = self.flow.cfg.pre_lookahead_len
            try:
                mels = self.run([*streams, *(r.stream for r in riders)],
                                [*new_tokens, *(r.prompt[:, r.tokens : r.tokens] for r in riders)],
                                [*lookahead, *(r.prompt[:, r.tokens : r.tokens + la] for r in riders)],
                                [*finalize, *(False for _ in riders)])
            except BaseException:
                for r in riders:
                    r.stream.state.restore(r.snapshot)
                    r.stream.fresh = True
                raise
            for r in riders:
                r.stream.state.pending = r.prompt[:, r.tokens :]
                self._cache(r.stream)
            self.counters.prefix_rides += len(riders)
            return mels[: len(streams)]
        if len(streams) > self.max_rows:
            raise ValueError(f"at most {self.max_rows} streams per paged flow call, got {len(streams)}")
        taken = []
        for stream, new, final in zip(streams, new_tokens, finalize, strict=True):
            pages = self.pool.take_pages(self.pages_needed(stream, new.shape[1], final))
            if pages is None:
                self._undo(taken)
                raise RuntimeError("the flow page pool is full")
            stream.pages += pages
            taken.append((stream, len(pages)))
        by_state = {id(s.state): s for s in streams}
        graph: _CfmGraph | None = None
        convs: tuple[Tensor, Tensor, Tensor] | None = None

        def encode(states: list[FlowStreamState], ids: Tensor, real: Tensor | None, lengths: list[int]) -> Tensor:
            nonlocal graph, convs
            live = [by_state[id(state)] for state in states]
            ratio = self.flow.cfg.token_mel_ratio
            graph = self._graph(self._key(len(live), ratio * max(lengths), max(s.frames for s in states) // page))
            graph.batch.load(graph.batch.host_rows([(s.pages, s.state.frames, ratio * n, s.slot, s.state.finished)
                                                    for s, n in zip(live, lengths, strict=True)]))
            convs = self._conv_histories(graph.batch.write_slot)  # overwritten in place by the call: kept to undo it
            return graph.encode(ids, real)

        page = self.pool.page
        try:
            batch = self.flow.prepare_chunks([s.state for s in streams], new_tokens, lookahead, finalize, encode)
            if not batch.states:
                return self.flow.finish_chunks(batch, None)
            self.counters.flow_calls += 1
            self.counters.flow_rows += len(batch.states)
            feat = graph.run(batch.z, batch.mu, batch.cond, batch.spks)
            return self.flow.finish_chunks(batch, feat)
        except BaseException:
            self._undo(taken, convs)
            raise

    def _conv_histories(self, slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A copy of the conv histories, estimator's and encoder's, of `slots` (on the device; 0.7 MB per stream at
        full size in bf16)."""
        return slots, self.pool.conv.index_select(1, slots), self.encoder_pool.conv.index_select(0, slots)

    def _undo(self, taken: list[tuple[PagedStream, int]], convs: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        """Give back the pages a failed call took, and put back the conv histories it may have overwritten."""
        if convs is not None:
            index, estimator, encoder = convs
            self.pool.conv.index_copy_(1, index, estimator)
            self.encoder_pool.conv.index_copy_(0, index, encoder)
        for stream, n in taken:
            if n:
                self.pool.give_back(stream.pages[-n:])
                del stream.pages[-n:]

    def _graph(self, key: tuple[int, int, int]) -> _CfmGraph:
        return self.graphs.get(key, self._make_graph)

    def _make_graph(self, key: tuple[int, int, int]) -> _CfmGraph:
        return _CfmGraph(self.flow, self.pool, self.encoder_pool, *key)

    def _copy_slot(self, src: int, dst: int) -> None:
        """Conv histories (estimator's and encoder's) of slot `src` into slot `dst`."""
        self.pool.copy_slot(src, dst)
        self.encoder_pool.copy_slot(src, dst)
