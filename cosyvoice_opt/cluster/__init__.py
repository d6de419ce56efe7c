"""Scale out on Ray Serve: one `Engine` per replica (one GPU each), the single server's HTTP API in front.

Three deployments make one Serve application (`application.py`):

- `EngineReplica` (`replica.py`) holds one engine. Serve's router (power of two choices) picks a replica per request
  and sends a replica at most `max_ongoing_requests` at once, the engine's admission limit, so the engine never
  queues behind Serve's back. When every replica is full and the caller's queue (`max_queued_requests`) is too,
  Serve refuses the request, and the client gets the single server's answer to a busy engine: 503 with
  `Retry-After`. `check_health` fails once the engine is dead (a CUDA error poisoned it): Serve replaces the replica.
- `ClusterIngress` (`ingress.py`) serves the routes of `cosyvoice_opt.server.openai_api` unchanged, bound to
  `RemoteEngine` (`remote_engine.py`), an engine-shaped object whose calls go to the replicas through a Serve handle
  (speech streams through a streaming handle, chunk by chunk). It reads voices from the voices folder the replicas
  share, so a voice saved through one replica is usable on all of them; each replica keeps its own prompt cache.
- `ReplicaBoard` (`replica.py`) collects each replica's engine readings (pushed every `BOARD_PERIOD_S`) for
  `/metrics` (per replica and summed) and `/health`, with the replica's GPU readings (NVML; CPU and RAM without a
  GPU) for the WebUI.

The ingress also serves the WebUI at `/` over the same `RemoteEngine` (`ui.py`): the page, the API and the GPU panel
(one row per replica) work as on the single server. Its engine settings are read-only: every replica runs as
deployed (`ClusterSettings`, `settings.py`).

Replicas drain on scale-down and shutdown: Serve stops routing to them and waits for their streams to finish
(`drain_s`) before the engine closes. `python -m cosyvoice_opt cluster --replicas N` (`cli.py`) runs it locally;
`deploy/serve.yaml` (`import_path: cosyvoice_opt.cluster:build_app`) deploys it on many hosts.
"""

from cosyvoice_opt.cluster.application import APP_NAME, build_app, cluster_app, replica_options
from cosyvoice_opt.cluster.cli import main
from cosyvoice_opt.cluster.ingress import ClusterIngress, cluster_readings
from cosyvoice_opt.cluster.remote_engine import RemoteEngine
from cosyvoice_opt.cluster.replica import EngineReplica, ReplicaBoard
from cosyvoice_opt.cluster.settings import ClusterSettings, admission_limit
from cosyvoice_opt.cluster.ui import SETTINGS_FIXED, ClusterMonitor, mount_webui

__all__ = ["APP_NAME", "SETTINGS_FIXED", "ClusterIngress", "ClusterMonitor", "ClusterSettings", "EngineReplica",
           "RemoteEngine", "ReplicaBoard", "admission_limit", "build_app", "cluster_app", "cluster_readings", "main",
           "mount_webui", "replica_options"]
