"""The Ray Serve application on the CPU: two tiny-model replicas behind the ingress, through HTTP and the `openai`
client. One Ray instance serves the whole module; a gate (a Ray actor) holds streams open after their first chunk,
so that the tests wait on it instead of on the clock."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from collections.abc import AsyncIterator

import httpx
import numpy as np
import openai
import psutil
import pytest
import ray
import soundfile as sf
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from ray import serve

from cosyvoice_opt.bench.loopback import free_port
from cosyvoice_opt.cluster import (
    APP_NAME,
    SETTINGS_FIXED,
    ClusterMonitor,
    ClusterSettings,
    EngineReplica,
    admission_limit,
    build_app,
    cluster_app,
    replica_options,
)
from cosyvoice_opt.engine import EngineConfig
from cosyvoice_opt.monitor import GIB, Sample
from cosyvoice_opt.types import AudioChunk, SynthesisRequest
from tests.conftest import REPO_ROOT, wait_until
from tests.test_app import PROMPT, PROMPT_TEXT
from tests.test_openai_api import _speech_wav

GATE = "cluster-test-gate"
NAMESPACE = "cosyvoice-tests"
MAX_BATCH = 1  # two streams per replica (admission_limit)
WAIT = 120.0  # a guard against a hang only: every wait ends on its condition long before


@ray.remote(num_cpus=0)
class Gate:
    """Holds the replicas' streams after their first chunk while closed; knows which replicas wait."""

    def __init__(self) -> None:
        import asyncio

        self._open = asyncio.Event()
        self._open.set()
        self._waiting: list[str] = []

    async def wait(self, replica: str) -> None:
        if self._open.is_set():
            return
        self._waiting.append(replica)
        try:
            await self._open.wait()
        finally:
            self._waiting.remove(replica)

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def waiting(self) -> list[str]:
        return list(self._waiting)


class GatedReplica(EngineReplica):
    """The real replica, whose streams wait at the gate after their first chunk (still ongoing for Serve)."""

    async def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        first = True
        async for chunk in super().stream(request):
            yield chunk
            if first and not chunk.is_last:
                await ray.get_actor(GATE, namespace=NAMESPACE).wait.remote(self.name)
            first = False

    def poison(self) -> str:
        """What a CUDA error does to the engine (`Engine._fatal`); returns this replica's name."""
        self.engine._fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
        return self.name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(base URL, gate, shared voices folder) of a local cluster of two tiny replicas."""
    ray.init(num_cpus=8, include_dashboard=False, namespace=NAMESPACE, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        gate = Gate.options(name=GATE).remote()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        voices = tmp_path_factory.mktemp("voices")
        settings = ClusterSettings(replicas=2, voices_dir=str(voices), max_batch_size=MAX_BATCH,
                                   max_queued_requests=1, drain_s=WAIT, health_check_period_s=1.0,
                                   gpus_per_replica=0, cpus_per_replica=1)
        serve.run(cluster_app(settings, GatedReplica), name=APP_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: len(_replicas(base)) == 2, WAIT)
        yield base, gate, voices
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def gate(cluster):
    """The gate, open again after the test whatever happened."""
    yield cluster[1]
    ray.get(cluster[1].open.remote())


def _metrics(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=WAIT).text


def _replicas(base: str) -> dict[str, int]:
    """Reporting replica -> requests its engine completed."""
    out = {r: 0 for r in re.findall(r'cosyvoice_engine_up\{replica="([^"]+)"\} 1', _metrics(base))}
    for r, n in re.findall(r'cosyvoice_engine_requests_total\{outcome="completed",replica="([^"]+)"\} (\d+)',
                           _metrics(base)):
        if r in out:
            out[r] = int(n)
    return out


def _speech(base: str, voice: str = "alloy", **extra) -> httpx.Response:
    body = {"model": "tts-1", "input": "Hello there.", "voice": voice, "response_format": "wav", **extra}
    return httpx.post(f"{base}/v1/audio/speech", json=body, timeout=WAIT)


class _HeldStream(threading.Thread):
    """A streamed request in a thread: `first` is set once its first bytes arrived; `events` are its SSE events."""

    def __init__(self, base: str, sse: bool = False) -> None:
        super().__init__(daemon=True)
        self.base, self.sse = base, sse
        self.first = threading.Event()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.data = bytearray()
        self.error: Exception | None = None

    def run(self) -> None:
        body = {"model": "tts-1", "input": "Hello there. How are you today?", "voice": "alloy",
                "response_format": "pcm", "stream_format": "sse" if self.sse else "audio"}
        try:
            with httpx.stream("POST", f"{self.base}/v1/audio/speech", json=body, timeout=WAIT) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for part in r.iter_bytes():
                    self.data += part
                    self.first.set()
        except Exception as e:  # the assertions read it
            self.error = e
        finally:
            self.first.set()

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.data.decode().splitlines() if line.startswith("data: ")]


def _hold(base: str, gate, n: int, sse: bool = False) -> list[_HeldStream]:
    """`n` streams held at the gate, each past its first bytes."""
    streams = []
    for _ in range(n):  # one by one: a burst can overflow the ingress's queue of one before Serve assigns it
        before = len(ray.get(gate.waiting.remote()))
        s = _HeldStream(base, sse)
        s.start()
        assert s.first.wait(WAIT) and s.status == 200, (s.status, s.error)
        assert wait_until(lambda b=before: len(ray.get(gate.waiting.remote())) == b + 1, WAIT)
        streams.append(s)
    return streams


# ---- tests -----------------------------------------------------------------------------------------------------------
def test_replicas_admit_what_serve_sends_them(cluster):
    """Serve's per-replica limit is the engine's admission limit: the engine never queues behind Serve's back."""
    base = cluster[0]
    streams = re.findall(r'cosyvoice_engine_max_streams\{replica="[^"]+"\} (\d+)', _metrics(base))
    assert streams == [str(admission_limit(MAX_BATCH))] * 2
    summed = re.findall(r"^cosyvoice_cluster_engine_max_streams (\d+)$", _metrics(base), re.M)
    assert summed == [str(2 * admission_limit(MAX_BATCH))]
    health = httpx.get(f"{base}/health", timeout=WAIT).json()
    assert health["status"] == "ok" and health["stats"]["replicas"] == 2
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]
    pids = [r["pid"] for r in health["replicas"]]  # processes of this host (one Ray node): each replica's own
    assert len(set(pids)) == 2 and os.getpid() not in pids and all(psutil.pid_exists(p) for p in pids)
    assert {r["host"] for r in health["replicas"]} == {socket.gethostname()}
    assert sum(r["stats"]["max_streams"] for r in health["replicas"]) == health["stats"]["max_streams"]
    families = re.findall(r"^# TYPE (\S+)", _metrics(base), re.M)
    assert len(families) == len(set(families))  # one family per name: replicas' and the ingress's series merged
    assert health["stats"]["max_streams"] == 2 * admission_limit(MAX_BATCH)


def test_requests_spread_over_both_replicas(cluster):
    base = cluster[0]
    before = _replicas(base)
    for _ in range(60):  # Serve's router picks at random between idle replicas: both serve long before 60
        assert _speech(base).status_code == 200
        after = _replicas(base)
        if len(after) == 2 and all(after[r] > before.get(r, 0) for r in after):
            break
    assert wait_until(lambda: all(n > before.get(r, 0) for r, n in _replicas(base).items()), WAIT), \
        (before, _replicas(base))


def test_openai_client_streams_through_the_ingress(cluster, gate):
    """Streamed end to end: the client has its first bytes while the replica still holds the rest."""
    base = cluster[0]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    ray.get(gate.close.remote())
    data = bytearray()
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there. How are you today?", response_format="pcm",
            extra_body={"stream_format": "audio"}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        for part in response.iter_bytes():
            if not data:
                # the replica holds the rest at the gate: these bytes came before it
                assert wait_until(lambda: len(ray.get(gate.waiting.remote())) == 1, WAIT)
                ray.get(gate.open.remote())
            data += part
    assert len(data) > 2 * 24000 // 10 and len(data) % 2 == 0


def test_the_webui_speaks_through_the_cluster(cluster, gate):
    """The page the ingress serves at / (gradio_client, as a browser's calls): its stream is held at a replica's
    gate, its GPU panel has one row per replica, its engine settings are read-only."""
    base = cluster[0]
    client = Client(f"{base}/", verbose=False)
    ray.get(gate.close.remote())
    job = client.submit("Hello there. How are you today?", handle_file(PROMPT), PROMPT_TEXT, True, 1.0, 0,
                        api_name="/zero_shot")
    assert wait_until(lambda: len(ray.get(gate.waiting.remote())) == 1, WAIT)  # on a replica, past its 1st chunk
    ray.get(gate.open.remote())
    streamed = [u[0] for u in job if isinstance(u[0], str)]
    _, full, metrics = job.outputs()[-1]
    data, rate = sf.read(full, dtype="int16")
    assert rate == 24000 and len(data) > 0 and np.abs(data).max() > 0
    assert len(streamed) == metrics["chunks"] >= 2
    rows = client.predict(api_name="/monitor")
    assert sorted(r["name"] for r in rows) == sorted(_replicas(base))
    for r in rows:  # CPU replicas: their host's CPU and RAM, and each replica's own RSS
        assert r["device"] == "CPU" and not r["gpu"] and 0 <= r["util_percent"] <= 100
        assert r["process_gib"] > 0 and 0 < r["mem_used_gib"] <= r["mem_total_gib"]
    with pytest.raises(AppError, match=re.escape(SETTINGS_FIXED[:40])):
        client.predict(8, api_name="/set_max_batch_size")


def test_a_voice_saved_through_one_replica_speaks_on_every_replica(cluster):
    base, _, voices = cluster
    files = {"file": ("alice.wav", _speech_wav(), "audio/wav")}
    r = httpx.post(f"{base}/v1/voices", data={"name": "alice", "prompt_text": "hello there, this is alice"},
                   files=files, timeout=WAIT)
    assert r.status_code == 201, r.text
    assert (voices / "alice.json").is_file()
    assert "alice" in [v["id"] for v in httpx.get(f"{base}/v1/voices", timeout=WAIT).json()["data"]]
    before = _replicas(base)
    for _ in range(60):
        assert _speech(base, "alice").status_code == 200
        after = _replicas(base)
        if all(after[r] > before.get(r, 0) for r in after):
            break
    assert wait_until(lambda: all(n > before.get(r, 0) for r, n in _replicas(base).items()), WAIT)
    assert httpx.delete(f"{base}/v1/voices/alice", timeout=WAIT).status_code == 200
    assert _speech(base, "alice").status_code == 400


def test_every_replica_full_is_a_503_with_retry_after(cluster, gate):
    base = cluster[0]
    ray.get(gate.close.remote())
    held = _hold(base, gate, 2 * admission_limit(MAX_BATCH))  # every replica at its limit
    extra = [_HeldStream(base) for _ in range(2)]  # one waits in the ingress's queue (max_queued_requests=1)
    for s in extra:
        s.start()
    assert wait_until(lambda: any(s.status == 503 for s in extra), WAIT)
    refused = next(s for s in extra if s.status == 503)
    queued = next(s for s in extra if s is not refused)
    refused.join(WAIT)  # its status arrives before its body: read the body once the thread has
    assert refused.headers["retry-after"] == "1"
    assert json.loads(refused.data)["error"]["code"] == "server_busy"
    ray.get(gate.open.remote())
    for s in [*held, queued]:
        s.join(WAIT)
        assert s.status == 200 and s.error is None and len(s.data) > 0


def test_a_replica_killed_mid_stream(cluster, gate):
    """Its client gets an error event, new requests go to the survivor, Serve starts a new replica."""
    base = cluster[0]
    ray.get(gate.close.remote())
    [stream] = _hold(base, gate, 1, sse=True)
    [victim] = ray.get(gate.waiting.remote())
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    stream.join(WAIT)
    assert not stream.is_alive()
    events = stream.events()
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "replica" in events[-1]["error"]["message"]
    ray.get(gate.open.remote())
    for _ in range(3):
        assert _speech(base).status_code == 200
    assert wait_until(lambda: _gone(victim) and len(_replicas(base)) == 2 and victim not in _replicas(base), WAIT)
    assert _speech(base).status_code == 200


def test_a_raw_audio_stream_whose_replica_dies_ends_incomplete(cluster, gate):
    """No error event can follow raw audio: the connection drops before the closing chunk."""
    base = cluster[0]
    ray.get(gate.close.remote())
    [stream] = _hold(base, gate, 1)
    [victim] = ray.get(gate.waiting.remote())
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    stream.join(WAIT)
    assert not stream.is_alive() and len(stream.data) > 0
    assert isinstance(stream.error, httpx.RemoteProtocolError), stream.error
    ray.get(gate.open.remote())
    assert _speech(base).status_code == 200
    assert wait_until(lambda: _gone(victim) and len(_replicas(base)) == 2 and victim not in _replicas(base), WAIT)


def _gone(actor: str) -> bool:
    try:
        ray.get_actor(actor, namespace="serve")
    except ValueError:
        return True
    return False


def test_a_dead_engine_fails_the_health_check(tmp_path):
    """Serve's health check of a replica (no Serve needed to call it) fails once the engine is dead."""
    replica = EngineReplica(None, EngineConfig(random_size="tiny", device="cpu", voices_dir=str(tmp_path)))
    try:
        asyncio.run(replica.check_health())
        replica.engine._fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
        with pytest.raises(RuntimeError, match="engine dead: the GPU failed"):
            asyncio.run(replica.check_health())
    finally:
        replica.__del__()


def test_a_replica_whose_engine_died_is_replaced(cluster):
    """It exits and Serve starts another; meanwhile the cluster stays ready."""
    base = cluster[0]
    handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
    victim = handle.poison.remote().result(timeout_s=WAIT)
    assert httpx.get(f"{base}/health/ready", timeout=WAIT).status_code == 200  # the other replica serves
    assert wait_until(lambda: _gone(victim) and len(_replicas(base)) == 2 and victim not in _replicas(base), WAIT)
    for _ in range(3):
        assert _speech(base).status_code == 200


def test_shutdown_drains_streams_in_flight(cluster, gate):
    """Last: the application is deleted while a stream is held; the stream still ends complete."""
    base = cluster[0]
    ray.get(gate.close.remote())
    [stream] = _hold(base, gate, 1, sse=True)

    def deleting() -> bool:  # the application is going away: its route is gone, its replicas drain
        app = serve.status().applications.get(APP_NAME)
        gone = httpx.get(f"{base}/health/live", timeout=WAIT).status_code != 200
        return app is not None and app.status == "DELETING" and gone

    serve.delete(APP_NAME, _blocking=False)
    assert wait_until(deleting, WAIT)
    assert stream.is_alive()
    ray.get(gate.open.remote())
    stream.join(WAIT)
    events = stream.events()
    assert stream.error is None and events[-1]["type"] == "speech.audio.done"
    assert wait_until(lambda: APP_NAME not in serve.status().applications, WAIT)


def test_the_serve_config_file_deploys_this_application():
    """deploy/serve.yaml is a valid Serve config whose args are `ClusterSettings` fields (no cluster needed)."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO_ROOT / "deploy" / "serve.yaml").read_text())
    ServeDeploySchema(**config)
    [app] = config["applications"]
    assert app["import_path"] == "cosyvoice_opt.cluster:build_app"
    settings = ClusterSettings(**app["args"])
    assert settings.gpus_per_replica == 1 and settings.min_replicas <= settings.max_replicas
    with pytest.raises(ValueError, match="unknown cluster args: replica_count"):
        build_app({"replica_count": 2})


class _Reports:
    """A `RemoteEngine` as the panel reads it: two GPU replicas' reports, with clocks 100 s apart."""

    info = {"device": "cuda:0"}

    def reports(self) -> list[dict]:
        def monitor(now: float, util: float) -> dict:
            samples = [Sample(now - k, util, 40 * GIB, 80 * GIB, 30 * GIB, 50.0, 300.0) for k in (2, 1, 0)]
            return {"device": "NVIDIA H200", "has_gpu": True, "samples": samples, "time": now}

        return [{"replica": "SERVE_REPLICA::cosyvoice#EngineReplica#a1", "monitor": monitor(1000.0, 20.0)},
                {"replica": "SERVE_REPLICA::cosyvoice#EngineReplica#b2", "monitor": monitor(1100.0, 60.0)}]


def test_the_cluster_gpu_panel_has_a_row_per_replica_and_plots_their_mean():
    panel = ClusterMonitor(_Reports())
    assert panel.has_gpu and [r["name"].rsplit("#", 1)[-1] for r in panel.rows()] == ["a1", "b2"]
    table = [line for line in panel.summary().splitlines() if line.startswith("| a1") or line.startswith("| b2")]
    assert table == ["| a1 | NVIDIA H200 | 20 | 40.0 / 80.0 | 50 | 300 |",
                     "| b2 | NVIDIA H200 | 60 | 40.0 / 80.0 | 50 | 300 |"]
    history = panel.history()  # each replica's "seconds ago" on its own clock, averaged per second
    util = history[history["series"] == "GPU util %"]
    assert util["seconds"].tolist() == [-2.0, -1.0, 0.0] and util["percent"].tolist() == [40.0] * 3
    assert history[history["series"] == "memory %"]["percent"].tolist() == [50.0] * 3


def test_replica_options_scale_on_ongoing_requests_and_drain():
    fixed = replica_options(ClusterSettings(replicas=3, max_batch_size=8, drain_s=42), gpus=1)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == admission_limit(8) == 16
    assert fixed["ray_actor_options"]["num_gpus"] == 1
    assert fixed["graceful_shutdown_timeout_s"] == 42
    scaled = replica_options(ClusterSettings(min_replicas=1, max_replicas=4, max_batch_size=8), gpus=0)
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    assert "num_replicas" not in scaled and scaled["ray_actor_options"]["num_gpus"] == 0
    assert replica_options(ClusterSettings(max_replicas=2, target_ongoing_requests=5), gpus=1)[
        "autoscaling_config"]["target_ongoing_requests"] == 5
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        replica_options(ClusterSettings(min_replicas=3, max_replicas=2), gpus=1)


def test_streamed_text_is_refused_clearly_before_it_reaches_a_replica():
    """A TextStream lives in the ingress's process and cannot travel to a replica: the request is refused with a
    one-line message (not an internal error), and whole texts travel unchanged."""
    from cosyvoice_opt.cluster.remote_engine import _portable
    from cosyvoice_opt.errors import InputError
    from cosyvoice_opt.types import TextStream

    with pytest.raises(InputError, match="streamed text"):
        _portable(SynthesisRequest(text=TextStream()))
    whole = SynthesisRequest(text="Hello.")
    assert _portable(whole) is whole
