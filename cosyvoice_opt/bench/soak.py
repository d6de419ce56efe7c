"""Load and soak: N client threads loop over the real HTTP API for a bounded time and count of requests.

`python -m cosyvoice_opt bench --soak SECONDS --concurrency N [--url URL] [--random tiny] [--json F]`. Without
`--url` the API is served in this process on a free loopback port (the routes `app.py` mounts, over uvicorn) with
the chosen model, and the clients run in a child process (the readings are the server's, and the clients' Python
does not slow the engine through the GIL). Clients alternate streamed and whole-file requests to a voice saved at
the start. Reported: completed/failed requests, first-byte and total latency percentiles, process RSS and GPU
memory at start and end, and sampled over the run (with the engine's completed requests and flow-graph captures,
and for an in-process server glibc's heap, Python's allocated blocks and the thread count) with the RSS growth of
the second half alone, which tells a leak from caches that fill once; and the Python types whose count grew most.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
import psutil
import torch

from cosyvoice_opt.bench.loopback import ClientProcess, serve_in_process
from cosyvoice_opt.bench.report import percentiles_ms
from cosyvoice_opt.bench.transport import MODEL
from cosyvoice_opt.bench.workload import synthetic_prompt, wav_bytes
from cosyvoice_opt.limits import MAX_QUEUE_WAIT_RANGE
from cosyvoice_opt.monitor import Sampler, malloc_heap

log = logging.getLogger(__name__)

SOAK_TEXT = "Hello, this is a soak test."
VOICE = "soak-voice"
REQUEST_TIMEOUT_S = 300.0


class Busy(Exception):
    """The server refused a request as busy (HTTP 503): a refusal it is built to give past its capacity, counted apart
    from failures."""


def _one(client: httpx.Client, k: int) -> tuple[float, float]:
    """Request `k` (even: streamed pcm, odd: whole wav) -> (first byte s, total s); raises `Busy` on a refusal,
    another exception on any failure."""
    body = {"model": MODEL, "input": SOAK_TEXT, "voice": VOICE, "seed": k,
            "response_format": "pcm" if k % 2 == 0 else "wav"}
    if k % 2 == 0:
        body["stream_format"] = "audio"
    t0 = time.perf_counter()
    first, size = None, 0
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            r.read()
            if r.status_code == 503:
                raise Busy(r.headers.get("retry-after", ""))
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for part in r.iter_bytes():
            if first is None and part:
                first = time.perf_counter() - t0
            size += len(part)
    total = time.perf_counter() - t0
    if first is None or size < 2 * 240:  # not even 10 ms of audio
        raise RuntimeError(f"short response: {size} bytes")
    return first, total


def _clients(url: str, headers: dict, n: int, fn: Callable[[httpx.Client, int], object]) -> None:
    """`fn(client, i)` in `n` threads at once, each with its own connection; returns when all are done."""

    def run(i: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
            fn(client, i)

    threads = [threading.Thread(target=run, args=(i,), name=f"soak-client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _object_types() -> Counter:
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def _memory(device: str | None) -> dict:
    """RSS and GPU memory; for an in-process server (`device` given) also the live torch tensors, which a leak
    grows exactly, unlike RSS (allocator arenas of new worker threads come and go)."""
    cuda = device is not None and device.startswith("cuda") and torch.cuda.is_available()
    reading = {"rss_mb": psutil.Process().memory_info().rss / 2**20,
               "gpu_allocated_mb": torch.cuda.memory_allocated() / 2**20 if cuda else None}
    if device is not None:
        gc.collect()
        reading["live_tensors"] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return reading


def process_reading(t0: float, device: str | None, stats: Callable[[], dict] | None) -> dict:
    """One soak sample: RSS (and GPU memory, engine counters) at `time.perf_counter() - t0` s. Sampled over the run,
    growth can be seen levelling off or not, not only compared between start and end."""
    cuda = device is not None and device.startswith("cuda") and torch.cuda.is_available()
    sample = {"t_s": round(time.perf_counter() - t0, 1),
              "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
              "gpu_allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1) if cuda else None}
    if cuda:  # pinned host memory is RSS too: its allocator caches blocks (power-of-two sizes), never frees them
        host = torch.cuda.host_memory_stats()
        for key in ("allocated_bytes.current", "reserved_bytes.current"):
            if key in host:
                sample[f"pinned_{key.split('_')[0]}_mb"] = round(host[key] / 2**20, 1)
    if device is not None:  # in-process server: what else could hold host memory
        sample.update(malloc_heap())
        # not len(gc.get_objects()): walking the GC while requests run breaks them (CPython gh-107137: a tuple
        # being built by tuple(generator) in another thread gets a second reference -> SystemError; seen on the
        # H200). Blocks of Python's small-object allocator grow with Python objects just as well.
        sample["python_blocks"] = sys.getallocatedblocks()
        sample["threads"] = threading.active_count()
    if stats is not None:
        counters = stats()
        kept = ("completed", "flow_graph_captures", "hift_graph_captures")
        sample.update({k: counters[k] for k in kept if k in counters})
    log.info("soak sample: %s", sample)  # progress, and readings that survive a run cut short
    return sample


def _sampler(interval: float, device: str | None, stats: Callable[[], dict] | None) -> Sampler[dict]:
    t0 = time.perf_counter()
    return Sampler(lambda: process_reading(t0, device, stats), interval, name="soak-sampler")


class SoakRefused(Exception):
    """The server refused the soak's set-up (a wrong --api-key, an unreachable --url): one line, no traceback."""


def _prepare(url: str, headers: dict, concurrency: int) -> None:
    """Save the soak voice, then one round of every client at once: batch shapes, graphs, allocator arenas and caches
    are warm when the readings start."""
    with httpx.Client(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
        try:
            r = client.post("/v1/voices", data={"name": VOICE, "prompt_text": "A synthetic prompt for the soak test."},
                            files={"file": ("prompt.wav", wav_bytes(*synthetic_prompt()), "audio/wav")})
        except httpx.TransportError as e:
            raise SoakRefused(f"cannot reach {url} ({type(e).__name__}: {e}); check --url") from None
        if r.status_code in (401, 403):
            raise SoakRefused(f"{url} refused the API key (HTTP {r.status_code}); check --api-key or "
                              "COSYVOICE_API_KEY")
        if r.status_code != 201:
            raise SoakRefused(f"could not save the soak voice: HTTP {r.status_code}: {r.text[:200]}")
    _clients(url, headers, concurrency, lambda client, i: _one(client, i))


def _load(url: str, headers: dict, seconds: float, concurrency: int, max_requests: int) -> dict:
    """The timed part: every client loops until the deadline or the request budget; refusals and failures are
    counted."""
    counter = itertools.count(concurrency)
    lock = threading.Lock()
    firsts: list[float] = []
    totals: list[float] = []
    errors: list[str] = []
    refused = [0]
    deadline = time.monotonic() + seconds

    def worker(client: httpx.Client, i: int) -> None:
        while time.monotonic() < deadline:
            k = next(counter)
            if k >= concurrency + max_requests:
                return
            try:
                first, total = _one(client, k)
            except Busy:
                with lock:
                    refused[0] += 1
                continue
            except Exception as e:  # counted and reported, the loop goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                firsts.append(first)
                totals.append(total)

    t0 = time.perf_counter()
    _clients(url, headers, concurrency, worker)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "completed": len(totals), "refused": refused[0], "failed": len(errors),
            "errors": sorted(set(errors))[:10],
            "requests_per_s": len(totals) / wall, "first_byte_ms": percentiles_ms(firsts),
            "total_ms": percentiles_ms(totals)}


def _cleanup(url: str, headers: dict) -> None:
    with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        client.delete(f"/v1/voices/{VOICE}")


def soak(url: str, seconds: float, concurrency: int, max_requests: int, api_key: str | None = None,
         device: str | None = None, stats: Callable[[], dict] | None = None) -> dict:
    """Run the soak against `url`. With `device` ("cuda"/"cpu") the server is in this process: the clients then run
    in a child process, so the memory readings (RSS, GPU, live tensors) are the server's alone and the clients' Python
    does not compete with the engine for this process's GIL; `stats` (the engine's) adds its counters to the samples.
    With None (a remote server) the clients run here and the readings are theirs."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    interval = max(1.0, min(10.0, seconds / 20))
    with ClientProcess("soak-clients") if device is not None else _Here() as clients:
        clients.call(_prepare, url, headers, concurrency)
        start = _memory(device)
        types_before = _object_types() if device is not None else Counter()
        with _sampler(interval, device, stats) as sampler:
            try:
                load = clients.call(_load, url, headers, seconds, concurrency, max_requests,
                                    timeout=seconds + 2 * REQUEST_TIMEOUT_S)
            finally:  # before the end readings: the server takes them with no request open
                clients.call(_cleanup, url, headers)
    end = _memory(device)
    growth = {}
    if device is not None:  # the Python types whose count grew most: a leak of objects names itself here
        growth = dict((_object_types() - types_before).most_common(10))
    samples = sampler.readings()
    half = next(x for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2)
    return {
        "url": url,
        "seconds": seconds,
        "concurrency": concurrency,
        **load,
        "start": start,
        "end": end,
        "rss_growth_mb": end["rss_mb"] - start["rss_mb"],
        "rss_growth_second_half_mb": samples[-1]["rss_mb"] - half["rss_mb"],
        "object_growth": growth,
        "samples": samples,
    }


class _Here:
    """`ClientProcess`'s interface, run in this process (clients of a remote server)."""

    def __enter__(self) -> _Here:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def call(self, fn: Callable, *args, timeout: float | None = None):
        return fn(*args)


def run(args: argparse.Namespace) -> dict:
    """`bench --soak`: against `args.url`, or an engine of `args.model_dir` / `args.random` served here."""
    concurrency = max(int(c) for c in args.concurrency.split(",") if c)
    api_key = args.api_key or os.environ.get("COSYVOICE_API_KEY")
    if args.url:
        report = soak(args.url, args.soak, concurrency, args.max_requests, api_key)
        return {**report, "server": "remote", "rss_note": "RSS is the client process's, not the server's"}
    from cosyvoice_opt.engine import Engine, EngineConfig

    random_size = None if args.model_dir else (args.random or "full")
    precision = args.precision.split(",")[0]
    with tempfile.TemporaryDirectory(prefix="cosyvoice-soak-voices-") as voices:
        config = EngineConfig(precision=precision, max_batch_size=concurrency, device=args.device,
                              random_size=random_size, family=args.family, cuda_graphs=not args.no_cuda_graphs,
                              compile=args.compile, voices_dir=voices,
                              max_queue_wait=MAX_QUEUE_WAIT_RANGE[1])  # closed-loop clients: their backlog waits
        with Engine.from_model_dir(args.model_dir, config) as engine, serve_in_process(engine) as url:
            report = soak(url, args.soak, concurrency, args.max_requests, device=str(engine.device),
                          stats=engine.stats)
            return {**report, "server": "in-process", "model": engine.info["model"],
                    "precision": engine.info["precision"], "device": engine.info["device"],
                    "engine_stats": engine.stats()}


def main(args: argparse.Namespace) -> int:
    """`bench --soak`: run, print the summary, write `args.json`; 1 if a request failed (a refusal as busy is not a
    failure) or the server refused the set-up."""
    try:
        report = run(args)
    except SoakRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    first, total, start, end = report["first_byte_ms"], report["total_ms"], report["start"], report["end"]
    print(f"soak {report['seconds']:g} s x {report['concurrency']} clients ({report['server']}): "
          f"{report['completed']} completed, {report['refused']} refused as busy (HTTP 503), "
          f"{report['failed']} failed, {report['requests_per_s']:.2f} req/s")
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
