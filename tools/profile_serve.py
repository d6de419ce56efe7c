"""Where the engine's time goes under the serving benchmark's open-loop traffic.

`python tools/profile_serve.py --rates 4,8 [--sync] [--switch-ms 5,1]` runs `bench --serve` loads (bf16, random
full-size weights, the default workload) on one engine and, per load, prints the wall time of the vocoder's stages
(rounds, prompt-prefix passes, the flow encoder, paged flow calls, HiFT calls), of a new voice's frontend (the whole
of it until the request is queued, its speech tokens, and of those the tokenizer's log-mel and, on the GPU, its
forward) and of the LLM steps (and their two halves: queuing the step's GPU work, and waiting for the step before it
and taking its tokens), with their rates, the share of the window they took and the thread's CPU time in them (wall
time beyond it is waiting, for the GPU or for the interpreter lock), and splits each request's first packet into
frontend, queue, LLM (from admission to its first chunk being picked up by the vocoder) and vocoder. The stages are
wrapped from outside; with `--sync` each stage ends with a device sync, so its time is its GPU time too (and the
threads overlap less). `--switch-ms` sets the interpreter's thread switch interval per load (the engine's two
threads share the GIL).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from cosyvoice_opt.bench import cli as bench_cli
from cosyvoice_opt.bench import serving
from cosyvoice_opt.engine import audio_worker, flow_runner, scheduler, torch_speech_tokenizer
from cosyvoice_opt.engine import engine as engine_module
from cosyvoice_opt.frontend import features
from cosyvoice_opt.models import flow
from cosyvoice_opt.monitor import Monitor

LOG: dict[str, list[tuple[float, float, object]]] = collections.defaultdict(list)
SYNC = threading.Event()


def _sync() -> None:
    if SYNC.is_set() and torch.cuda.is_available():
        torch.cuda.synchronize()


def _wrap(owner, name: str, tag: str, info=None, sync: bool = True) -> None:
    """Time `owner.name` under `tag`: wall time and the calling thread's CPU time (their difference is time spent
    waiting: for the GPU, or for the interpreter lock)."""
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        detail = info(*args) if info else None
        if sync:
            _sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = real(*args, **kwargs)
        if sync:
            _sync()
        LOG[tag].append((t0, time.perf_counter() - t0, detail, time.thread_time() - c0))
        return out

    setattr(owner, name, timed)


def _stamp(owner, name: str, attr: str, when) -> None:
    real = getattr(owner, name)

    def stamped(self, *args):
        out = real(self, *args)
        for req in when(self, out):
            if not hasattr(req, attr):
                setattr(req, attr, time.perf_counter())
        return out

    setattr(owner, name, stamped)


def instrument() -> None:
    _wrap(audio_worker.AudioWorker, "_run", "round", lambda self, jobs: len(jobs))
    _wrap(flow_runner.FlowRunner, "_compute_prefixes", "prefix", lambda self, leaders: len(leaders))
    _wrap(flow_runner.FlowRunner, "run", "flow call", lambda self, streams, *a: len(streams))
    _wrap(flow.Flow, "prepare_chunks", "encoder", lambda self, states, *a: len(states))
    _wrap(audio_worker.AudioWorker, "_vocode_and_emit", "hift call", lambda self, jobs: len(jobs))
    _wrap(engine_module.Engine, "_prepare", "frontend", sync=False)
    _wrap(engine_module, "start_prompt_features", "tokens", sync=False)  # a new voice's, until they are made
    _wrap(features, "whisper_log_mel", "log-mel", sync=False)
    _wrap(torch_speech_tokenizer.TorchSpeechTokenizer, "_run", "tokenizer", lambda self, batch: len(batch),
          sync=False)
    _wrap(scheduler.Scheduler, "step", "llm step", lambda self, runner: len(self.running), sync=False)
    # a step's two halves: queuing its GPU work (host only), and waiting for the step before it, then taking its tokens
    _wrap(scheduler.Scheduler, "_launch", "llm launch", lambda self, runner, prefill, extend: len(self.running),
          sync=False)
    _wrap(scheduler.Scheduler, "_deliver", "llm tokens", lambda self, launch, runner, t0: len(self.running),
          sync=False)
    # the graph shape (rows, new frames, history pages) each paged flow call is padded to
    _wrap(flow_runner.FlowRunner, "_graph", "flow key", lambda self, key: key, sync=False)
    _stamp(scheduler.Scheduler, "_admit", "admitted_at", lambda self, admitted: admitted)
    _stamp(audio_worker._RequestAudio, "next_job", "picked_at", lambda self, job: [self.req] if job else [])
    real_send = scheduler.Request.send

    def send(self, pcm, sample_rate, is_last):
        if self.chunks_sent == 0:
            LOG["first"].append((self.arrival, time.perf_counter(), (self.timings.frontend,
                                 getattr(self, "admitted_at", None), getattr(self, "picked_at", None))))
        return real_send(self, pcm, sample_rate, is_last)

    scheduler.Request.send = send


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def report(t0: float, t1: float) -> None:
    span = t1 - t0
    for tag in ("round", "prefix", "encoder", "flow call", "hift call", "frontend", "tokens", "log-mel", "tokenizer",
                "llm step", "llm launch", "llm tokens"):
        rows = [r for r in LOG[tag] if t0 <= r[0] < t1]
        if rows:
            walls, sizes, cpu = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
            size = "" if sizes[0] is None else f"  rows mean {np.mean(sizes):4.1f}"
            print(f"  {tag:10s} {len(rows) / span:7.1f}/s  {sum(walls) / span:6.1%} of the window  mean "
                  f"{np.mean(walls) * 1000:6.1f}  p95 {_ms(walls, 95):6.1f} ms  thread CPU mean "
                  f"{np.mean(cpu) * 1000:6.1f} ms{size}")
    keys = collections.Counter(r[2] for r in LOG["flow key"] if t0 <= r[0] < t1)
    if keys:
        total = sum(keys.values())
        print("  flow shapes (rows, frames, history pages): " + ", ".join(
            f"{k} {n / total:.0%}" for k, n in keys.most_common(10)))
    firsts = [r for r in LOG["first"] if t0 <= r[0] < t1]
    parts = {"frontend": [], "queue": [], "LLM": [], "vocoder": [], "first packet": []}
    for arrival, sent, (frontend, admitted, picked) in firsts:
        parts["frontend"].append(frontend)
        parts["first packet"].append(sent - arrival)
        if admitted and picked:
            parts["queue"].append(admitted - arrival - frontend)
            parts["LLM"].append(picked - admitted)
            parts["vocoder"].append(sent - picked)
    for name, values in parts.items():
        print(f"  first packet: {name:12s} p50 {_ms(values, 50):7.1f}  p95 {_ms(values, 95):7.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="4")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--sync", action="store_true", help="end every vocoder stage with a device sync")
    ap.add_argument("--switch-ms", default="", help="comma list: the thread switch interval of each load")
    ap.add_argument("--random", default="full", choices=("tiny", "full"))
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",") if x]
    switches = [float(x) for x in a.switch_ms.split(",")] if a.switch_ms else [sys.getswitchinterval() * 1000]
    argv = ["--serve", "--random", a.random, "--precision", "bf16" if a.random == "full" else "fp32",
            "--duration", str(a.duration)] + (["--device", a.device] if a.device else [])
    args = bench_cli.parse_args(argv)
    if a.sync:
        SYNC.set()
    instrument()
    with tempfile.TemporaryDirectory() as voices, serving._engine(args, voices) as engine, \
            Monitor(serving.GPU_INTERVAL_S, history_s=None) as gpu:
        target = serving.in_process_target(engine, serving._workload(args), args.duration, args.warmup,
                                           args.seed, gpu)
        series = serving.LoadSeries(target)
        for i, rate in enumerate(rates):
            switch = switches[min(i, len(switches) - 1)]
            sys.setswitchinterval(switch / 1000)
            t0 = time.perf_counter() + args.warmup
            series.load("rate", rate)
            print(f"{rate:g} req/s, thread switch interval {switch:g} ms, stage syncs {'on' if a.sync else 'off'}:")
            report(t0, t0 + args.duration)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
