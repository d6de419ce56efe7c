"""A/B of the vocoder thread's CUDA stream priority (normal vs high): one engine, one process, 1/16/64/128 streams."""
import json
import logging
import os

import torch

from cosyvoice_opt.bench import print_table, run_config, synthetic_prompt
from cosyvoice_opt.engine import Engine, EngineConfig

logging.basicConfig(level=logging.WARNING)
eng = Engine.from_model_dir(None, EngineConfig(precision="bf16", max_batch_size=1, random_size="full"))
prompt = synthetic_prompt()
voc = eng._parts.vocoder
streams = {"normal": voc._cuda_stream, "high": torch.cuda.Stream(eng.device, priority=-1)}
rows = []
try:
    for conc in (1, 16, 64, 128):
        for name in (("normal", "high", "normal") if conc == 1 else ("normal", "high")):
            voc._cuda_stream = streams[name]
            r = run_config(eng, conc, True, 250, 1, prompt)
            r["vocoder_stream"] = name
            rows.append(r)
            print(name, flush=True)
            print_table([r])
            with open(f"{os.environ['OUT']}/ab_priority.json", "w") as f:
                json.dump(rows, f, indent=1)
finally:
    eng.close()
print()
print_table(rows)
print([r["vocoder_stream"] for r in rows])
