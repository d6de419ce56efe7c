"""/v1/audio/speech/stream (WebSocket), for voice agents: text goes in while audio comes out."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect

from cosyvoice_opt.errors import CosyVoiceError, EngineDead
from cosyvoice_opt.frontend.text_split import has_speakable
from cosyvoice_opt.limits import MAX_STREAM_TEXT_CHARS
from cosyvoice_opt.server.base import ApiBase
from cosyvoice_opt.server.errors import ApiError, engine_error
from cosyvoice_opt.server.metrics import CLIENT_CLOSED
from cosyvoice_opt.server.parsing import synthesis_request
from cosyvoice_opt.types import AudioChunk, TextStream

log = logging.getLogger(__name__)


async def receive_message(ws: WebSocket) -> dict:
    """The client's next message, a JSON object in a text frame; anything else is the client's error (400).
    WebSocketDisconnect when the client has gone."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
    text = message.get("text")
    if text is None:
        raise ApiError(400, "Messages are JSON objects in text frames; got a binary frame.")
    try:
        msg = json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"A message is not valid JSON ({e.msg} at character {e.pos}); messages are JSON "
                       'objects such as {"type": "text", "text": "..."}.') from None
    if not isinstance(msg, dict):
        raise ApiError(400, 'Messages are JSON objects with a "type" ("start", "text" or "end"); got '
                       f"{type(msg).__name__}.", "type")
    return msg


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
        /v1/audio/speech (an end before any word is refused, as an empty input is); text that stops arriving for the
        engine's idle limit ends the speech. A message that is not a JSON object in a text frame is the client's
        error (400); a client that leaves cancels the request (counted as 499, not as a failure)."""
        arrival = time.perf_counter()
        await ws.accept()
        source, status, code = TextStream(), 200, None
        try:
            self._check_key(ws)
            if self._fatal() is not None:
                raise EngineDead("the speech engine stopped after a fatal error; the server must be restarted")
            start = await receive_message(ws)
            if start.get("type") != "start":
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
                await self._speak(ws, chunks, arrival, source)
            finally:
                chunks.close()
        except WebSocketDisconnect:
            status = CLIENT_CLOSED
            log.info("speech stream ended early: the client disconnected")
        except Exception as e:  # noqa: BLE001 - every failure becomes an error event
            if isinstance(e, CosyVoiceError):
                e = engine_error(e)
            elif not isinstance(e, ApiError):
                log.exception("speech stream failed")
                e = ApiError(500, "Internal server error; see the server log.", code="internal_error")
            status, code = e.status, e.code
            await self._close_with_error(ws, e)
        finally:
            if not source.closed:  # the request ended early: the engine lets go of it
                source.abort()
            self.metrics.count_speech("/v1/audio/speech/stream", status, code)

    async def _speak(self, ws: WebSocket, chunks: Iterator[AudioChunk], arrival: float, source: TextStream) -> None:
        """Audio out while the text comes in. When the reader ends the request (a bad message, no text, the client
        gone), the engine's "aborted" error gives way to the reader's reason."""
        ended: list[Exception] = []
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_text, ws, source, ended)
            try:
                await self._send_audio(ws, chunks, arrival, source)
            except (CosyVoiceError, WebSocketDisconnect) as e:  # re-raised after the group, not wrapped in one
                error = ended[0] if ended else e
            tg.cancel_scope.cancel()
        if error is not None:
            raise error

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
    async def _read_text(ws: WebSocket, source: TextStream, ended: list[Exception]) -> None:
        """Text deltas into `source` until the end message. Text with nothing to speak yet (spaces, punctuation) is
        held back until a word arrives, so that the engine never speaks from no text. A bad message, an end without
        a word, or a vanished client aborts the request, with the reason in `ended`."""
        total, held, spoke = 0, "", False
        try:
            while True:
                msg = await receive_message(ws)
                kind = msg.get("type")
                if kind == "end":
                    if not spoke:
                        raise ApiError(400, "The streamed text has nothing to speak: send at least one word in "
                                       '{"type": "text", "text": "..."} messages before {"type": "end"}.', "text")
                    source.close()
                    return
                text = msg.get("text") if kind == "text" else None
                if not isinstance(text, str):
                    raise ApiError(400, 'Text messages are {"type": "text", "text": "..."}; end with {"type": '
                                   '"end"}.', "text")
                total += len(text)
                if total > MAX_STREAM_TEXT_CHARS:
                    raise ApiError(400, f"The streamed text is over {MAX_STREAM_TEXT_CHARS} characters.", "text")
                if spoke or has_speakable(held + text):
                    source.push(held + text)
                    held, spoke = "", True
                else:
                    held += text
        except (ApiError, WebSocketDisconnect) as e:
            ended.append(e)
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
