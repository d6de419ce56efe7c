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
    no Carry act as on a fresh stream (zero left context) and keep nothing. Stored tensors are never modified in
    place, so a shallow copy of `slots` is a cheap snapshot.
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


def chunk_visibility(start: int, n: int, k_len: int, chunk: int, device: torch.device) -> Tensor | None:
    """Block-causal mask [n, k_len] (True = visible) for queries at positions start..start+n-1 over keys
    0..k_len-1: a query sees every key before the end of its chunk. None when every key is visible."""
    if chunk <= 0 or (start // chunk + 1) * chunk >= k_len:
        return None
    limit = (torch.arange(start, start + n, device=device) // chunk + 1) * chunk
    return torch.arange(k_len, device=device)[None, :] < limit[:, None]


def conv_history(x: Tensor, carry: Carry | None, size: int) -> Tensor:
    """`x` [B,C,T] with its left history prepended (zeros on a fresh stream, as upstream's zero padding); stores
    the last `size` input frames for the next chunk."""
    hist = carry.take() if carry is not None else None
    if hist is None:
        hist = x.new_zeros(x.shape[0], x.shape[1], size)
    x = torch.cat((hist, x), dim=-1)
    if carry is not None:
        carry.put(x[..., x.shape[-1] - size :].clone())
    return x


class LinearEmbed(nn.Module):
    """Linear -> LayerNorm -> x sqrt(d) (upstream `LinearNoSubsampling` + the rel-pos encoder's x scaling)."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.scale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale


class PreLookahead(nn.Module):
    """Conv k=L+1 over [x, L look-ahead frames] -> LeakyReLU -> causal conv k=3, plus the input."""

    def __init__(self, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, x: Tensor, context: Tensor, carry: Carry | None) -> Tensor:
        """x [B,n,C]; context [B,c,C] with c <= L real look-ahead frames (the rest are zeros)."""
        y = torch.cat((x, context), dim=1).transpose(1, 2)
        y = F.pad(y, (0, self.lookahead - context.shape[1]))
        y = F.leaky_relu(self.conv1(y))
        y = self.conv2(conv_history(y, carry, self.conv2.kernel_size[0] - 1))
        return y.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest x stride, then a causal conv k = 2*stride+1."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor, carry: Carry | None) -> Tensor:
        """x [B,C,n] -> [B,C,stride*n]."""
        y = x.repeat_interleave(self.stride, dim=-1)
        return self.conv(conv_history(y, carry, 2 * self.stride))


class RelPositionAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions (upstream `RelPositionMultiHeadedAttention`):
    score(i, j) = ((q_i + u)·k_j + (q_i + v)·P(i - j)) / sqrt(d_k), P = linear_pos(sinusoid(i - j)).
    The stream cache holds K and V of every earlier position (model dtype)."""

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

    def forward(self, x: Tensor, pe: Tensor, visible: Tensor | None, carry: Carry | None) -> Tensor:
        """x [B,n,d] at the positions after the cached ones; pe [n+K-1, d] = sinusoids of the relative distances
        K-1 down to -(n-1) (K = cached + n keys); visible [n,K] or None."""
        b, n, _ = x.shape
        q = self.linear_q(x).view(b, n, self.heads, self.d_k)
        kv = torch.stack((self.linear_k(x), self.linear_v(x))).view(2, b, n, self.heads, self.d_k).transpose(2, 3)
        past = carry.take() if carry is not None else None
        if past is not None:
            kv = torch.cat((past, kv), dim=3)
        if carry is not None:
            carry.put(kv)
        k_len, w = kv.shape[3], pe.shape[0]
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
        out = F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), kv[0], kv[1], bias, scale=scale)
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

    def forward(self, x: Tensor, pe: Tensor, visible: Tensor | None, carry: Carry | None) -> Tensor:
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

    def forward(self, x: Tensor, context: Tensor, streaming: bool, carry: Carry | None = None) -> Tensor:
        """x [B,n,in] token embeddings following the `carry.pos` already encoded; context [B,c,in] (c <= L) real
        look-ahead embeddings (none when the sequence ends here). Attention is block-causal iff `streaming`."""
        start = carry.pos if carry is not None else 0
        if carry is not None:
            carry.begin()
        x = self.pre_lookahead_layer(self.embed(x), self.embed(context), carry)
        x = self._stage(self.encoders, x, start, self.chunk if streaming else 0, carry)
        x = self.up_layer(x.transpose(1, 2), carry).transpose(1, 2)
        chunk = self.chunk * self.stride if streaming else 0
        x = self._stage(self.up_encoders, self.up_embed(x), start * self.stride, chunk, carry)
        if carry is not None:
            carry.end(x.shape[1] // self.stride)
        return self.after_norm(x)

    @staticmethod
    def _stage(layers: nn.ModuleList, x: Tensor, start: int, chunk: int, carry: Carry | None) -> Tensor:
        n, d = x.shape[1], x.shape[2]
        k_len = start + n
        pe = rel_pos_table(k_len - 1, -(n - 1), d, x.device).to(x.dtype)
        visible = chunk_visibility(start, n, k_len, chunk, x.device)
        for layer in layers:
            x = layer(x, pe, visible, carry)
        return x


def rel_pos_table(hi: int, lo: int, d: int, device: torch.device) -> Tensor:
    """Sinusoids of the relative distances hi, hi-1, ..., lo: [hi-lo+1, d], columns (sin, cos) interleaved
    (upstream `EspnetRelPositionalEncoding`, computed the same way in float32; not stored in the checkpoint)."""
    inv_freq = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / d))
    arg = torch.arange(hi, lo - 1, -1, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack((arg.sin(), arg.cos()), dim=-1).flatten(1)
