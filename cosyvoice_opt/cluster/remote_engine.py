"""The engine as the ingress sees it: `RemoteEngine` forwards the API's calls to the replicas through a Serve
handle (speech through a streaming handle, chunk by chunk), and turns a replica's failures into the errors the
single server gives (busy, dead). Voices come from the voices folder the replicas share."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cosyvoice_opt.cluster.replica import BOARD_PERIOD_S
from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, EngineDead, InputError
from cosyvoice_opt.frontend.voices import VoiceStore
from cosyvoice_opt.types import AudioChunk, SynthesisRequest

BUSY_RETRY_AFTER_S = 1.0  # the Retry-After hint when every replica is full
DEAD_RETRIES = 2  # a request refused by a dead engine (before any audio) goes to another replica this many times


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
