"""CFM velocity estimator: upstream `CausalConditionalDecoder`, a one-level 1-D U-Net of causal resnet blocks and
transformer blocks (diffusers `BasicTransformerBlock` layout).

The U-Net runs channels-last ([B, T, C]), like its transformer blocks: a conv is one matmul (a k-tap conv is a
Linear over k consecutive frames, its weight viewed as [C_out, C_in·k]), and LayerNorm over channels needs no
transpose. Channels-first convs cost two layout copies each (transposes around it, or cuDNN's own), and small
batches are launch-bound: fewer kernels is what makes a step faster.
Every causal conv and attention can run chunk by chunk through a `Carry` (see flow_encoder): a conv keeps its
last k-1 input frames; a transformer block keeps its normalised attention inputs and recomputes K/V from them,
because at full size these are 4x smaller than K and V (256 channels vs 2 x 512 inner dims). Several streams
run as one padded batch through a `CarryBatch`.
Sub-module indices that hold no weights upstream (transposes, dropouts) are `nn.Identity` placeholders so the
state-dict keys match the checkpoint.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import EstimatorConfig
from cosyvoice_opt.models import fused
from cosyvoice_opt.models.flow_encoder import CarryBatch, chunk_visibility, conv_windows
from cosyvoice_opt.models.parallel_linear import ParallelLinear


def sinusoidal_time_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoid of 1000·t ([B] -> [B, dim]: sines, then cosines), computed in float32 like upstream."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    arg = 1000 * t.float()[:, None] * freq[None, :]
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else x * mask


def pointwise(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """A 1x1 conv on channels-last x [B,T,C_in] -> [B,T,C_out]."""
    return F.linear(x, conv.weight[..., 0], conv.bias)


class CausalConv1d(nn.Conv1d):
    """Conv1d whose output frame t sees input frames t-k+1..t (left history from the carry, zeros at the start).
    Channels-last: x [B,T,C_in] -> [B,T,C_out], one matmul over each frame's window (`conv_windows`)."""

    def forward(self, x: Tensor, carry: CarryBatch | None = None) -> Tensor:
        return F.linear(conv_windows(x, carry, self.kernel_size[0]), self.weight.flatten(1), self.bias)


class CausalBlock1D(nn.Module):
    """mask -> causal conv k3 -> LayerNorm over channels -> Mish -> mask, on [B,T,C] (+ `add`, in the same kernel)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out)])

    def forward(self, x: Tensor, mask: Tensor | None, carry: CarryBatch | None, add: Tensor | None = None) -> Tensor:
        y = self.block[0](_masked(x, mask), carry)
        return fused.layer_norm_mish(y, self.block[2], mask, add)


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor | None, temb: Tensor, carry: CarryBatch | None) -> Tensor:
        """x [B,T,C], mask [B,T,1] or None; temb [B,1,C] = `mlp` of the time embedding (the caller computes every
        resnet's at once: `CausalConditionalDecoder.time_projections`)."""
        h = self.block1(x, mask, carry, add=temb)
        return self.block2(h, mask, carry, add=pointwise(self.res_conv, _masked(x, mask)))


class Attention(nn.Module):
    """Self-attention (q/k/v without bias, out with bias); the stream cache holds the inputs of earlier frames. Without
    earlier frames (no carry, or a chunk with no history) q, k and v are one matmul; with them, k and v read the
    history too, and q only the new frames."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.qkv = ParallelLinear(self.to_q, self.to_k, self.to_v)

    def forward(self, x: Tensor, visible: Tensor | None, carry: CarryBatch | None) -> Tensor:
        """x [B,n,C] following the (padded) cached frames; visible: an additive mask broadcastable to [B,1,n,K], or
        None."""
        b, n, _ = x.shape
        ctx = x if carry is None else carry.cache(x, dim=1)
        if ctx.shape[1] == n:
            q, k, v = self.qkv(x).view(b, n, 3 * self.heads, self.head_dim).transpose(1, 2).chunk(3, dim=1)
        else:
            q = self.to_q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
            k, v = self.qkv(ctx, first=1).view(b, -1, 2 * self.heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class GELUProj(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(GELUProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """x + Attn(LN(x)), then x + FF(LN(x)) with FF = Linear(4x) -> GELU -> Linear.

    The residual stream travels beside the block's output unsummed (as the LLM's layers do), so each add is one
    kernel with the LayerNorm after it (`fused.add_layer_norm`); the stage sums the last block's pair."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, residual: Tensor | None, visible: Tensor | None,
                carry: CarryBatch | None) -> tuple[Tensor, Tensor]:
        """(FF output, the residual stream before it) for x + residual (x alone when residual is None)."""
        h, residual = fused.add_layer_norm(x, residual, self.norm1)
        h, residual = fused.add_layer_norm(self.attn1(h, visible, carry), residual, self.norm3)
        return self.ff(h), residual


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalConditionalDecoder(nn.Module):
    """v(x, mu, t, spks, cond) -> [B, out_channels, T]; inputs stacked as channels [x, mu, spks, cond]."""

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        if len(cfg.channels) != 1:
            raise ValueError(f"only a one-level estimator U-Net is supported (CosyVoice2), got channels {cfg.channels}")
        c = cfg.channels[0]
        temb_dim = 4 * c
        self.in_channels, self.chunk = cfg.in_channels, cfg.static_chunk_size
        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb_dim)

        def stage(dim_in: int) -> list[nn.Module]:
            blocks = (TransformerBlock(c, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks))
            return [CausalResnetBlock1D(dim_in, c, temb_dim), nn.ModuleList(blocks)]

        self.down_blocks = nn.ModuleList([nn.ModuleList([*stage(cfg.in_channels), CausalConv1d(c, c, 3)])])
        self.mid_blocks = nn.ModuleList(nn.ModuleList(stage(c)) for _ in range(cfg.num_mid_blocks))
        self.up_blocks = nn.ModuleList([nn.ModuleList([*stage(2 * c), CausalConv1d(c, c, 3)])])
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, cfg.out_channels, 1)
        # every resnet projects the same Mish(time embedding): one matmul for all of them (see `ParallelLinear`)
        resnets = [self.down_blocks[0][0], *(stage[0] for stage in self.mid_blocks), self.up_blocks[0][0]]
        self.time_projections = ParallelLinear(*(resnet.mlp[1] for resnet in resnets))

    def fuse_projections_(self) -> None:
        """Each attention's q/k/v, and every resnet's time projection, as one matmul (after the last dtype/device
        move)."""
        self.time_projections.fuse_()
        for m in self.modules():
            if isinstance(m, Attention):
                m.qkv.fuse_()

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        carry: CarryBatch | None = None,
    ) -> Tensor:
        """x, mu, cond [B,80,n]; mask [B,1,n] padding (None = all valid); t [B]; spks [B,80]. With a carry, each
        stream's rows follow the frames its carry has seen and the carry masks the padding (pass mask=None then)."""
        n, chunk = x.shape[-1], self.chunk if streaming else 0
        if carry is not None:
            carry.begin()
        temb_act = F.mish(self.time_mlp(sinusoidal_time_embedding(t, self.in_channels).to(x.dtype)))
        down_t, *mid_t, up_t = self.time_projections.each(temb_act[:, None, :])
        # channels-last from here on (one cat kernel reads the channels-first inputs)
        h = torch.cat((x.mT, mu.mT, spks[:, None, :].expand(-1, n, -1), cond.mT), dim=-1)
        if carry is None:
            visible = chunk_visibility(0, n, n, chunk, x.device)
        else:
            visible = carry.visibility(x.shape[0], n, chunk, x.device)
        if mask is not None:
            keys = mask.bool()[:, None]  # [B,1,1,n]
            visible = keys if visible is None else keys & visible
        # additive once here, not in each of the 56 SDPAs (a paged carry's comes additive, computed once per chunk)
        if visible is not None and visible.dtype == torch.bool:
            visible = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
        frames = None if mask is None else mask.mT  # [B,T,1]
        (resnet, blocks, conv), = self.down_blocks
        h = self._stage(resnet, blocks, h, frames, down_t, visible, carry)
        skip = h
        h = conv(_masked(h, frames), carry)
        for (resnet, blocks), temb in zip(self.mid_blocks, mid_t, strict=True):
            h = self._stage(resnet, blocks, h, frames, temb, visible, carry)
        (resnet, blocks, conv), = self.up_blocks
        h = self._stage(resnet, blocks, torch.cat((h, skip), dim=-1), frames, up_t, visible, carry)
        h = conv(_masked(h, frames), carry)
        h = self.final_block(h, frames, carry)
        if carry is not None:
            carry.end()
        return _masked(pointwise(self.final_proj, _masked(h, frames)).mT, mask)  # [B,80,T], a transposed view

    @staticmethod
    def _stage(
        resnet: CausalResnetBlock1D,
        blocks: nn.ModuleList,
        h: Tensor,
        mask: Tensor | None,
        temb: Tensor,
        visible: Tensor | None,
        carry: CarryBatch | None,
    ) -> Tensor:
        h, residual = resnet(h, mask, temb, carry), None
        for block in blocks:
            h, residual = block(h, residual, visible, carry)
        return h if residual is None else h + residual
