"""The HTTP entry point: `ClusterIngress` serves the single server's routes over `RemoteEngine` (`ClusterApi` adds
the replicas to /health and /metrics) and the WebUI at /."""

from __future__ import annotations

import json

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.cluster.remote_engine import RemoteEngine
from cosyvoice_opt.cluster.ui import mount_webui
from cosyvoice_opt.server.metrics import CONTENT_TYPE, Reading, process_readings
from cosyvoice_opt.server.openai_api import OpenAIApi

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
