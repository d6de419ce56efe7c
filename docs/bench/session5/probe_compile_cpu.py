"""--compile on the CPU (tiny model): graph breaks and recompiles of the decode step over every (batch, length) bucket.

Run from the repository root: `PYTHONPATH=. python docs/bench/session5/probe_compile_cpu.py`."""
import time

import torch
from torch._dynamo.utils import counters

from cosyvoice_opt.engine.llm_runner import LLMRunner
from cosyvoice_opt.random_model import random_model

torch._logging.set_logs(recompiles=True, graph_breaks=True)
llm = random_model("tiny", 0, "cpu").llm.eval()
llm.backbone.fuse_projections_()
runner = LLMRunner(llm, 16, 512, torch.float32, torch.device("cpu"), False)
print("buckets", runner.batch_buckets, runner.kv_buckets)
step = torch.compile(runner._decode_rows, dynamic=True)
with torch.inference_mode():
    for b in runner.batch_buckets:
        for s in runner.kv_buckets:
            runner._n_live.fill_(b)
            t0 = time.perf_counter()
            step(b, s)
            print(b, s, f"{time.perf_counter() - t0:.1f}s", dict(counters["stats"]), flush=True)
