"""A replica: one `Engine` behind Serve (`EngineReplica`), and the board its readings go to (`ReplicaBoard`).

Serve's router sends a replica at most `max_ongoing_requests` at once, the engine's admission limit, so the engine
never queues behind Serve's back. `check_health` fails once the engine is dead (a CUDA error poisoned it): Serve
replaces the replica. Each replica pushes its engine's readings and its GPU's to the board every `BOARD_PERIOD_S`,
since the ingress cannot address a replica by itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator

import ray
from ray.serve.handle import DeploymentHandle

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.server.metrics import engine_readings, process_readings
from cosyvoice_opt.types import AudioChunk, SynthesisRequest

log = logging.getLogger(__name__)

BOARD_PERIOD_S = 1.0  # how often a replica reports its engine's readings
BOARD_STALE_S = 5.0  # a replica silent this long is gone (killed, or drained and closed)


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
