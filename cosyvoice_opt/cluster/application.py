"""The Serve application: the board, the replicas and the ingress bound with their Serve options (`cluster_app`),
and Serve's builder for `deploy/serve.yaml` (`build_app`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import ray
from ray import serve

from cosyvoice_opt.cluster.ingress import ClusterIngress
from cosyvoice_opt.cluster.replica import EngineReplica, ReplicaBoard
from cosyvoice_opt.cluster.settings import ClusterSettings, admission_limit

APP_NAME = "cosyvoice"


def _cluster_gpus() -> float:
    return ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0


def replica_options(s: ClusterSettings, gpus: float) -> dict[str, Any]:
    """The replica deployment's Serve options: resources, the admission limit as `max_ongoing_requests`, a fixed
    count or autoscaling on ongoing requests (target: half the limit unless given), the health check and the
    drain."""
    ongoing = s.max_ongoing_requests or admission_limit(s.max_batch_size)
    if s.min_replicas is not None or s.max_replicas is not None:
        lo = s.min_replicas if s.min_replicas is not None else 1
        hi = s.max_replicas if s.max_replicas is not None else max(lo, s.replicas)
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{lo} and {hi}")
        scaling: dict[str, Any] = {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi,
            "target_ongoing_requests": s.target_ongoing_requests or max(1.0, ongoing / 2)}}
    else:
        scaling = {"num_replicas": s.replicas}
    return {"name": "EngineReplica", "ray_actor_options": {"num_gpus": gpus, "num_cpus": s.cpus_per_replica},
            "max_ongoing_requests": ongoing, "max_queued_requests": s.max_queued_requests,
            "health_check_period_s": s.health_check_period_s, **scaling, **_drain(s)}


def _drain(s: ClusterSettings) -> dict[str, float]:
    return {"graceful_shutdown_timeout_s": s.drain_s, "graceful_shutdown_wait_loop_s": 1.0}


def cluster_app(s: ClusterSettings, replica_cls: type = EngineReplica) -> serve.Application:
    """The Serve application: `replica_cls` (an `EngineReplica`) behind `ClusterIngress`."""
    gpus = s.gpus_per_replica if s.gpus_per_replica is not None else (1 if _cluster_gpus() > 0 else 0)
    config = s.engine_config(cpu=gpus == 0)
    options = replica_options(s, gpus)
    board = serve.deployment(ReplicaBoard).options(
        name="ReplicaBoard", num_replicas=1, ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False}).bind()
    replicas = serve.deployment(replica_cls).options(**options).bind(
        s.model_dir, config, board, options["max_ongoing_requests"])
    ingress = serve.deployment(ClusterIngress).options(
        name="ClusterIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1_000_000, **_drain(s))
    return ingress.bind(replicas, board, config.voices_dir, s.api_key, s.webui_flags())


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder (`import_path: cosyvoice_opt.cluster:build_app`): `args` are `ClusterSettings`
    fields."""
    known = {f.name for f in fields(ClusterSettings)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown cluster args: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cluster_app(ClusterSettings(**args))
