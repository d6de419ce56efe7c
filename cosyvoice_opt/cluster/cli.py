"""`python -m cosyvoice_opt cluster`: start (or join) Ray, deploy the application, serve until Ctrl-C, then drain."""

from __future__ import annotations

import argparse
import signal
import threading

import ray
from ray import serve

from cosyvoice_opt.cluster.application import APP_NAME, cluster_app
from cosyvoice_opt.cluster.settings import ClusterSettings
from cosyvoice_opt.config import COSYVOICE2, FAMILIES


def parse_args(argv: list[str] | None = None, prog: str = "python -m cosyvoice_opt cluster") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog,
                                description="Serve the WebUI and the HTTP API from N engine replicas on a local Ray "
                                            "instance (one GPU each; without GPUs, CPU replicas of the tiny random "
                                            "model).")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    p.add_argument("--min-replicas", type=int, help="autoscale: fewest replicas")
    p.add_argument("--max-replicas", type=int, help="autoscale: most replicas")
    p.add_argument("--target-ongoing", type=float, help="autoscale: ongoing requests per replica to aim for")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model-dir")
    p.add_argument("--random", choices=["tiny", "full"])
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2, help="family of the --random model")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--voices-dir", default="voices")
    p.add_argument("--api-key")
    p.add_argument("--no-webui", action="store_true", help="serve the HTTP API only (no WebUI at /)")
    p.add_argument("--auth", help="the WebUI's login: user:pass, or a file with one user:pass per line")
    p.add_argument("--ui-concurrency", type=int, default=16, help="requests the WebUI's queue lets through at once")
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--max-ongoing-requests", type=int, help="per replica (default: the engine's admission limit)")
    p.add_argument("--max-queued-requests", type=int, default=8)
    p.add_argument("--drain-s", type=float, default=300.0, help="how long a stopping replica lets streams finish")
    p.add_argument("--address", help="join a running Ray cluster (default: start a local one)")
    return p.parse_args(argv)


def settings_from_args(a: argparse.Namespace) -> ClusterSettings:
    return ClusterSettings(model_dir=a.model_dir, random=a.random, family=a.family, precision=a.precision,
                           max_batch_size=a.max_batch_size, voices_dir=a.voices_dir, api_key=a.api_key,
                           replicas=a.replicas, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                           target_ongoing_requests=a.target_ongoing, cpus_per_replica=a.cpus_per_replica,
                           max_ongoing_requests=a.max_ongoing_requests, max_queued_requests=a.max_queued_requests,
                           drain_s=a.drain_s, webui=not a.no_webui, auth=a.auth, ui_concurrency=a.ui_concurrency)


def main(argv: list[str] | None = None, prog: str = "python -m cosyvoice_opt cluster") -> int:
    """Start (or join) Ray, deploy the application on `--port`, serve until Ctrl-C, then drain and stop."""
    a = parse_args(argv, prog)
    s = settings_from_args(a)
    ray.init(address=a.address, include_dashboard=False)
    serve.start(http_options={"host": a.host, "port": a.port})
    serve.run(cluster_app(s), name=APP_NAME, route_prefix="/")
    count = s.replicas if s.min_replicas is None and s.max_replicas is None else "autoscaled"
    what = "the HTTP API" if a.no_webui else "the WebUI and the HTTP API"
    print(f"serving {what} from {count} replica(s) on http://{a.host}:{a.port} (Ctrl-C drains and stops)",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ray's own handlers would end the process without a drain
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        serve.delete(APP_NAME)  # replicas drain: their streams finish first
        if a.address is None:  # a joined cluster keeps Serve and its other applications
            serve.shutdown()
        ray.shutdown()
    return 0
