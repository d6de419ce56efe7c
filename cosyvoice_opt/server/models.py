"""GET /v1/models and /v1/models/{model}: the names this server answers to (see model_names.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.model_names import model_ids


class ModelRoutes(ApiBase):
    """/v1/models."""

    def _model_ids(self) -> list[str]:
        return model_ids(self.engine.info)

    def _model(self, model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "cosyvoice-opt",
                "family": self.engine.info.get("family", "cosyvoice2")}  # every name is served by this family

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self._model_ids()]})

    async def get_model(self, request: Request) -> Response:
        model_id, known = request.path_params["model"], self._model_ids()
        if model_id not in known:
            raise ApiError(404, f"The model {model_id[:100]!r} does not exist; models: {', '.join(known)}.", "model",
                           "model_not_found")
        return JSONResponse(self._model(model_id))
