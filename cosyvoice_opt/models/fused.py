"""Triton kernels that fuse the LLM decode step's elementwise work, with the PyTorch composition as the fallback.

A decode step is launch-bound: on the H200 one step of 1-8 rows is 432 kernels and 1.7 ms, most of them a few
microseconds of elementwise work between the matmuls (docs/benchmarks.md, kernel census). Per layer these three
replace eight kernels with three:

* `add_rms_norm`: the residual add and the next RMSNorm (two kernels -> one, twice per layer);
* `silu_mul`: SwiGLU's SiLU and product (two -> one);
* `rope_to_cache`: rope over the fused q|k|v heads, the k/v write into the cache slot and q's folded layout
  (multiply, concatenation, multiply-add, a layout copy and the cache's index write -> one).

Each rounds where the PyTorch composition rounds (the sum before the norm, `x * cos` before the rope's add), so they
differ from it only by the order of fp32 operations. They run on CUDA tensors when Triton is importable and
`enabled` is set; everywhere else (CPU, the parity tests) the composition runs. Under `TRITON_INTERPRET=1`
(set before this module is imported) the kernels run on CPU tensors too, which is how the tests check them without
a GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported torch wheel on Linux brings Triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
enabled = True  # tests and benchmarks switch the kernels off to compare


def active(t: Tensor) -> bool:
    """Whether the kernels run for tensors like `t`."""
    return enabled and triton is not None and (t.is_cuda or INTERPRET)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual) over the last dim; without a residual, (RMSNorm(x), x)."""
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps), x
    if not active(x):
        s = x + residual
        return F.rms_norm(s, weight.shape, weight, eps), s
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    out, s = torch.empty_like(x2), torch.empty_like(x2)
    _add_rms_norm[(x2.shape[0],)](x2, r2, weight, out, s, n, eps, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), s.view(x.shape)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up for `gate_up` = [..., gate | up] (SwiGLU)."""
    if not active(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    n = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * n)
    out = gu.new_empty(gu.shape[0], n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul[(gu.shape[0], triton.cdiv(n, block))](gu, out, n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x `[B, T, heads, D]`: `x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1) (the sign is in sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)


def rope_to_cache(qkv: Tensor, cos: Tensor, signed_sin: Tensor, layer_cache: Tensor, slots: Tensor,
                  positions: Tensor, heads: int, kv_heads: int) -> Tensor:
    """Rope over qkv `[B, T, heads + 2 kv_heads, D]` (cos/sin of the same shape; v's are 1 and 0); the rotated k and
    the v of token (b, t) go to `layer_cache [2, slots, kv_heads, S, D]` at slot `slots[b*T + t]`, position
    `positions[b*T + t]`. Returns q folded for grouped attention: `[B, kv_heads, group * T, D]`, rows ordered
    (group, T)."""
    b, t, nh, d = qkv.shape
    g = heads // kv_heads
    if not active(qkv) or (d // 2) & (d // 2 - 1):  # the kernel takes a power-of-two half head
        qkv = rope(qkv, cos, signed_sin)
        layer_cache[:, slots, :, positions] = qkv[:, :, heads:].reshape(b * t, 2, kv_heads, d)
        return qkv[:, :, :heads].view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
    q = qkv.new_empty(b, kv_heads, g * t, d)
    qkv, cos, signed_sin = qkv.contiguous(), cos.contiguous(), signed_sin.contiguous()
    _rope_to_cache[(b * t, nh)](qkv, cos, signed_sin, q, layer_cache, slots.contiguous(), positions.contiguous(), t,
                                heads, kv_heads, g,
                                *layer_cache.stride()[:4], HALF=d // 2)
    return q


if triton is not None:

    @triton.jit
    def _add_rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        r = tl.load(r_ptr + row * n + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded, as the composition's add
        tl.store(sum_ptr + row * n + cols, s, mask=mask)
        s = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (s * inv * w).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(gu_ptr + row * 2 * n + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (g / (1.0 + tl.exp(-g)) * u).to(gate.dtype), mask=mask)

    @triton.jit(do_not_specialize=["t_len"])  # decode's 1 and the extends' lengths share one compiled kernel
    def _rope_to_cache(qkv_ptr, cos_ptr, sin_ptr, q_ptr, cache_ptr, slot_ptr, pos_ptr, t_len, heads, kv_heads,
                       group, stride_kv, stride_slot, stride_head, stride_pos, HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # b * T + t
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        base = (token * (heads + 2 * kv_heads) + head) * 2 * HALF
        d = tl.arange(0, HALF)
        x1 = tl.load(qkv_ptr + base + d)
        x2 = tl.load(qkv_ptr + base + HALF + d)
        c1 = tl.load(cos_ptr + base + d).to(tl.float32)
        c2 = tl.load(cos_ptr + base + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + base + d).to(tl.float32)
        s2 = tl.load(sin_ptr + base + HALF + d).to(tl.float32)
        # x * cos is rounded first, then rotate_half(x) * sin added in fp32 (as `rope`'s addcmul)
        o1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32) + x2.to(tl.float32) * s1
        o2 = (x2.to(tl.float32) * c2).to(x1.dtype).to(tl.float32) + x1.to(tl.float32) * s2
        if head < heads:
            b = token // t_len
            t = token % t_len
            kv = head // group
            row = (b * kv_heads + kv) * group * t_len + (head % group) * t_len + t
            dst = q_ptr + row * 2 * HALF
        else:
            which = (head - heads) // kv_heads  # 0: k, 1: v
            slot = tl.load(slot_ptr + token)
            pos = tl.load(pos_ptr + token)
            dst = (cache_ptr + which * stride_kv + slot * stride_slot + ((head - heads) % kv_heads) * stride_head
                   + pos * stride_pos)
        tl.store(dst + d, o1.to(x1.dtype))
        tl.store(dst + HALF + d, o2.to(x1.dtype))
