"""The estimator's streaming history in fixed, paged memory, so that a whole flow chunk can be one CUDA graph.

Incremental streaming keeps, per stream, each Euler step's attention rows of every frame seen and each causal
conv's last inputs (see `FlowStreamState`). A `Carry` keeps them as Python lists of growing tensors: exact, but a
few Python ops per stream, per module and per Euler step (about 10^4 per chunk), which bounded the engine. Here the
same history lives in pools allocated once:

* attention rows in pages of one estimator chunk (50 frames): `attn [steps, blocks, pages, page, 2, W]` (Euler
  steps, transformer blocks), 2 = the CFG rows. A row is what the estimator caches (`CacheLayout`): CosyVoice2's
  U-Net its normalised attention inputs (K and V are recomputed from them), CosyVoice3's DiT its K and V after RoPE,
  so RoPE needs each new frame's position in its stream (`PagedCarry.positions`). A stream owns a list of pages (its
  page table), as in vLLM's paged KV cache. Frame f sits in page `table[f // page]` at offset `f % page`; a non-final
  chunk ends on a chunk boundary, so a stream's history is always whole pages.
* conv histories per stream slot, every conv's in one tensor: `conv [steps, slots, 2, Σ_i (k_i-1)·C_i]` (conv i's
  last inputs channels-last at `conv_offsets[i]`).

A captured step is bound by its kernel count, so the history moves in few, large index kernels: one gather reads
every conv's history at the first conv of a step; each conv stores its last inputs with one row copy; the
transformer blocks of a group (a U-Net stage; one DiT block) share one gather of their histories (with room for the
new frames, copied in by each block) and one scatter of their new frames. Every one of them indexes whole rows with
one flat row index (`index_select`, `index_put_`, `index_copy_`): the same moves written as multi-tensor advanced
indexing were a third of a 64-row step's GPU time on the H200 (14 of 45 ms), as that kernel computes five indices per
element.

Pages are reference-counted: the pages of a prompt's cached prefix (see `FlowRunner`) are shared, read-only, by
every stream that starts from it. Page/slot 0 is write-only trash (padding and final chunks write there) and
page/slot 1 stays zero (padding reads it, and so does a first chunk: a fresh stream's conv history is zeros), so
reads are always finite.
`PagedCarry` is the estimator's `carry` over the pools; a `PagedBatch` holds the static index tensors of one batch
shape, including the Euler step on the device (so that one captured step serves every step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cosyvoice_opt.models import dit, flow_estimator, fused

TRASH, ZERO = 0, 1  # reserved page / slot ids
RESERVED = 2


@dataclass(frozen=True)
class CacheLayout:
    """What an estimator's carry keeps, in call order: `n_attn` attention rows of `width` per frame (CosyVoice2's
    U-Net: the normalised attention inputs, 256 wide; CosyVoice3's DiT: K and V after RoPE as one row, 2·inner wide)
    and the causal convs' last inputs `conv_shapes` (channels, frames). A page is one chunk of `page` frames; `group`
    attention layers share one gather of their contexts ([group, 2·rows, history + new, width]: the U-Net's stages of
    a few 256-wide blocks; the DiT's 2048-wide blocks one at a time, as 64 rows over thousands of frames of two
    blocks would hold gigabytes)."""

    page: int
    n_attn: int
    width: int
    conv_shapes: tuple[tuple[int, int], ...]
    group: int

    @staticmethod
    def of(estimator: nn.Module) -> CacheLayout:
        if isinstance(estimator, flow_estimator.CausalConditionalDecoder):
            attn = [m for m in estimator.modules() if isinstance(m, flow_estimator.Attention)]
            convs = [m for m in estimator.modules() if isinstance(m, flow_estimator.CausalConv1d)]
            group = len(estimator.down_blocks[0][1])  # transformer blocks per stage
            width = attn[0].to_q.in_features
        elif isinstance(estimator, dit.DiT):
            attn = [m for m in estimator.modules() if isinstance(m, dit.Attention)]
            pos = estimator.input_embed.conv_pos_embed
            convs = [pos.conv1[0], pos.conv2[0]]
            group, width = 1, 2 * attn[0].to_k.out_features
        else:
            raise TypeError(f"no paged layout for a {type(estimator).__name__} estimator")
        if len(attn) % group:
            raise ValueError(f"{len(attn)} attention layers do not make groups of {group}")
        shapes = tuple((m.in_channels, m.kernel_size[0] - 1) for m in convs)
        return CacheLayout(estimator.chunk, len(attn), width, shapes, group)

    def bytes_per_page(self, steps: int, dtype: torch.dtype) -> int:
        """One page of every Euler step's attention rows, both CFG rows."""
        return steps * self.n_attn * self.page * 2 * self.width * dtype.itemsize


class PagePool:
    """The pools and their free lists. `pages`/`slots` count usable ones (the two reserved come on top)."""

    def __init__(self, layout: CacheLayout, steps: int, pages: int, slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.page, self.n_attn, self.width, self.group = layout.page, layout.n_attn, layout.width, layout.group
        self.steps = steps
        self.layers = torch.arange(self.n_attn, device=device)
        self.conv_shapes = list(layout.conv_shapes)
        widths = [c * k for c, k in self.conv_shapes]
        self.conv_offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.dtype, self.device = dtype, device
        self.attn = torch.zeros(0, dtype=dtype, device=device)
        self.conv = torch.zeros(0, dtype=dtype, device=device)
        self.free_pages: list[int] = []
        self.free_slots: list[int] = []
        self.refs: list[int] = []  # per page: its owners (streams and cached prompt prefixes)
        self.num_pages = self.num_slots = 0
        self.grow(pages, slots)

    def grow(self, pages: int, slots: int) -> None:
        """Enlarge to `pages`/`slots` usable ones, keeping every stream's contents (never shrinks)."""
        pages, slots = max(pages, self.num_pages), max(slots, self.num_slots)
        if (pages, slots) == (self.num_pages, self.num_slots):
            return
        attn = torch.zeros(self.steps, self.n_attn, pages + RESERVED, self.page, 2, self.width,
                           dtype=self.dtype, device=self.device)
        conv = torch.zeros(self.steps, slots + RESERVED, 2, sum(c * k for c, k in self.conv_shapes),
                           dtype=self.dtype, device=self.device)
        if self.num_pages:
            attn[:, :, : self.attn.shape[2]].copy_(self.attn)
            conv[:, : self.conv.shape[1]].copy_(self.conv)
        self.attn, self.conv = attn, conv
        self.free_pages += range(self.num_pages + RESERVED, pages + RESERVED)
        self.refs += [0] * (pages + RESERVED - len(self.refs))
        self.free_slots += range(self.num_slots + RESERVED, slots + RESERVED)
        self.num_pages, self.num_slots = pages, slots

    def attn_rows(self) -> tuple[Tensor, int, int]:
        """The attention pool as rows [steps·blocks·pages·page·2, width], and the rows of one Euler step and of one
        block: row (step, block, page, offset, CFG row) is step·S + block·B + (page·page + offset)·2 + CFG."""
        per_block = self.attn.shape[2] * self.page * 2
        return self.attn.view(-1, self.width), self.n_attn * per_block, per_block

    def conv_rows(self) -> tuple[Tensor, int]:
        """The conv pool as rows [steps·slots·2, Σ size·C] and the rows of one Euler step: row (step, slot, CFG row)
        is step·S + slot·2 + CFG."""
        return self.conv.view(-1, self.conv.shape[-1]), self.conv.shape[1] * 2

    def take_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def take_pages(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self.free_pages):
            return None
        taken = self.free_pages[len(self.free_pages) - n:]
        del self.free_pages[len(self.free_pages) - n:]
        self.share(taken)
        return taken

    def share(self, pages: list[int]) -> None:
        """One more owner for each of `pages`."""
        for p in pages:
            self.refs[p] += 1

    def give_back(self, pages: list[int], slot: int | None = None) -> int:
        """Drop one owner of each page (a page with none left is free again) and free `slot`; returns the pages
        freed."""
        freed = 0
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)
                freed += 1
        if slot is not None:
            self.free_slots.append(slot)
        return freed

    def copy_slot(self, src: int, dst: int) -> None:
        """Conv histories of slot `src` into slot `dst` (every Euler step and conv)."""
        self.conv[:, dst].copy_(self.conv[:, src])


class PagedBatch:
    """Where each row of one batch shape (rows x frames new frames, hist_pages pages of history) reads and writes.

    All index tensors are views of one int64 buffer, so a round's indices cost one host-to-device copy (`load`);
    the tensors derived from them (gather/scatter indices, the attention mask) are updated by `load` too, in place.
    Defaults (all rows padding) read the zero page/slot and write to the trash: safe for warm-up and capture.
    """

    def __init__(self, rows: int, frames: int, hist_pages: int, page: int, device: torch.device) -> None:
        self.rows, self.frames, self.hist_pages, self.page = rows, frames, hist_pages, page
        sizes = [rows * hist_pages, rows, rows, rows * frames, rows * frames, rows, rows, 1]
        self.buffer = torch.empty(sum(sizes), dtype=torch.long, device=device)
        views = self.buffer.split(sizes)
        self.page_table = views[0].view(rows, hist_pages)  # history pages, ZERO-padded
        self.hist_len, self.new_len = views[1], views[2]  # frames before / in this chunk
        self.write_page, self.write_off = views[3].view(rows, frames), views[4].view(rows, frames)
        self.read_slot, self.write_slot = views[5], views[6]
        # the Euler step: 0 when loaded, advanced by each step; [1], not 0-d: indexing with a 0-d tensor reads it on
        # the host (a sync, which a graph capture refuses), while [1] broadcasts like any index tensor
        self.step = views[7]
        self._derived: dict[tuple, tuple[Callable[[], tuple[Tensor, ...]], tuple[Tensor, ...]]] = {}
        self.load(self.defaults())

    def defaults(self) -> Tensor:
        """The host buffer with every row padding."""
        r, n = self.rows, self.frames
        return torch.cat([
            torch.full((r * self.hist_pages,), ZERO), torch.zeros(r, dtype=torch.long), torch.full((r,), n),
            torch.full((r * n,), TRASH), torch.arange(n).remainder(self.page).repeat(r),
            torch.full((r,), ZERO), torch.full((r,), TRASH), torch.zeros(1, dtype=torch.long),
        ])

    def host_rows(self, rows: list[tuple[list[int], int, int, int | None, bool]]) -> Tensor:
        """The host buffer for real rows (page table, frames before, new frames, slot, final), padding after."""
        r, n, page, hp = self.rows, self.frames, self.page, self.hist_pages
        buf = self.defaults()
        table, hist, new, wpage, woff, rslot, wslot, _ = buf.split([r * hp, r, r, r * n, r * n, r, r, 1])
        table, wpage, woff = table.view(r, hp), wpage.view(r, n), woff.view(r, n)
        for i, (pages, f0, m, slot, final) in enumerate(rows):
            known = f0 // page
            table[i, :known] = torch.tensor(pages[:known], dtype=torch.long)
            hist[i], new[i] = f0, m
            if f0:
                rslot[i] = slot
            if not final:
                frame = torch.arange(f0, f0 + m)
                wpage[i, :m] = torch.tensor(pages, dtype=torch.long)[frame // page]
                woff[i, :m] = frame % page
                wslot[i] = slot
        return buf

    def load(self, host: Tensor) -> None:
        """Take a host buffer (`host_rows`, `defaults`) and update the derived index tensors in place."""
        self.buffer.copy_(host, non_blocking=True)
        for fn, value in self._derived.values():
            for dst, src in zip(value, fn(), strict=True):
                dst.copy_(src)

    def derive(self, key: tuple, fn: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """fn's tensors, computed from the buffer once and then updated by each `load`: a captured step reads them
        in place instead of recomputing them (tens of small kernels) at every step."""
        if key not in self._derived:
            self._derived[key] = (fn, fn())
        return self._derived[key][1]

    def _cfg_rows(self) -> Tensor:
        """[2·rows, 1]: each batch row's CFG row (0 conditional, 1 not)."""
        return torch.arange(2, device=self.buffer.device).repeat(self.rows)[:, None]

    def conv_read_index(self) -> Tensor:
        """[2·rows]: each row's conv histories in one Euler step of `PagePool.conv_rows`."""
        return self.derive(("conv_read",), lambda: (self._slot_rows(self.read_slot),))[0]

    def conv_write_index(self) -> Tensor:
        """[2·rows]: where each row's last conv inputs go in one Euler step of `PagePool.conv_rows` (the trash slot for
        padding rows and final chunks)."""
        return self.derive(("conv_write",), lambda: (self._slot_rows(self.write_slot),))[0]

    def _slot_rows(self, slots: Tensor) -> Tensor:
        return slots.repeat_interleave(2) * 2 + self._cfg_rows()[:, 0]

    def new_lengths(self) -> Tensor:
        """[2·rows]: each batch row's new frames (both CFG rows of a stream)."""
        return self.derive(("new",), lambda: (self.new_len.repeat_interleave(2),))[0]

    def conv_tail_index(self, size: int) -> Tensor:
        """[2·rows·size]: the rows of a conv's (history ++ new) inputs [2·rows, size + frames, C], seen as rows of C,
        that are its last `size` real inputs: columns new_len .. new_len + size - 1 of each row."""
        def fn() -> tuple[Tensor, ...]:
            width = size + self.frames
            first = torch.arange(2 * self.rows, device=self.buffer.device) * width + self.new_len.repeat_interleave(2)
            return ((first[:, None] + torch.arange(size, device=first.device)).reshape(-1),)
        return self.derive(("conv_tail", size), fn)[0]

    def history_index(self) -> Tensor:
        """[2·rows, hist_pages·page + frames]: the row of each attention context column within one block of
        `PagePool.attn_rows`: its history columns' page and offset, then the zero page for the new frames' columns
        (the caller copies them in), so one gather makes attention's whole context."""
        def fn() -> tuple[Tensor, ...]:
            cols = torch.arange(self.hist_pages * self.page + self.frames, device=self.buffer.device)
            table = torch.cat((self.page_table, self.page_table.new_full((self.rows, 1), ZERO)), dim=1)
            pages = table[:, (cols // self.page).clamp(max=self.hist_pages)]
            return (((pages * self.page + cols.remainder(self.page)) * 2).repeat_interleave(2, dim=0)
                    + self._cfg_rows(),)
        return self.derive(("hist",), fn)[0]

    def write_index(self) -> Tensor:
        """[2·rows, frames]: the row of each new frame's attention input within one block of `PagePool.attn_rows`."""
        def fn() -> tuple[Tensor, ...]:
            frame = self.write_page * self.page + self.write_off
            return ((frame * 2).repeat_interleave(2, dim=0) + self._cfg_rows(),)
        return self.derive(("write",), fn)[0]

    def positions(self, n: int) -> Tensor:
        """[2·rows, n]: the frame of each of n new columns in its stream (padding continues past a row's real ones)."""
        def fn() -> tuple[Tensor, ...]:
            return (self.hist_len.repeat_interleave(2)[:, None] + torch.arange(n, device=self.hist_len.device),)
        return self.derive(("pos", n), fn)[0]

    def visibility(self, n: int, chunk: int, dtype: torch.dtype) -> Tensor:
        """[2·rows, 1, n, H+n] additive mask (0 visible, -inf not) over the keys (history columns, then the n new
        frames): a real key before the end of the query's chunk (every key of the row when chunk is 0)."""
        def fn() -> tuple[Tensor, ...]:
            device, hk = self.hist_len.device, self.hist_pages * self.page
            keys = torch.arange(hk + n, device=device)
            h, m = self.hist_len[:, None], self.new_len[:, None]
            past = keys < hk
            key_pos = torch.where(past, keys, keys - hk + h)  # [rows, K] absolute frame of each key
            valid = torch.where(past, keys < h, keys - hk < m)
            vis = valid[:, None, :]
            if chunk > 0:
                limit = ((h + torch.arange(n, device=device)) // chunk + 1) * chunk  # [rows, n]
                vis = vis & (key_pos[:, None, :] < limit[:, :, None])
            vis = vis.repeat_interleave(2, dim=0)[:, None]
            return (torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill_(~vis, float("-inf")),)
        return self.derive(("vis", n, chunk, dtype), fn)[0]


class PagedCarry:
    """The estimator's carry over the pools (the `CarryBatch` interface), at the Euler step `batch.step`."""

    def __init__(self, pool: PagePool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self._attn = self._conv = 0
        self._contexts = self._conv_history = self._conv_rows = self._blocks = self._conv_step = torch.empty(0)

    def begin(self) -> None:
        """The Euler step's first rows in the pools, once per step (the index tensors are the same at every step)."""
        self._attn = self._conv = 0
        _, step_rows, block_rows = self.pool.attn_rows()
        self._blocks = self.batch.step * step_rows + self.pool.layers * block_rows  # [blocks]: each block's first row
        self._conv_step = self.batch.step * self.pool.conv_rows()[1]

    def end(self) -> None:
        if (self._attn, self._conv) != (self.pool.n_attn, len(self.pool.conv_shapes)):
            raise RuntimeError("the estimator's cached modules do not match the page pool's layout")
        self._contexts = self._conv_history = self._conv_rows = torch.empty(0)

    def cache(self, x: Tensor, dim: int) -> Tensor:
        """Attention rows x [2B,n,W] -> history ++ x [2B,H+n,W]; x's real frames are stored in their pages (with
        those of the rest of its group, after the group's last block)."""
        n = x.shape[1]
        group, i = self.pool.group, self._attn % self.pool.group
        rows = self.pool.attn_rows()[0]
        blocks = self._blocks[self._attn - i : self._attn - i + group, None, None]
        if i == 0:
            index = self.batch.history_index() + blocks  # [group, 2B, H+n]
            self._contexts = rows.index_select(0, index.view(-1)).view(*index.shape, -1)
        ctx = self._contexts[i]
        ctx[:, ctx.shape[1] - n :].copy_(x)
        self._attn += 1
        if i == group - 1:
            new = self._contexts[:, :, self._contexts.shape[2] - n :]
            rows.index_put_((self.batch.write_index() + blocks,), new)
            self._contexts = torch.empty(0)
        return ctx

    def conv(self, x: Tensor, size: int) -> Tensor:
        """Conv inputs x [2B,C,n] -> the last `size` inputs before them ++ x (a channels-last tensor, seen as
        [2B,C,size+n]); stores each row's last real ones."""
        rows, c, _ = x.shape
        history, store = self._next_conv(c, size)
        full = torch.cat((history.view(rows, size, c), x.mT), dim=1)
        tail = full.view(-1, c).index_select(0, self.batch.conv_tail_index(size)).view(rows, size * c)
        store.index_copy_(0, self._conv_rows, tail)
        return full.mT

    def conv_windows(self, x: Tensor, k: int) -> Tensor:
        """Channels-last conv inputs x [2B,n,C] -> each frame's window of k inputs [2B,n,C·k] (`conv`'s history and x,
        see `flow_encoder.conv_windows`); stores each row's last real ones. One kernel on CUDA."""
        rows, _, c = x.shape
        history, store = self._next_conv(c, k - 1)
        return fused.causal_windows(history.view(rows, k - 1, c), x, self.batch.new_lengths(), store,
                                    self._conv_rows)

    def _next_conv(self, c: int, size: int) -> tuple[Tensor, Tensor]:
        """The next conv's (history [2B, size·C], its columns of the pool's rows)."""
        if self.pool.conv_shapes[self._conv] != (c, size):
            raise RuntimeError("the estimator's causal convs do not match the page pool's layout")
        pool, start = self.pool.conv_rows()[0], self.pool.conv_offsets[self._conv]
        if self._conv == 0:  # every conv's history in one gather, and where every conv writes, once per step
            self._conv_history = pool.index_select(0, self.batch.conv_read_index() + self._conv_step)  # [2B, Σ size·C]
            self._conv_rows = self.batch.conv_write_index() + self._conv_step
        self._conv += 1
        return self._conv_history[:, start : start + size * c], pool[:, start : start + size * c]

    def visibility(self, rows: int, n: int, chunk: int, device: torch.device) -> Tensor:
        """Additive (see `PagedBatch.visibility`), in the pool's dtype."""
        return self.batch.visibility(n, chunk, self.pool.dtype)

    def positions(self, rows: int, n: int, device: torch.device) -> Tensor:
        """[2B, n]: each new frame's position in its stream (RoPE), for both CFG rows of a stream."""
        return self.batch.positions(n)
