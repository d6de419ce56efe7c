"""Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) and the HTTP answer to each of the
engine's refusals and failures."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, EngineDead, InputError
from cosyvoice_opt.frontend.voices import ReadOnlyVoice, VoiceExists


class ApiError(Exception):
    """A request rejected by the API itself, before the engine saw it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def _retry_after(seconds: float) -> str:
    """`Retry-After` in whole seconds, at least 1 (a hint of 0 would invite an immediate retry storm)."""
    try:
        return str(max(1, math.ceil(seconds)))
    except (TypeError, ValueError, OverflowError):  # NaN, inf or not a number: the smallest honest hint
        return "1"


def engine_error(e: CosyVoiceError) -> ApiError:
    """The HTTP answer to an engine's refusal or failure (the message is user-facing by contract)."""
    if isinstance(e, EngineBusy):
        return ApiError(503, str(e), code="server_busy", headers={"Retry-After": _retry_after(e.retry_after)})
    if isinstance(e, EngineDead):
        return ApiError(503, str(e), code="engine_dead")
    if isinstance(e, VoiceExists):
        return ApiError(409, str(e), "name", "voice_exists")
    if isinstance(e, ReadOnlyVoice):
        return ApiError(403, str(e), "name", "voice_read_only")
    if isinstance(e, InputError):
        return ApiError(400, str(e))
    return ApiError(500, str(e), code="engine_error")
