"""What every group of routes shares: the engine, the API key, the metrics and the worker threads that blocking
engine calls run in."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

import anyio
from starlette.requests import HTTPConnection

from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.metrics import Metrics, metrics_for
from cosyvoice_opt.server.parsing import speakers

STREAM_THREADS = 512  # a streamed request holds a worker thread while it waits for its next chunk


class ApiBase:
    """One engine, its key and its metrics; the route groups (speech, the WebSocket, models, voices, status) build
    on this."""

    def __init__(self, engine, api_key: str | None, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.metrics = metrics or metrics_for(engine)  # shared with the WebUI on the same engine
        self.created = int(time.time())
        self._threads = anyio.CapacityLimiter(STREAM_THREADS)

    async def _run(self, fn: Callable, *args, **kwargs):
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self._threads)

    def _check_key(self, request: HTTPConnection) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "").strip()
        scheme, _, key = header.partition(" ")
        if not header:
            raise ApiError(401, "Missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        if scheme.lower() != "bearer":
            raise ApiError(401, f"The Authorization header uses the {scheme[:20]!r} scheme; this API expects its "
                           "API key as a Bearer token: 'Authorization: Bearer <key>'.", code="invalid_api_key")
        if not key.strip():
            raise ApiError(401, "The Authorization header has no API key after 'Bearer'; send 'Authorization: "
                           "Bearer <key>'.", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def _speakers(self) -> list[str]:
        return speakers(self.engine)

    def _fatal(self) -> str | None:
        """The engine's fatal error (the GPU is unusable), None while it serves."""
        return getattr(self.engine, "fatal_error", None)
