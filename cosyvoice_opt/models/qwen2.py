"""Compact Qwen2 decoder (the CosyVoice2 LLM backbone) with a static, slotted KV cache.

Three entry points share one layer stack: `forward` (whole sequences, no cache: teacher forcing),
`prefill` (one request's embeddings into its cache slot) and `decode` (one token for each of B requests
in arbitrary slots, each at its own position). `decode` has static shapes and no host syncs, so it can be
captured in a CUDA graph per batch size.

GQA without copying the cache: the `group = num_heads // num_kv_heads` query heads sharing a kv head are
folded into the query-length axis, so SDPA sees `kv_heads` heads with `group * T` queries each and reads
the cache as stored (HF repeats k/v instead; the result is the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import Qwen2Config
from cosyvoice_opt.models.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Computed in fp32 whatever the activation dtype (as HF Qwen2)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin `[B, T, 1, head_dim]` for absolute `positions [B, T]` (rotate-half layout, fp32
    angles). The sign of rotate-half's negated half is folded into sin, once per forward instead of per layer.

    Recomputed per call (cheap) rather than kept as a buffer, so meta-device construction needs no re-init.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)[:, :, None, :]
    sin = torch.cat((-sin, sin), dim=-1)[:, :, None, :]
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x `[B, T, heads, D]`: `x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)


@dataclass
class _Step:
    """What one forward pass tells every layer: rope, mask and where its k/v go and come from."""

    cos: Tensor  # [B, T, 1, D]
    sin: Tensor  # signed: (-sin, sin) halves, see rope_cos_sin
    mask: Tensor  # [B, 1, T, S] bool, True = attend
    cache: KVCache | None = None
    write: tuple[Tensor, Tensor] | None = None  # (slot ids, positions), each [B*T]
    read: tuple | None = None  # index of a layer's k (or v) `[slots, kv, S, D]` giving `[B, kv, S', D]`


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, step: _Step, layer_cache: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        kvh, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // kvh
        q = apply_rope(self.q_proj(x).view(b, t, self.num_heads, d), step.cos, step.sin)
        k = apply_rope(self.k_proj(x).view(b, t, kvh, d), step.cos, step.sin)
        v = self.v_proj(x).view(b, t, kvh, d)
        if layer_cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            slot_idx, pos_idx = step.write
            layer_cache[0][slot_idx, :, pos_idx] = k.reshape(b * t, kvh, d)
            layer_cache[1][slot_idx, :, pos_idx] = v.reshape(b * t, kvh, d)
            k, v = layer_cache[0][step.read], layer_cache[1][step.read]
        # fold the query heads of each kv head into the query axis: [B, kv, g*T, D], rows ordered (g, T)
        q = q.view(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
        s = step.mask.shape[-1]
        mask = step.mask[:, :, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.view(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, self.num_heads * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, step: _Step, layer_cache: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, layer_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Token embedding table + decoder stack + final norm; every entry point takes embeddings and
    returns hidden states after the final norm (what CosyVoice2 uses)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _step(self, q_pos: Tensor, kv_len: int, dtype: torch.dtype, **cache_args) -> _Step:
        """Rope for query positions `[B, T]`; causal mask over keys `0 .. kv_len-1` (key j <= query pos)."""
        cos, sin = rope_cos_sin(q_pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        keys = torch.arange(kv_len, device=q_pos.device)
        mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]
        return _Step(cos, sin, mask, **cache_args)

    def _run(self, x: Tensor, step: _Step) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, step, None if step.cache is None else step.cache.layer(i))
        return self.norm(x)

    def forward(self, x: Tensor) -> Tensor:
        """Full causal forward without cache: `[B, T, H] -> [B, T, H]`, positions `0 .. T-1`."""
        b, t, _ = x.shape
        q_pos = torch.arange(t, device=x.device).expand(b, t)
        return self._run(x, self._step(q_pos, t, x.dtype))

    def prefill(self, x: Tensor, cache: KVCache, slot: int, start: int = 0) -> Tensor:
        """Append one request's embeddings `[1, T, H]` to its slot at positions `start .. start+T-1`
        (attending to the slot's first `start` cached positions too). Returns the last hidden `[1, H]`."""
        t = x.shape[1]
        if x.shape[0] != 1 or start < 0 or start + t > cache.max_seq:
            raise ValueError(f"prefill takes [1, T, H] with start + T <= {cache.max_seq}; got {tuple(x.shape)}, "
                             f"start {start}")
        pos = torch.arange(start, start + t, device=x.device)
        step = self._step(
            pos[None], start + t, x.dtype, cache=cache,
            write=(torch.full_like(pos, slot), pos), read=(slice(slot, slot + 1), slice(None), slice(0, start + t)),
        )
        return self._run(x, step)[:, -1]

    def decode(
        self, x: Tensor, cache: KVCache, slots: Tensor | None, positions: Tensor, kv_len: int | None = None
    ) -> Tensor:
        """One token for each of B requests: `x [B, 1, H]`, `positions [B]` (long; row b's token goes to
        `positions[b]` and attends to `0 .. positions[b]` of its slot) -> hidden `[B, H]`.

        `slots [B]` (long) names each row's cache slot; `None` means rows `0..B-1` are slots `0..B-1`, which
        reads the cache as a view instead of gathering it. `kv_len` (a static bound > every position,
        default the whole cache) limits how much of each slot attention reads.
        """
        b = x.shape[0]
        s = cache.max_seq if kv_len is None else kv_len
        rows = torch.arange(b, device=x.device) if slots is None else slots
        read = (slice(0, b) if slots is None else slots, slice(None), slice(0, s))
        step = self._step(positions[:, None], s, x.dtype, cache=cache, write=(rows, positions), read=read)
        return self._run(x, step)[:, 0]


class Qwen2ForCausalLM(nn.Module):
    """Only for the checkpoint layout `model.*` + `lm_head.weight` (tied to `embed_tokens`, same Parameter).
    CosyVoice2 never uses the text head, so it has no forward."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
