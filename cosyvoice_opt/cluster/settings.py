"""What a cluster is deployed with: `ClusterSettings` (the `cluster` command's flags, and the `args` of
`deploy/serve.yaml`) and the admission limit that Serve sends each replica up to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cosyvoice_opt.config import COSYVOICE2
from cosyvoice_opt.engine import EngineConfig


@dataclass
class ClusterSettings:
    """Everything `cluster_app` needs; also the `args` of `deploy/serve.yaml` (`build_app`)."""

    model_dir: str | None = None  # None: $COSYVOICE_MODEL_DIR, pretrained_models/..., else a random model
    random: str | None = None  # "tiny" | "full": a seeded random-weight model (no GPU: tiny unless a folder is given)
    family: str = COSYVOICE2  # the random model's family (a folder's is read from its files)
    precision: str = "auto"
    max_batch_size: int = 64
    voices_dir: str = "voices"  # one folder every replica (and the ingress) sees at the same path
    api_key: str | None = None
    replicas: int = 1  # fixed replica count, unless autoscaling is set (min_replicas and max_replicas)
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica (default: half the admission limit)
    gpus_per_replica: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0 (CPU replicas)
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int | None = None  # None: the engine's admission limit (`admission_limit`)
    max_queued_requests: int = 8  # requests the ingress holds for a free replica before refusing with 503
    drain_s: float = 300.0  # how long a stopping replica waits for its streams to finish
    health_check_period_s: float = 5.0
    exit_on_fatal: bool = True  # a replica whose GPU failed exits at once (Serve restarts it) instead of failing fast
    warmup: bool = True
    webui: bool = True  # the WebUI at / beside the API, in the ingress
    auth: str | None = None  # the WebUI's login: user:pass, or a file of such lines on the ingress's host (--auth)
    ui_concurrency: int = 16  # requests the WebUI's queue lets through at once (the webui's --concurrency)

    def webui_flags(self) -> list[str] | None:
        """The webui's flags for the page the ingress serves; None without a WebUI."""
        if not self.webui:
            return None
        if self.ui_concurrency < 1:
            raise ValueError(f"ui_concurrency must be >= 1, got {self.ui_concurrency}")
        flags = ["--concurrency", str(self.ui_concurrency)]
        if self.random:
            flags += ["--random", self.random, "--family", self.family]
        if self.auth:
            flags += ["--auth", self.auth]
        return flags

    def engine_config(self, cpu: bool) -> EngineConfig:
        """The replicas' engine configuration; on a CPU replica the tiny random model unless a folder is named."""
        random = self.random or ("tiny" if cpu and self.model_dir is None else None)
        return EngineConfig(precision=self.precision, max_batch_size=self.max_batch_size,
                            device="cpu" if cpu else None, random_size=random, family=self.family,
                            voices_dir=str(Path(self.voices_dir).resolve()), warmup=self.warmup,
                            exit_on_fatal=self.exit_on_fatal)


def admission_limit(max_batch_size: int) -> int:
    """Audio streams one engine admits at once when its memory allows: two per LLM slot (a stream's audio goes on
    after its LLM part ends). `EngineReplica` logs a warning when its engine admits fewer."""
    return 2 * max_batch_size
