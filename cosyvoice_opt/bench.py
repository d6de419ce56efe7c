"""The benchmark: first-packet latency, RTF, throughput, stage times, GPU use and memory per configuration.

`python -m cosyvoice_opt bench` sweeps precision x concurrency x streaming on random full-size weights (or
`--model-dir`) with a synthetic 3 s prompt and a forced number of speech tokens per request, prints a table and
writes JSON. CPU smoke test: `--random tiny --concurrency 1,2 --tokens 30`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest

MORE_WARMUP = 3  # extra unmeasured rounds allowed while new flow graphs are still being captured
MIN_SAMPLES = 8  # low concurrencies run several measured rounds, so that percentiles come from 8+ requests
TEXT = "This sentence is synthesised by the benchmark to measure the speed of the streaming engine."
PROMPT_TEXT = "A three second synthetic prompt for the benchmark."


def synthetic_prompt(seconds: float = 3.0, rate: int = 16000) -> tuple[int, np.ndarray]:
    """A voiced-sounding signal: a gliding 120-220 Hz harmonic tone with syllable-rate amplitude and a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 170 + 50 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    noise = np.random.default_rng(0).normal(0, 0.01, t.shape)
    return rate, (0.25 * tone * envelope + noise).astype(np.float32)


class GpuSampler:
    """Mean GPU utilisation over a window, sampled by NVML in a thread; None without NVML."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.values: list[float] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no driver / library: utilisation is n/a
            self._nvml = self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.values.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None


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
    stats = engine.stats()
    return stats["flow_graph_captures"] + stats["hift_graph_captures"]


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
    with GpuSampler() as gpu:
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
        "gpu_util_mean": gpu.mean,
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_opt bench", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a CosyVoice2-0.5B folder (default: random weights)")
    p.add_argument("--random", choices=("tiny", "full"), default=None, help="random-weight model size (default full)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32|fp16|bf16|auto")
    p.add_argument("--stream", default="1,0", help="comma list of 1 (streaming) / 0 (one chunk)")
    p.add_argument("--concurrency", default=None,
                   help="comma list of concurrent requests (default 1,4,16,64,128; soak: clients, default 4)")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens forced per request (EOS ignored)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds before each configuration")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the LLM decode step (see README)")
    p.add_argument("--json", help="write the results here")
    soak = p.add_argument_group("soak (load over the HTTP API instead of the sweep)")
    soak.add_argument("--soak", type=float, metavar="SECONDS", help="run N clients for this long")
    soak.add_argument("--url", help="a running server (default: serve the API in this process on loopback)")
    soak.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    soak.add_argument("--api-key", help="bearer key for --url (default: COSYVOICE_API_KEY)")
    args = p.parse_args(argv)
    args.concurrency = args.concurrency or ("4" if args.soak else "1,4,16,64,128")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # engine progress (load, compile and graph captures, warm-up) and the soak's samples go to stderr as they happen
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.soak:
        return _soak(args)
    concurrency = _ints(args.concurrency)
    streams = [bool(x) for x in _ints(args.stream)]
    random_size = None if args.model_dir else (args.random or "full")
    prompt = synthetic_prompt()
    rows, meta = [], {}
    for precision in [p for p in args.precision.split(",") if p]:
        config = EngineConfig(precision=precision, max_batch_size=min(concurrency), device=args.device,
                              random_size=random_size, cuda_graphs=not args.no_cuda_graphs,
                              compile=args.compile)
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


def _soak(args: argparse.Namespace) -> int:
    from cosyvoice_opt.soak import run

    report = run(args)
    first, total, start, end = report["first_byte_ms"], report["total_ms"], report["start"], report["end"]
    print(f"soak {report['seconds']:g} s x {report['concurrency']} clients ({report['server']}): "
          f"{report['completed']} completed, {report['failed']} failed, {report['requests_per_s']:.2f} req/s")
    if first:
        print(f"first byte ms p50 {first['p50']:.0f} p95 {first['p95']:.0f} p99 {first['p99']:.0f} max "
              f"{first['max']:.0f}; total ms p50 {total['p50']:.0f} p95 {total['p95']:.0f} p99 {total['p99']:.0f} "
              f"max {total['max']:.0f}")
    gpu = "" if start["gpu_allocated_mb"] is None else \
        f"; GPU allocated {start['gpu_allocated_mb']:.0f} -> {end['gpu_allocated_mb']:.0f} MB"
    half = report["rss_growth_second_half_mb"]
    print(f"RSS {start['rss_mb']:.0f} -> {end['rss_mb']:.0f} MB (second half: {half:+.0f} MB){gpu}")
    first_sample, last_sample = report["samples"][0], report["samples"][-1]
    if "heap_in_use_mb" in first_sample:
        print(f"malloc heap in use {first_sample['heap_in_use_mb']:.0f} -> {last_sample['heap_in_use_mb']:.0f} MB, "
              f"free but kept {first_sample['heap_free_mb']:.0f} -> {last_sample['heap_free_mb']:.0f} MB")
    if report["object_growth"]:
        print("Python objects grown most: " + ", ".join(f"{k} +{v}" for k, v in report["object_growth"].items()))
    for error in report["errors"]:
        print(f"error: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "args": vars(args)}, f, indent=1)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
