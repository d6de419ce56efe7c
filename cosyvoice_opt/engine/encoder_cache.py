"""The flow encoder's streaming history in fixed, paged memory, so that a flow chunk's encoder is one CUDA graph too.

Run eagerly, the encoder of a chunk is about 400 small kernels plus about 50 more per stream (each stream's history
cut and joined in Python), 16 ms of host time per call under serving load on the H200 (docs/benchmarks.md): a third
of a small flow call, spent holding the interpreter lock that the LLM thread needs. Here the history that a
`Carry` keeps per stream lives beside the estimator's (`engine/flow_cache.py`), under the same page tables and
slots, so a batch of fixed shape runs it with a fixed set of index kernels. What it holds is what the flow's
encoder caches (`EncoderLayout`):

* K and V of every attention layer, `kv [pages, rows_per_page, width]`, one row [K | V] per position. A page is
  one estimator chunk: `tokens` positions of each 25 Hz layer, then `stride·tokens` of each up-sampled layer.
  CosyVoice2's conformer encoder has them; CosyVoice3's (a token embedding and the pre-lookahead layer) has none.
* the causal convs' last inputs, channels-last per stream slot: `conv [slots, Σ size·d]`. CosyVoice2: the
  look-ahead layer's second conv and the up-sampling conv; CosyVoice3: the look-ahead layer's second conv.

The relative-position scores depend on each key's distance to its query, so a row's history is gathered
right-aligned, left-padded with the zero page up to the batch's history length, as `CarryBatch` pads it: every key
then sits at its own stream's distance. Padding rows (and a row's padding positions) read zeros and write to the
trash page/slot, as in the estimator's pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cosyvoice_opt.engine.flow_cache import RESERVED, ZERO, PagedBatch
from cosyvoice_opt.models.flow import Flow, FlowBase
from cosyvoice_opt.models.flow_dit import FlowDiT


@dataclass(frozen=True)
class EncoderLayout:
    """What a flow's encoder caches, in call order: attention layers at `rates` positions per token (1: 25 Hz,
    `stride`: the mel frame rate), K|V rows of `width`, and causal convs of `conv_shapes` (channels, inputs kept).
    `tokens`: the positions of one page at 25 Hz; `stride`: mel frames per token."""

    tokens: int
    stride: int
    rates: tuple[int, ...]
    width: int
    conv_shapes: tuple[tuple[int, int], ...]

    @staticmethod
    def of(flow: FlowBase) -> EncoderLayout:
        if isinstance(flow, Flow):
            enc = flow.encoder
            d, conv2 = enc.after_norm.normalized_shape[0], enc.pre_lookahead_layer.conv2
            rates = (1,) * len(enc.encoders) + (enc.stride,) * len(enc.up_encoders)
            convs = ((conv2.in_channels, conv2.kernel_size[0] - 1), (d, 2 * enc.stride))
            return EncoderLayout(enc.chunk, enc.stride, rates, 2 * d, convs)
        if isinstance(flow, FlowDiT):
            conv2 = flow.pre_lookahead_layer.conv2
            return EncoderLayout(flow.chunk_tokens, flow.cfg.token_mel_ratio, (), 0,
                                 ((conv2.in_channels, conv2.kernel_size[0] - 1),))
        raise TypeError(f"no paged encoder layout for a {type(flow).__name__}")

    @property
    def rows_per_page(self) -> int:
        return sum(self.tokens * r for r in self.rates)

    def bytes_per_page(self, dtype: torch.dtype) -> int:
        return self.rows_per_page * self.width * dtype.itemsize


class EncoderPool:
    """The encoder's pools, with the same page and slot ids as the estimator's `PagePool` (its owner sizes both)."""

    def __init__(self, layout: EncoderLayout, pages: int, slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.tokens, self.stride, self.rates = layout.tokens, layout.stride, list(layout.rates)
        sizes = [self.tokens * r for r in self.rates]
        self.bases = [sum(sizes[:i]) for i in range(len(sizes))]  # each layer's first row in a page
        self.rows_per_page, self.width = layout.rows_per_page, layout.width
        self.conv_shapes = list(layout.conv_shapes)
        widths = [c * k for c, k in self.conv_shapes]
        self.conv_offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.dtype, self.device = dtype, device
        self.kv = torch.zeros(0, self.rows_per_page, self.width, dtype=dtype, device=device)
        self.conv = torch.zeros(0, sum(widths), dtype=dtype, device=device)
        self.grow(pages, slots)

    def grow(self, pages: int, slots: int) -> None:
        """Enlarge to `pages`/`slots` usable ones (plus the reserved two), keeping the contents (never shrinks)."""
        pages, slots = max(pages + RESERVED, self.kv.shape[0]), max(slots + RESERVED, self.conv.shape[0])
        if (pages, slots) == (self.kv.shape[0], self.conv.shape[0]):
            return
        kv = self.kv.new_zeros(pages, self.rows_per_page, self.width)
        conv = self.conv.new_zeros(slots, self.conv.shape[1])
        kv[: self.kv.shape[0]].copy_(self.kv)
        conv[: self.conv.shape[0]].copy_(self.conv)
        self.kv, self.conv = kv, conv

    def copy_slot(self, src: int, dst: int) -> None:
        self.conv[dst].copy_(self.conv[src])


class PagedEncoderCarry:
    """The encoder's carry over the pools (the `CarryBatch` interface) for one batch shape. Positions come at two
    rates: a tensor of `rate·tokens` positions is at that many per token (1: 25 Hz, `stride`: the mel frame rate)."""

    def __init__(self, pool: EncoderPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self.tokens = batch.frames // pool.stride  # new token positions of the batch shape
        self._attn = self._conv = 0

    def begin(self) -> None:
        self._attn = self._conv = 0

    def end(self) -> None:
        if (self._attn, self._conv) != (len(self.pool.rates), len(self.pool.conv_shapes)):
            raise RuntimeError("the encoder's cached modules do not match the encoder pool's layout")

    def history(self, n: int) -> int:
        """History positions (the batch's whole history pages) before a tensor of n new positions."""
        return self.batch.hist_pages * self.pool.tokens * (n // self.tokens)

    def cache(self, x: Tensor, dim: int) -> Tensor:
        """K|V rows x [B,n,2d] -> history ++ x [B,H+n,2d]; x's real positions are stored in their pages."""
        if dim != 1:
            raise ValueError("the paged encoder caches positions at dim 1")
        b, n, width = x.shape
        rate, layer = n // self.tokens, self._attn
        if self.pool.rates[layer] != rate:
            raise RuntimeError("the encoder's attention layers do not match the encoder pool's layout")
        self._attn += 1
        rows, base = self.pool.kv.view(-1, width), self.pool.bases[layer]
        ctx = rows.index_select(0, (self._history_index(rate) + base).view(-1)).view(b, -1, width)
        ctx[:, ctx.shape[1] - n :].copy_(x)
        rows.index_copy_(0, (self._write_index(rate) + base).view(-1), x.reshape(-1, width))
        return ctx

    def conv(self, x: Tensor, size: int) -> Tensor:
        """Conv inputs x [B,C,T] -> the last `size` inputs before them ++ x ([B,C,size+T], a channels-last tensor's
        view); stores each row's last real ones."""
        b, c, t = x.shape
        k = self._conv
        if self.pool.conv_shapes[k] != (c, size):
            raise RuntimeError("the encoder's causal convs do not match the encoder pool's layout")
        self._conv += 1
        cols = self.pool.conv[:, self.pool.conv_offsets[k] : self.pool.conv_offsets[k] + size * c]
        history = cols.index_select(0, self.batch.read_slot).view(b, size, c)
        full = torch.cat((history, x.mT), dim=1)
        tail = full.view(-1, c).index_select(0, self._tail_index(size, t // self.tokens)).view(b, size * c)
        cols.index_copy_(0, self.batch.write_slot, tail)
        return full.mT

    def visibility(self, rows: int, n: int, chunk: int, device: torch.device) -> Tensor:
        """[rows,1,n,H+n] (True = visible): a real key of the row before the end of the query's chunk."""
        rate = n // self.tokens

        def fn() -> tuple[Tensor, ...]:
            pos, hist, new = self._positions(rate)
            cols = torch.arange(pos.shape[1], device=pos.device)
            vis = ((pos >= 0) & (cols < pos.shape[1] - n + new[:, None]))[:, None, :]  # [rows, 1, K]
            if chunk > 0:
                limit = ((hist[:, None] + torch.arange(n, device=pos.device)) // chunk + 1) * chunk  # [rows, n]
                vis = vis & (pos[:, None, :] < limit[:, :, None])
            return (vis[:, None],)
        return self.batch.derive(("enc_vis", rate, chunk), fn)[0]

    # ---- index tensors (derived from the batch's buffer; `PagedBatch.load` updates them) --------------------------
    def _positions(self, rate: int) -> tuple[Tensor, Tensor, Tensor]:
        """Per row at `rate`: each context column's position in its stream [rows, H+n] (negative: left padding),
        the positions before the chunk [rows] and the new ones [rows]."""
        def fn() -> tuple[Tensor, ...]:
            batch, stride = self.batch, self.pool.stride
            hist, new = batch.hist_len * rate // stride, batch.new_len * rate // stride
            h_cols = batch.hist_pages * self.pool.tokens * rate
            cols = torch.arange(h_cols + self.tokens * rate, device=hist.device)
            return cols[None, :] - h_cols + hist[:, None], hist, new
        return self.batch.derive(("enc_pos", rate), fn)

    def _history_index(self, rate: int) -> Tensor:
        """[rows, H+n]: the kv row (without the layer's base) of each context column: its history position's page
        and offset, the zero page for left padding and for the new positions (the caller copies them in)."""
        def fn() -> tuple[Tensor, ...]:
            pos, hist, _ = self._positions(rate)
            per_page, zero = self.pool.tokens * rate, ZERO * self.pool.rows_per_page
            past = (pos >= 0) & (pos < hist[:, None])
            if self.batch.hist_pages == 0:
                return (torch.full_like(pos, zero),)
            slot = (pos.clamp(min=0) // per_page).clamp(max=self.batch.hist_pages - 1)
            page = self.batch.page_table.gather(1, slot)
            return (torch.where(past, page * self.pool.rows_per_page + pos.remainder(per_page), zero),)
        return self.batch.derive(("enc_hist", rate), fn)[0]

    def _write_index(self, rate: int) -> Tensor:
        """[rows, n]: the kv row (without the layer's base) of each new position (the trash page for padding and
        final chunks): the batch's per-frame write pages and offsets, every `stride / rate`-th frame."""
        def fn() -> tuple[Tensor, ...]:
            step = self.pool.stride // rate
            page, off = self.batch.write_page[:, ::step], self.batch.write_off[:, ::step] // step
            return (page * self.pool.rows_per_page + off,)
        return self.batch.derive(("enc_write", rate), fn)[0]

    def _tail_index(self, size: int, rate: int) -> Tensor:
        """[rows·size]: the rows of a conv's (history ++ new) inputs [rows, size+T, C], seen as rows of C, that are
        its last `size` real inputs."""
        def fn() -> tuple[Tensor, ...]:
            _, _, new = self._positions(rate)
            width = size + self.tokens * rate
            first = torch.arange(len(new), device=new.device) * width + new
            return ((first[:, None] + torch.arange(size, device=new.device)).reshape(-1),)
        return self.batch.derive(("enc_tail", size, rate), fn)[0]
