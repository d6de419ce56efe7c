"""OpenAI-compatible speech API, voices over HTTP, /health and /metrics, served beside the Gradio UI.

`mount_api(app, engine, api_key)` puts the routes in front of whatever the app already routes, so a Gradio app
mounted at "/" cannot shadow them. Engine calls block, so they run in worker threads; a streamed response pulls
one chunk at a time and closing it (client gone) closes the engine iterator, which cancels the request.

Every error under /v1/ and /health comes in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`),
unknown URLs and wrong methods included. An engine at capacity answers 503 with `Retry-After`.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import anyio
import numpy as np
import soundfile as sf
from fastapi import FastAPI
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Match, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyvoice_opt.audio_formats import FORMATS, MEDIA_TYPES, encode_clip
from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, EngineDead, InputError
from cosyvoice_opt.frontend.voices import ReadOnlyVoice, VoiceExists
from cosyvoice_opt.limits import MAX_SEED, MAX_STREAM_TEXT_CHARS, MAX_TEXT_CHARS, MAX_UPLOAD_BYTES, SPEED_RANGE
from cosyvoice_opt.server.metrics import CONTENT_TYPE, Metrics, engine_readings, process_readings
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest, TextStream

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "STREAM_FORMATS", "OpenAIApi", "encode_clip", "mount_api", "parse_speech"]

STREAM_FORMATS = ("wav", "pcm", "opus")  # mp3 and flac rewrite their headers at the end: not streamable here
MAX_FORM_BYTES = MAX_UPLOAD_BYTES + (64 << 10)  # the file plus the other fields and multipart framing
MAX_JSON_BYTES = 1 << 20  # a speech request is a few KiB at most
STREAM_THREADS = 512  # a streamed request holds a worker thread while it waits for its next chunk
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # OpenAI's speech models: requests naming them are served
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
API_PREFIXES = ("/v1", "/v1/{rest:path}", "/health", "/health/{rest:path}", "/metrics")  # errors in OpenAI's shape
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


class StreamAborted(Exception):
    """A raw audio stream failed after its headers: raised out of the response body so that the HTTP server drops
    the connection without the closing chunk, and the client sees an incomplete body, not a short clip that looks
    whole (an SSE stream says so in an error event instead)."""


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


# ---- audio encoding ------------------------------------------------------------------------------------------------
def streaming_wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown (maximal) sizes, as OpenAI streams WAV: decoders read to the end."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" + \
        struct.pack("<I", unknown)


class _Pipe:
    """An append-only file for libsndfile's virtual IO; the Ogg/Opus writer never seeks back."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class StreamEncoder:
    """`fmt` bytes as chunks arrive: raw pcm, WAV with a streaming header, or Ogg/Opus pages."""

    def __init__(self, fmt: str, rate: int) -> None:
        self._header = streaming_wav_header(rate) if fmt == "wav" else b""
        self._pipe = _Pipe()
        self._file = sf.SoundFile(self._pipe, "w", rate, 1, format="OGG", subtype="OPUS") if fmt == "opus" else None

    def feed(self, pcm: np.ndarray, last: bool) -> bytes:
        if self._file is None:
            out, self._header = self._header + pcm.astype("<i2").tobytes(), b""
            return out
        self._file.write(pcm)
        if last:
            self._file.close()
        return self._pipe.take()

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def _pull(chunks: Iterator[AudioChunk], encoder: StreamEncoder) -> tuple[AudioChunk, bytes]:
    """Next chunk and its encoded bytes (worker thread: both block)."""
    chunk = next(chunks)
    return chunk, encoder.feed(chunk.pcm, chunk.is_last)


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


# ---- request parsing -----------------------------------------------------------------------------------------------
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def _kind(value) -> str:
    """What a JSON value is, for an error message: "a string", "an array", ..."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _choice(value, name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    if value is None:
        return default
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, one of {', '.join(allowed)}; got {_kind(value)}.", name)
    if value not in allowed:
        raise ApiError(400, f"Unsupported {name} {value!r}; supported: {', '.join(allowed)}.", name,
                       f"unsupported_{name}")
    return value


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SpeechParams(NamedTuple):
    text: str
    voice: str
    response_format: str
    stream_format: str | None  # None: one whole file
    speed: float
    instructions: str
    seed: int


def parse_speech(body, voices: list[str], speakers: list[str], aliases: list[str] = ()) -> SpeechParams:
    """Validate a /v1/audio/speech body against `limits` (the engine's own ranges); ApiError names the offending
    `param`. `voices`: built-in and saved voice names; `aliases`: OpenAI's voice names for the built-in ones."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string (any value: this server has one model); got {_kind(model)}.",
                       "model")
    text = body.get("input")
    if text is None:
        raise ApiError(400, "'input' is required: the text to speak, as a string.", "input")
    if not isinstance(text, str):
        raise ApiError(400, f"'input' must be a string (the text to speak); got {_kind(text)}.", "input")
    if not text.strip():
        raise ApiError(400, "'input' is empty; send the text to speak as a non-empty string.", "input")
    if len(text) > MAX_TEXT_CHARS:
        raise ApiError(400, f"'input' is {len(text)} characters; the maximum is {MAX_TEXT_CHARS}.", "input")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is None or voice == "":
        raise ApiError(400, "'voice' is required: a voice name (GET /v1/voices lists them).", "voice")
    if not isinstance(voice, str):
        raise ApiError(400, f"'voice' must be a string (a voice name) or an object with a string 'id'; got "
                       f"{_kind(voice)}.", "voice")
    if voice not in voices and voice not in speakers and voice not in aliases:
        known = ", ".join([*voices, *speakers]) or "none"
        also = f"; OpenAI's voice names also work: {', '.join(aliases)}" if aliases else ""
        raise ApiError(400, f"Unknown voice {voice!r}; available voices: {known}{also}.", "voice", "voice_not_found")
    fmt = _choice(body.get("response_format"), "response_format", FORMATS, "mp3")
    stream_format = _choice(body.get("stream_format"), "stream_format", ("audio", "sse"), None)
    if stream_format and fmt not in STREAM_FORMATS:
        raise ApiError(400, f"response_format {fmt!r} cannot be streamed; with stream_format use one of "
                       f"{', '.join(STREAM_FORMATS)}, or omit stream_format for a whole {fmt} file.", "response_format")
    speed = body.get("speed")
    speed = 1.0 if speed is None else speed
    lo, hi = SPEED_RANGE
    if not _number(speed):
        raise ApiError(400, f"'speed' must be a number from {lo} to {hi}; got {_kind(speed)}.", "speed")
    if not lo <= speed <= hi:  # NaN fails this too
        raise ApiError(400, f"'speed' must be a number from {lo} to {hi}, got {speed!r}.", "speed")
    if stream_format and speed != 1.0:
        raise ApiError(400, "'speed' other than 1.0 needs a whole-file response; omit stream_format.", "speed")
    instructions = body.get("instructions")
    instructions = "" if instructions is None else instructions
    if not isinstance(instructions, str):
        raise ApiError(400, f"'instructions' must be a string; got {_kind(instructions)}.", "instructions")
    seed = body.get("seed")  # an extension: OpenAI has no seed
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}; got {_kind(seed)}.", "seed")
    if not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}, got {str(seed)[:40]}.", "seed")
    return SpeechParams(text, voice, fmt, stream_format, float(speed), instructions.strip(), seed)


def parse_flag(value, name: str) -> bool:
    """A true/false form field (absent: false)."""
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ApiError(400, f"'{name}' must be true or false.", name)


async def read_capped(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body, chunk by chunk; 413 as soon as it is (or says it will be) larger than `limit` bytes, so an
    oversized upload is never buffered."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"The request body is larger than {limit / 2**20:.0f} MiB.", code="request_too_large")
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ApiError(413, f"The request body is larger than {limit / 2**20:.0f} MiB.", code="request_too_large")
        yield chunk


# ---- the API -------------------------------------------------------------------------------------------------------
class OpenAIApi:
    """The route handlers, bound to one engine."""

    def __init__(self, engine, api_key: str | None, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.metrics = metrics or Metrics()
        self.created = int(time.time())
        self._threads = anyio.CapacityLimiter(STREAM_THREADS)

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

    async def _run(self, fn: Callable, *args, **kwargs):
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self._threads)

    def _endpoint(self, path: str, handler: Callable[[Request], Awaitable[Response]], public: bool = False):
        """Key check, error mapping (user-facing messages only) and request counting around a handler."""

        async def endpoint(request: Request) -> Response:
            try:
                if not public:
                    self._check_key(request)
                try:
                    response = await handler(request)
                except CosyVoiceError as e:
                    raise engine_error(e) from e
            except ApiError as e:
                response = error_response(e.status, str(e), e.param, e.code, e.headers)
            except Exception:
                log.exception("%s failed", path)
                response = error_response(500, "Internal server error; see the server log.", code="internal_error")
            self.metrics.count_request(path, response.status_code)
            if response.status_code >= 400 and path == "/v1/audio/speech":
                status = response.status_code
                self.metrics.count_failure("busy" if status == 503 else "rejected" if status < 500 else "engine_error")
            return response

        return endpoint

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Missing API key: send the header 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def _speakers(self) -> list[str]:
        return list(self.engine.info.get("speakers") or [])

    def _fatal(self) -> str | None:
        """The engine's fatal error (the GPU is unusable), None while it serves."""
        return getattr(self.engine, "fatal_error", None)

    # ---- speech ----------------------------------------------------------------------------------------------------
    def _synthesis_request(self, body, text: TextStream | None = None) -> tuple[SynthesisRequest, str, str | None]:
        """(engine request, response format, stream format); runs in a worker thread (reads the voice store). With
        `text`, the body is a streaming start message: the text arrives later, so `input` is not looked for."""
        speakers, store = self._speakers(), self.engine.voices
        if text is not None and isinstance(body, dict):
            body = {**body, "input": "-", "response_format": "pcm", "stream_format": "audio"}
        p = parse_speech(body, self.engine.list_voices(), speakers, list(store.aliases))
        if p.instructions:
            mode = Mode.INSTRUCT2
        elif p.voice in speakers:
            mode = Mode.SFT
        else:  # a clone prompt: zero-shot with its transcript, cross-lingual when it was saved without one
            mode = Mode.ZERO_SHOT if store.prompt_text(p.voice).strip() else Mode.CROSS_LINGUAL
        request = SynthesisRequest(text=p.text if text is None else text, mode=mode, voice=p.voice,
                                   instruct_text=p.instructions, stream=p.stream_format is not None, speed=p.speed,
                                   seed=p.seed)
        return request, p.response_format, p.stream_format

    async def speech(self, request: Request) -> Response:
        arrival = time.perf_counter()
        data = b"".join([chunk async for chunk in read_capped(request, MAX_JSON_BYTES)])
        try:
            body = json.loads(data)
        except ValueError:
            raise ApiError(400, "The request body must be JSON (Content-Type: application/json).") from None
        req, fmt, stream_format = await self._run(self._synthesis_request, body)
        if self._fatal() is not None:
            raise EngineDead("the speech engine stopped after a fatal error; the server must be restarted")
        if stream_format is None:
            clip = await self._run(self.engine.synthesize, req)
            data = await self._run(encode_clip, clip.pcm, clip.sample_rate, fmt)
            elapsed = time.perf_counter() - arrival
            self.metrics.observe_first_chunk(elapsed)
            self.metrics.observe_done(elapsed, clip.duration)
            return Response(data, media_type=MEDIA_TYPES[fmt])
        chunks = await self._run(self.engine.stream, req)
        encoder = StreamEncoder(fmt, self.engine.info["sample_rate"])
        try:  # the first chunk before the headers: a failure here (busy included) is still a proper error response
            first = await self._run(_pull, chunks, encoder)
        except BaseException:
            chunks.close()
            encoder.close()
            raise
        self.metrics.observe_first_chunk(time.perf_counter() - arrival)
        sse = stream_format == "sse"
        body_iter = self._stream_body(chunks, encoder, first, sse, arrival)
        media_type = "text/event-stream" if sse else MEDIA_TYPES[fmt]
        return StreamingResponse(body_iter, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _stream_body(self, chunks: Iterator[AudioChunk], encoder: StreamEncoder,
                           first: tuple[AudioChunk, bytes], sse: bool, arrival: float) -> AsyncIterator[bytes]:
        chunk, data = first
        seconds = 0.0
        try:
            while True:
                seconds += chunk.duration
                if data:
                    yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse \
                        else data
                if chunk.is_last:
                    break
                chunk, data = await self._run(_pull, chunks, encoder)
            if sse:
                yield _sse({"type": "speech.audio.done", "usage": {"output_tokens": chunk.tokens}})
            self.metrics.observe_done(time.perf_counter() - arrival, seconds)
        except Exception as e:  # headers are sent: end the stream (with an error event for SSE)
            user_facing = isinstance(e, CosyVoiceError)
            if not user_facing:
                log.exception("speech stream failed")
            error = engine_error(e) if user_facing else ApiError(500, "Internal server error; see the server log.",
                                                                 code="internal_error")
            self.metrics.count_failure("busy" if isinstance(e, EngineBusy) else "engine_error")
            if sse:
                yield _sse({"type": "error", "error": {"message": str(error), "type": "server_error", "param": None,
                                                       "code": error.code}})
            else:
                raise StreamAborted(str(error)) from None
        except BaseException:  # client disconnected: the request is cancelled below
            self.metrics.count_failure("client_disconnected")
            raise
        finally:
            chunks.close()
            encoder.close()

    # ---- streamed text in, audio out ------------------------------------------------------------------------------
    async def speech_stream(self, ws: WebSocket) -> None:
        """`/v1/audio/speech/stream` (WebSocket), for voice agents: text goes in while audio comes out.

        Client: `{"type": "start", "voice", "response_format": "pcm", "instructions"?, "seed"?}`, then
        `{"type": "text", "text": delta}` as the text arrives, then `{"type": "end"}`. Server: `{"type": "started",
        "sample_rate", "format": "pcm16"}`, 16-bit little-endian mono PCM as binary frames, `{"type":
        "first_audio", "seconds", "after_text"}` before the first of them (seconds since the call, and since the text
        it waited for last arrived), `{"type": "done", "audio_seconds", "tokens",
        "timings"}` at the end; any failure is `{"type": "error", "error": {...}}` in OpenAI's shape (a busy
        engine: code server_busy), then the socket closes. The key, the limits and the refusals are those of
        /v1/audio/speech; text that stops arriving for the engine's idle limit ends the speech."""
        arrival = time.perf_counter()
        await ws.accept()
        source, status = TextStream(), 200
        try:
            self._check_key(ws)
            if self._fatal() is not None:
                raise EngineDead("the speech engine stopped after a fatal error; the server must be restarted")
            start = await ws.receive_json()
            if not isinstance(start, dict) or start.get("type") != "start":
                raise ApiError(400, 'The first message must be {"type": "start", "voice": ...}.', "type")
            fmt = start.get("response_format", "pcm")
            if fmt not in ("pcm", "pcm16"):
                raise ApiError(400, f"Unsupported response_format {fmt!r}; this endpoint streams pcm (16-bit).",
                               "response_format", "unsupported_response_format")
            req, _, _ = await self._run(self._synthesis_request, start, source)
            chunks = await self._run(self.engine.stream, req)
            try:
                await ws.send_json({"type": "started", "sample_rate": self.engine.info["sample_rate"],
                                    "format": "pcm16"})
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read_text, ws, source)
                    await self._send_audio(ws, chunks, arrival, source)
                    tg.cancel_scope.cancel()
            finally:
                chunks.close()
        except WebSocketDisconnect:
            status = 499
            self.metrics.count_failure("client_disconnected")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event
            if isinstance(e, CosyVoiceError):
                e = engine_error(e)
            elif not isinstance(e, ApiError):
                log.exception("speech stream failed")
                e = ApiError(500, "Internal server error; see the server log.", code="internal_error")
            status = e.status
            self.metrics.count_failure("busy" if e.code == "server_busy" else "rejected" if e.status < 500
                                       else "engine_error")
            await self._close_with_error(ws, e)
        finally:
            if not source.closed:  # the request ended early: the engine lets go of it
                source.abort()
            self.metrics.count_request("/v1/audio/speech/stream", status)

    @staticmethod
    async def _close_with_error(ws: WebSocket, e: ApiError) -> None:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        try:
            await ws.send_json({"type": "error", "error": {"message": str(e), "type": kind, "param": e.param,
                                                           "code": e.code}})
            await ws.close(1008 if e.status in (401, 403) else 1011 if e.status >= 500 else 1000)
        except (WebSocketDisconnect, RuntimeError):  # the client is gone already
            pass

    @staticmethod
    async def _read_text(ws: WebSocket, source: TextStream) -> None:
        """Text deltas into `source` until the end message. A bad message or a vanished client aborts the
        request (the audio loop then ends with the engine's error)."""
        total = 0
        try:
            while True:
                msg = await ws.receive_json()
                kind = msg.get("type") if isinstance(msg, dict) else None
                if kind == "end":
                    source.close()
                    return
                text = msg.get("text") if kind == "text" else None
                if not isinstance(text, str):
                    raise ApiError(400, 'Text messages are {"type": "text", "text": "..."}; end with {"type": '
                                   '"end"}.', "text")
                total += len(text)
                if total > MAX_STREAM_TEXT_CHARS:
                    raise ApiError(400, f"The streamed text is over {MAX_STREAM_TEXT_CHARS} characters.", "text")
                source.push(text)
        except ApiError as e:
            source.abort()
            await OpenAIApi._close_with_error(ws, e)
        except (WebSocketDisconnect, ValueError, RuntimeError):  # gone, or not JSON
            source.abort()

    async def _send_audio(self, ws: WebSocket, chunks: Iterator[AudioChunk], arrival: float,
                          source: TextStream) -> None:
        seconds = 0.0
        while True:
            chunk = await self._run(next, chunks)
            if chunk.index == 0:
                first = time.perf_counter() - arrival
                self.metrics.observe_first_chunk(first)
                text_at = source.first_audio_text_at
                after_text = None if text_at is None else round(time.monotonic() - text_at, 4)
                await ws.send_json({"type": "first_audio", "seconds": round(first, 4), "after_text": after_text})
            seconds += chunk.duration
            if len(chunk.pcm):
                await ws.send_bytes(chunk.pcm.astype("<i2").tobytes())
            if chunk.is_last:
                break
        elapsed = time.perf_counter() - arrival
        self.metrics.observe_done(elapsed, seconds)
        t = chunk.timings
        await ws.send_json({"type": "done", "audio_seconds": round(seconds, 4), "tokens": chunk.tokens,
                            "timings": {"total": round(elapsed, 4), "frontend": round(t.frontend, 4),
                                        "llm": round(t.llm, 4), "flow": round(t.flow, 4), "hift": round(t.hift, 4)}})
        await ws.close()

    # ---- models ----------------------------------------------------------------------------------------------------
    def _model_ids(self) -> list[str]:
        """The served model's own id, then OpenAI's speech model names (a request may name any of them)."""
        info = self.engine.info
        own = info["model"].replace(" ", "-") if info["is_random"] else Path(info["model"]).name  # no server paths
        return [own, *(m for m in OPENAI_MODELS if m != own)]

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

    # ---- voices ----------------------------------------------------------------------------------------------------
    def _voice_list(self) -> list[dict]:
        store = self.engine.voices
        builtin = [{"object": "voice", "id": n, "name": n, "type": "builtin", "prompt_text": store.prompt_text(n)}
                   for n in store.builtin_names()]
        aliases = [{"object": "voice", "id": a, "name": a, "type": "builtin", "alias_of": n}
                   for a, n in store.aliases.items()]
        speakers = [{"object": "voice", "id": n, "name": n, "type": "builtin"} for n in self._speakers()]
        saved = [{"object": "voice", "id": n, "name": n, "type": "saved"} for n in store.list()]
        return builtin + aliases + speakers + saved

    async def list_voices(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self._run(self._voice_list)})

    def _read_only(self, name: str) -> bool:
        return name in self._speakers() or self.engine.voices.builtin(name) is not None

    async def create_voice(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "POST /v1/voices takes multipart/form-data with fields name, prompt_text, file and "
                           "optionally overwrite.")
        parser = MultiPartParser(request.headers, read_capped(request, MAX_FORM_BYTES), max_files=1, max_fields=8)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise ApiError(400, f"Malformed multipart/form-data body: {e.message}") from None
        try:
            name, prompt_text, upload = form.get("name"), form.get("prompt_text"), form.get("file")
            if not isinstance(name, str) or not name.strip():
                raise ApiError(400, "'name' is required: the name to save the voice under.", "name")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "'file' is required: the prompt audio (wav, flac, mp3 or ogg) as a file field.",
                               "file")
            if prompt_text is not None and not isinstance(prompt_text, str):
                raise ApiError(400, "'prompt_text' must be a text field.", "prompt_text")
            if not (prompt_text or "").strip():
                raise ApiError(400, "'prompt_text' is empty: zero-shot cloning needs the transcript of the prompt "
                               "audio, word for word.", "prompt_text")
            overwrite = parse_flag(form.get("overwrite"), "overwrite")
            audio = await upload.read()
        finally:
            await form.close()
        if len(audio) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"'file' is larger than {MAX_UPLOAD_BYTES >> 20} MiB; upload a short speech prompt.",
                           "file", "request_too_large")
        name, prompt_text = name.strip(), prompt_text.strip()
        if self._read_only(name):
            raise ApiError(409, f"{name!r} is a built-in voice and read-only; choose another name.", "name",
                           "voice_read_only")
        existed = name in await self._run(self.engine.voices.list)
        if existed and not overwrite:
            raise ApiError(409, f"A voice named {name!r} already exists; send overwrite=true to replace it, or choose "
                           "another name.", "name", "voice_exists")
        await self._run(self.engine.save_voice, name, audio, prompt_text, overwrite=overwrite)
        return JSONResponse({"object": "voice", "id": name, "name": name, "type": "saved", "prompt_text": prompt_text},
                            200 if existed else 201)

    async def delete_voice(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self._read_only(name):
            raise ApiError(403, f"{name!r} is a built-in voice and read-only; only saved voices can be deleted.",
                           "name", "voice_read_only")
        saved = await self._run(self.engine.voices.list)
        if name not in saved:
            known = ", ".join(saved) or "none"
            raise ApiError(404, f"No saved voice {name!r}; saved voices: {known}.", "name", "voice_not_found")
        await self._run(self.engine.delete_voice, name)
        return JSONResponse({"object": "voice.deleted", "id": name, "name": name, "deleted": True})

    # ---- status ----------------------------------------------------------------------------------------------------
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


def mount_api(app: FastAPI, engine, api_key: str | None) -> Metrics:
    """Serve the API on `app` (e.g. Gradio's `demo.app` or a FastAPI app that Gradio is mounted on), ahead of its
    own routes. With `api_key`, every route but /health/live and /health/ready wants `Authorization: Bearer
    <api_key>`. Returns the API's metrics."""
    api = OpenAIApi(engine, api_key)
    app.router.routes[:0] = api.routes()
    return api.metrics
