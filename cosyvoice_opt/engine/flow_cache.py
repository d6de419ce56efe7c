"""The estimator's streaming history in fixed, paged memory, so that a whole flow chunk can be one CUDA graph.

Incremental streaming keeps, per stream, each Euler step's attention inputs of every frame seen and each causal
conv's last inputs (see `FlowStreamState`). A `Carry` keeps them as Python lists of growing tensors: exact, but a
few Python ops per stream, per module and per Euler step (about 10^4 per chunk), which bounded the engine. Here the
same history lives in pools allocated once:

* attention inputs in pages of one estimator chunk (50 frames): `attn [steps, blocks, pages, page, 2, C]` (Euler
  steps, transformer blocks), 2 = the CFG rows. A stream owns a list of pages (its page table), as in vLLM's paged
  KV cache. Frame f sits in page `table[f // page]` at offset `f % page`; a non-final chunk ends on a chunk
  boundary, so a stream's history is always whole pages.
* conv histories per stream slot: `conv[i] [steps, slots, 2, C_i, k-1]`.

Pages are reference-counted: the pages of a prompt's cached prefix (see `FlowRunner`) are shared, read-only, by
every stream that starts from it. Page/slot 0 is write-only trash (padding and final chunks write there) and
page/slot 1 stays zero (padding reads it, and so does a first chunk: a fresh stream's conv history is zeros), so
reads are always finite.
`PagedCarry` is the estimator's `carry` over the pools; a `PagedBatch` holds the static index tensors of one batch
shape, including the Euler step on the device (so that one captured step serves every step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cosyvoice_opt.models.flow_estimator import Attention, CausalConditionalDecoder, CausalConv1d

TRASH, ZERO = 0, 1  # reserved page / slot ids
RESERVED = 2


class PagePool:
    """The pools and their free lists. `pages`/`slots` count usable ones (the two reserved come on top)."""

    def __init__(self, estimator: CausalConditionalDecoder, steps: int, pages: int, slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.page = estimator.chunk
        attn = [m for m in estimator.modules() if isinstance(m, Attention)]
        convs = [m for m in estimator.modules() if isinstance(m, CausalConv1d)]
        self.steps, self.n_attn = steps, len(attn)
        self.channels = attn[0].to_q.in_features
        self.conv_shapes = [(m.in_channels, m.kernel_size[0] - 1) for m in convs]
        self.dtype, self.device = dtype, device
        self.attn = torch.zeros(0, dtype=dtype, device=device)
        self.conv: list[Tensor] = []
        self.free_pages: list[int] = []
        self.free_slots: list[int] = []
        self.refs: list[int] = []  # per page: its owners (streams and cached prompt prefixes)
        self.num_pages = self.num_slots = 0
        self.grow(pages, slots)

    @staticmethod
    def bytes_per_page(estimator: CausalConditionalDecoder, steps: int, dtype: torch.dtype) -> int:
        n_attn = sum(isinstance(m, Attention) for m in estimator.modules())
        channels = next(m for m in estimator.modules() if isinstance(m, Attention)).to_q.in_features
        return steps * n_attn * estimator.chunk * 2 * channels * dtype.itemsize

    def grow(self, pages: int, slots: int) -> None:
        """Enlarge to `pages`/`slots` usable ones, keeping every stream's contents (never shrinks)."""
        pages, slots = max(pages, self.num_pages), max(slots, self.num_slots)
        if (pages, slots) == (self.num_pages, self.num_slots):
            return
        attn = torch.zeros(self.steps, self.n_attn, pages + RESERVED, self.page, 2, self.channels,
                           dtype=self.dtype, device=self.device)
        conv = [torch.zeros(self.steps, slots + RESERVED, 2, c, k, dtype=self.dtype, device=self.device)
                for c, k in self.conv_shapes]
        if self.num_pages:
            attn[:, :, : self.attn.shape[2]].copy_(self.attn)
            for new, old in zip(conv, self.conv, strict=True):
                new[:, : old.shape[1]].copy_(old)
        self.attn, self.conv = attn, conv
        self.free_pages += range(self.num_pages + RESERVED, pages + RESERVED)
        self.refs += [0] * (pages + RESERVED - len(self.refs))
        self.free_slots += range(self.num_slots + RESERVED, slots + RESERVED)
        self.num_pages, self.num_slots = pages, slots

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
        for t in self.conv:
            t[:, dst].copy_(t[:, src])


class PagedBatch:
    """Where each row of one batch shape (rows x frames new frames, hist_pages pages of history) reads and writes.

    All index tensors are views of one int64 buffer, so a round's indices cost one host-to-device copy (`load`).
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
        self.load(self.defaults())
        self._derived: dict[tuple, Tensor] = {}

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
        self.buffer.copy_(host, non_blocking=True)

    def reset(self) -> None:
        """Forget derived tensors: call at the start of each step (they must be recomputed inside a capture)."""
        self._derived = {}

    def tail_index(self, size: int) -> Tensor:
        """[2·rows, size] columns of each row's last `size` real inputs in (history ++ new) coordinates."""
        key = ("tail", size)
        if key not in self._derived:
            ends = self.new_len.repeat_interleave(2)
            self._derived[key] = ends[:, None] + torch.arange(size, device=ends.device)
        return self._derived[key]

    def history_index(self) -> tuple[Tensor, Tensor, Tensor]:
        """(page, offset, CFG row), each [2·rows, hist_pages·page]: where each row's history columns sit in a layer's
        pages, so one gather reads the history in attention's layout (no permuted copy)."""
        key = ("hist",)
        if key not in self._derived:
            device = self.page_table.device
            cols = torch.arange(self.hist_pages * self.page, device=device)
            pages = self.page_table[:, cols // self.page].repeat_interleave(2, dim=0)
            offsets = (cols % self.page).expand_as(pages)
            cfg_rows = torch.arange(2, device=device).repeat(self.rows)[:, None].expand_as(pages)
            self._derived[key] = (pages, offsets, cfg_rows)
        return self._derived[key]

    def visibility(self, n: int, chunk: int) -> Tensor:
        """[2·rows, 1, n, H+n] (True = visible) over the keys (history columns, then the n new frames): a real key
        before the end of the query's chunk (every key of the row when chunk is 0)."""
        key = ("vis", n, chunk)
        if key not in self._derived:
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
            self._derived[key] = vis.repeat_interleave(2, dim=0)[:, None]
        return self._derived[key]


class PagedCarry:
    """The estimator's carry over the pools (the `CarryBatch` interface), at the Euler step `batch.step`."""

    def __init__(self, pool: PagePool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self._attn = self._conv = 0

    def begin(self) -> None:
        self._attn = self._conv = 0

    def end(self) -> None:
        if (self._attn, self._conv) != (self.pool.n_attn, len(self.pool.conv_shapes)):
            raise RuntimeError("the estimator's cached modules do not match the page pool's layout")

    def cache(self, x: Tensor, dim: int) -> Tensor:
        """Attention inputs x [2B,n,C] -> history ++ x [2B,H+n,C]; x's real frames are stored in their pages."""
        rows, n, c = x.shape
        layer = self.pool.attn[:, self._attn]  # [steps, pages, page, 2, C]
        self._attn += 1
        step = self.batch.step
        pages, offsets, cfg_rows = self.batch.history_index()
        past = layer[step, pages, offsets, cfg_rows]  # [2B, H, C]
        layer[step, self.batch.write_page, self.batch.write_off] = x.view(rows // 2, 2, n, c).transpose(1, 2)
        return torch.cat((past, x), dim=1)

    def conv(self, x: Tensor, size: int) -> Tensor:
        """Conv inputs x [2B,C,n] -> the last `size` inputs before them ++ x; stores each row's last real ones."""
        rows, c, _ = x.shape
        if self.pool.conv_shapes[self._conv] != (c, size):
            raise RuntimeError("the estimator's causal convs do not match the page pool's layout")
        store = self.pool.conv[self._conv]  # [steps, slots, 2, C, size]
        self._conv += 1
        step = self.batch.step
        full = torch.cat((store[step, self.batch.read_slot].view(rows, c, size), x), dim=-1)
        tail = full.gather(2, self.batch.tail_index(size)[:, None, :].expand(-1, c, -1))
        store[step, self.batch.write_slot] = tail.view(rows // 2, 2, c, size)
        return full

    def visibility(self, rows: int, n: int, chunk: int, device: torch.device) -> Tensor:
        return self.batch.visibility(n, chunk)
