"""GET /v1/models and /v1/models/{model}: the served model and OpenAI's speech model names."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # OpenAI's speech models: requests naming them are served


class ModelRoutes(ApiBase):
    """/v1/models."""

    def _model_ids(self) -> list[str]:
        """The served model's own id, then OpenAI's speech model names (a request may name any of them)."""
        info = self.engine.info
        own = info["model"].replace(" ", "-") if info["is_random"] else Path(info["model"]).name  # no server paths
        return [own, *(m for m in OPENAI_MODELS if m != own)]

    def _model(self, model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "cosyvoice-opt"}

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self._model_ids()]})

    async def get_model(self, request: Request) -> Response:
        model_id, known = request.path_params["model"], self._model_ids()
        if model_id not in known:
            raise ApiError(404, f"The model {model_id[:100]!r} does not exist; models: {', '.join(known)}.", "model",
                           "model_not_found")
        return JSONResponse(self._model(model_id))
