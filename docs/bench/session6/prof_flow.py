"""Where a flow CFM round's time goes at the benchmark's shapes: graph replay time, host time, kernel table (H200)."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cosyvoice_opt.engine.backends import configure_backends, cudnn_attention
from cosyvoice_opt.engine.flow_runner import FlowRunner
from cosyvoice_opt.random_model import random_model

configure_backends()
dev = torch.device("cuda")
m = random_model("full", 0, dev)
flow = m.flow.to(torch.bfloat16).eval().fuse_projections_()
KEYS = [(1, 100, 0), (1, 100, 2), (64, 200, 6), (64, 100, 4), (64, 150, 12)]
COMPILE = "compile" in sys.argv
with torch.inference_mode():
    r = FlowRunner(flow, 400, 140, True)
    page = r.pool.page
    for key in KEYS:
        rows, frames, hp = key
        g = r._graph(key)
        pages = r.pool.take_pages(hp + -(-frames // page))
        host = g.batch.host_rows([(pages, hp * page, frames, r.pool.take_slot(), False) for _ in range(rows)])

        def cfm(g=g, host=host):
            g.batch.load(host)
            for _ in range(10):
                g.graph.replay()
        for _ in range(3):
            cfm()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            cfm()
        host_ms = (time.perf_counter() - t0) * 1000 / 5
        e1.record()
        torch.cuda.synchronize()
        print(f"== {key}: graph CFM {e0.elapsed_time(e1) / 5:.2f} ms on the GPU, {host_ms:.2f} ms to launch")
        with cudnn_attention():
            g.batch.load(host)
            g.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.batch.load(host)
                g.step()
                torch.cuda.synchronize()
        ev = list(prof.key_averages())
        total = sum(e.device_time_total for e in ev)
        count = sum(e.count for e in ev if e.device_time_total > 0)
        print(f"   one eager step: {count} kernels, {total / 1000:.2f} ms kernel time")
        if rows > 1 or key == KEYS[0]:
            for e in sorted(ev, key=lambda e: -e.device_time_total)[:22]:
                print(f"   {e.device_time_total / 1000:7.3f} ms {e.count:5d}  {e.key[:110]}")
        if COMPILE and rows == 64 and frames == 200:
            t0 = time.perf_counter()
            step = torch.compile(g.step, dynamic=False)
            with cudnn_attention():
                g.batch.load(host)
                step()
                torch.cuda.synchronize()
                print(f"   compile: {time.perf_counter() - t0:.1f} s")
                cg = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    g.batch.load(host)
                    step()
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(cg):
                    step()
            g.batch.load(host)
            torch.cuda.synchronize()
            e0.record()
            for _ in range(5):
                g.batch.load(host)
                for _ in range(10):
                    cg.replay()
            e1.record()
            torch.cuda.synchronize()
            print(f"   compiled graph CFM {e0.elapsed_time(e1) / 5:.2f} ms on the GPU")
