"""Scale out on Ray Serve: one `Engine` per replica (one GPU each), the single server's HTTP API in front.

Three deployments make one Serve application:

- `EngineReplica` holds one engine. Serve's router (power of two choices) picks a replica per request and sends a
  replica at most `max_ongoing_requests` at once, the engine's admission limit, so the engine never queues behind
  Serve's back. When every replica is full and the caller's queue (`max_queued_requests`) is too, Serve refuses
  the request, and the client gets the single server's answer to a busy engine: 503 with `Retry-After`.
  `check_health` fails once the engine is dead (a CUDA error poisoned it): Serve replaces the replica.
- `ClusterIngress` serves the routes of `cosyvoice_opt.server.openai_api` unchanged, bound to `RemoteEngine`, an
  engine-shaped object whose calls go to the replicas through a Serve handle (speech streams through a streaming
  handle, chunk by chunk). It reads voices from the voices folder the replicas share, so a voice saved through one
  replica is usable on all of them; each replica keeps its own prompt cache.
- `ReplicaBoard` collects each replica's engine readings (pushed every `BOARD_PERIOD_S`) for `/metrics` (per replica
  and summed) and `/health`, with the replica's GPU readings (NVML; CPU and RAM without a GPU) for the WebUI.

The ingress also serves the WebUI at `/` over the same `RemoteEngine` (`mount_webui`): the page, the API and the
GPU panel (one row per replica) work as on the single server. Its engine settings are read-only: every replica runs
as deployed.

Replicas drain on scale-down and shutdown: Serve stops routing to them and waits for their streams to finish
(`drain_s`) before the engine closes. `python -m cosyvoice_opt cluster --replicas N` runs it locally; see
`deploy/serve.yaml` for many hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pandas as pd
import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, EngineDead, InputError
from cosyvoice_opt.frontend.voices import VoiceStore
from cosyvoice_opt.monitor import Monitor, history_frame, panel_row
from cosyvoice_opt.server.metrics import CONTENT_TYPE, Reading, engine_readings, process_readings
from cosyvoice_opt.server.openai_api import OpenAIApi
from cosyvoice_opt.types import AudioChunk, SynthesisRequest

log = logging.getLogger(__name__)

APP_NAME = "cosyvoice"
BOARD_PERIOD_S = 1.0  # how often a replica reports its engine's readings
BOARD_STALE_S = 5.0  # a replica silent this long is gone (killed, or drained and closed)
BUSY_RETRY_AFTER_S = 1.0  # the Retry-After hint when every replica is full
DEAD_RETRIES = 2  # a request refused by a dead engine (before any audio) goes to another replica this many times


# ---- settings ------------------------------------------------------------------------------------------------------
@dataclass
class ClusterSettings:
    """Everything `cluster_app` needs; also the `args` of `deploy/serve.yaml` (`build_app`)."""

    model_dir: str | None = None  # None: $COSYVOICE_MODEL_DIR, pretrained_models/..., else a random model
    random: str | None = None  # "tiny" | "full": a seeded random-weight model (no GPU: tiny unless a folder is given)
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
            flags += ["--random", self.random]
        if self.auth:
            flags += ["--auth", self.auth]
        return flags

    def engine_config(self, cpu: bool) -> EngineConfig:
        """The replicas' engine configuration; on a CPU replica the tiny random model unless a folder is named."""
        random = self.random or ("tiny" if cpu and self.model_dir is None else None)
        return EngineConfig(precision=self.precision, max_batch_size=self.max_batch_size,
                            device="cpu" if cpu else None, random_size=random,
                            voices_dir=str(Path(self.voices_dir).resolve()), warmup=self.warmup,
                            exit_on_fatal=self.exit_on_fatal)


def admission_limit(max_batch_size: int) -> int:
    """Audio streams one engine admits at once when its memory allows: two per LLM slot (a stream's audio goes on
    after its LLM part ends). `EngineReplica` logs a warning when its engine admits fewer."""
    return 2 * max_batch_size


# ---- replicas ------------------------------------------------------------------------------------------------------
class ReplicaBoard:
    """The replicas' latest readings (one Serve replica): the ingress cannot address a replica by itself."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, dict]] = {}

    def report(self, snapshot: dict) -> None:
        self._snapshots[snapshot["replica"]] = (time.monotonic(), snapshot)

    def forget(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self) -> list[dict]:
        """Reports of the live replicas, by name (a replica silent for `BOARD_STALE_S` is dropped)."""
        now = time.monotonic()
        self._snapshots = {k: v for k, v in self._snapshots.items() if now - v[0] < BOARD_STALE_S}
        return [snap for _, (_, snap) in sorted(self._snapshots.items())]


class EngineReplica:
    """One engine. Its methods are what `RemoteEngine` forwards; `check_health` is Serve's health check."""

    def __init__(self, model_dir: str | None, config: EngineConfig, board: DeploymentHandle | None = None,
                 max_ongoing_requests: int | None = None) -> None:
        self.engine = Engine.from_model_dir(model_dir, config)
        self.name = ray.get_runtime_context().get_actor_name() or f"replica-{id(self):x}"
        admits = self.engine.stats().get("max_streams", 0)
        if max_ongoing_requests and admits < max_ongoing_requests:
            log.warning("%s: the engine admits %d streams at once, Serve sends up to %d; the rest queue in the "
                        "engine (refused busy after %.0f s)", self.name, admits, max_ongoing_requests,
                        config.max_queue_wait)
        self._threads = concurrent.futures.ThreadPoolExecutor(max(admits, max_ongoing_requests or 0) + 4,
                                                              thread_name_prefix="replica-stream")
        self._board = board
        self._stop = threading.Event()
        self.monitor = Monitor()  # this replica's GPU (the first of the CUDA_VISIBLE_DEVICES Ray gives it)
        self.monitor.start()
        if board is not None:
            threading.Thread(target=self._report_loop, name="board-report", daemon=True).start()

    async def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """The engine's chunks as they are made; cancelling (the client went away) cancels the request. Each wait
        for a chunk takes a thread of this replica's own pool, not one of Serve's few user-code threads, so that
        every admitted stream and the health check get one."""
        loop = asyncio.get_running_loop()
        chunks = await loop.run_in_executor(self._threads, self.engine.stream, request)
        pending = None
        try:
            while True:
                pending = loop.run_in_executor(self._threads, next, chunks, None)
                chunk = await pending
                pending = None
                if chunk is None:
                    return
                yield chunk
                if chunk.is_last:
                    return
        finally:
            if pending is None:
                chunks.close()
            else:  # a thread is inside the iterator: close it once that thread is out
                pending.add_done_callback(lambda _: chunks.close())

    async def synthesize(self, request: SynthesisRequest) -> AudioChunk:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.engine.synthesize, request)

    def save_voice(self, name: str, prompt_audio: bytes, prompt_text: str, overwrite: bool = True) -> None:
        self.engine.save_voice(name, prompt_audio, prompt_text, overwrite=overwrite)

    def info(self) -> dict:
        return self.engine.info

    def snapshot(self) -> dict:
        """This replica's name, host and process, engine info and stats, fatal error, Prometheus readings, and its
        GPU's readings of the last minute (with this host's clock, so that the panel's "seconds ago" needs no clock
        in common)."""
        monitor = {"device": self.monitor.device_name, "has_gpu": self.monitor.has_gpu,
                   "samples": self.monitor.readings(), "time": time.time()}
        return {"replica": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                "info": self.engine.info, "stats": self.engine.stats(),
                "fatal_error": self.engine.fatal_error,
                "readings": engine_readings(self.engine) + process_readings(), "monitor": monitor}

    async def check_health(self) -> None:
        """Serve's health check: a dead engine takes the replica out of routing, and Serve starts another."""
        if self.engine.fatal_error is not None:
            raise RuntimeError(f"engine dead: {self.engine.fatal_error}")

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._board.report.remote(self.snapshot()).result()
            except Exception:  # the board restarts with the app; a missed report only ages this one
                log.debug("board report failed", exc_info=True)
            self._stop.wait(BOARD_PERIOD_S)

    def __del__(self) -> None:
        """Serve calls this after the drain (no stream left, or `drain_s` passed)."""
        self._stop.set()
        if getattr(self, "monitor", None) is not None:
            self.monitor.stop()
        if getattr(self, "_board", None) is not None:
            with contextlib.suppress(Exception):  # leave the board now rather than age out of it
                self._board.forget.remote(self.name)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if hasattr(self, "_threads"):
            self._threads.shutdown(wait=False)


# ---- the ingress ---------------------------------------------------------------------------------------------------
def _engine_error(e: BaseException) -> BaseException:
    """What the API should see of a failed replica call: the engine's own error (its message is user-facing), a
    busy refusal when Serve's queue is full, a clear error when the replica died; anything else unchanged."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, CosyVoiceError):
        return e.cause
    if isinstance(e, BackPressureError):
        return EngineBusy("Every replica is busy; retry shortly.", BUSY_RETRY_AFTER_S)
    if isinstance(e, RayActorError):  # died or unreachable: Serve routes new requests to the others
        return CosyVoiceError("The replica serving this request stopped; retry the request.")
    return e


def _file_bytes(prompt_audio: Any) -> Any:
    """A prompt given as a path on this host (a WebUI upload) as the file's bytes: the replica may be on another
    host. Anything else goes as it is (a missing file: the engine words the error)."""
    if isinstance(prompt_audio, str) and os.path.isfile(prompt_audio):
        return Path(prompt_audio).read_bytes()
    return prompt_audio


def _portable(request: SynthesisRequest) -> SynthesisRequest:
    """`request` as it can travel to a replica: prompt files as their bytes. Streamed text cannot travel (its source
    lives in this process): it is refused with a clear error."""
    if not isinstance(request.text, str):
        raise InputError("streamed text (the Live text tab, /v1/audio/speech/stream) needs the engine in the "
                         "server's own process; a cluster speaks whole texts")
    prompt = _file_bytes(request.prompt_audio)
    return request if prompt is request.prompt_audio else replace(request, prompt_audio=prompt)


class RemoteEngine:
    """What `OpenAIApi` calls on an engine, forwarded to the replicas (blocking calls, made from worker threads, as
    the API makes them). Voices are read from the shared voices folder; saving one needs a replica's models."""

    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, voices_dir: str, info: dict) -> None:
        self._replicas = replicas
        self._streams = replicas.options(stream=True)
        self._board = board
        self.voices = VoiceStore(voices_dir)
        self.info = info
        self.snapshots: list[dict] = []
        self.fatal_error: str | None = None
        self._fetched = -float("inf")
        self._lock = threading.Lock()

    async def refresh(self) -> list[dict]:
        """Fetch the replicas' latest reports; the cluster is dead only when every reporting replica is."""
        return self._take(await self._board.snapshots.remote())

    def reports(self, max_age: float = BOARD_PERIOD_S / 2) -> list[dict]:
        """The replicas' latest reports for the WebUI's worker threads, fetched at most every `max_age` s however
        many pages ask. In the event loop (the page is built there), where a blocking fetch is refused: the last
        ones fetched."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            return self.snapshots
        with self._lock:
            if time.monotonic() - self._fetched >= max_age:
                self._take(self._board.snapshots.remote().result())
            return self.snapshots

    def _take(self, snapshots: list[dict]) -> list[dict]:
        dead = [s["fatal_error"] for s in snapshots if s["fatal_error"]]
        self.snapshots, self._fetched = snapshots, time.monotonic()
        self.fatal_error = dead[0] if snapshots and len(dead) == len(snapshots) else None
        return snapshots

    def stream(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Chunks from one replica. A replica whose engine is dead refuses at once, so that it would draw requests
        until Serve removes it: a request it refused before any audio goes to another replica."""
        request = _portable(request)
        for attempt in range(DEAD_RETRIES + 1):
            response = self._streams.stream.remote(request)
            done = started = False
            try:
                for chunk in response:
                    started, done = True, chunk.is_last
                    yield chunk
                return
            except Exception as e:
                error = _engine_error(e)
                if started or not isinstance(error, EngineDead) or attempt == DEAD_RETRIES:
                    raise error from None
            finally:
                if not done:
                    with contextlib.suppress(Exception):  # cancel() re-raises a failed assignment (busy, no replica)
                        response.cancel()

    def _call(self, method: str, *args, **kwargs):
        for attempt in range(DEAD_RETRIES + 1):
            try:
                return getattr(self._replicas, method).remote(*args, **kwargs).result()
            except Exception as e:
                error = _engine_error(e)
                if not isinstance(error, EngineDead) or attempt == DEAD_RETRIES:
                    raise error from None

    def synthesize(self, request: SynthesisRequest) -> AudioChunk:
        return self._call("synthesize", _portable(request))

    def save_voice(self, name: str, prompt_audio: str | bytes, prompt_text: str, overwrite: bool = True) -> None:
        self.voices.check_writable(name, overwrite)  # before a replica decodes the prompt
        self._call("save_voice", name, _file_bytes(prompt_audio), prompt_text, overwrite=overwrite)

    def delete_voice(self, name: str) -> None:
        self.voices.delete(name)

    def list_voices(self) -> list[str]:
        return self.voices.names()

    def stats(self) -> dict:
        """The replicas' engine stats, summed."""
        total: dict[str, float] = {}
        for snap in self.snapshots:
            for k, v in snap["stats"].items():
                if isinstance(v, int | float):
                    total[k] = total.get(k, 0) + v
        return {**total, "replicas": len(self.snapshots)}


class ClusterMonitor:
    """The WebUI's GPU panel over the replicas: each one samples its own GPU and reports the readings to the board
    with its engine's; the panel has one row per replica and plots their mean."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.has_gpu = str(engine.info.get("device", "")).startswith("cuda")  # the plot's labels, at build time

    def _monitors(self) -> list[tuple[str, dict]]:
        return [(snap["replica"], snap["monitor"]) for snap in self.engine.reports()
                if snap.get("monitor", {}).get("samples")]

    def rows(self) -> list[dict]:
        """The panel's data, one row per replica: its GPU's latest reading (its CPU's and RAM without a GPU)."""
        return [panel_row(name, m["device"], m["has_gpu"], m["samples"][-1]) for name, m in self._monitors()]

    def summary(self) -> str:
        """Markdown for the sidebar panel: a table, one row per replica (named by its Serve replica id)."""
        rows = self.rows()
        if not rows:
            return "**No replica reports yet**"

        def cell(value: float | None, spec: str) -> str:
            return "n/a" if value is None else f"{value:{spec}}"

        lines = ["| Replica | Device | Util % | Memory GiB | °C | W |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['name'].rsplit('#', 1)[-1]} | {r['device']} | {r['util_percent']:.0f} | "
                         f"{r['mem_used_gib']:.1f} / {r['mem_total_gib']:.1f} | {cell(r['temperature_c'], '.0f')} | "
                         f"{cell(r['power_w'], '.0f')} |")
        unit = "GPU" if any(r["gpu"] for r in rows) else "CPU and RAM (no GPU)"
        return f"**{len(rows)} replica(s)**: {unit}; the plot is their mean.\n\n" + "\n".join(lines)

    def history(self) -> pd.DataFrame:
        """The replicas' readings of the last minute, averaged per second and series (`Monitor.history`'s frame)."""
        frames = [history_frame(m["samples"], self.has_gpu, m["time"]) for _, m in self._monitors()]
        if not frames:
            return history_frame([], self.has_gpu, time.time())
        frame = pd.concat(frames)
        frame["seconds"] = frame["seconds"].round()
        return frame.groupby(["seconds", "series"], as_index=False)["percent"].mean()[["seconds", "percent",
                                                                                       "series"]]


SETTINGS_FIXED = ("Engine settings are fixed in a cluster: every replica runs as deployed (`cluster` flags or "
                  "deploy/serve.yaml); redeploy to change them.")


def mount_webui(app: FastAPI, engine: RemoteEngine, flags: list[str]) -> None:
    """The WebUI at the root of `app`, behind its API routes, over `engine`: the page's calls go to the replicas as
    the API's do; its settings are read-only. `flags` are the webui's (`ClusterSettings.webui_flags`)."""
    from cosyvoice_opt import webui  # here: the replicas, which import this module too, never load Gradio
    from cosyvoice_opt.webui.settings import SettingsAccess

    args = webui.parse_args(flags)
    access = SettingsAccess(auth=False, allow=False, note=SETTINGS_FIXED)
    webui.mount_ui(app, webui.build_app(engine, args, ClusterMonitor(engine), access=access), args)


INGRESS_LABEL = "ingress"  # the `replica` label of the ingress's own process readings


def cluster_readings(snapshots: list[dict], own: list[Reading] = ()) -> list[Reading]:
    """Every replica's readings with a `replica` label (and `own`, the ingress's, labelled `replica="ingress"`: one
    family per name), then the engine's readings summed over the replicas as `cosyvoice_cluster_*` (one series per
    label set), and how many replicas report."""
    families: dict[str, tuple[str, str, list]] = {}
    sums: dict[str, tuple[str, str, dict]] = {}
    for snap in [*snapshots, {"replica": INGRESS_LABEL, "readings": list(own)}]:
        for name, kind, help_text, samples in snap["readings"]:
            pairs = samples if isinstance(samples, list) else [({}, samples)]
            families.setdefault(name, (kind, help_text, []))[2].extend(
                ({**labels, "replica": snap["replica"]}, v) for labels, v in pairs)
            if name.startswith("cosyvoice_engine_"):
                total = sums.setdefault("cosyvoice_cluster_" + name.removeprefix("cosyvoice_"),
                                        (kind, f"Summed over the replicas: {help_text}", {}))[2]
                for labels, v in pairs:
                    key = tuple(sorted(labels.items()))
                    total[key] = total.get(key, 0) + v
    readings: list[Reading] = [(n, k, h, s) for n, (k, h, s) in families.items()]
    for n, (k, h, s) in sums.items():
        samples = s.get(()) if list(s) == [()] else [(dict(key), v) for key, v in s.items()]
        readings.append((n, k, h, samples))
    readings.append(("cosyvoice_cluster_replicas", "gauge", "Replicas reporting their engine.", len(snapshots)))
    return readings


class ClusterApi(OpenAIApi):
    """The single server's API; /health, /health/ready and /metrics first fetch the replicas' reports."""

    engine: RemoteEngine

    async def health(self, request: Request) -> Response:
        """The single server's body (stats summed over the replicas), plus each replica's status and stats."""
        snapshots = await self.engine.refresh()
        response = await super().health(request)
        body = json.loads(response.body)
        body["replicas"] = [{"replica": snap["replica"], "host": snap["host"], "pid": snap["pid"],
                             "status": "unhealthy" if snap["fatal_error"] else "ok", "stats": snap["stats"]}
                            for snap in snapshots]
        return JSONResponse(body, response.status_code)

    async def ready(self, request: Request) -> Response:
        await self.engine.refresh()
        return await super().ready(request)

    async def prometheus(self, request: Request) -> Response:
        snapshots = await self.engine.refresh()
        return Response(self.metrics.render(cluster_readings(snapshots, process_readings())), media_type=CONTENT_TYPE)


@serve.ingress()
class ClusterIngress:
    """HTTP in front of the replicas: the routes of `openai_api`, no copy of them, and the WebUI at / (unless
    `webui_flags` is None)."""

    async def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, voices_dir: str,
                       api_key: str | None, webui_flags: list[str] | None = None) -> None:
        info = await replicas.info.remote()  # waits for the first replica
        self.engine = RemoteEngine(replicas, board, voices_dir, info)
        self.api = ClusterApi(self.engine, api_key)
        self.webui_flags = webui_flags
        await self.engine.refresh()  # the page is built with the reports there are

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.router.routes[:0] = self.api.routes()
        if self.webui_flags is not None:
            mount_webui(app, self.engine, self.webui_flags)
        return app


# ---- the application -----------------------------------------------------------------------------------------------
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


# ---- command line --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cosyvoice_opt cluster",
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
    return ClusterSettings(model_dir=a.model_dir, random=a.random, precision=a.precision,
                           max_batch_size=a.max_batch_size, voices_dir=a.voices_dir, api_key=a.api_key,
                           replicas=a.replicas, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                           target_ongoing_requests=a.target_ongoing, cpus_per_replica=a.cpus_per_replica,
                           max_ongoing_requests=a.max_ongoing_requests, max_queued_requests=a.max_queued_requests,
                           drain_s=a.drain_s, webui=not a.no_webui, auth=a.auth, ui_concurrency=a.ui_concurrency)


def main(argv: list[str] | None = None) -> int:
    """Start (or join) Ray, deploy the application on `--port`, serve until Ctrl-C, then drain and stop."""
    a = parse_args(argv)
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


__all__ = ["ClusterIngress", "ClusterMonitor", "ClusterSettings", "EngineReplica", "RemoteEngine", "ReplicaBoard",
           "admission_limit", "build_app", "cluster_app", "cluster_readings", "main", "mount_webui", "replica_options"]

