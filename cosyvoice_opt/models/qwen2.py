"""Compact Qwen2 decoder (the CosyVoice2 LLM backbone) with a static, slotted KV cache.

Three entry points share one layer stack: `forward` (whole sequences, no cache: teacher forcing),
`prefill` (several requests' prefixes packed into one sequence, each into its own cache slot) and `decode`
(one token for each of B requests in arbitrary slots, each at its own position). `decode` has static shapes
and no host syncs, so it can be captured in a CUDA graph per batch size.

GQA without copying the cache: the `group = num_heads // num_kv_heads` query heads sharing a kv head are
folded into the query-length axis, so SDPA sees `kv_heads` heads with `group * T` queries each and reads
the cache as stored (HF repeats k/v instead; the result is the same).

Few kernels per layer (decode is launch-bound): `fuse_projections_()` runs q/k/v and gate/up as one matmul
each, rope rotates q and k in one pass over the fused heads, k and v go to the cache in one write, and the
attention mask is built once per forward in the folded, additive form SDPA uses (not once per layer). On CUDA the
residual add and the next norm, SwiGLU, rope with the cache write, and decode's attention (which then needs no mask)
are one Triton kernel each (`fused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import Qwen2Config
from cosyvoice_opt.models import fused
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.parallel_linear import ParallelLinear


class RMSNorm(nn.Module):
    """One fused kernel that accumulates in fp32 whatever the activation dtype. HF Qwen2 casts to fp32, normalises,
    casts back and multiplies by the weight (four kernels); the fused form rounds once instead of twice, and decode is
    launch-bound (two norms per layer: 147 of a step's ~720 graph nodes were these casts and products)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(RMSNorm(x + residual), x + residual): the layers pass the residual stream along unsummed, so its add and
        the next norm are one kernel (`fused.add_rms_norm`)."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, rotated: int, plain: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and signed sin `[B, T, rotated + plain, head_dim]` for absolute `positions [B, T]` (rotate-half
    layout, fp32 angles). The sign of rotate-half's negated half is folded into sin, once per forward instead
    of per layer.

    The last `plain` heads (v) get frequency 0, i.e. cos 1 and sin 0: one rope pass over the fused q|k|v heads
    rotates q and k and leaves v exactly as it was, so k and v stay adjacent for a single cache write.
    Recomputed per call (cheap) rather than kept as a buffer, so meta-device construction needs no re-init.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    per_head = torch.cat([inv_freq.expand(rotated, -1), inv_freq.new_zeros(plain, inv_freq.numel())])
    freqs = positions.float()[..., None, None] * per_head
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def causal_mask(q_pos: Tensor, kv_len: int) -> Tensor:
    """`[B, T, kv_len]` bool, True = attend: key j is visible to a query at position `q_pos [B, T]` iff j <= it."""
    keys = torch.arange(kv_len, device=q_pos.device)
    return keys <= q_pos[:, :, None]


@dataclass
class _Step:
    """What one forward pass tells every layer: rope, mask and where its k/v go and come from."""

    cos: Tensor  # [B, T, heads + 2 * kv_heads, D], see rope_cos_sin
    sin: Tensor  # signed: (-sin, sin) halves
    mask: Tensor | None  # [B, 1, group * T, S] additive (0 = attend, -inf), query rows ordered (group, T) as folded
    cache: KVCache | None = None
    write: tuple[Tensor, Tensor] | None = None  # (slot ids, positions), each [B*T]
    read: tuple | None = None  # index into a layer's k and v `[slots, kv, S, D]`; None: this step's own k/v
    lengths: Tensor | None = None  # decode: keys each row reads [B] (its position + 1), for `fused.decode_attention`


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
        self.qkv = ParallelLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, step: _Step, layer_cache: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = h // kvh
        qkv = self.qkv(x).view(b, t, h + 2 * kvh, d)
        if step.read is not None:  # rotated k and v go to the cache, attention reads them from there
            q = fused.rope_to_cache(qkv, step.cos, step.sin, layer_cache, *step.write, h, kvh)
            k, v = layer_cache[(slice(None), *step.read)]
        else:  # this step's own k and v (written to the cache too, when it has one)
            q, kv = fused.rope_and_fold(qkv, step.cos, step.sin, h, kvh, layer_cache, step.write)
            k, v = kv.view(b, t, 2, kvh, d).permute(2, 0, 3, 1, 4)
        if step.lengths is not None:
            out = fused.decode_attention(q, k, v, step.lengths, step.mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)
        out = out.view(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = ParallelLinear(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None, step: _Step,
                layer_cache: Tensor | None) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds the two in the next norm (the
        first layer gets the embeddings as x and no residual)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, step, layer_cache), residual)
        return self.mlp(h), residual


class Qwen2Model(nn.Module):
    """Token embedding table + decoder stack + final norm; every entry point takes embeddings and
    returns hidden states after the final norm (what CosyVoice2 uses)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse_projections_(self) -> Qwen2Model:
        """Run q/k/v and gate/up as one matmul each (see `ParallelLinear`); state_dict keys stay upstream's.

        Call it after the model's final `.to(dtype / device)`: moving it afterwards would give the parameters new
        storage and leave the fused copies behind (a later forward refuses to run). Returns self.
        """
        for layer in self.layers:
            layer.self_attn.qkv.fuse_()
            layer.mlp.gate_up.fuse_()
        return self

    def _step(self, rope_pos: Tensor, visible: Tensor | None, dtype: torch.dtype, **cache_args) -> _Step:
        """Rope for positions `[B, T]`; `visible [B, T, S]` (bool) becomes the folded additive mask (None: no mask,
        the decode kernel reads each row's `lengths`)."""
        cfg = self.cfg
        cos, sin = rope_cos_sin(rope_pos, cfg.head_dim, cfg.rope_theta, cfg.num_heads + cfg.num_kv_heads,
                                cfg.num_kv_heads, dtype)
        if visible is None:
            return _Step(cos, sin, None, **cache_args)
        b, t, s = visible.shape
        g = cfg.num_heads // cfg.num_kv_heads
        # rows padded to a multiple of 16 elements: SDPA's memory-efficient kernel would otherwise pad a copy per layer
        bias = torch.full((b, t, s + -s % 16), float("-inf"), dtype=dtype, device=visible.device)
        bias[..., :s].masked_fill_(visible, 0.0)
        mask = bias[:, None, None].expand(b, 1, g, t, -1).reshape(b, 1, g * t, -1)[..., :s]
        return _Step(cos, sin, mask, **cache_args)

    def _run(self, x: Tensor, step: _Step) -> Tensor:
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, step, None if step.cache is None else step.cache.layer(i))
        return self.norm(x, residual)[0]

    def forward(self, x: Tensor) -> Tensor:
        """Full causal forward without cache: `[B, T, H] -> [B, T, H]`, positions `0 .. T-1`."""
        b, t, _ = x.shape
        q_pos = torch.arange(t, device=x.device).expand(b, t)
        return self._run(x, self._step(q_pos, causal_mask(q_pos, t), x.dtype))

    def prefill(self, x: Tensor, cache: KVCache, slots: Sequence[int], lengths: Sequence[int]) -> Tensor:
        """Several requests' prefixes in one forward: `x [1, sum(lengths), H]` holds request i's `lengths[i]`
        embeddings after those of requests `0..i-1`. Each goes to cache slot `slots[i]` at positions
        `0 .. lengths[i]-1`, attending only to earlier tokens of its own request (block-diagonal causal mask;
        the mask is `sum(lengths)^2`, so callers bound the packed length). Returns each request's last hidden
        `[len(slots), H]`. No host sync."""
        n = x.shape[1]
        if (x.shape[0] != 1 or len(slots) != len(lengths) or sum(lengths) != n
                or not all(0 < length <= cache.max_seq for length in lengths)
                or not all(0 <= s < cache.num_slots for s in slots)):
            raise ValueError(f"prefill takes [1, sum(lengths), H] with 0 < each length <= {cache.max_seq} and "
                             f"slots below {cache.num_slots}; got {tuple(x.shape)}, lengths {list(lengths)}, "
                             f"slots {list(slots)}")
        lens = torch.tensor(lengths)
        ends = lens.cumsum(0)
        request = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        host = torch.cat([torch.arange(n) - (ends - lens)[request], torch.tensor(slots)[request], ends - 1])
        index = host.to(x.device, non_blocking=True)  # a blocking host-to-device copy would wait for the GPU
        pos, slot_ids, last = index[:n], index[n:2 * n], index[2 * n:]
        token = torch.arange(n, device=x.device)
        visible = (token <= token[:, None]) & (token >= (token - pos)[:, None])  # own request's start .. itself
        step = self._step(pos[None], visible[None], x.dtype, cache=cache, write=(slot_ids, pos))
        return self._run(x, step)[0, last]

    def extend(self, x: Tensor, cache: KVCache, slot: int, start: int) -> Tensor:
        """Several positions of one request after its cached ones: `x [1, T, H]` goes to `slot` at positions
        `start .. start+T-1`, attending to the slot's `0 .. start-1` and causally to itself (bidirectional streaming
        feeds text blocks mid-sequence). Returns hidden `[T, H]`."""
        t = x.shape[1]
        if x.shape[0] != 1 or start < 0 or start + t > cache.max_seq or not 0 <= slot < cache.num_slots:
            raise ValueError(f"extend takes [1, T, H] with start + T <= {cache.max_seq} and a slot below "
                             f"{cache.num_slots}; got {tuple(x.shape)} at {start} in slot {slot}")
        pos = torch.arange(start, start + t, device=x.device)[None]
        return self.extend_rows(x, cache, torch.full((1,), slot, device=x.device), pos, start + t)[0]

    def extend_rows(self, x: Tensor, cache: KVCache, slots: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """`extend` for B requests at once: `x [B, T, H]` goes to `slots [B]` at `positions [B, T]`, each row's
        position attending to its slot's `0 .. position`. A row shorter than T is padded by repeating its last input
        at its last position (the same keys and values written again). `kv_len` (> every position) bounds the keys
        read. Returns hidden `[B, T, H]`. No host sync."""
        b, t, _ = x.shape
        write = (slots[:, None].expand(b, t).reshape(-1), positions.reshape(-1))
        step = self._step(positions, causal_mask(positions, kv_len), x.dtype, cache=cache, write=write,
                          read=(slots, slice(None), slice(0, kv_len)))
        return self._run(x, step)

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
        q_pos = positions[:, None]
        visible = None if fused.active(x) else causal_mask(q_pos, s)  # the kernel needs no mask
        step = self._step(q_pos, visible, x.dtype, cache=cache, write=(rows, positions), read=read,
                          lengths=positions + 1)
        return self._run(x, step)[:, 0]


class Qwen2ForCausalLM(nn.Module):
    """Only for the checkpoint layout `model.*` + `lm_head.weight` (tied to `embed_tokens`, same Parameter).
    CosyVoice2 never uses the text head, so it has no forward."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
