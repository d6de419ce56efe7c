"""Eager SDPA wall time per call by backend, at the decode step's and the estimator's masked attention shapes."""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV, DT = "cuda", torch.bfloat16


def bench(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def case(b, h, q_len, k_len):
    """q, k (also used as v) and an additive mask of one attention call."""
    return (torch.randn(b, h, q_len, 64, device=DEV, dtype=DT), torch.randn(b, h, k_len, 64, device=DEV, dtype=DT),
            torch.zeros(b, 1, q_len, k_len, device=DEV, dtype=DT))


CASES = {"decode b64 kv600": case(64, 2, 7, 600), "decode b1 kv300": case(1, 2, 7, 300),
         "est b64 q100 k800": case(64, 8, 100, 800), "est b2 q100 k300": case(2, 8, 100, 300)}
BACKENDS = (("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
            ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("math", [SDPBackend.MATH]))

for name, (q, k, m) in CASES.items():
    row = []
    for label, backends in BACKENDS:
        def call(q=q, k=k, m=m):
            return F.scaled_dot_product_attention(q, k, k, attn_mask=m)
        try:
            if backends is None:
                us = bench(call)
            else:
                with sdpa_kernel(backends):
                    us = bench(call)
            row.append(f"{label} {us:.0f}us")
        except Exception:
            row.append(f"{label} n/a")
    print(name, " | ".join(row))
