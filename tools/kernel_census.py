"""What one LLM decode step and one flow Euler step launch, and what a flow call costs per batch shape.

`python tools/kernel_census.py [--no-fused]` (CUDA, random full-size weights, bf16) prints the kernels of one eager
decode step (1 and 8 rows) and of one eager Euler step (1 row x 100 frames after 8 pages of history) by kind, with
their count and GPU time; then the time of a paged flow call (the encoder graph and ten Euler-step replays) per
(rows, new frames, history pages) shape alone, and beside a thread that replays a 4-row decode graph, with that
decode step's time. A launch-bound step is read off its kernel count; the shapes show where the flow's arithmetic
takes over and what the history costs. `--no-fused` runs the PyTorch composition instead of `models/fused.py`.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from cosyvoice_opt.engine.backends import configure_backends, cudnn_attention
from cosyvoice_opt.engine.flow_runner import FlowRunner
from cosyvoice_opt.models import fused
from cosyvoice_opt.models.kv_cache import KVCache
from cosyvoice_opt.random_model import random_model

SHAPES = ((1, 100, 8), (2, 200, 8), (8, 300, 16), (8, 300, 32), (16, 300, 16), (16, 300, 32), (32, 300, 32),
          (64, 200, 32))
BESIDE = ((1, 100, 8), (8, 300, 16), (16, 300, 32))


def census(fn: Callable[[], object], label: str, top: int) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    count, gpu_us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            count[e.name[:90]] += 1
            gpu_us[e.name[:90]] += e.device_time_total
    print(f"== {label}: {sum(count.values())} kernels, {sum(gpu_us.values()) / 1000:.2f} ms kernel time")
    for name, n in count.most_common(top):
        print(f"  {n:5d} {gpu_us[name] / 1000:7.3f} ms  {name}")


def mean_ms(fn: Callable[[], object], n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fused", action="store_true", help="the PyTorch composition instead of the Triton kernels")
    fused.enabled = not ap.parse_args().no_fused
    configure_backends()
    device = torch.device("cuda")
    model = random_model("full", 0, device)
    llm = model.llm.to(torch.bfloat16).eval()
    llm.backbone.fuse_projections_()
    flow = model.flow.to(torch.bfloat16).eval().fuse_projections_()
    backbone, hidden = llm.backbone, llm.backbone.cfg.hidden_size
    cache = KVCache(backbone.cfg, 64, 1024, torch.bfloat16, device)

    def decode_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, 1, hidden, device=device, dtype=torch.bfloat16),
                torch.full((rows,), 300, device=device, dtype=torch.long))

    for rows in (1, 8):
        x, pos = decode_inputs(rows)
        census(lambda x=x, pos=pos: backbone.decode(x, cache, None, pos, 512), f"decode step, {rows} rows", 30)
    runner = FlowRunner(flow, pages=256, slots=130, cuda_graphs=True, max_rows=64, max_tokens=2048)
    step = runner._make_graph((1, 100, 8))

    def one_step() -> None:
        step.batch.load(step.batch.defaults())  # the step index back to 0
        step.step()

    with cudnn_attention():
        census(one_step, "flow Euler step, 1 row x 100 frames after 8 pages", 40)

    x, pos = decode_inputs(4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            backbone.decode(x, cache, None, pos, 512)
    torch.cuda.synchronize()
    decode_graph = torch.cuda.CUDAGraph()
    with cudnn_attention(), torch.cuda.graph(decode_graph, stream=side):
        backbone.decode(x, cache, None, pos, 512)
    print(f"decode graph, 4 rows, alone: {mean_ms(decode_graph.replay, 300):.3f} ms")

    graphs = {}
    for key in SHAPES:
        graphs[key] = runner._make_graph(key)
        graphs[key].capture(runner.graphs._pool, runner.graphs._stream)

    def flow_call(key: tuple[int, int, int]) -> None:
        graph = graphs[key]
        graph.batch.load(graph.batch.defaults())
        graph.encoder_graph.replay()
        for _ in range(len(graph.grid)):
            graph.graph.replay()

    for key in SHAPES:
        mean_ms(lambda key=key: flow_call(key), 2)
        print(f"flow call {key} alone: {mean_ms(lambda key=key: flow_call(key), 5):.1f} ms", flush=True)
    for key in BESIDE:
        stop, decode_ms = threading.Event(), []

        def decode_loop(stop: threading.Event = stop, decode_ms: list[float] = decode_ms) -> None:
            stream = torch.cuda.Stream()
            with torch.inference_mode(), torch.cuda.stream(stream):
                n, t0 = 0, time.perf_counter()
                while not stop.is_set():
                    decode_graph.replay()
                    stream.synchronize()
                    n += 1
                decode_ms.append((time.perf_counter() - t0) / n * 1000)

        thread = threading.Thread(target=decode_loop)
        thread.start()
        time.sleep(0.2)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            flow_ms = mean_ms(lambda key=key: flow_call(key), 5)
        stop.set()
        thread.join()
        print(f"beside a decode loop: flow call {key} {flow_ms:.1f} ms, decode step {decode_ms[0]:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
