"""Moving rows of channels on the H200: multi-tensor advanced indexing (the old paged history) vs one flat row index."""
import torch

dev = torch.device("cuda")
steps, blocks, pages, page, C = 10, 56, 700, 50, 256
pool = torch.randn(steps, blocks, pages, page, 2, C, device=dev, dtype=torch.bfloat16)
rows2d = pool.view(-1, C)
B2, K, n, group = 128, 500, 200, 4
step = torch.tensor([3], device=dev)
layers = torch.arange(group, device=dev)[:, None, None] + 8
pg = torch.randint(2, pages, (B2, K), device=dev)
off = torch.arange(K, device=dev) % page
cfg = torch.arange(2, device=dev).repeat(B2 // 2)[:, None]
flat = ((pg * page + off) * 2 + cfg)
base = step * (blocks * pages * page * 2) + layers * (pages * page * 2)


def t(fn, label, reps=20):
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    print(f"{label:60s} {e0.elapsed_time(e1) / reps * 1000:8.1f} us")


t(lambda: pool[(step, layers, pg, off, cfg)], "gather: 5 index tensors [4,128,500,256]")
t(lambda: rows2d.index_select(0, (flat + base).view(-1)), "gather: add + index_select")
new = torch.randn(group, B2, K, C, device=dev, dtype=torch.bfloat16)[:, :, K - n:]
wpg, woff = pg[:, :n], off[:n]
wflat = flat[:, :n]


def put5():
    pool[(step, layers, wpg, woff, cfg)] = new


t(put5, "scatter: 5 index tensors [4,128,200,256]")
t(lambda: rows2d.index_put_(((wflat + base),), new), "scatter: add + index_put_ (one flat index)")
t(lambda: rows2d.index_copy_(0, (wflat + base).view(-1), new.reshape(-1, C)), "scatter: add + reshape + index_copy_")
