"""The benchmark: first-packet latency, RTF, throughput, stage times, GPU use and memory per configuration.

`python -m cosyvoice_opt bench` sweeps precision x concurrency x streaming on random full-size weights (or
`--model-dir`) with a synthetic 3 s prompt and a forced number of speech tokens per request, prints a table and
writes JSON. CPU smoke test: `--random tiny --concurrency 1,2 --tokens 30`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from cosyvoice_opt.bench.report import graph_captures as captured
from cosyvoice_opt.bench.workload import synthetic_prompt
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.limits import MAX_QUEUE_WAIT_RANGE
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest

MORE_WARMUP = 3  # extra unmeasured rounds allowed while new flow graphs are still being captured
MIN_SAMPLES = 8  # low concurrencies run several measured rounds, so that percentiles come from 8+ requests
TEXT = "This sentence is synthesised by the benchmark to measure the speed of the streaming engine."
PROMPT_TEXT = "A three second synthetic prompt for the benchmark."


@dataclass
class _Result:
    first_packet: float  # s from stream() to the first chunk
    total: float  # s from stream() to the last chunk
    audio: float  # s of audio
    last: AudioChunk


def _one(engine: Engine, request: SynthesisRequest) -> _Result:
    t0 = time.perf_counter()
    first, samples, last = None, 0, None
    for chunk in engine.stream(request):
        if first is None:
            first = time.perf_counter() - t0
        samples += len(chunk.pcm)
        last = chunk
    return _Result(first, time.perf_counter() - t0, samples / last.sample_rate, last)


def _round(engine: Engine, concurrency: int, stream: bool, tokens: int, prompt) -> tuple[list[_Result], float]:
    """`concurrency` requests at once, each from its own thread; returns the results and the wall time."""
    results: list[_Result | BaseException] = [None] * concurrency

    def run(i: int) -> None:
        req = SynthesisRequest(text=TEXT, mode=Mode.ZERO_SHOT, prompt_audio=prompt, prompt_text=PROMPT_TEXT,
                               stream=stream, seed=i, force_tokens=tokens)
        try:
            results[i] = _one(engine, req)
        except BaseException as e:  # reported after the round
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results, wall


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def graph_captures(engine: Engine) -> int:
    """Flow and HiFT CUDA graphs captured so far (each stalls the vocoder once)."""
    return captured(engine.stats())


def run_config(engine: Engine, concurrency: int, stream: bool, tokens: int, warmup: int, prompt) -> dict:
    engine.set_max_batch_size(concurrency)
    for k in range(warmup + MORE_WARMUP):  # until a round needs no new CUDA graph (or the extra rounds run out)
        captures = graph_captures(engine)
        _round(engine, concurrency, stream, tokens, prompt)
        if k + 1 >= warmup and graph_captures(engine) == captures:
            break
    captures = graph_captures(engine)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    results, wall = [], 0.0
    with Monitor(interval=0.05, history_s=None) as gpu:
        for _ in range(-(-MIN_SAMPLES // concurrency)):
            got, took = _round(engine, concurrency, stream, tokens, prompt)
            results += got
            wall += took
    audio = sum(r.audio for r in results)
    rtf = [r.total / r.audio for r in results]
    stage = {k: statistics.fmean(getattr(r.last.timings, k) for r in results)
             for k in ("frontend", "llm", "flow", "hift")}
    return {
        "precision": engine.info["precision"],
        "stream": stream,
        "concurrency": concurrency,
        "tokens": tokens,
        "requests": len(results),
        "first_packet_p50_ms": 1000 * _pct([r.first_packet for r in results], 50),
        "first_packet_p95_ms": 1000 * _pct([r.first_packet for r in results], 95),
        "rtf_p50": _pct(rtf, 50),
        "rtf_max": max(rtf),
        "audio_s_per_s": audio / wall,
        "audio_s": audio,
        "wall_s": wall,
        "stage_s": stage,
        "gpu_util_mean": gpu.gpu_busy(),
        "peak_mem_gb": torch.cuda.max_memory_allocated(engine.device) / 2**30 if cuda else None,
        "prompt_cache_hit_ms": prompt_cache_hit_ms(engine, prompt),
        "graph_captures": graph_captures(engine) - captures,  # in the measured round: should be 0
    }


def prompt_cache_hit_ms(engine: Engine, prompt, repeats: int = 20) -> float:
    """Median cost of the prompt features of an already-seen prompt (decode + hash + cache lookup)."""
    engine.prompt_features(prompt)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.prompt_features(prompt)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'prec':5} {'strm':4} {'conc':>4} {'fp50ms':>8} {'fp95ms':>8} {'rtf50':>7} {'rtfmax':>7} "
            f"{'aud-s/s':>8} {'llm_s':>7} {'flow_s':>7} {'hift_s':>7} {'gpu%':>5} {'memGB':>6} {'hit_ms':>7} "
            f"{'cap':>3}")
    print(head)
    for r in rows:
        s = r["stage_s"]
        print(f"{r['precision']:5} {int(r['stream']):4} {r['concurrency']:4} {r['first_packet_p50_ms']:8.1f} "
              f"{r['first_packet_p95_ms']:8.1f} {r['rtf_p50']:7.4f} {r['rtf_max']:7.4f} {r['audio_s_per_s']:8.1f} "
              f"{s['llm']:7.3f} {s['flow']:7.3f} {s['hift']:7.3f} {_fmt(r['gpu_util_mean'], '5.1f')} "
              f"{_fmt(r['peak_mem_gb'], '6.2f')} {r['prompt_cache_hit_ms']:7.2f} {r['graph_captures']:3}")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def run(args: argparse.Namespace) -> int:
    """The sweep: every precision x concurrency x streaming configuration, one table, `args.json`."""
    concurrency = _ints(args.concurrency)
    streams = [bool(x) for x in _ints(args.stream)]
    random_size = None if args.model_dir else (args.random or "full")
    prompt = synthetic_prompt()
    rows, meta = [], {}
    for precision in [p for p in args.precision.split(",") if p]:
        # sized for the largest concurrency (smaller ones set the batch limit live), and no request is refused:
        # the closed loop measures throughput, every request waits its turn
        config = EngineConfig(precision=precision, max_batch_size=max(concurrency), device=args.device,
                              random_size=random_size, family=args.family, cuda_graphs=not args.no_cuda_graphs,
                              compile=args.compile, max_queue_wait=MAX_QUEUE_WAIT_RANGE[1])
        t0 = time.perf_counter()
        engine = Engine.from_model_dir(args.model_dir, config)
        meta[precision] = {"load_s": time.perf_counter() - t0, **engine.info}
        try:
            for c in sorted(concurrency):
                for stream in streams:
                    row = run_config(engine, c, stream, args.tokens, args.warmup, prompt)
                    rows.append(row)
                    print_table([row])
        finally:
            engine.close()
            del engine
            gc.collect()  # the closed engine's reference cycles hold its GPU memory until collected
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engines": meta, "results": rows, "args": vars(args)}, f, indent=1)
    return 0
