"""A/B of the decode hold during first audio (same engine, same process), then the rows at 64 and 128 with it."""
import json
import logging
import os

from cosyvoice_opt.bench import print_table, run_config, synthetic_prompt
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.scheduler import Scheduler

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
eng = Engine.from_model_dir(None, EngineConfig(precision="bf16", max_batch_size=1, random_size="full"))
prompt = synthetic_prompt()
hold_rule = Scheduler._all_making_first_audio
rows = []
for conc, holds in ((1, (True, False, True)), (16, (True, False)), (64, (True,)), (128, (True,))):
    for hold in holds:
        Scheduler._all_making_first_audio = hold_rule if hold else (lambda self: False)
        r = run_config(eng, conc, True, 250, 1, prompt)
        r["hold"] = hold
        rows.append(r)
        print("hold" if hold else "no hold", flush=True)
        print_table([r])
        with open(f"{os.environ['OUT']}/ab_hold.json", "w") as f:
            json.dump(rows, f, indent=1)
print()
print_table(rows)
print([r["hold"] for r in rows])
