"""OpenAI-compatible speech API, saved voices over HTTP, /health and /metrics, served beside the Gradio UI.

`mount_api(app, engine, api_key)` puts the routes in front of whatever the app already routes, so a Gradio app
mounted at "/" cannot shadow them. Engine calls block, so they run in worker threads; a streamed response pulls
one chunk at a time and closing it (client gone) closes the engine iterator, which cancels the request.
"""

from __future__ import annotations

import base64
import hmac
import io
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import anyio
import numpy as np
import soundfile as sf
import torch
from fastapi import FastAPI
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cosyvoice_opt.engine.engine import MAX_SEED
from cosyvoice_opt.errors import CosyVoiceError, InputError
from cosyvoice_opt.server.metrics import CONTENT_TYPE, Metrics
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest

log = logging.getLogger(__name__)

FORMATS = ("wav", "pcm", "flac", "mp3", "opus")  # whole-file responses (all written by libsndfile, pcm raw)
STREAM_FORMATS = ("wav", "pcm", "opus")  # mp3 and flac rewrite their headers at the end: not streamable here
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg"}
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
              "opus": ("OGG", "OPUS")}
SPEED_RANGE = (0.25, 4.0)  # OpenAI's range; the engine may accept less and says so
MAX_INPUT_CHARS = 4096  # OpenAI's limit
MAX_UPLOAD_BYTES = 20 << 20
MAX_FORM_BYTES = MAX_UPLOAD_BYTES + (64 << 10)  # the file plus the other fields and multipart framing
MAX_JSON_BYTES = 1 << 20  # a speech request is a few KiB at most
ENGINE_GAUGES = {"running": "requests decoding", "waiting": "requests queued", "batch_size": "current LLM batch",
                 "flow_pages": "flow history pages of 50 frames", "flow_pages_used": "flow history pages in use"}
STREAM_THREADS = 512  # a streamed request holds a worker thread while it waits for its next chunk


class ApiError(Exception):
    """A request rejected by the API itself, before the engine saw it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# ---- audio encoding ------------------------------------------------------------------------------------------------
def encode_clip(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """A whole int16 clip as a `fmt` file (`pcm`: raw s16le)."""
    if fmt == "pcm":
        return pcm.astype("<i2").tobytes()
    buf = io.BytesIO()
    container, subtype = _SOUNDFILE[fmt]
    sf.write(buf, pcm, rate, format=container, subtype=subtype)
    return buf.getvalue()


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
def _choice(value, name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    if value is None:
        return default
    if value not in allowed:
        raise ApiError(400, f"Unsupported {name} {value!r}; supported: {', '.join(allowed)}.", name,
                       f"unsupported_{name}")
    return value


class SpeechParams(NamedTuple):
    text: str
    voice: str
    response_format: str
    stream_format: str | None  # None: one whole file
    speed: float
    instructions: str
    seed: int


def parse_speech(body, voices: list[str], speakers: list[str]) -> SpeechParams:
    """Validate a /v1/audio/speech body; ApiError names the offending `param`."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string (any value: this server has one model).", "model")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "'input' is empty; send the text to speak as a non-empty string.", "input")
    if len(text) > MAX_INPUT_CHARS:
        raise ApiError(400, f"'input' is {len(text)} characters; the maximum is {MAX_INPUT_CHARS}.", "input")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise ApiError(400, "'voice' is required: a saved voice name (GET /v1/voices lists them).", "voice")
    if voice not in voices and voice not in speakers:
        known = ", ".join([*voices, *speakers]) or "none yet; save one with POST /v1/voices"
        raise ApiError(400, f"Unknown voice {voice!r}; available voices: {known}.", "voice", "voice_not_found")
    fmt = _choice(body.get("response_format"), "response_format", FORMATS, "mp3")
    stream_format = _choice(body.get("stream_format"), "stream_format", ("audio", "sse"), None)
    if stream_format and fmt not in STREAM_FORMATS:
        raise ApiError(400, f"response_format {fmt!r} cannot be streamed; with stream_format use one of "
                       f"{', '.join(STREAM_FORMATS)}, or omit stream_format for a whole {fmt} file.", "response_format")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]:
        raise ApiError(400, f"'speed' must be a number from {SPEED_RANGE[0]} to {SPEED_RANGE[1]}, got {speed!r}.",
                       "speed")
    if stream_format and speed != 1.0:
        raise ApiError(400, "'speed' other than 1.0 needs a whole-file response; omit stream_format.", "speed")
    instructions = body.get("instructions") or ""
    if not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string.", "instructions")
    seed = body.get("seed", 0)  # an extension: OpenAI has no seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}, got {str(seed)[:40]}.", "seed")
    return SpeechParams(text, voice, fmt, stream_format, float(speed), instructions.strip(), seed)


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
        self._threads = anyio.CapacityLimiter(STREAM_THREADS)

    def routes(self) -> list[Route]:
        table = [
            ("/v1/audio/speech", ["POST"], self.speech),
            ("/v1/voices", ["GET"], self.list_voices),
            ("/v1/voices", ["POST"], self.create_voice),
            ("/v1/voices/{name}", ["DELETE"], self.delete_voice),
            ("/health", ["GET"], self.health),
            ("/metrics", ["GET"], self.prometheus),
        ]
        return [Route(path, self._endpoint(path, handler), methods=methods, include_in_schema=False)
                for path, methods, handler in table]

    async def _run(self, fn: Callable, *args):
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def _endpoint(self, path: str, handler: Callable[[Request], Awaitable[Response]]):
        """Key check, error mapping (user-facing messages only) and request counting around a handler."""

        async def endpoint(request: Request) -> Response:
            try:
                self._check_key(request)
                response = await handler(request)
            except ApiError as e:
                response = error_response(e.status, str(e), e.param, e.code)
            except InputError as e:
                response = error_response(400, str(e))
            except CosyVoiceError as e:
                response = error_response(500, str(e), code="engine_error")
            except Exception:
                log.exception("%s failed", path)
                response = error_response(500, "Internal server error; see the server log.", code="internal_error")
            self.metrics.count_request(path, response.status_code)
            if response.status_code >= 400 and path == "/v1/audio/speech":
                self.metrics.count_failure("rejected" if response.status_code < 500 else "engine_error")
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

    # ---- speech ----------------------------------------------------------------------------------------------------
    def _synthesis_request(self, body) -> tuple[SynthesisRequest, str, str | None]:
        """(engine request, response format, stream format); runs in a worker thread (reads the voice store)."""
        speakers = self._speakers()
        p = parse_speech(body, self.engine.list_voices(), speakers)
        if p.instructions:
            mode = Mode.INSTRUCT2
        elif p.voice in speakers:
            mode = Mode.SFT
        else:  # a saved clone prompt: zero-shot with its transcript, cross-lingual when it was saved without one
            has_text = bool(self.engine.voices.load(p.voice).meta.get("prompt_text", "").strip())
            mode = Mode.ZERO_SHOT if has_text else Mode.CROSS_LINGUAL
        request = SynthesisRequest(text=p.text, mode=mode, voice=p.voice, instruct_text=p.instructions,
                                   stream=p.stream_format is not None, speed=p.speed, seed=p.seed)
        return request, p.response_format, p.stream_format

    async def speech(self, request: Request) -> Response:
        arrival = time.perf_counter()
        data = b"".join([chunk async for chunk in read_capped(request, MAX_JSON_BYTES)])
        try:
            body = json.loads(data)
        except ValueError:
            raise ApiError(400, "The request body must be JSON (Content-Type: application/json).") from None
        req, fmt, stream_format = await self._run(self._synthesis_request, body)
        if stream_format is None:
            clip = await self._run(self.engine.synthesize, req)
            data = await self._run(encode_clip, clip.pcm, clip.sample_rate, fmt)
            elapsed = time.perf_counter() - arrival
            self.metrics.observe_first_chunk(elapsed)
            self.metrics.observe_done(elapsed, clip.duration)
            return Response(data, media_type=MEDIA_TYPES[fmt])
        chunks = await self._run(self.engine.stream, req)
        encoder = StreamEncoder(fmt, self.engine.info["sample_rate"])
        try:  # the first chunk before the headers: a failure here is still a proper error response
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
            self.metrics.count_failure("engine_error")
            if sse:
                message = str(e) if user_facing else "Internal server error; see the server log."
                yield _sse({"type": "error", "error": {"message": message, "type": "server_error", "param": None,
                                                       "code": "engine_error"}})
        except BaseException:  # client disconnected: the request is cancelled below
            self.metrics.count_failure("client_disconnected")
            raise
        finally:
            chunks.close()
            encoder.close()

    # ---- voices ----------------------------------------------------------------------------------------------------
    def _voice_list(self) -> list[dict]:
        saved = [{"object": "voice", "id": n, "name": n, "type": "saved"} for n in self.engine.list_voices()]
        return saved + [{"object": "voice", "id": n, "name": n, "type": "builtin"} for n in self._speakers()]

    async def list_voices(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self._run(self._voice_list)})

    async def create_voice(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "POST /v1/voices takes multipart/form-data with fields name, prompt_text and file.")
        parser = MultiPartParser(request.headers, read_capped(request, MAX_FORM_BYTES), max_files=1, max_fields=8)
        try:
            form = await parser.parse()
        except MultiPartException as e:
            raise ApiError(400, f"Malformed multipart/form-data body: {e.message}") from None
        try:
            name, prompt_text, upload = form.get("name"), form.get("prompt_text") or "", form.get("file")
            if not isinstance(name, str) or not name.strip():
                raise ApiError(400, "'name' is required: the name to save the voice under.", "name")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "'file' is required: the prompt audio (wav, flac, mp3 or ogg) as a file field.",
                               "file")
            if not isinstance(prompt_text, str):
                raise ApiError(400, "'prompt_text' must be a text field.", "prompt_text")
            audio = await upload.read()
        finally:
            await form.close()
        if len(audio) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"'file' is larger than {MAX_UPLOAD_BYTES >> 20} MiB; upload a short speech prompt.",
                           "file", "request_too_large")
        name = name.strip()
        if name in self._speakers():
            raise ApiError(400, f"{name!r} is a built-in speaker; choose another name.", "name")
        await self._run(self.engine.save_voice, name, audio, prompt_text.strip())
        return JSONResponse({"object": "voice", "id": name, "name": name, "type": "saved",
                             "prompt_text": prompt_text.strip()}, 201)

    async def delete_voice(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name in self._speakers():
            raise ApiError(400, f"{name!r} is a built-in speaker of the model; only saved voices can be deleted.",
                           "name")
        saved = await self._run(self.engine.list_voices)
        if name not in saved:
            known = ", ".join(saved) or "none"
            raise ApiError(404, f"No saved voice {name!r}; saved voices: {known}.", "name", "voice_not_found")
        await self._run(self.engine.delete_voice, name)
        return JSONResponse({"object": "voice.deleted", "id": name, "name": name, "deleted": True})

    # ---- status ----------------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        info = self.engine.info
        model = info["model"] if info["is_random"] else Path(info["model"]).name  # no server paths
        return JSONResponse({"status": "ok", **info, "model": model, "stats": self.engine.stats()})

    async def prometheus(self, request: Request) -> Response:
        info, stats = self.engine.info, self.engine.stats()
        readings = [(f"cosyvoice_engine_{k}", "gauge", f"Engine now: {k} ({ENGINE_GAUGES[k]}).", stats[k])
                    for k in ENGINE_GAUGES if k in stats]
        readings += [(f"cosyvoice_engine_{k}_total", "counter", f"Engine since start: {k} requests or events.", v)
                     for k, v in stats.items() if k not in ENGINE_GAUGES and isinstance(v, int | float)]
        readings.append(("cosyvoice_engine_max_batch_size", "gauge", "LLM continuous-batching limit.",
                         info["max_batch_size"]))
        device = torch.device(info["device"])
        if device.type == "cuda":
            readings += [
                ("cosyvoice_gpu_memory_allocated_bytes", "gauge", "GPU memory held by tensors.",
                 torch.cuda.memory_allocated(device)),
                ("cosyvoice_gpu_memory_reserved_bytes", "gauge", "GPU memory reserved by the caching allocator.",
                 torch.cuda.memory_reserved(device)),
                ("cosyvoice_gpu_memory_max_allocated_bytes", "gauge", "Peak GPU memory held by tensors.",
                 torch.cuda.max_memory_allocated(device)),
            ]
        return Response(self.metrics.render(readings), media_type=CONTENT_TYPE)


def mount_api(app: FastAPI, engine, api_key: str | None) -> None:
    """Serve the API on `app` (e.g. Gradio's `demo.app` or a FastAPI app that Gradio is mounted on), ahead of its
    own routes. With `api_key`, every route wants `Authorization: Bearer <api_key>`."""
    app.router.routes[:0] = OpenAIApi(engine, api_key).routes()
