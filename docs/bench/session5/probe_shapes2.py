"""Host heap and first-call time per novel input shape: LLM forward (SDPA + GEMMs) and non-streaming flow."""
import sys
import time

import torch

from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.soak import _malloc_heap

mode = sys.argv[1]
torch.set_grad_enabled(False)
torch.inference_mode().__enter__()
if mode == "no-cudnn-sdp":
    torch.backends.cuda.enable_cudnn_sdp(False)
sdp = torch.backends.cuda
print(mode, "sdp enabled: cudnn", sdp.cudnn_sdp_enabled(), "flash", sdp.flash_sdp_enabled(),
      "mem_eff", sdp.mem_efficient_sdp_enabled(), "math", sdp.math_sdp_enabled())
m = random_model("full", 0, torch.device("cuda"))
llm = m.llm.to(torch.bfloat16).eval()
flow = m.flow.to(torch.bfloat16).eval()
for mod in (llm.backbone, flow):
    if hasattr(mod, "fuse_projections_"):
        mod.fuse_projections_()
dev = "cuda"


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def llm_call(t):
    x = torch.randn(1, t, 896, device=dev, dtype=torch.bfloat16)
    return timed(lambda: llm.backbone(x))


P = 75
pt = torch.randint(0, 6561, (1, P), device=dev)
pf = torch.randn(1, 2 * P, 80, device=dev, dtype=torch.bfloat16)
emb = torch.randn(1, 192, device=dev, dtype=torch.bfloat16)


def flow_call(n):
    tok = torch.randint(0, 6561, (1, n), device=dev)
    return timed(lambda: flow.inference(tok, pt, pf, emb))


for name, fn, base, step in (("llm", llm_call, 60, 3), ("flow", flow_call, 50, 3)):
    fn(base - 5)
    fn(base - 4)
    h0 = _malloc_heap()["heap_in_use_mb"]
    firsts = [fn(base + step * i) for i in range(30)]
    h1 = _malloc_heap()["heap_in_use_mb"]
    again = [fn(base + step * i) for i in range(30)]
    h2 = _malloc_heap()["heap_in_use_mb"]
    print(f"{mode} {name}: 30 novel lengths: heap +{h1 - h0:.1f} MB ({(h1 - h0) / 30:.2f} MB/shape), first median "
          f"{sorted(firsts)[15]:.1f} ms, repeat median {sorted(again)[15]:.1f} ms, repeat heap +{h2 - h1:.1f} MB")
