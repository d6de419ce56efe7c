"""POST /v1/audio/speech: one whole file, or audio streamed as it is made (raw bytes or server-sent events).

Engine calls block, so they run in worker threads; a streamed response pulls one chunk at a time and closing it
(client gone) closes the engine iterator, which cancels the request."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from cosyvoice_opt.audio_formats import MEDIA_TYPES, encode_clip
from cosyvoice_opt.errors import CosyVoiceError, EngineDead
from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError, engine_error
from cosyvoice_opt.server.metrics import failure_reason
from cosyvoice_opt.server.parsing import read_capped, synthesis_request
from cosyvoice_opt.server.stream_encoding import StreamEncoder, pull, sse
from cosyvoice_opt.types import AudioChunk

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 1 << 20  # a speech request is a few KiB at most


class StreamAborted(Exception):
    """A raw audio stream failed after its headers: raised out of the response body so that the HTTP server drops
    the connection without the closing chunk, and the client sees an incomplete body, not a short clip that looks
    whole (an SSE stream says so in an error event instead)."""


class SpeechRoutes(ApiBase):
    """/v1/audio/speech."""

    async def speech(self, request: Request) -> Response:
        arrival = time.perf_counter()
        data = b"".join([chunk async for chunk in read_capped(request, MAX_JSON_BYTES)])
        try:
            body = json.loads(data)
        except ValueError:
            raise ApiError(400, "The request body must be JSON (Content-Type: application/json).") from None
        req, fmt, stream_format = await self._run(synthesis_request, self.engine, body)
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
            first = await self._run(pull, chunks, encoder)
        except BaseException:
            chunks.close()
            encoder.close()
            raise
        self.metrics.observe_first_chunk(time.perf_counter() - arrival)
        as_sse = stream_format == "sse"
        body_iter = self._stream_body(chunks, encoder, first, as_sse, arrival)
        media_type = "text/event-stream" if as_sse else MEDIA_TYPES[fmt]
        return StreamingResponse(body_iter, media_type=media_type, headers={"Cache-Control": "no-cache"})

    async def _stream_body(self, chunks: Iterator[AudioChunk], encoder: StreamEncoder,
                           first: tuple[AudioChunk, bytes], as_sse: bool, arrival: float) -> AsyncIterator[bytes]:
        chunk, data = first
        seconds = 0.0
        try:
            while True:
                seconds += chunk.duration
                if data:
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if as_sse \
                        else data
                if chunk.is_last:
                    break
                chunk, data = await self._run(pull, chunks, encoder)
            if as_sse:
                yield sse({"type": "speech.audio.done", "usage": {"output_tokens": chunk.tokens}})
            self.metrics.observe_done(time.perf_counter() - arrival, seconds)
        except Exception as e:  # headers are sent: end the stream (with an error event for SSE)
            user_facing = isinstance(e, CosyVoiceError)
            if not user_facing:
                log.exception("speech stream failed")
            error = engine_error(e) if user_facing else ApiError(500, "Internal server error; see the server log.",
                                                                 code="internal_error")
            self.metrics.count_failure(failure_reason(error.status, error.code) or "engine_error")
            if as_sse:
                yield sse({"type": "error", "error": {"message": str(error), "type": "server_error", "param": None,
                                                      "code": error.code}})
            else:
                raise StreamAborted(str(error)) from None
        except BaseException:  # client disconnected: the request is cancelled below
            self.metrics.count_disconnect()
            raise
        finally:
            chunks.close()
            encoder.close()
