"""Repetition-aware sampling (RAS) of speech tokens, batched on the device without host syncs.

Upstream draws with `torch.multinomial` from the global RNG, so a request's tokens depend on everything
else that used the RNG. Here every row draws by inverse CDF from two uniforms it is given, and
`sampling_uniforms` derives those from the row's own (seed, step) with a counter-based hash: a request's
tokens depend only on its seed, never on the batch it shares (up to the logits themselves). Same rule as
upstream's `ras_sampling`, so the distribution is upstream's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cosyvoice_opt.config import SamplingConfig
from cosyvoice_opt.models import fused

_MASK32 = 0xFFFFFFFF


def nucleus(probs: Tensor, top_p: float, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Upstream's top-p/top-k set: `probs [B, V]` -> `(ids, p, kept)`, each `[B, min(top_k, V)]`.

    `ids`/`p` are the largest probabilities in stable descending order; `kept` marks the nucleus: items
    taken in order while the sum of those before is < top_p (so the crossing item is included), at most
    top_k. `kept` is always a non-empty prefix.
    """
    p, ids = _largest(probs, min(top_k, probs.shape[-1]))
    cum = p.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    return ids, p, before < top_p


def _largest(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `k` largest of `probs [B, V]` (>= 0) and their ids, in stable descending order: what a stable sort's first
    `k` are, from one `topk` over keys that are unique. A probability's float32 bits order as its value does, and the
    low bits of its key rank the lower id first among equal ones. A sort of the whole row is radix passes and memory
    sets, and a captured graph that holds memory sets launches slowly."""
    v = probs.shape[-1]
    low = 1 << max(1, (v - 1).bit_length())  # ids fit below it
    ids = torch.arange(v, device=probs.device)
    keys = probs.float().view(torch.int32).long() * low + (low - 1 - ids)
    top = (low - 1) - keys.topk(k, dim=-1).values % low
    return probs.gather(-1, top), top


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index `[B, 1]` drawn with probability proportional to `weights [B, N]` (>= 0), for `u [B]` in (0, 1):
    the first index whose cumulative weight exceeds `u * total` (never a zero-weight one)."""
    cdf = weights.cumsum(dim=-1)
    below = (cdf <= u[:, None] * cdf[:, -1:]).sum(dim=-1, keepdim=True)
    return below.clamp_(max=weights.shape[-1] - 1)


def ras_sample(
    logp: Tensor, uniforms: Tensor, history: Tensor, ignore_eos: Tensor, eos_id: int | range, cfg: SamplingConfig
) -> Tensor:
    """One speech id per row.

    logp `[B, V]` log-probs; uniforms `[B, 2]` in (0, 1) (column 0: nucleus draw, column 1: redraw);
    history `[B, win_size]` last emitted ids, -1 where empty; ignore_eos `[B]` bool: mask id `eos_id` (a range of
    consecutive ids: every one of them; `LLMConfig.min_len_masked_ids`).
    Nucleus draw from the kept unnormalised probabilities; if that id occurs >= win_size * tau_r times in
    the row's history, redraw from the full softmax with it masked. Returns long `[B]`. Where the fused kernels run
    (CUDA) this is one kernel, `fused.ras_sample`; the composition below is what it is tested against.
    """
    if history.shape[-1] != cfg.win_size:
        raise ValueError(f"history must have win_size={cfg.win_size} columns, got {history.shape[-1]}")
    masked = range(eos_id, eos_id + 1) if isinstance(eos_id, int) else eos_id
    if masked.step != 1:
        raise ValueError(f"the masked ids must be consecutive, got {masked}")
    if fused.active(logp):
        return fused.ras_sample(logp, uniforms, history, ignore_eos, masked, cfg.top_p, cfg.top_k,
                                cfg.win_size * cfg.tau_r)
    vocab = torch.arange(logp.shape[-1], device=logp.device)
    in_masked = (vocab >= masked.start) & (vocab < masked.stop)
    scores = logp.float().masked_fill(ignore_eos[:, None] & in_masked, float("-inf"))
    ids, p, kept = nucleus(scores.softmax(dim=-1), cfg.top_p, cfg.top_k)
    first = ids.gather(1, _inverse_cdf(p * kept, uniforms[:, 0]))
    repeated = (history == first).sum(dim=-1) >= cfg.win_size * cfg.tau_r
    redraw = _inverse_cdf(scores.scatter(1, first, float("-inf")).softmax(dim=-1), uniforms[:, 1])
    return torch.where(repeated, redraw[:, 0], first[:, 0])


def push_history(history: Tensor, ids: Tensor) -> Tensor:
    """Shift each row left by one and append `ids [B]` (the window of the last win_size emitted ids)."""
    return torch.cat([history[:, 1:], ids[:, None].to(history.dtype)], dim=1)


def _mul32(x: Tensor, c: int) -> Tensor:
    """`(x * c) mod 2**32` for int64 `x` in [0, 2**32) without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """Bijective 32-bit integer mix (Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sampling_uniforms(seeds: Tensor, steps: Tensor) -> Tensor:
    """Uniforms `[B, 2]` float32 in (0, 1) from per-row `seeds [B]` and `steps [B]` (integer tensors).

    Counter-based: pure elementwise integer ops, so the same (seed, step) gives the same numbers on any
    device, in any batch, inside a CUDA graph. Seeds use all 64 bits; steps the low 32.
    """
    seeds, steps = seeds.long(), steps.long()
    key = _hash32(_hash32((seeds & _MASK32) ^ 0x9E3779B9) ^ ((seeds >> 32) & _MASK32))
    base = _hash32(key ^ (steps & _MASK32))
    bits = torch.stack([_hash32(base ^ 0x85EBCA6B), _hash32(base ^ 0xC2B2AE35)], dim=-1) >> 8
    return (bits.float() + 0.5) * 2.0**-24
