"""Triton kernels that fuse the elementwise work of the LLM's decode step and the flow's Euler step, with the PyTorch
composition as the fallback.

A decode step and a flow Euler step of a few rows are launch-bound: composed of PyTorch ops, a decode step of 1-8
rows is 432 kernels and 1.7 ms on the H200, an Euler step of one row 1,088 kernels and 3.3 ms, most of them a few
microseconds of elementwise work between the matmuls (docs/benchmarks.md, kernel census). These kernels fuse it:

* `add_rms_norm`: the LLM's residual add and the next RMSNorm (two kernels -> one, twice per layer);
* `silu_mul`: SwiGLU's SiLU and product (two -> one);
* `rope_to_cache`: rope over the fused q|k|v heads, the k/v write into the cache slot and q's folded layout
  (multiply, concatenation, multiply-add, a layout copy and the cache's index write -> one);
* `decode_attention`: one query position per row against its slot's first `length` keys (split along the keys,
  no mask tensor). cuDNN's attention, the fastest of SDPA's backends at this shape (12 against 27 us per call on the
  H200), makes every launch of a graph that holds it slow: 1.2 ms of host time for a decode step holding it and a
  sort, 0.02 ms for one of plain kernels (engine/llm_runner.py);
* `ras_sample`: the speech token's repetition-aware sampling (about 50 kernels and a `topk` -> one);
* `add_layer_norm`: the flow estimator's residual add and the next LayerNorm (two -> one, twice per block);
* `layer_norm_mish`: the flow's causal conv blocks' LayerNorm and Mish, and the resnet's add after the block (three
  -> one). PyTorch's LayerNorm kernel is also slow at 256 channels (35 us per call at 64 rows, a seventh of a large
  Euler step), where this one tiles rows;
* `causal_windows`: a causal conv's input windows from its paged history and new frames, and the history it leaves
  (four -> one per conv);
* `modulated_layer_norm`: the DiT's gated residual add and the AdaLN-Zero modulation of the LayerNorm after it
  (product, sum, norm, `1 + scale`, product, sum: six -> one, twice per block);
* `rope_pairs_`: the DiT's interleaved-pair rope over q and k, in place (about fourteen -> one per block).

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
from torch import Tensor, nn

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported torch wheel on Linux brings Triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DECODE_KEYS = 64  # keys per program of `decode_attention`
enabled = True  # tests and benchmarks switch the kernels off to compare


def active(t: Tensor) -> bool:
    """Whether the kernels run for tensors like `t` (not while `torch.compile` traces: Inductor fuses the composition
    itself)."""
    return enabled and triton is not None and (t.is_cuda or INTERPRET) and not torch.compiler.is_compiling()


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual) over the last dim; without a residual, (RMSNorm(x), x)."""
    if residual is None:
        return F.rms_norm(x, weight.shape, weight, eps), x
    if not active(x):
        s = x + residual
        return F.rms_norm(s, weight.shape, weight, eps), s
    n = x.shape[-1]
    x2, r2 = x.contiguous().view(-1, n), residual.contiguous().view(-1, n)
    out, s = torch.empty_like(x2), torch.empty_like(x2)
    _add_rms_norm[(x2.shape[0],)](x2, r2, weight, out, s, n, eps, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape), s.view(x.shape)


def add_layer_norm(x: Tensor, residual: Tensor | None, norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    """(norm(x + residual), x + residual) for a LayerNorm over the last dim; without a residual, (norm(x), x)."""
    if residual is None:
        return norm(x), x
    if not active(x):
        s = x + residual
        return norm(s), s
    return _layer_norm(x, residual, norm, mish=False)


def layer_norm_mish(x: Tensor, norm: nn.LayerNorm, mask: Tensor | None = None, add: Tensor | None = None) -> Tensor:
    """Mish(norm(x)) · mask + add for a LayerNorm over the last dim of x [B, T, C] (the flow's causal conv blocks;
    a resnet adds its time projection [B, 1, C] to the first block's output and its residual [B, T, C] to the
    second's). mask [B, T, 1] or None; add [B, 1 or T, C] or None."""
    if not active(x):
        y = F.mish(norm(x))
        y = y if mask is None else y * mask
        return y if add is None else y + add
    if mask is not None:  # padded calls (upstream's whole-utterance call) mask between the norm and the add
        y = _layer_norm(x, None, norm, mish=True)[0] * mask
        return y if add is None else y + add
    return _layer_norm(x, None, norm, mish=True, add=add)[0]


def _layer_norm(x: Tensor, residual: Tensor | None, norm: nn.LayerNorm, mish: bool,
                add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n, frames = x.shape[-1], 1
    x2 = x.contiguous().view(-1, n)
    r2 = x2 if residual is None else residual.contiguous().view(-1, n)
    if add is None:
        add, add_strides = x2, (0, 0)
    else:  # x [B, T, C]
        frames, add = x.shape[1], add.expand(*x.shape)
        add = add if add.stride(-1) == 1 else add.contiguous()
        add_strides = add.stride()[-3:-1]
    out = torch.empty_like(x2)
    s = out if residual is None else torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    rows = max(1, 2048 // block)
    _add_layer_norm[(triton.cdiv(x2.shape[0], rows),)](
        x2, r2, norm.weight, norm.bias, out, s, add, x2.shape[0], frames, n, norm.eps, *add_strides,
        HAS_RESIDUAL=residual is not None, MISH=mish, ADD=add is not x2, ROWS=rows, BLOCK=block)
    return out.view(x.shape), s.view(x.shape)


def causal_windows(history: Tensor, x: Tensor, tails: Tensor, store: Tensor, store_rows: Tensor) -> Tensor:
    """A causal conv's input windows, and the history it leaves, in one pass (the composition is a concatenation, a
    gather, an indexed copy and the windows' copy: four kernels per conv).

    history [R, k-1, C] (each row's inputs before x) and x [R, n, C] -> [R, n, C·k]: frame t's window, inputs
    t .. t+k-1 of history ++ x, in the conv weight's [C, k] order, so that the conv is one matmul. Inputs
    tails[r] .. tails[r]+k-2 of row r of history ++ x (its last real ones) go to store[store_rows[r]] ([(k-1)·C],
    frames then channels)."""
    r, size, c = history.shape
    n, k = x.shape[1], size + 1
    if not active(x):
        full = torch.cat((history, x), dim=1)
        last = (tails[:, None] + torch.arange(size, device=x.device))[..., None].expand(-1, -1, c)
        store.index_copy_(0, store_rows, full.gather(1, last).reshape(r, size * c))
        return full.unfold(1, k, 1).reshape(r, n, c * k)
    if history.stride(2) != 1 or history.stride(1) != c or store.stride(1) != 1:
        raise ValueError("causal_windows reads a history and a store of packed frames, channels next to each other")
    x = x if x.stride(2) == 1 else x.contiguous()
    out = x.new_empty(r, n, c * k)
    block_w = triton.next_power_of_2(c * k)
    block_t = max(1, 4096 // block_w)
    _causal_windows[(r, triton.cdiv(n, block_t))](
        history, x, out, tails, store, store_rows, n, c, history.stride(0), x.stride(0), x.stride(1), store.stride(0),
        K=k, BLOCK_T=block_t, BLOCK_W=block_w, BLOCK_C=triton.next_power_of_2(c))
    return out


def modulated_layer_norm(x: Tensor, gated: tuple[Tensor, Tensor] | None, shift: Tensor, scale: Tensor,
                         eps: float) -> tuple[Tensor, Tensor]:
    """(LayerNorm(s) · (1 + scale) + shift, s) for s = x + gate · y with `gated` = (y, gate), else s = x: AdaLN-Zero's
    gated residual and the modulated norm after it. x, y [B, T, C]; gate, shift, scale [B, 1, C]; the LayerNorm over C
    has no affine parameters."""
    if not active(x):
        if gated is not None:
            y, gate = gated
            x = x + gate * y
        return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift, x
    b, t, n = x.shape
    x2 = x.contiguous().view(-1, n)
    y2, gate = (x2, shift) if gated is None else (gated[0].contiguous().view(-1, n), gated[1])
    vectors = [v.expand(b, 1, n) for v in (gate, shift, scale)]
    if any(v.stride(-1) != 1 for v in vectors):
        vectors = [v.contiguous() for v in vectors]
    out = torch.empty_like(x2)
    s = x2 if gated is None else torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    rows = max(1, 2048 // block)
    _modulated_layer_norm[(triton.cdiv(x2.shape[0], rows),)](
        x2, y2, *vectors, out, s, x2.shape[0], t, n, eps, *(v.stride(0) for v in vectors), HAS_GATE=gated is not None,
        ROWS=rows, BLOCK=block)
    return out.view(x.shape), s.view(x.shape)


def rope_pairs_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `r = cos.shape[-1]` channels of every group of x [B, T, G, C] in interleaved pairs, in place:
    (a, b) -> (a·c - b·s, b·c + a·s), computed in float32 and rounded once. cos, sin [B or 1, T, r] (or [T, r]),
    float32, each pair's angle repeated; the same for every group. Returns x."""
    r = cos.shape[-1]
    if not active(x) or (r // 2) & (r // 2 - 1):  # the kernel takes a power-of-two number of pairs
        head = x[..., :r]
        pairs = head.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        head.copy_(head * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2))
        return x
    b, t, g, n = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rope_pairs_ rotates channels that lie next to each other")
    cos, sin = (c.expand(b, t, r) for c in (cos, sin))
    _rope_pairs[(b * t,)](x, cos, sin, t, g, *x.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], HALF=r // 2,
                          BLOCK_G=triton.next_power_of_2(g))
    return x


def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up for `gate_up` = [..., gate | up] (SwiGLU)."""
    if not active(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    n = gate_up.shape[-1] // 2
    gu = gate_up.contiguous().view(-1, 2 * n)
    out = gu.new_empty(gu.shape[0], n)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul[(gu.shape[0], triton.cdiv(n, block))](gu, out, n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of folded queries `q [B, kv_heads, G, D]` (one position each: G = the query heads per kv head) over
    `k`, `v [B, kv_heads, S, D]`, row b reading its keys `0 .. lengths[b]-1` (1 <= lengths[b] <= S). Without the
    kernels, SDPA with `mask [B, 1, G, S]` (additive, the same keys visible) runs instead.

    Split along the keys (flash-decoding): one program per block of `DECODE_KEYS` keys of a (row, kv head), then one
    per query that weighs the blocks' partial softmaxes together. A program per (row, kv head) walking its keys
    would leave one row's step to two programs in a row (22 us per call at 512 keys, against 12 for cuDNN)."""
    if not active(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q = q.contiguous()
    b, kv_heads, g, d = q.shape
    splits = triton.cdiv(k.shape[2], DECODE_KEYS)
    block_g = max(16, triton.next_power_of_2(g))  # the smallest tile `tl.dot` takes
    part = q.new_empty(b * kv_heads, splits, block_g, d + 2, dtype=torch.float32)  # acc | max | sum, per query
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays fp32 (TF32 is Triton's default)
    _decode_attention_blocks[(b * kv_heads, splits)](
        q, k, v, lengths, part, kv_heads, g, d ** -0.5, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        BLOCK_G=block_g, BLOCK_S=DECODE_KEYS, D=d, PRECISION=precision)
    out = torch.empty_like(q)
    _decode_attention_merge[(b * kv_heads, g)](part, lengths, out, kv_heads, splits, *out.stride()[:3], BLOCK_G=block_g,
                                               BLOCK_S=DECODE_KEYS, SPLITS=triton.next_power_of_2(splits), D=d)
    return out


def ras_sample(logp: Tensor, uniforms: Tensor, history: Tensor, ignore_eos: Tensor, masked: range, top_p: float,
               top_k: int, min_repeats: float) -> Tensor:
    """`sampling.ras_sample` in one kernel, one program per row (the composition is ~50 kernels and a `topk`, a
    tenth of a one-row decode step): the masked softmax, the top-k in stable descending order by one max over keys
    that are unique (a probability's float32 bits, then the reversed id, as `sampling._largest`), the nucleus draw
    with `uniforms[:, 0]` by inverse CDF, and, if the history holds that id at least `min_repeats` times, the redraw
    from the whole softmax without it with `uniforms[:, 1]`. Returns long `[B]`."""
    b, v = logp.shape
    # rows are read with their own stride: the window is a column slice of the decode state, read in place
    logp, uniforms, history = (t if t.stride(-1) == 1 else t.contiguous() for t in (logp, uniforms, history))
    out = torch.empty(b, dtype=torch.long, device=logp.device)
    _ras_sample[(b,)](logp, uniforms, history, ignore_eos.contiguous(), out, v, history.shape[1], logp.stride(0),
                      uniforms.stride(0), history.stride(0), masked.start, masked.stop, top_p, min_repeats,
                      TOP_K=min(top_k, v), BLOCK_K=triton.next_power_of_2(top_k),
                      BLOCK_V=triton.next_power_of_2(v), BLOCK_W=triton.next_power_of_2(history.shape[1]),
                      ID_BITS=max(1, (v - 1).bit_length()), num_warps=8)
    return out


def rope_and_fold(qkv: Tensor, cos: Tensor, signed_sin: Tensor, heads: int, kv_heads: int,
                  layer_cache: Tensor | None = None,
                  write: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The PyTorch composition: rope over qkv `[B, T, heads + 2 kv_heads, D]` (`x * cos + rotate_half(x) * sin`, the
    sign of rotate_half in sin), then (q folded for grouped attention `[B, kv_heads, group * T, D]`, rows ordered
    (group, T); the rotated k and the v `[B, T, 2 kv_heads, D]`). With `write` = (slots, positions), each `[B*T]`,
    the k/v also go to `layer_cache [2, slots, kv_heads, S, D]`."""
    b, t, _, d = qkv.shape
    g = heads // kv_heads
    x1, x2 = qkv.chunk(2, dim=-1)
    qkv = torch.addcmul(qkv * cos, torch.cat((x2, x1), dim=-1), signed_sin)
    kv = qkv[:, :, heads:]
    if write is not None:
        layer_cache[:, write[0], :, write[1]] = kv.reshape(b * t, 2, kv_heads, d)
    return qkv[:, :, :heads].view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d), kv


def rope_to_cache(qkv: Tensor, cos: Tensor, signed_sin: Tensor, layer_cache: Tensor, slots: Tensor,
                  positions: Tensor, heads: int, kv_heads: int) -> Tensor:
    """`rope_and_fold` with the k/v written to `layer_cache` at (slots, positions), returning only the folded q (cos/sin
    of qkv's shape; v's are 1 and 0): one kernel."""
    b, t, nh, d = qkv.shape
    g = heads // kv_heads
    if not active(qkv) or (d // 2) & (d // 2 - 1):  # the kernel takes a power-of-two half head
        return rope_and_fold(qkv, cos, signed_sin, heads, kv_heads, layer_cache, (slots, positions))[0]
    q = qkv.new_empty(b, kv_heads, g * t, d)
    qkv, cos, signed_sin = qkv.contiguous(), cos.contiguous(), signed_sin.contiguous()
    _rope_to_cache[(b * t, nh)](qkv, cos, signed_sin, q, layer_cache, slots.contiguous(), positions.contiguous(), t,
                                heads, kv_heads, g, *layer_cache.stride()[:4], HALF=d // 2)
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

    @triton.jit(do_not_specialize=["n_rows", "frames", "s_ab", "s_at"])  # one compiled kernel for every batch shape
    def _add_layer_norm(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, a_ptr, n_rows, frames, n, eps, s_ab, s_at,
                        HAS_RESIDUAL: tl.constexpr, MISH: tl.constexpr, ADD: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
        rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n_rows) & (cols < n)
        x = tl.load(x_ptr + rows * n + cols, mask=mask, other=0.0)
        s = x.to(tl.float32)
        if HAS_RESIDUAL:
            s = (s + tl.load(r_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + rows * n + cols, s, mask=mask)
            s = s.to(tl.float32)
        mean = tl.sum(s, axis=1)[:, None] / n
        dev = tl.where(mask, s - mean, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(dev * dev, axis=1)[:, None] / n + eps)
        w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        y = dev * inv * w + b
        if MISH:  # x · tanh(softplus(x)) = x · e(2 + e) / (e(2 + e) + 2), e = exp(x): no cancellation for x << 0
            y = y.to(x.dtype).to(tl.float32)  # the norm's output is rounded, as the composition's
            e = tl.exp(tl.minimum(y, 20.0))
            p = e * (2.0 + e)
            y = tl.where(y > 20.0, y, y * p / (p + 2.0))
        if ADD:  # the activation is rounded, then the sum, as the composition's
            a = tl.load(a_ptr + (rows // frames) * s_ab + (rows % frames) * s_at + cols, mask=mask, other=0.0)
            y = y.to(x.dtype).to(tl.float32) + a.to(tl.float32)
        tl.store(out_ptr + rows * n + cols, y.to(x.dtype), mask=mask)

    @triton.jit(do_not_specialize=["n", "s_h", "s_x", "s_xt", "s_store"])  # one compiled kernel per conv width
    def _causal_windows(h_ptr, x_ptr, out_ptr, tails_ptr, store_ptr, rows_ptr, n, c, s_h, s_x, s_xt, s_store,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        """BLOCK_T frames' windows of one row, each written whole (column w: channel w // K, tap w % K); the row's
        first program also stores its last K-1 inputs."""
        row = tl.program_id(0).to(tl.int64)
        t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
        w = tl.arange(0, BLOCK_W)[None, :]
        ch, f = w // K, t + w % K  # f: the frame of history ++ x
        valid = (t < n) & (w < c * K)
        past = f < K - 1
        old = tl.load(h_ptr + row * s_h + f * c + ch, mask=valid & past, other=0.0)
        new = tl.load(x_ptr + row * s_x + (f - (K - 1)) * s_xt + ch, mask=valid & (f >= K - 1), other=0.0)
        tl.store(out_ptr + (row * n + t) * (c * K) + w, tl.where(past, old, new), mask=valid)
        if tl.program_id(1) == 0:
            first = tl.load(tails_ptr + row)
            dest = store_ptr + tl.load(rows_ptr + row) * s_store
            chans = tl.arange(0, BLOCK_C)
            for i in tl.static_range(K - 1):
                frame = first + i
                kept = tl.load(h_ptr + row * s_h + frame * c + chans, mask=(chans < c) & (frame < K - 1), other=0.0)
                came = tl.load(x_ptr + row * s_x + (frame - (K - 1)) * s_xt + chans,
                               mask=(chans < c) & (frame >= K - 1), other=0.0)
                tl.store(dest + i * c + chans, tl.where(frame < K - 1, kept, came), mask=chans < c)

    @triton.jit(do_not_specialize=["n_rows", "frames", "s_gate", "s_shift", "s_scale"])  # one kernel for every shape
    def _modulated_layer_norm(x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, out_ptr, sum_ptr, n_rows, frames, n, eps,
                              s_gate, s_shift, s_scale, HAS_GATE: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK: tl.constexpr):
        rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < n_rows) & (cols < n)
        batch = rows // frames
        x = tl.load(x_ptr + rows * n + cols, mask=mask, other=0.0)
        s = x.to(tl.float32)
        if HAS_GATE:  # each product and sum rounded, as the composition's
            y = tl.load(y_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptr + batch * s_gate + cols, mask=mask, other=0.0).to(tl.float32)
            s = (s + (gate * y).to(x.dtype).to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + rows * n + cols, s, mask=mask)
            s = s.to(tl.float32)
        mean = tl.sum(s, axis=1)[:, None] / n
        dev = tl.where(mask, s - mean, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(dev * dev, axis=1)[:, None] / n + eps)
        normed = (dev * inv).to(x.dtype).to(tl.float32)
        scale = tl.load(scale_ptr + batch * s_scale + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + batch * s_shift + cols, mask=mask, other=0.0).to(tl.float32)
        scaled = (normed * (1.0 + scale).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + rows * n + cols, (scaled + shift).to(x.dtype), mask=mask)

    @triton.jit(do_not_specialize=["t_len", "sxb", "scb", "ssb"])  # one kernel for every shape
    def _rope_pairs(x_ptr, cos_ptr, sin_ptr, t_len, groups, sxb, sxt, sxg, scb, sct, ssb, sst, HALF: tl.constexpr,
                    BLOCK_G: tl.constexpr):
        """Every group's first 2·HALF channels of one (row, frame)."""
        token = tl.program_id(0).to(tl.int64)
        b, t = token // t_len, token % t_len
        g = tl.arange(0, BLOCK_G)[:, None]
        k = tl.arange(0, HALF)[None, :]
        even = x_ptr + b * sxb + t * sxt + g * sxg + 2 * k
        mask = (g < groups) & (k < HALF)
        a = tl.load(even, mask=mask, other=0.0)
        o = tl.load(even + 1, mask=mask, other=0.0)
        c_e = tl.load(cos_ptr + b * scb + t * sct + 2 * k)
        c_o = tl.load(cos_ptr + b * scb + t * sct + 2 * k + 1)
        s_e = tl.load(sin_ptr + b * ssb + t * sst + 2 * k)
        s_o = tl.load(sin_ptr + b * ssb + t * sst + 2 * k + 1)
        af, of = a.to(tl.float32), o.to(tl.float32)
        tl.store(even, (af * c_e + (-of) * s_e).to(a.dtype), mask=mask)
        tl.store(even + 1, (of * c_o + af * s_o).to(a.dtype), mask=mask)

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

    @triton.jit
    def _decode_attention_blocks(q_ptr, k_ptr, v_ptr, len_ptr, part_ptr, kv_heads, group, scale, sqb, sqh, sqg, skb,
                                 skh, sks, svb, svh, svs, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                                 D: tl.constexpr, PRECISION: tl.constexpr):
        """Block `program_id(1)` of keys of one (row, kv head): its scores' max, their exp-sum and the exp-weighted
        values, per query (a block past the row's length computes nothing that the merge reads)."""
        bh, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, h = bh // kv_heads, bh % kv_heads
        rows, cols = tl.arange(0, BLOCK_G), tl.arange(0, D)
        idx = block * BLOCK_S + tl.arange(0, BLOCK_S)
        seen = idx < tl.load(len_ptr + b)
        q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqg + cols[None, :], mask=rows[:, None] < group,
                    other=0.0)
        k = tl.load(k_ptr + b * skb + h * skh + idx[:, None] * sks + cols[None, :], mask=seen[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(seen[None, :], s * scale, float("-inf"))
        m = tl.maximum(tl.max(s, axis=1), -1e30)  # finite in a block past the length, so no NaN from -inf - -inf
        p = tl.exp(s - m[:, None])
        v = tl.load(v_ptr + b * svb + h * svh + idx[:, None] * svs + cols[None, :], mask=seen[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        base = part_ptr + ((bh * tl.num_programs(1) + block) * BLOCK_G + rows) * (D + 2)
        tl.store(base[:, None] + cols[None, :], acc)
        tl.store(base + D, m)
        tl.store(base + D + 1, tl.sum(p, axis=1))

    @triton.jit
    def _decode_attention_merge(part_ptr, len_ptr, out_ptr, kv_heads, splits, sob, soh, sog, BLOCK_G: tl.constexpr,
                                BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr):
        """One query of one (row, kv head): its key blocks' partial softmaxes rescaled to their common max."""
        bh, row = tl.program_id(0).to(tl.int64), tl.program_id(1)
        b, h = bh // kv_heads, bh % kv_heads
        blocks, cols = tl.arange(0, SPLITS), tl.arange(0, D)
        used = (blocks < tl.cdiv(tl.load(len_ptr + b), BLOCK_S)) & (blocks < splits)
        base = part_ptr + ((bh * splits + blocks) * BLOCK_G + row) * (D + 2)
        m = tl.load(base + D, mask=used, other=float("-inf"))
        w = tl.exp(m - tl.max(m, axis=0))
        total = tl.sum(w * tl.load(base + D + 1, mask=used, other=0.0), axis=0)
        acc = tl.load(base[:, None] + cols[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(out_ptr + b * sob + h * soh + row * sog + cols, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _inverse_cdf(weights, u, n):
        """The first index whose cumulative weight exceeds u · total (as `sampling._inverse_cdf`), at most n - 1."""
        cdf = tl.cumsum(weights, axis=0)
        below = tl.sum((cdf <= u * tl.max(cdf, axis=0)).to(tl.int32), axis=0)
        return tl.minimum(below, n - 1)

    @triton.jit
    def _ras_sample(logp_ptr, u_ptr, hist_ptr, ignore_ptr, out_ptr, v, win, s_logp, s_u, s_hist, mask_start,
                    mask_stop, top_p, min_repeats, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_W: tl.constexpr, ID_BITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ids = tl.arange(0, BLOCK_V)
        hidden = (ids >= v) | ((tl.load(ignore_ptr + row) != 0) & (ids >= mask_start) & (ids < mask_stop))
        scores = tl.load(logp_ptr + row * s_logp + ids, mask=ids < v, other=0.0).to(tl.float32)
        scores = tl.where(hidden, float("-inf"), scores)
        e = tl.exp(scores - tl.max(scores, axis=0))
        probs = e / tl.sum(e, axis=0)
        # the k largest, largest first, the lower id first among equal ones: one max per rank over unique keys
        low = (1 << ID_BITS) - 1
        keys = tl.where(ids < v, (probs.to(tl.int32, bitcast=True).to(tl.int64) << ID_BITS) + (low - ids), -1)
        ranks = tl.arange(0, BLOCK_K)
        top_ids = tl.zeros([BLOCK_K], tl.int32)
        weights = tl.zeros([BLOCK_K], tl.float32)
        cum = 0.0
        for i in tl.static_range(TOP_K):
            best = tl.max(keys, axis=0)
            keys = tl.where(keys == best, -1, keys)
            idx = (low - (best & low)).to(tl.int32)
            p = (best >> ID_BITS).to(tl.int32).to(tl.float32, bitcast=True)
            top_ids = tl.where(ranks == i, idx, top_ids)
            weights = tl.where(ranks == i, tl.where(cum < top_p, p, 0.0), weights)  # the nucleus: sum before < top_p
            cum += p
        pick = _inverse_cdf(weights, tl.load(u_ptr + row * s_u), TOP_K)
        first = tl.sum(tl.where(ranks == pick, top_ids, 0), axis=0)
        w = tl.arange(0, BLOCK_W)
        recent = tl.load(hist_ptr + row * s_hist + w, mask=w < win, other=-1)
        token = first
        if tl.sum((recent == first).to(tl.float32), axis=0) >= min_repeats:
            again = tl.where(ids == first, float("-inf"), scores)
            e2 = tl.exp(again - tl.max(again, axis=0))
            token = _inverse_cdf(e2 / tl.sum(e2, axis=0), tl.load(u_ptr + row * s_u + 1), v)
        tl.store(out_ptr + row, token.to(tl.int64))
