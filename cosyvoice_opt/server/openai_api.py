"""OpenAI-compatible speech API, voices over HTTP, /health and /metrics, served beside the Gradio UI: the routes of
each group (speech.py, websocket.py, models.py, voices.py, health.py) assembled into one table.

`mount_api(app, engine, api_key)` puts the routes in front of whatever the app already routes, so a Gradio app
mounted at "/" cannot shadow them.

Every error under /v1/ and /health comes in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`),
unknown URLs and wrong methods included. An engine at capacity answers 503 with `Retry-After`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route, WebSocketRoute

from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.server.errors import ApiError, engine_error, error_response
from cosyvoice_opt.server.health import StatusRoutes
from cosyvoice_opt.server.metrics import Metrics
from cosyvoice_opt.server.models import ModelRoutes
from cosyvoice_opt.server.speech import SpeechRoutes
from cosyvoice_opt.server.voices import VoiceRoutes
from cosyvoice_opt.server.websocket import SpeechStreamRoute

log = logging.getLogger(__name__)

__all__ = ["OpenAIApi", "mount_api"]

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
API_PREFIXES = ("/v1", "/v1/{rest:path}", "/health", "/health/{rest:path}", "/metrics")  # errors in OpenAI's shape


class OpenAIApi(SpeechRoutes, SpeechStreamRoute, ModelRoutes, VoiceRoutes, StatusRoutes):
    """The route handlers, bound to one engine."""

    def routes(self) -> list[BaseRoute]:
        """The API's routes, then catch-alls that answer unknown URLs and wrong methods under the API's prefixes in
        OpenAI's error shape (anything else falls through to the app's own routes, e.g. Gradio's)."""
        table = [  # path, methods, handler, key-free (liveness probes carry no secrets)
            ("/v1/audio/speech", ["POST"], self.speech, False),
            ("/v1/models", ["GET"], self.list_models, False),
            ("/v1/models/{model}", ["GET"], self.get_model, False),
            ("/v1/voices", ["GET"], self.list_voices, False),
            ("/v1/voices", ["POST"], self.create_voice, False),
            ("/v1/voices/{name}", ["DELETE"], self.delete_voice, False),
            ("/health", ["GET"], self.health, False),
            ("/health/live", ["GET"], self.live, True),
            ("/health/ready", ["GET"], self.ready, True),
            ("/metrics", ["GET"], self.prometheus, False),
        ]
        routes = [Route(path, self._endpoint(path, handler, public), methods=methods, include_in_schema=False)
                  for path, methods, handler, public in table]

        async def unknown(request: Request) -> Response:
            allowed = sorted({m for r in routes if r.matches(request.scope)[0] != Match.NONE for m in r.methods or ()})
            where = f"{request.method} {request.url.path[:200]}"
            if allowed:
                raise ApiError(405, f"Method not allowed: {where}; allowed: {', '.join(allowed)}.",
                               code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
            raise ApiError(404, f"Unknown URL: {where}. Endpoints: /v1/audio/speech, /v1/models, /v1/voices, "
                           "/health, /health/live, /health/ready, /metrics.", code="not_found")

        fallback = self._endpoint("unknown", unknown, public=True)  # one metrics label, whatever the URL
        stream = WebSocketRoute("/v1/audio/speech/stream", self.speech_stream)
        return [stream, *routes] + [Route(p, fallback, methods=ALL_METHODS, include_in_schema=False)
                                    for p in API_PREFIXES]

    def _endpoint(self, path: str, handler: Callable[[Request], Awaitable[Response]], public: bool = False):
        """Key check, error mapping (user-facing messages only) and request counting around a handler."""

        async def endpoint(request: Request) -> Response:
            code = None
            try:
                if not public:
                    self._check_key(request)
                try:
                    response = await handler(request)
                except CosyVoiceError as e:
                    raise engine_error(e) from e
            except ApiError as e:
                response, code = error_response(e.status, str(e), e.param, e.code, e.headers), e.code
            except Exception:
                log.exception("%s failed", path)
                response = error_response(500, "Internal server error; see the server log.", code="internal_error")
            if path == "/v1/audio/speech":
                self.metrics.count_speech(path, response.status_code, code)
            else:
                self.metrics.count_request(path, response.status_code)
            return response

        return endpoint


def mount_api(app: FastAPI, engine, api_key: str | None) -> Metrics:
    """Serve the API on `app` (e.g. Gradio's `demo.app` or a FastAPI app that Gradio is mounted on), ahead of its
    own routes. With `api_key`, every route but /health/live and /health/ready wants `Authorization: Bearer
    <api_key>`. Returns the API's metrics."""
    api = OpenAIApi(engine, api_key)
    app.router.routes[:0] = api.routes()
    return api.metrics
