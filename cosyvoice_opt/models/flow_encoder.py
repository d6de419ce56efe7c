"""Flow encoder: upstream `UpsampleConformerEncoder` (a conformer at 25 Hz, x2 up-sampling, a conformer at 50 Hz)
with Transformer-XL relative-position attention.

Every time-mixing module can run chunk by chunk: it takes its left history from a `Carry` and leaves the history
the next chunk needs. The attention is block-causal when streaming (a position sees every key before the end of
its own chunk) and the relative-position scores depend only on `i - j`, so chunk-aligned calls over a stream give
the frames of one full block-causal call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import EncoderConfig


class Carry:
    """What the causal modules of one network keep between the chunks of one stream.

    Within a call the modules `take()` their history and `put()` the next one in a fixed order, so the slots need
    no names. `begin()` starts a call, `end(n)` commits it and advances `pos` (positions seen) by n. Modules given
    no carry act as on a fresh stream (zero left context) and keep nothing. Stored tensors are never modified in
    place, so a shallow copy of `slots` is a cheap snapshot. Modules see the carries of a batch as a `CarryBatch`.
    """

    def __init__(self) -> None:
        self.slots: list[Tensor] = []
        self.pos = 0
        self._old: Iterator[Tensor] = iter(())
        self._new: list[Tensor] = []

    def begin(self) -> None:
        self._old, self._new = iter(self.slots), []

    def take(self) -> Tensor | None:
        return next(self._old, None)

    def put(self, t: Tensor) -> None:
        self._new.append(t)

    def end(self, n: int) -> None:
        self.slots, self._new = self._new, []
        self.pos += n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)


class CarryBatch:
    """The carries of B streams run as one right-padded batch (each stream owns g consecutive rows, g = rows // B).

    Stream i has seen `carries[i].pos` positions and brings `lengths[i]` > 0 new ones, padded to the longest. A
    tensor of N·s new positions (N = longest length) runs at s positions per unit: its caches are each row's history
    left-padded to the longest history, then the new positions, so relative distances are the same in every row.
    Padded positions are never stored nor visible to real ones; what each carry stores is exactly what a batch of
    that stream alone stores.
    """

    def __init__(self, carries: list[Carry], lengths: list[int]) -> None:
        if len(carries) != len(lengths) or min(lengths) <= 0:
            raise ValueError(f"a carry batch needs one positive length per carry, got {lengths}")
        self.carries, self.lengths = carries, lengths
        self.starts = [c.pos for c in carries]
        self.longest = max(lengths)

    def begin(self) -> None:
        for c in self.carries:
            c.begin()

    def end(self) -> None:
        for c, n in zip(self.carries, self.lengths, strict=True):
            c.end(n)

    def _rows(self, x: Tensor, dim: int) -> tuple[int, int]:
        """(rows per stream, positions per unit) of a batch tensor with time at `dim`."""
        return x.shape[0] // len(self.carries), x.shape[dim] // self.longest

    def conv(self, x: Tensor, size: int) -> Tensor:
        """x [B·g,C,T] with each row's last `size` earlier inputs prepended (zeros on a fresh stream, as upstream's
        zero padding); stores each row's last `size` real inputs."""
        g, s = self._rows(x, -1)
        hist = [c.take() for c in self.carries]
        if all(h is None for h in hist):
            x = F.pad(x, (size, 0))
        else:
            zeros = x.new_zeros(g, x.shape[1], size)
            x = torch.cat((torch.cat([zeros if h is None else h for h in hist]), x), dim=-1)
        for i, (c, n) in enumerate(zip(self.carries, self.lengths, strict=True)):
            c.put(x[i * g : (i + 1) * g, :, n * s : n * s + size].clone())
        return x

    def conv_windows(self, x: Tensor, k: int) -> Tensor:
        """`conv_windows` of channels-last x [B·g,T,C] over this batch's histories (see `conv`)."""
        return windows(self.conv(x.mT, k - 1), k)

    def cache(self, x: Tensor, dim: int) -> Tensor:
        """New positions x [B·g,...] (time at `dim`) -> each row's cached positions left-padded to the longest
        history, then x; stores each row's cached + real new positions."""
        g, s = self._rows(x, dim)
        full = []
        for i, (c, n) in enumerate(zip(self.carries, self.lengths, strict=True)):
            past, new = c.take(), x[i * g : (i + 1) * g].narrow(dim, 0, n * s)
            if past is not None:
                new = torch.cat((past, new), dim)
            elif new.numel() != x.numel():
                new = new.clone()  # a view would keep the whole batch alive
            c.put(new)
            full.append(new)
        if self.uniform:
            return full[0] if len(full) == 1 else torch.cat(full)
        hmax = self.history(x.shape[dim])
        out = x.new_zeros(*x.shape[:dim], hmax + x.shape[dim], *x.shape[dim + 1 :])
        for i, (t, h) in enumerate(zip(full, self.starts, strict=True)):
            out[i * g : (i + 1) * g].narrow(dim, hmax - h * s, t.shape[dim]).copy_(t)
        return out

    def positions(self, rows: int, n: int, device: torch.device) -> Tensor:
        """[rows, n] or [n]: the absolute position of each of the n new positions of a batch tensor in its own
        stream (padding continues past a row's real ones)."""
        s, g = n // self.longest, rows // len(self.carries)
        new = torch.arange(n, device=device)
        if len(set(self.starts)) == 1:
            return self.starts[0] * s + new
        return to_device([h * s for h in self.starts for _ in range(g)], device)[:, None] + new

    def history(self, n: int) -> int:
        """Cached positions (padded to the longest history) before a batch tensor of n new positions."""
        return max(self.starts) * (n // self.longest)

    @property
    def uniform(self) -> bool:
        """Every stream has the same history and no padding (the batch needs no padding mask)."""
        return len(set(self.starts)) == 1 and all(n == self.longest for n in self.lengths)

    def visibility(self, rows: int, n: int, chunk: int, device: torch.device) -> Tensor | None:
        """[rows,1,n,H+n] or [n,H+n] (True = visible) for the n new positions over `cache`'s keys: a real position
        sees its own row's real keys before the end of its chunk on its own grid (block-causal when chunk > 0).
        None when every key is visible."""
        s, g = n // self.longest, rows // len(self.carries)
        if self.uniform:
            return chunk_visibility(self.starts[0] * s, n, self.starts[0] * s + n, chunk, device)
        hmax = self.history(n)
        hist = to_device([h * s for h in self.starts for _ in range(g)], device)
        ends = to_device([m * s for m in self.lengths for _ in range(g)], device)
        keys = torch.arange(hmax + n, device=device)
        pos = keys[None, :] - hmax + hist[:, None]  # [rows, K] each key's position in its own row
        vis = ((pos >= 0) & (keys[None, :] < hmax + ends[:, None]))[:, None, :]
        if chunk > 0:
            limit = ((hist[:, None] + torch.arange(n, device=device)) // chunk + 1) * chunk  # [rows, n]
            vis = vis & (pos[:, None, :] < limit[:, :, None])
        return vis[:, None]


def to_device(values: list[int], device: torch.device) -> Tensor:
    """A small int64 tensor on `device` without a host sync (a blocking host-to-device copy waits for the GPU)."""
    return torch.tensor(values).to(device, non_blocking=True)


def chunk_visibility(start: int, n: int, k_len: int, chunk: int, device: torch.device) -> Tensor | None:
    """Block-causal mask [n, k_len] (True = visible) for queries at positions start..start+n-1 over keys
    0..k_len-1: a query sees every key before the end of its chunk. None when every key is visible."""
    if chunk <= 0 or (start // chunk + 1) * chunk >= k_len:
        return None
    limit = (torch.arange(start, start + n, device=device) // chunk + 1) * chunk
    return torch.arange(k_len, device=device)[None, :] < limit[:, None]


def conv_history(x: Tensor, carry: CarryBatch | None, size: int) -> Tensor:
    """`x` [B,C,T] with `size` frames of left history prepended (zeros without a carry)."""
    return F.pad(x, (size, 0)) if carry is None else carry.conv(x, size)


def windows(full: Tensor, k: int) -> Tensor:
    """[B,C,k-1+T] inputs -> [B,T,C·k]: frame t's k inputs t..t+k-1 in a conv weight's [C, k] order (one copy)."""
    return full.unfold(2, k, 1).transpose(1, 2).reshape(full.shape[0], full.shape[2] - k + 1, -1)


def conv_windows(x: Tensor, carry: CarryBatch | None, k: int) -> Tensor:
    """Channels-last x [B,T,C] -> [B,T,C·k]: each frame's window of its k-1 earlier inputs (from the carry, which
    keeps the history the next chunk needs; zeros without one) and itself, so that a k-tap causal conv is one matmul.
    A paged carry (engine/flow_cache.py) makes them in one kernel."""
    return windows(F.pad(x.mT, (k - 1, 0)), k) if carry is None else carry.conv_windows(x, k)


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm -> x sqrt(d) (upstream `LinearNoSubsampling` + the rel-pos encoder's x scaling)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.scale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale


class PreLookahead(nn.Module):
    """Conv k=L+1 over [x, L look-ahead frames] -> LeakyReLU -> causal conv k=3, plus the input. The hidden width
    `channels` defaults to the input's (CosyVoice2); CosyVoice3 widens 80 to 1024."""

    def __init__(self, in_channels: int, lookahead: int, channels: int | None = None) -> None:
        super().__init__()
        self.lookahead = lookahead
        hidden = in_channels if channels is None else channels
        self.conv1 = nn.Conv1d(in_channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, in_channels, 3)

    def forward(self, x: Tensor, carry: CarryBatch | None) -> Tensor:
        """x [B,n+L,C]: n frames, then each row's look-ahead frames (zeros where a row has fewer than L) -> [B,n,C]."""
        y = F.leaky_relu(self.conv1(x.transpose(1, 2)))
        y = self.conv2(conv_history(y, carry, self.conv2.kernel_size[0] - 1))
        return y.transpose(1, 2) + x[:, : x.shape[1] - self.lookahead]


class Upsample1D(nn.Module):
    """Nearest x stride, then a causal conv k = 2*stride+1."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor, carry: CarryBatch | None) -> Tensor:
        """x [B,C,n] -> [B,C,stride*n]."""
        y = x.repeat_interleave(self.stride, dim=-1)
        return self.conv(conv_history(y, carry, 2 * self.stride))


class RelPositionAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions (upstream `RelPositionMultiHeadedAttention`):
    score(i, j) = ((q_i + u)·k_j + (q_i + v)·P(i - j)) / sqrt(d_k), P = linear_pos(sinusoid(i - j)).
    The stream cache holds K and V of every earlier position (model dtype), one row [K | V] per position."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))

    def forward(self, x: Tensor, pe: Tensor, visible: Tensor | None, carry: CarryBatch | None) -> Tensor:
        """x [B,n,d] at the positions after the (padded) cached ones; pe [n+K-1, d] = sinusoids of the relative
        distances K-1 down to -(n-1) (K = cached + n keys); visible broadcastable to [B,1,n,K] or None."""
        b, n, _ = x.shape
        q = self.linear_q(x).view(b, n, self.heads, self.d_k)
        kv = torch.cat((self.linear_k(x), self.linear_v(x)), dim=-1)  # [B,n,2d]: a position's K and V as one row
        if carry is not None:
            kv = carry.cache(kv, dim=1)
        k_len, w = kv.shape[1], pe.shape[0]
        k, v = kv.view(b, k_len, 2, self.heads, self.d_k).permute(2, 0, 3, 1, 4)  # [B,h,K,d_k] each
        p = self.linear_pos(pe).view(w, self.heads, self.d_k).permute(1, 2, 0)  # [h, d_k, W]
        bd = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p).contiguous()  # [B,h,n,W]
        # Query a sits at position K-n+a, so key j is at distance K-n+a-j = table row n-1-a+j: a view with row
        # stride W-1 from column n-1 (upstream's "rel_shift", generalised to n queries over K keys).
        strides = (self.heads * n * w, n * w, w - 1, 1)
        bd = bd.as_strided((b, self.heads, n, k_len), strides, bd.storage_offset() + n - 1)
        scale = 1.0 / math.sqrt(self.d_k)
        bias = bd * scale
        if visible is not None:
            bias = bias.masked_fill(~visible, float("-inf"))
        out = F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), k, v, bias, scale=scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, n, self.heads * self.d_k))


class FeedForward(nn.Module):
    def __init__(self, dim: int, units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, units)
        self.w_2 = nn.Linear(units, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm self-attention + FFN (upstream conformer without macaron FFN or conv module)."""

    def __init__(self, dim: int, heads: int, units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(dim, heads)
        self.feed_forward = FeedForward(dim, units)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, pe: Tensor, visible: Tensor | None, carry: CarryBatch | None) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pe, visible, carry)
        return x + self.feed_forward(self.norm_ff(x))


class UpsampleConformerEncoder(nn.Module):
    """Token embeddings [B,n,in] (+ look-ahead) -> hidden states [B, stride*n, d] at the mel frame rate."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.output_size
        if cfg.input_size != d:
            raise ValueError(f"encoder input_size ({cfg.input_size}) must equal output_size ({d}) (up_embed)")
        self.chunk, self.stride = cfg.static_chunk_size, cfg.up_stride
        self.embed = LinearEmbed(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookahead(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerLayer(d, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.up_layer = Upsample1D(d, cfg.up_stride)
        self.up_embed = LinearEmbed(cfg.input_size, d)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(d, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: Tensor, real: Tensor | None, streaming: bool, carry: CarryBatch | None = None) -> Tensor:
        """x [B,n+L,in]: each row's token embeddings (following the positions its carry has seen), then its
        look-ahead embeddings; `real` [B,n+L,1] zeroes the slots past a row's real tokens/look-ahead (None: all
        real). -> [B, stride*n, d]. Attention is block-causal iff `streaming`."""
        if carry is not None:
            carry.begin()
        x = self.embed(x)
        x = self.pre_lookahead_layer(x if real is None else x * real, carry)
        x = self._stage(self.encoders, x, self.chunk if streaming else 0, carry)
        x = self.up_layer(x.transpose(1, 2), carry).transpose(1, 2)
        x = self._stage(self.up_encoders, self.up_embed(x), self.chunk * self.stride if streaming else 0, carry)
        if carry is not None:
            carry.end()
        return self.after_norm(x)

    @staticmethod
    def _stage(layers: nn.ModuleList, x: Tensor, chunk: int, carry: CarryBatch | None) -> Tensor:
        n, d = x.shape[1], x.shape[2]
        if carry is None:
            k_len, visible = n, chunk_visibility(0, n, n, chunk, x.device)
        else:
            k_len, visible = carry.history(n) + n, carry.visibility(x.shape[0], n, chunk, x.device)
        pe = rel_pos_table(k_len - 1, -(n - 1), d, x.device).to(x.dtype)
        for layer in layers:
            x = layer(x, pe, visible, carry)
        return x


def rel_pos_table(hi: int, lo: int, d: int, device: torch.device) -> Tensor:
    """Sinusoids of the relative distances hi, hi-1, ..., lo: [hi-lo+1, d], columns (sin, cos) interleaved
    (upstream `EspnetRelPositionalEncoding`, computed the same way in float32; not stored in the checkpoint)."""
    inv_freq = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / d))
    arg = torch.arange(hi, lo - 1, -1, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack((arg.sin(), arg.cos()), dim=-1).flatten(1)
