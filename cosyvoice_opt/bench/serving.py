"""The serving benchmark: the engine under traffic as users send it.

`python -m cosyvoice_opt bench --serve [--rates 1,3,6,12 | --clients 16 | --capacity] [--http [both] | --url URL]`.
Every request brings a new synthetic voice, its own text and its own length (`workload.py`); arrivals are Poisson
at each rate (open loop) or come from N clients that each wait for their last request (closed loop). Each load
runs `--warmup` unmeasured seconds, then `--duration` measured ones; its row: sent / ok / failed / refused, first
packet percentiles from the call (frontend included), how long refusals took to be answered from the call (p95 and
max; the engine's queue bound, `--max-queue-wait`, is in the report's engine info), frontend time, playback
underruns, audio seconds delivered per second, CUDA graphs captured in the window, GPU busy and peak memory, the
serving process's RSS at the load's end and its change over the load (when this process serves: in-process and
`--http`), and a second line of where the engine's time went (each thread's busy share, LLM steps and their rows,
vocoder rounds, flow calls and their rows, prompt prefixes; from the engine's counters,
`engine.counters.stage_use`). `--capacity` searches the highest
rate whose first packet p95 stays within `--p95-ms` with no underrun, failure or refusal.

In-process, threads of this process call the engine with forced token counts. Over HTTP (`--http`: the API
served here on loopback; `--url`: a running server) the clients run in a child process and the engine's counters
come from `GET /health`; a server on random weights takes the same forced token counts (`force_tokens`), so the
same command with and without `--http` runs the same requests; a real model's lengths follow the text. GPU busy
needs the engine in this process (n/a with `--url`); peak GPU memory is read in-process only. `--http both` runs
each load in-process, then over HTTP, on one engine, and reports their first packets side by side (what the API
adds; the HTTP request's voice is saved beforehand, so its first packet holds no frontend: the in-process row's
`fe50` is what the new voice's frontend took there).

`--bistream N` runs N closed-loop clients beside each load whose text streams in at `--text-rate` tokens/s (a voice
agent's LLM; in-process only), each text and length drawn as an ordinary request's: the text phase speaks 15 speech
tokens per 5 text tokens (upstream's ratio), and the final phase ends at the request's forced length (a real model
ends it at eos, after the rest of the text; random weights rarely sample eos). The load's row then counts the
ordinary requests, and its "bistream" entry the streamed-text ones: first audio from the text that let decoding
start, underruns while text was arriving, their audio-s/s; `audio_s_per_s_all` is everyone's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import torch

from cosyvoice_opt.bench import capacity
from cosyvoice_opt.bench.load import Bistream, Run, closed_loop, open_loop
from cosyvoice_opt.bench.loopback import ClientProcess, serve_in_process
from cosyvoice_opt.bench.report import (
    compare_transports,
    graph_captures,
    passes,
    print_bistream_rows,
    print_comparison,
    print_rows,
    print_stage_rows,
    summarize,
    summarize_bistream,
)
from cosyvoice_opt.bench.transport import InProcessTransport, health, http_lengths, http_load
from cosyvoice_opt.bench.workload import Workload
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.counters import stage_use
from cosyvoice_opt.monitor import Monitor, host_memory

GPU_INTERVAL_S = 0.1
RUN_TIMEOUT_S = 600.0  # past a load's warm-up and window: the time its last requests may take to end


@dataclass
class Target:
    """Where the load goes: `measure(kind, value, first_index)` runs one load ("rate" or "clients") and returns its
    run; `gpu` is set when the engine's GPU can be watched from here, `host_memory` when its process is this one."""

    transport: str  # "in-process" or "http"
    lengths: str  # "forced" or "text"
    measure: Callable[[str, float, int], Run]
    info: dict  # the engine's (`GET /health` without the counters, over HTTP)
    gpu: Monitor | None = None
    peak_mem_gb: Callable[[], float | None] = lambda: None
    bistream: Bistream | None = None  # streamed-text clients beside every load
    host_memory: Callable[[], dict] | None = None


def _engine(args: argparse.Namespace, voices_dir: str) -> Engine:
    queue = {} if args.max_queue_wait is None else {"max_queue_wait": args.max_queue_wait}
    config = EngineConfig(precision=args.precision.split(",")[0], max_batch_size=args.max_batch_size,
                          device=args.device, random_size=None if args.model_dir else (args.random or "full"),
                          family=args.family, cuda_graphs=not args.no_cuda_graphs, compile=args.compile,
                          voices_dir=voices_dir, speech_tokenizer=args.speech_tokenizer, **queue)
    return Engine.from_model_dir(args.model_dir, config)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(_range(args.prompt_seconds), _range(args.audio_seconds), args.words_per_second, args.seed)


def _range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def in_process_target(engine: Engine, workload: Workload, duration: float, warmup: float, seed: int,
                      gpu: Monitor | None = None, bistream: Bistream | None = None) -> Target:
    """Loads from threads of this process (with `bistream` clients beside each); peak GPU memory counted from each
    window's start."""
    transport = InProcessTransport(engine)
    cuda = engine.device.type == "cuda"

    def window_opened() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)

    def measure(kind: str, value: float, first_index: int) -> Run:
        if kind == "rate":
            return open_loop(transport, workload, value, duration, warmup, first_index, seed, window_opened,
                             bistream)
        return closed_loop(transport, workload, int(value), duration, warmup, first_index, window_opened, bistream)

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated(engine.device) / 2**30 if cuda else None

    return Target("in-process", transport.lengths, measure, engine.info, gpu, peak, bistream, host_memory)


def http_target(url: str, headers: dict, clients: ClientProcess, workload: Workload, duration: float,
                warmup: float, seed: int, gpu: Monitor | None = None, served_here: bool = False) -> Target:
    """Loads from the child process `clients` over the API at `url` (served by this process if `served_here`)."""
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        info = {k: v for k, v in health(client).items() if k != "stats"}

    def measure(kind: str, value: float, first_index: int) -> Run:
        return clients.call(http_load, url, headers, kind, value, workload, duration, warmup, first_index, seed,
                            timeout=warmup + duration + RUN_TIMEOUT_S)

    return Target("http", http_lengths(info), measure, info, gpu, host_memory=host_memory if served_here else None)


@contextlib.contextmanager
def open_targets(args: argparse.Namespace) -> Iterator[list[Target]]:
    """The targets of `args`: an engine here (in-process, the API served here, or both on that one engine with
    `--http both`), or the server at `--url`. Both: the HTTP clients send the same requests with twins of their
    voices (`Workload.voice_variant`), so the engine's prompt caches treat them as new voices again."""
    workload, duration, warmup, seed = _workload(args), args.duration, args.warmup, args.seed
    if args.url:
        api_key = args.api_key or os.environ.get("COSYVOICE_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with ClientProcess("serve-clients") as clients:
            yield [http_target(args.url, headers, clients, workload, duration, warmup, seed)]
        return
    with contextlib.ExitStack() as stack:
        voices = stack.enter_context(tempfile.TemporaryDirectory(prefix="cosyvoice-serve-voices-"))
        engine = stack.enter_context(_engine(args, voices))
        gpu = stack.enter_context(Monitor(GPU_INTERVAL_S, history_s=None))
        targets = []
        if args.http != "only":
            bistream = Bistream(args.bistream, args.text_rate) if args.bistream else None
            targets.append(in_process_target(engine, workload, duration, warmup, seed, gpu, bistream))
        if args.http:
            url = stack.enter_context(serve_in_process(engine))
            clients = stack.enter_context(ClientProcess("serve-clients"))
            twins = dataclasses.replace(workload, voice_variant=1) if targets else workload
            targets.append(http_target(url, {}, clients, twins, duration, warmup, seed, gpu, served_here=True))
        yield targets


class LoadSeries:
    """Runs loads on one target, each with voices no earlier load used, and keeps their rows; `tagged`: each load's
    label names the transport (loads run on more than one)."""

    def __init__(self, target: Target, tagged: bool = False) -> None:
        self.target = target
        self.tagged = tagged
        self.rows: list[dict] = []
        self._next_index = 0

    def load(self, kind: str, value: float) -> dict:
        memory = self.target.host_memory
        start = memory() if memory else None
        run = self.target.measure(kind, value, self._next_index)
        end = memory() if memory else None
        self._next_index = run.next_index
        before, after = graph_captures(run.stats_before), graph_captures(run.stats_after)
        gpu = self.target.gpu.gpu_busy(run.started, run.ended) if self.target.gpu else None
        label = f"{value:g} req/s" if kind == "rate" else f"{value:g} clients"
        label += f" {self.target.transport}" if self.tagged else ""
        ordinary = [r for r in run.records if r.delivery.text is None]
        streamed = [r for r in run.records if r.delivery.text is not None]
        row = {"load": label, "mode": "open" if kind == "rate" else "closed", kind: value,
               "transport": self.target.transport, "lengths": self.target.lengths, "warmup_sent": run.warmup_sent,
               **summarize(ordinary, run.window_s, None if None in (before, after) else after - before, gpu,
                           self.target.peak_mem_gb())}
        bistream = self.target.bistream
        if bistream:
            row["bistream"] = {"clients": bistream.clients, "text_rate": bistream.text_rate, "lengths": "forced",
                               **summarize_bistream(streamed, run.window_s)}
        row["audio_s_per_s_all"] = row["audio_s_per_s"] + (row["bistream"]["audio_s_per_s"] if bistream else 0.0)
        row["stages"] = stage_use(run.stats_before, run.stats_after, run.window_s)
        row["host_memory"] = None if start is None else {"start": start, "end": end}
        self.rows.append(row)
        print_rows([row])
        print_bistream_rows([row])
        print_stage_rows([row])
        return row


def _values(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def run(args: argparse.Namespace) -> dict:
    """The loads of `args` (rates, clients or the capacity search) on its target; the report."""
    t0 = time.perf_counter()
    with open_targets(args) as targets:
        series = [LoadSeries(t, tagged=len(targets) > 1) for t in targets]
        rows: list[dict] = []
        found = None
        if args.capacity:  # one target (the command line refuses `--http both` here)
            found = capacity.search(lambda rate: passes(series[0].load("rate", rate), args.p95_ms),
                                    _values(args.rates)[0], args.capacity_steps)
            rows = series[0].rows
        else:  # each load on every target in turn, before the next load
            kind, values = ("clients", args.clients) if args.clients else ("rate", args.rates)
            rows = [s.load(kind, value) for value in _values(values) for s in series]
    report = {"rows": rows, "engine": targets[0].info, "transport": ",".join(t.transport for t in targets),
              "lengths": ",".join(dict.fromkeys(t.lengths for t in targets)), "wall_s": time.perf_counter() - t0}
    if len(targets) > 1:
        report["comparison"] = compare_transports(rows)
    if found is not None:
        report["capacity"] = {"best_rate": found.best, "failed_at": found.failed_at, "p95_ms": args.p95_ms,
                              "steps": [{"rate": r, "passed": ok} for r, ok in found.steps]}
    return report


def main(args: argparse.Namespace) -> int:
    """`bench --serve`: run, print the table (and the capacity), write `args.json`; 1 if a load served nothing."""
    report = run(args)
    print()
    print_rows(report["rows"])
    print_bistream_rows(report["rows"])
    print_stage_rows(report["rows"])
    print_comparison(report.get("comparison", []))
    if (bound := report["engine"].get("max_queue_wait")) is not None:
        print(f"max queue wait {bound:g} s: refused at once what cannot start within it")
    if "text" in report["lengths"].split(","):
        print("lengths: over HTTP the output length follows the text (a real model's server forces no token count)")
    if "capacity" in report:
        c = report["capacity"]
        best = "none passed" if c["best_rate"] is None else f"{c['best_rate']:g} req/s"
        above = "" if c["failed_at"] is None else f" (failed at {c['failed_at']:g} req/s)"
        print(f"capacity at first packet p95 <= {c['p95_ms']:g} ms: {best}{above}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "args": vars(args)}, f, indent=1)
    return 1 if any(row["ok"] + row.get("bistream", {}).get("ok", 0) == 0 for row in report["rows"]) else 0
