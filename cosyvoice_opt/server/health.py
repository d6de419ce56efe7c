"""/health (everything about the engine, behind the key), /health/live and /health/ready (key-free probes) and
/metrics (Prometheus)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.metrics import CONTENT_TYPE, engine_readings, process_readings


class StatusRoutes(ApiBase):
    """/health, /health/live, /health/ready and /metrics."""

    async def health(self, request: Request) -> Response:
        """Everything about the engine (behind the key); 503 once the engine is dead."""
        info, fatal = self.engine.info, self._fatal()
        model = info["model"] if info["is_random"] else Path(info["model"]).name  # no server paths
        body = {"status": "ok" if fatal is None else "unhealthy", **info, "model": model, "stats": self.engine.stats()}
        if fatal is not None:
            body["error"] = fatal
        return JSONResponse(body, 200 if fatal is None else 503)

    async def live(self, request: Request) -> Response:
        """Liveness: the process answers HTTP. Key-free, says nothing else."""
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness: the engine can serve requests. Key-free, says nothing else."""
        if self._fatal() is not None:
            return JSONResponse({"status": "unavailable"}, 503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        readings = engine_readings(self.engine) + process_readings()
        return Response(self.metrics.render(readings), media_type=CONTENT_TYPE)
