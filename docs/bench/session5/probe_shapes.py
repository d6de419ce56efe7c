"""Host memory and time per novel HiFT input shape (cuDNN convolution plans), plan cache bounded or cuDNN off."""
import sys
import time

import torch

from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.soak import _malloc_heap

mode = sys.argv[1]
torch.set_grad_enabled(False)
m = random_model("full", 0, torch.device("cuda"))
hift = m.hift.eval()
if mode == "nocudnn":
    torch.backends.cudnn.enabled = False


def call(b, t):
    mel = torch.randn(b, 80, t, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hift.inference(mel)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


for b in (1, 2, 4, 8, 16, 32, 64):
    call(b, 58)
h0 = _malloc_heap()["heap_in_use_mb"]
firsts = [call(1, 100 + 7 * i) for i in range(40)]
h1 = _malloc_heap()["heap_in_use_mb"]
again = [call(1, 100 + 7 * i) for i in range(40)]
h2 = _malloc_heap()["heap_in_use_mb"]
print(f"{mode}: 40 novel B=1 lengths: heap +{h1 - h0:.1f} MB ({(h1 - h0) / 40:.2f} MB/shape), first call "
      f"median {sorted(firsts)[20]:.1f} ms, repeat median {sorted(again)[20]:.1f} ms; repeat heap +{h2 - h1:.1f} MB; "
      f"cufft plans {torch.backends.cuda.cufft_plan_cache[0].size}")
for b in (1, 16, 64):
    ts = sorted(call(b, 58) for _ in range(15))
    print(f"{mode}: steady HiFT B={b} T=58: median {ts[7]:.2f} ms")
