"""Scale-out on one host: the serving benchmark's capacity search through a Ray Serve cluster of 1, 2, ... replicas,
and a replica killed under load.

`python tools/scale_out.py --replicas 1,2 --out DIR [--kill] [--random full --precision bf16 ...]`

For each replica count it starts `python -m cosyvoice_opt cluster --replicas N` (log: DIR/cluster-N.log), waits
until `/health` reports N healthy replicas, runs `bench --serve --capacity --url` from the last count's capacity
scaled by the replica ratio (DIR/capacity-N.json), and stops the cluster. With `--kill`, on the largest cluster it
then runs a load at 70 % of that capacity and kills one replica's process halfway through (SIGKILL, as a crash
would), waits until Serve has N healthy replicas again, and runs the same load once more (DIR/kill-N.json,
DIR/after-kill-N.json). A benchmark that does not end in time (a request that hung) stops the run with an error.
It prints one table and writes it to DIR/scale_out.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from cosyvoice_opt.bench.cli import SERVE_WARMUP_S
from cosyvoice_opt.bench.loopback import free_port

KILL_LOAD = 0.7  # of the largest cluster's capacity
READY_TIMEOUT_S = 900.0  # Ray's start and every replica's engine start-up (captures included)
LOAD_DRAIN_S = 180.0  # past a load's window, for its requests to end (the longest speaks 20 s, after queueing)


def _healthy(base: str, replicas: int) -> dict | None:
    """`/health` when it reports `replicas` replicas, all ok; else None."""
    try:
        body = httpx.get(f"{base}/health", timeout=10.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    reps = body.get("replicas", [])
    return body if len(reps) == replicas and all(r["status"] == "ok" for r in reps) else None


def wait_healthy(base: str, replicas: int, timeout: float = READY_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while (body := _healthy(base, replicas)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} did not report {replicas} healthy replicas within {timeout:.0f} s")
        time.sleep(1.0)
    return body


def bench(base: str, out: Path, extra: list[str], args: argparse.Namespace, loads: int = 1) -> dict:
    """`bench --serve --url base` with `extra` (`loads` measured loads at most); its JSON report."""
    cmd = [sys.executable, "-m", "cosyvoice_opt", "bench", "--serve", "--url", base, "--duration", str(args.duration),
           "--p95-ms", str(args.p95_ms), "--seed", str(args.seed), "--json", str(out), *extra]
    print("+", " ".join(cmd), flush=True)
    timeout = loads * (SERVE_WARMUP_S + args.duration + LOAD_DRAIN_S)
    try:
        subprocess.run(cmd, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the benchmark did not end within {timeout:.0f} s: a request hung") from e
    return json.loads(out.read_text())


def row_at(report: dict, rate: float | None) -> dict | None:
    """The report's row measured at `rate` (the last one, if it was measured more than once)."""
    rows = [r for r in report["rows"] if r.get("rate") == rate]
    return rows[-1] if rows else None


def start_rate(found: dict[int, float | None], replicas: int, first: float) -> float:
    """Where a count's search starts: the last count's capacity scaled by the replica ratio, else `first`."""
    known = [(n, c) for n, c in found.items() if c]
    if not known:
        return first
    n, capacity = known[-1]
    return capacity * replicas / n


def summary(capacities: dict[int, dict], kill: dict | None) -> dict:
    """Per replica count: the capacity and its row; the scaling per doubling; the kill run's outcome."""
    counts = sorted(capacities)
    out = {"capacity": {}, "scaling": {}, "kill": kill}
    for n in counts:
        report = capacities[n]
        best = report["capacity"]["best_rate"]
        row = row_at(report, best)
        out["capacity"][n] = {"rate": best, "failed_at": report["capacity"]["failed_at"],
                              "first_packet_ms": row and row["first_packet_ms"],
                              "underrun_events": row and row["underrun_events"],
                              "failed": row and row["failed"], "audio_s_per_s": row and row["audio_s_per_s"]}
    for small, large in itertools.pairwise(counts):
        a, b = out["capacity"][small]["rate"], out["capacity"][large]["rate"]
        if a and b:
            out["scaling"][f"{small}->{large}"] = round(b / a, 3)
    return out


def print_summary(s: dict) -> None:
    print(f"{'replicas':>8} {'req/s':>6} {'p50':>6} {'p95':>6} {'p99':>6} {'under':>5} {'fail':>4} {'aud-s/s':>8}")
    for n, c in s["capacity"].items():
        fp = c["first_packet_ms"] or {}
        cells = [fp.get(k) for k in ("p50", "p95", "p99")]
        rate = "  none" if c["rate"] is None else f"{c['rate']:6.2f}"
        print(f"{n:>8} {rate} " + " ".join("   n/a" if v is None else f"{v:6.0f}" for v in cells)
              + f" {c['underrun_events'] or 0:5} {c['failed'] or 0:4} {c['audio_s_per_s'] or 0:8.2f}")
    for pair, ratio in s["scaling"].items():
        print(f"capacity {pair} replicas: x{ratio}")
    if s["kill"]:
        k = s["kill"]
        print(f"killed {k['replica']} (pid {k['pid']}) at {k['rate']:.2f} req/s: {k['during']}; Serve had "
              f"{k['replicas']} healthy replicas again {k['recovered_after_s']:.0f} s after the kill; "
              f"the same load then: {k['after']}")


def _outcome(row: dict) -> str:
    fp = row["first_packet_ms"]
    return (f"{row['ok']}/{row['sent']} ok, {row['failed']} failed, {row['rejected']} refused, "
            f"p95 {fp.get('p95', float('nan')):.0f} ms, {row['underrun_events']} underruns, errors {row['errors']}")


class Cluster:
    """`python -m cosyvoice_opt cluster` in its own process group, stopped as Ctrl-C would (then killed)."""

    def __init__(self, replicas: int, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cosyvoice_opt", "cluster", "--replicas", str(replicas), "--host", "127.0.0.1",
               "--port", str(self.port), "--no-webui", "--precision", args.precision,
               "--max-batch-size", str(args.max_batch_size)]
        cmd += ["--model-dir", args.model_dir] if args.model_dir else ["--random", args.random]
        print("+", " ".join(cmd), flush=True)
        self._log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def kill_run(cluster: Cluster, replicas: int, rate: float, out: Path, args: argparse.Namespace) -> dict:
    """A load at `rate`; halfway through its measured window one replica's process is killed."""
    victim = wait_healthy(cluster.base, replicas)["replicas"][0]
    killed_at: list[float] = []

    def crash() -> None:
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at.append(time.monotonic())

    timer = threading.Timer(SERVE_WARMUP_S + args.duration / 2, crash)
    timer.start()
    try:
        during = bench(cluster.base, out / f"kill-{replicas}.json", ["--rates", f"{rate:.3f}"], args)
    finally:
        timer.cancel()
    if not killed_at:
        raise RuntimeError("the load ended before the replica was killed")
    wait_healthy(cluster.base, replicas)
    recovered = time.monotonic() - killed_at[0]
    after = bench(cluster.base, out / f"after-kill-{replicas}.json", ["--rates", f"{rate:.3f}"], args)
    return {"replica": victim["replica"], "pid": victim["pid"], "rate": rate, "replicas": replicas,
            "during": _outcome(during["rows"][-1]), "recovered_after_s": recovered,
            "after": _outcome(after["rows"][-1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2", help="comma list of replica counts (one GPU each)")
    p.add_argument("--out", required=True, help="folder for the logs and JSON reports")
    p.add_argument("--kill", action="store_true", help="kill a replica under load on the largest cluster")
    p.add_argument("--kill-rate", type=float, help=f"that load, req/s (default {KILL_LOAD:.0%} of its capacity)")
    p.add_argument("--model-dir")
    p.add_argument("--random", choices=("tiny", "full"), default="full")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--start-rate", type=float, default=4.0, help="the first count's search starts here, req/s")
    p.add_argument("--capacity-steps", type=int, default=5)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per load")
    p.add_argument("--p95-ms", type=float, default=500.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    counts = sorted(int(n) for n in args.replicas.split(",") if n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capacities: dict[int, dict] = {}
    kill = None
    for n in counts:
        cluster = Cluster(n, args, out / f"cluster-{n}.log")
        try:
            t0 = time.monotonic()
            wait_healthy(cluster.base, n)
            print(f"{n} replica(s) healthy after {time.monotonic() - t0:.0f} s", flush=True)
            found = {m: capacities[m]["capacity"]["best_rate"] for m in capacities}
            rate = start_rate(found, n, args.start_rate)
            capacities[n] = bench(cluster.base, out / f"capacity-{n}.json",
                                  ["--capacity", "--rates", f"{rate:.3f}", "--capacity-steps",
                                   str(args.capacity_steps)], args, loads=args.capacity_steps)
            best = capacities[n]["capacity"]["best_rate"]
            kill_rate = args.kill_rate or (best and KILL_LOAD * best)
            if args.kill and n == counts[-1]:
                if kill_rate:
                    kill = kill_run(cluster, n, kill_rate, out, args)
                else:
                    print("no replica killed: no capacity found to load it at (give --kill-rate)", flush=True)
        finally:
            cluster.stop()
    result = summary(capacities, kill)
    print_summary(result)
    (out / "scale_out.json").write_text(json.dumps({**result, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
