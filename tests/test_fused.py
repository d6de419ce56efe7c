"""The Triton kernels of the decode and Euler steps (`models/fused.py`) against the PyTorch composition they
replace: on the CPU through Triton's interpreter (a fresh process with TRITON_INTERPRET=1, in fp32, where both must
agree to rounding), and on a GPU through the real kernels in bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from cosyvoice_opt.config import DiTConfig, EstimatorConfig, Qwen2Config, SamplingConfig
from cosyvoice_opt.engine.llm_runner import LLMRunner
from cosyvoice_opt.models import fused
from cosyvoice_opt.models.dit import DiT
from cosyvoice_opt.models.flow_estimator import CausalConditionalDecoder
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.models.qwen2 import Qwen2Model, rope_cos_sin
from cosyvoice_opt.models.sampling import ras_sample
from cosyvoice_opt.random_model import random_model, randomize_
from tests.conftest import REPO_ROOT
from tests.tolerances import KERNEL_INTERPRETER_MAX_DIFF

triton = pytest.importorskip("triton", reason="the fused kernels are Triton kernels")

CFG = Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  vocab_size=128)


def _both(fn):
    """fn() with the kernels, then with the composition."""
    fused.enabled = True
    try:
        a = fn()
        fused.enabled = False
        return a, fn()
    finally:
        fused.enabled = True


def _max_diff(a, b) -> float:
    if isinstance(a, tuple):
        return max(_max_diff(x, y) for x, y in zip(a, b, strict=True))
    return (a.float() - b.float()).abs().max().item()


@torch.inference_mode()
def _ops(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Max difference, kernels vs composition, of each op on shapes like the decode step's (and one odd width)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    out = {}
    x, r = rand(3, 2, 70), rand(3, 2, 70)
    w = rand(70)
    out["add_rms_norm"] = _max_diff(*_both(lambda: fused.add_rms_norm(x, r, w, 1e-6)))
    gu = rand(5, 2 * 100)
    out["silu_mul"] = _max_diff(*_both(lambda: fused.silu_mul(gu)))
    xs, rs = rand(37, 70) * 3, rand(37, 70)  # 37 rows: the last tile of rows is partial
    norm = torch.nn.LayerNorm(70).to(device, dtype)
    randomize_(norm, 2)
    out["add_layer_norm"] = _max_diff(*_both(lambda: fused.add_layer_norm(xs, rs, norm)))
    out["layer_norm_mish"] = _max_diff(*_both(lambda: fused.layer_norm_mish(xs, norm)))
    # a resnet's adds after its blocks: its time projection (a column slice of one projection, broadcast over the
    # frames), then its residual; and a padded call's mask between the activation and the add
    xr, res = rand(2, 37, 70) * 3, rand(2, 37, 70)
    temb = rand(2, 1, 75)[..., 5:]
    frames = (torch.arange(37) < torch.tensor([[37], [30]]))[..., None].to(device, dtype)
    out["layer_norm_mish + time"] = _max_diff(*_both(lambda: fused.layer_norm_mish(xr, norm, None, temb)))
    out["layer_norm_mish + residual"] = _max_diff(*_both(lambda: fused.layer_norm_mish(xr, norm, None, res)))
    out["masked layer_norm_mish + time"] = _max_diff(*_both(lambda: fused.layer_norm_mish(xr, norm, frames, temb)))
    # a 3-tap conv's windows over a paged history (a column slice of the pool's rows): rows with 37 new frames, 20
    # (their last real inputs inside x) and 1 (the last real inputs straddle the history and x)
    history = rand(3, 10 + 2 * 70)[:, 10:].view(3, 2, 70)
    xw = rand(3, 37, 70)
    tails, store_rows = torch.tensor([37, 20, 1], device=device), torch.tensor([4, 0, 2], device=device)
    stores = [torch.zeros(6, 4 + 2 * 70, dtype=dtype, device=device)[:, 4:] for _ in range(2)]
    windows = _both(lambda: fused.causal_windows(history, xw, tails, stores[fused.enabled], store_rows))
    out["causal_windows"], out["causal_windows store"] = _max_diff(*windows), _max_diff(*stores)
    out["stores written"] = stores[0].abs().amax(dim=1).count_nonzero().item()
    # AdaLN-Zero: rows of two batch rows (37 frames each: a partial last tile), the vectors column slices of one
    # projection (strided rows, as `DiT.modulations` gives them)
    xm, ym = rand(2, 37, 70) * 3, rand(2, 37, 70)
    mods = rand(2, 1, 3 * 70 + 5)[..., 5:].chunk(3, dim=-1)
    out["modulated_layer_norm"] = _max_diff(*_both(lambda: fused.modulated_layer_norm(xm, None, *mods[1:], 1e-6)))
    out["gated modulated_layer_norm"] = _max_diff(*_both(
        lambda: fused.modulated_layer_norm(xm, (ym, mods[0]), *mods[1:], 1e-6)))
    # rope over the first 16 channels of q and k in a q|k|v row (each group 24 wide), angles per row and per frame
    angles = torch.randn(2, 5, 8, generator=g).to(device) * 4
    cos_r, sin_r = (f(angles).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))
    qkv_r = rand(2, 5, 3, 24)
    out["rope_pairs_"] = _max_diff(*_both(lambda: fused.rope_pairs_(qkv_r.clone()[:, :, :2], cos_r, sin_r)))
    b, t, heads, kv, d = 3, 2, 4, 2, 16
    qkv = rand(b, t, heads + 2 * kv, d)
    pos = torch.tensor([[5, 6], [0, 1], [9, 10]])
    cos, sin = rope_cos_sin(pos, d, 1e4, heads + kv, kv, dtype)
    slots = torch.tensor([2, 0, 1]).repeat_interleave(t)
    caches = [torch.zeros(2, 3, kv, 12, d, dtype=dtype, device=device) for _ in range(2)]
    q = _both(lambda: fused.rope_to_cache(qkv, cos.to(device), sin.to(device), caches[fused.enabled],
                                          slots.to(device), pos.reshape(-1).to(device), heads, kv))
    out["rope q"], out["rope cache"] = _max_diff(*q), _max_diff(*caches)
    # decode attention: 7 query heads per kv head (as the release's), keys read from a cache view; lengths of one,
    # of a partial last block and of the whole cache
    q, cache = rand(3, 2, 7, 16), rand(2, 4, 2, 150, 16)
    lengths = torch.tensor([150, 1, 77])
    visible = torch.arange(150) < lengths[:, None]
    mask = torch.zeros(3, 150).masked_fill(~visible, float("-inf"))[:, None, None].expand(3, 1, 7, 150)
    out["decode attention"] = _max_diff(*_both(lambda: fused.decode_attention(
        q, cache[0, :3], cache[1, :3], lengths.to(device), mask.to(device, dtype))))
    out["cache written"] = caches[0].abs().amax(dim=(-1, -3)).count_nonzero().item() / 2  # (slot, pos) pairs
    return out


@torch.inference_mode()
def _ras(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Tokens drawn by the fused RAS kernel that differ from the composition's, over rows of random logits, of
    logits with many exact ties (the top-k's order among equal probabilities), of a dominant stop id that half the
    rows mask, and of a nucleus of exactly three drawn at its far end (0.4, 0.3, 0.12, then 0.1: the sum before the
    fourth is 0.82; 0.45, 0.33, 0.1: before the third, 0.78); every other row's history holds its nucleus draw, so
    it redraws."""
    sc = SamplingConfig()
    g = torch.Generator().manual_seed(5)
    rows, vocab, stop = 56, 6564, range(6561, 6564)
    logits = torch.randint(0, 6, (rows, vocab), generator=g).float() * 1.5
    logits[:16] = torch.randn(16, vocab, generator=g) * 3
    logits[32:48, 6562] = 20.0
    probs = torch.full((8, vocab), 0.08 / (vocab - 4))
    heads = torch.tensor([[0.4, 0.3, 0.12, 0.1]] * 4 + [[0.45, 0.33, 0.1, 0.03]] * 4)
    probs.scatter_(1, torch.randperm(vocab, generator=g)[:32].view(8, 4), heads)
    logits[48:] = probs.log()
    logp = logits.log_softmax(-1).to(device, dtype)
    u = torch.rand(rows, 2, generator=g)
    u[48:, 0] = 0.999
    u = u.to(device)
    ignore = (torch.arange(rows) % 2 == 0).to(device)
    # the window as the decode state holds it: a column slice, its rows strided
    empty = torch.full((rows, 3 + sc.win_size), -1, device=device)[:, 3:]
    fused.enabled = False
    try:
        first = ras_sample(logp, u, empty, ignore, stop, sc)
    finally:
        fused.enabled = True
    history = torch.full((rows, 3 + sc.win_size), -1, device=device)[:, 3:]
    history[1::2, 3] = first[1::2]
    a, b = _both(lambda: ras_sample(logp, u, history, ignore, stop, sc))
    third = logits[48:].topk(3).indices[:, 2].to(device)
    return {"mismatches": (a != b).sum().item(), "redraws": (b != first).sum().item(),
            "unmasked stop": (first[32:48] == 6562).sum().item(), "nucleus end": (first[48:] == third).sum().item()}


@torch.inference_mode()
def _decode(device: str, dtype: torch.dtype) -> dict[str, float]:
    """A small Qwen2: prefill 2 requests, then two decode steps, with the kernels and with the composition."""
    model = randomize_(Qwen2Model(CFG), 0).to(device, dtype)

    def run():
        cache = KVCache(CFG, 2, 16, dtype, device)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, 7, CFG.hidden_size, generator=g).to(device, dtype)
        model.prefill(x, cache, [0, 1], [4, 3])
        outs = []
        for step in range(2):
            token = torch.randn(2, 1, CFG.hidden_size, generator=g).to(device, dtype)
            outs.append(model.decode(token, cache, None, torch.tensor([4 + step, 3 + step], device=device), 16))
        return torch.stack(outs), cache.data

    (h1, c1), (h2, c2) = _both(run)
    return {"hidden": _max_diff(h1, h2), "cache": _max_diff(c1, c2), "scale": h2.abs().max().item()}


@torch.inference_mode()
def _estimator(device: str, dtype: torch.dtype) -> dict[str, float]:
    """A small flow estimator (two stages of two transformer blocks), streaming, with the kernels and without."""
    cfg = EstimatorConfig(in_channels=32, out_channels=8, channels=(32,), attention_head_dim=8, n_blocks=2,
                          num_mid_blocks=1, num_heads=2, static_chunk_size=4)
    est = randomize_(CausalConditionalDecoder(cfg), 3).to(device, dtype).eval()
    g = torch.Generator().manual_seed(4)
    x, mu, cond = (torch.randn(2, 8, 12, generator=g).to(device, dtype) for _ in range(3))
    t, spks = torch.rand(2, generator=g).to(device), torch.randn(2, 8, generator=g).to(device, dtype)
    a, b = _both(lambda: est(x, None, mu, t, spks, cond, streaming=True))
    return {"diff": _max_diff(a, b), "scale": b.abs().max().item()}


@torch.inference_mode()
def _dit(device: str, dtype: torch.dtype) -> dict[str, float]:
    """A small DiT (three blocks, q/k/v and AdaLN-Zero fused), streaming with a padding mask, with the kernels and
    without."""
    cfg = DiTConfig(dim=32, depth=3, heads=2, dim_head=8, mel_dim=8, mu_dim=8, spk_dim=8, out_channels=8,
                    static_chunk_size=4, time_freq_dim=16, conv_pos_kernel=5, conv_pos_groups=4)
    est = randomize_(DiT(cfg), 3).to(device, dtype).eval()
    est.fuse_projections_()
    g = torch.Generator().manual_seed(4)
    x, mu, cond = (torch.randn(2, 8, 12, generator=g).to(device, dtype) for _ in range(3))
    t, spks = torch.rand(2, generator=g).to(device), torch.randn(2, 8, generator=g).to(device, dtype)
    mask = (torch.arange(12) < torch.tensor([[12], [9]]))[:, None].to(device, dtype)
    a, b = _both(lambda: est(x, mask, mu, t, spks, cond, streaming=True))
    return {"diff": _max_diff(a, b), "scale": b.abs().max().item()}


_SCRIPT = """
import json, torch
from tests.test_fused import _decode, _dit, _estimator, _ops, _ras
decode = {"decode " + k: v for k, v in _decode("cpu", torch.float32).items()}
flow = {"estimator " + k: v for k, v in _estimator("cpu", torch.float32).items()}
flow.update({"dit " + k: v for k, v in _dit("cpu", torch.float32).items()})
ras = {"ras " + k: v for k, v in _ras("cpu", torch.float32).items()}
print(json.dumps({**_ops("cpu", torch.float32), **decode, **flow, **ras}))
"""


def test_kernels_match_the_composition_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert diffs.pop("cache written") == 6  # three rows x two positions, each slot's own
    assert diffs.pop("stores written") == 3  # each row's last inputs, in its own store row
    assert diffs.pop("decode scale") > 0.1 and diffs.pop("estimator scale") > 0.1 and diffs.pop("dit scale") > 0.1
    assert diffs.pop("ras mismatches") == 0
    # every other row redrew; the dominant stop id is drawn exactly where it is not masked; a draw at the far end of
    # a nucleus of three is its third id
    assert diffs.pop("ras redraws") == 28 and diffs.pop("ras unmasked stop") == 8 and diffs.pop("ras nucleus end") == 8
    assert all(v <= KERNEL_INTERPRETER_MAX_DIFF for v in diffs.values()), diffs


def test_the_composition_runs_where_no_kernel_can() -> None:
    """On CPU tensors (no interpreter) the ops are the plain PyTorch composition: bit for bit what the parity
    fixtures were checked against."""
    assert not fused.active(torch.zeros(1))
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8)
    normed, summed = fused.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(summed, x + r, atol=0, rtol=0)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + r, (8,), w, 1e-6), atol=0, rtol=0)


def _compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict[str, int]) -> None:
    """Compile a kernel for sm_90 down to its binary, without a GPU: what the interpreter does not check (a name
    that holds tensors of two types, say)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton.compile(ASTSource(kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))


def test_the_flow_kernels_compile_for_hopper() -> None:
    pointers = dict.fromkeys(("h_ptr", "x_ptr", "out_ptr", "store_ptr"), "*bf16")
    ints = dict.fromkeys(("n", "c", "s_h", "s_x", "s_xt", "s_store"), "i32")
    _compile_for_hopper(fused._causal_windows, {**pointers, "tails_ptr": "*i64", "rows_ptr": "*i64", **ints},
                        {"K": 3, "BLOCK_T": 2, "BLOCK_W": 2048, "BLOCK_C": 512})
    pointers = dict.fromkeys(("x_ptr", "r_ptr", "w_ptr", "b_ptr", "out_ptr", "sum_ptr", "a_ptr"), "*bf16")
    ints = {**dict.fromkeys(("n_rows", "frames", "n"), "i32"), "eps": "fp32", "s_ab": "i32", "s_at": "i32"}
    _compile_for_hopper(fused._add_layer_norm, {**pointers, **ints},
                        {"HAS_RESIDUAL": False, "MISH": True, "ADD": True, "ROWS": 8, "BLOCK": 256})


@pytest.mark.gpu
def test_kernels_match_the_composition_on_the_gpu() -> None:
    ops = _ops("cuda", torch.bfloat16)
    assert ops.pop("cache written") == 6 and ops.pop("stores written") == 3
    assert all(v <= 0.07 for v in ops.values()), ops  # a bf16 ulp or two at magnitudes up to ~4
    decode = _decode("cuda", torch.bfloat16)
    assert decode["hidden"] <= 0.05 * decode["scale"] and decode["cache"] <= 0.1, decode
    flow = _estimator("cuda", torch.bfloat16)
    assert flow["diff"] <= 0.05 * flow["scale"], flow
    dit = _dit("cuda", torch.bfloat16)
    assert dit["diff"] <= 0.05 * dit["scale"], dit
    ras = _ras("cuda", torch.bfloat16)
    assert ras["mismatches"] == 0 and ras["redraws"] == 28 and ras["nucleus end"] == 8, ras


@pytest.mark.gpu
def test_a_captured_decode_step_is_a_chain_of_plain_kernels() -> None:
    """The decode graph holds no node that makes its every launch slow (engine/llm_runner.py): its attention is the
    Triton decode kernel pair, not cuDNN's or another SDPA backend's, and no sort's memory sets."""
    llm = random_model("tiny", 0, "cuda").llm.to(torch.bfloat16).eval()
    llm.backbone.fuse_projections_()
    runner = LLMRunner(llm, 2, 256, torch.bfloat16, torch.device("cuda"), cuda_graphs=True)
    hidden = llm.backbone.cfg.hidden_size
    runner.prefill_many([0], [torch.randn(1, 20, hidden, device="cuda", dtype=torch.bfloat16)], [0], [0], [True])
    assert (1, 256) in runner._graphs
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode(1, 21)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert any("_decode_attention_blocks" in n for n in names) and any("_decode_attention_merge" in n for n in names)
    slow = [n for n in names if any(s in n.lower() for s in ("cudnn", "fmha", "flash", "memset", "radixsort"))]
    assert not slow, slow
