"""/v1/audio/speech/stream (WebSocket), for voice agents: text goes in while audio comes out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyvoice_opt.errors import CosyVoiceError, EngineDead
from cosyvoice_opt.limits import MAX_STREAM_TEXT_CHARS
from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError, engine_error
from cosyvoice_opt.server.parsing import synthesis_request
from cosyvoice_opt.types import AudioChunk, TextStream

log = logging.getLogger(__name__)


class SpeechStreamRoute(ApiBase):
    """Streamed text in, audio out."""

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
            req, _, _ = await self._run(synthesis_request, self.engine, start, source)
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
            await SpeechStreamRoute._close_with_error(ws, e)
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
