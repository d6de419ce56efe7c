"""CFM velocity estimator of CosyVoice3: upstream `DiT` (F5-TTS style diffusion transformer).

    temb = MLP(sinusoid(1000 t))
    h    = Linear(cat[x, cond, mu, spks]);  h += CausalConvPositionEmbedding(h)
    depth x DiTBlock:  AdaLN-Zero(temb) -> self-attention with RoPE -> gated residual -> AdaLN -> tanh-GELU FFN
    out  = Linear(LN(h) * (1 + scale) + shift)

Upstream quirk kept (the weights were trained with it): RoPE is applied to the un-split `[B, T, heads * dim_head]`
q and k over `dim_head` channels, so only head 0 gets positions; the other heads are position-free.

Attention is full (`streaming=False`) or block-causal over `static_chunk_size`-frame chunks counted from frame 0
(`streaming=True`). Everything that mixes time is causal in streaming mode, so the model can run chunk by chunk
through a carry (`flow_encoder.CarryBatch`): each conv takes its left history from it, each attention keeps the
rotated keys and values of every earlier frame (computed once) and reads them back, and RoPE gives each new frame
its absolute position.

An Euler step of a few rows is launch-bound, so a block is few kernels: q/k/v as one matmul with the rope applied in
place (`fused.rope_pairs_`), every block's AdaLN-Zero projection in one matmul per step (`DiT.modulations`), and each
gated residual add fused with the modulated norm after it (`fused.modulated_layer_norm`): the residual stream travels
beside a block's output unsummed, and the next block (or the output norm) adds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import DiTConfig
from cosyvoice_opt.models import fused
from cosyvoice_opt.models.flow_encoder import CarryBatch, chunk_visibility, conv_history
from cosyvoice_opt.models.flow_estimator import sinusoidal_time_embedding
from cosyvoice_opt.models.parallel_linear import ParallelLinear

LN_EPS = 1e-6  # the DiT's LayerNorms: over channels, without affine parameters


class TimestepEmbedding(nn.Module):
    """t [B] -> [B, dim]: sinusoid of 1000 t (float32) -> Linear -> SiLU -> Linear."""

    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(sinusoidal_time_embedding(t, self.freq_dim).to(self.time_mlp[0].weight.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs, each left-padded (or fed its history) and followed by Mish, on channels-last x."""

    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    def forward(self, x: Tensor, carry: CarryBatch | None) -> Tensor:
        y = x.transpose(1, 2)
        for conv in (self.conv1, self.conv2):
            y = conv(conv_history(y, carry, conv[0].kernel_size[0] - 1))
        return y.transpose(1, 2)


class InputEmbedding(nn.Module):
    """[x, cond, mu, spks] (channels-last, that order) -> Linear -> plus its causal conv position embedding."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, carry: CarryBatch | None) -> Tensor:
        h = self.proj(torch.cat((x, cond, mu, spks[:, None, :].expand(-1, x.shape[1], -1)), dim=-1))
        return self.conv_pos_embed(h, carry) + h


class RotaryEmbedding(nn.Module):
    """x-transformers' rotary embedding: angle `p * inv_freq[k]` for the interleaved channel pair (2k, 2k+1).

    `inv_freq` is a persistent buffer in upstream's checkpoint, so it is one here too; the angles use the same values
    recomputed in float32 (a model cast to bf16 would round the buffer, and positions reach 15000)."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self.frequencies())

    def frequencies(self, device: torch.device | None = None) -> Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [..., n] -> (cos, sin), each [..., n, dim] in float32."""
        inv_freq = self.frequencies(positions.device)
        freqs = (positions.float()[..., None] * inv_freq).repeat_interleave(2, dim=-1)
        return freqs.cos(), freqs.sin()


class Attention(nn.Module):
    """Multi-head self-attention, q/k/v/out with bias, RoPE on the first `dim_head` channels of q and k (rotated in
    interleaved pairs: (a, b) -> (a·cos - b·sin, b·cos + a·sin))."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.qkv = ParallelLinear(self.to_q, self.to_k, self.to_v)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], visible: Tensor | None,
                carry: CarryBatch | None) -> Tensor:
        """x [B,n,dim] following the carry's (padded) frames; rope for the n new positions; visible: an additive
        mask broadcastable to [B,1,n,K], or None."""
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads * self.dim_head)
        fused.rope_pairs_(qkv[:, :, :2], *rope)
        kv = qkv[:, :, 1:].flatten(2)  # a frame's K and V as one row
        if carry is not None:
            kv = carry.cache(kv, dim=1)
        k, v = kv.view(b, kv.shape[1], 2, self.heads, self.dim_head).permute(2, 0, 3, 1, 4)
        q = qkv[:, :, 0].view(b, n, self.heads, self.dim_head).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, self.heads * self.dim_head))


class AdaLayerNormZero(nn.Module):
    """SiLU(temb) -> Linear -> n modulation vectors [B, 1, dim] each (shift, scale, gate, ... in upstream's order).
    The DiT applies every block's projection in one matmul (`DiT.modulations`); this holds the weights."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, n * dim)
        self.n = n


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(),
                                nn.Linear(inner, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim, 6)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, gated: tuple[Tensor, Tensor] | None, mods: Tensor, rope: tuple[Tensor, Tensor],
                visible: Tensor | None, frames: Tensor | None,
                carry: CarryBatch | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x + gate·y (`gated` = (y, gate): the block before's output, added here with the norm after it; None: x
        alone) -> the same for the next block: (the residual stream, (FF output, its gate)).

        mods [B, 1, 6·dim]: this block's AdaLN-Zero vectors; frames [B,n,1] bool: the attention output of padded
        frames is zeroed (upstream), None = all real."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=-1)
        h, x = fused.modulated_layer_norm(x, gated, shift_msa, scale_msa, LN_EPS)
        attn = self.attn(h, rope, visible, carry)
        if frames is not None:
            attn = attn.masked_fill(~frames, 0.0)
        h, x = fused.modulated_layer_norm(x, (attn, gate_msa), shift_mlp, scale_mlp, LN_EPS)
        return x, (self.ff(h), gate_mlp)


class DiT(nn.Module):
    """v(x, mu, t, spks, cond) -> [B, out_channels, T]."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg, self.chunk = cfg, cfg.static_chunk_size
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormZero(cfg.dim, 2)  # (scale, shift): upstream's order here
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels)
        # every AdaLN-Zero projection reads SiLU(temb): one matmul for all of them (see `ParallelLinear`)
        norms = [block.attn_norm for block in self.transformer_blocks] + [self.norm_out]
        self.modulations = ParallelLinear(*(norm.linear for norm in norms))

    def fuse_projections_(self) -> None:
        """Each attention's q/k/v, and every AdaLN-Zero projection, as one matmul (after the last dtype/device move)."""
        self.modulations.fuse_()
        for block in self.transformer_blocks:
            block.attn.qkv.fuse_()

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
        b, n = x.shape[0], x.shape[-1]
        chunk = self.chunk if streaming else 0
        if carry is not None:
            carry.begin()
        mods = self.modulations.each(F.silu(self.time_embed(t))[:, None, :])
        h = self.input_embed(x.mT, cond.mT, mu.mT, spks, carry)
        if carry is None:
            positions = torch.arange(n, device=x.device)
            visible = chunk_visibility(0, n, n, chunk, x.device)
        else:
            positions = carry.positions(b, n, x.device)
            visible = carry.visibility(b, n, chunk, x.device)
        frames = None
        if mask is not None:
            keys = mask.bool()[:, None]  # [B,1,1,n]
            visible = keys if visible is None else keys & visible
            frames = mask.bool().mT
        # additive once here, not in each block's SDPA (a paged carry's comes additive, computed once per chunk)
        if visible is not None and visible.dtype == torch.bool:
            visible = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
        rope, gated = self.rotary_embed(positions), None
        for block, block_mods in zip(self.transformer_blocks, mods[:-1], strict=True):
            h, gated = block(h, gated, block_mods, rope, visible, frames, carry)
        if carry is not None:
            carry.end()
        scale, shift = mods[-1].chunk(2, dim=-1)
        return self.proj_out(fused.modulated_layer_norm(h, gated, shift, scale, LN_EPS)[0]).mT
