"""`/v1/audio/speech/stream` (WebSocket): text deltas in, PCM frames and JSON events out, through Starlette's test
client against the tiny random engine."""

from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import EngineBusy
from cosyvoice_opt.server import mount_api
from tests.conftest import wait_until
from tests.test_openai_api import _speech_wav

KEY = "ws-secret"
URL = "/v1/audio/speech/stream"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_model_dir(None, EngineConfig(random_size="tiny", device="cpu", text_idle_timeout=0.5,
                                                   voices_dir=str(tmp_path_factory.mktemp("v"))))
    eng.save_voice("alice", _speech_wav(), "hello there, this is alice")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine):
    app = FastAPI()
    mount_api(app, engine, KEY)
    with TestClient(app) as c:
        yield c


def _idle(engine) -> bool:
    return engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0 and engine._parts.vocoder.idle()


def _until_done(ws) -> tuple[list[dict], bytes]:
    """Every event and all the audio up to the done (or error) event."""
    events, audio = [], b""
    while True:
        msg = ws.receive()
        if msg.get("bytes") is not None:
            audio += msg["bytes"]
            continue
        if msg["type"] == "websocket.close":
            return events, audio
        events.append(json.loads(msg["text"]))
        if events[-1]["type"] in ("done", "error"):
            return events, audio


def test_text_in_audio_out(client, engine) -> None:
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice", "response_format": "pcm", "seed": 7})
        started = ws.receive_json()
        assert started == {"type": "started", "sample_rate": engine.sample_rate, "format": "pcm16"}
        for word in ("Hello ", "there, ", "this ", "text ", "arrives ", "one ", "word ", "at ", "a ", "time."):
            ws.send_json({"type": "text", "text": word})
        ws.send_json({"type": "end"})
        events, audio = _until_done(ws)
    kinds = [e["type"] for e in events]
    assert kinds == ["first_audio", "done"]
    assert 0 < events[0]["after_text"] <= events[0]["seconds"]  # the text it waited for came after the call
    done = events[-1]
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert done["audio_seconds"] == pytest.approx(len(audio) / 2 / engine.sample_rate, abs=1e-3)
    assert done["tokens"] > 0 and set(done["timings"]) == {"total", "frontend", "llm", "flow", "hift"}
    assert wait_until(lambda: _idle(engine))


@pytest.mark.parametrize(("start", "param", "code"), [
    ({"type": "start", "voice": "nobody"}, "voice", "voice_not_found"),
    ({"type": "text", "text": "hi"}, "type", None),
    ({"type": "start", "voice": "alice", "response_format": "mp3"}, "response_format",
     "unsupported_response_format"),
    ({"type": "start", "voice": "alice", "seed": -1}, "seed", None),
])
def test_a_bad_start_message_is_an_error_event(client, engine, start, param, code) -> None:
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json(start)
        events, audio = _until_done(ws)
    assert not audio and [e["type"] for e in events] == ["error"]
    error = events[0]["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert engine.stats()["running"] == 0


def test_a_bad_text_message_ends_the_request(client, engine) -> None:
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        ws.send_json({"type": "text", "text": 42})
        events, _ = _until_done(ws)
    assert events[-1]["type"] == "error" and events[-1]["error"]["param"] == "text"
    assert wait_until(lambda: _idle(engine))


def test_text_that_stops_arriving_ends_cleanly(client, engine) -> None:
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        ws.send_json({"type": "text", "text": "Some text, and then nothing more for a while"})
        events, audio = _until_done(ws)  # no end message: the engine's idle limit ends the text
    assert [e["type"] for e in events] == ["first_audio", "done"] and audio
    assert wait_until(lambda: _idle(engine))


def test_a_client_that_goes_away_frees_its_request(client, engine) -> None:
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        for _ in range(30):
            ws.send_json({"type": "text", "text": "more and more words to speak "})
        assert ws.receive_json()["type"] == "first_audio"
    assert wait_until(lambda: _idle(engine))
    assert engine._sched.admission.streams_held == 0 and engine._sched.admission.pages_held == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_the_api_key_is_required(client, engine, headers) -> None:
    """The WebSocket refuses a missing or wrong key with the very error HTTP answers for the same headers."""
    http = client.get("/v1/models", headers=headers)
    assert http.status_code == 401 and "API key" in http.json()["error"]["message"]
    with client.websocket_connect(URL, headers=headers) as ws:
        events, _ = _until_done(ws)
        assert events == [{"type": "error", "error": http.json()["error"]}]
        assert events[0]["error"]["type"] == "invalid_request_error" and events[0]["error"]["code"] == "invalid_api_key"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert closed.value.code == 1008


def test_a_busy_engine_answers_server_busy(client, engine, monkeypatch) -> None:
    def busy(request):
        raise EngineBusy("the server is busy (1 streams admitted, 0 waiting); try again in 2 s", retry_after=2.0)

    monkeypatch.setattr(engine, "stream", busy)
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        events, _ = _until_done(ws)
    assert events[0]["type"] == "error"
    assert (events[0]["error"]["type"], events[0]["error"]["code"]) == ("server_error", "server_busy")


def _metric(client, name: str, labels: str = "") -> float:
    text = client.get("/metrics", headers=AUTH).text
    labels = re.escape("{" + labels + "}") if labels else ""
    match = re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


STATUS = 'client="api",endpoint="/v1/audio/speech/stream",status="{}"'
FAILED = 'reason="{}"'


def _counts(client) -> dict[str, float]:
    return {"400": _metric(client, "cosyvoice_requests_total", STATUS.format(400)),
            "499": _metric(client, "cosyvoice_requests_total", STATUS.format(499)),
            "500": _metric(client, "cosyvoice_requests_total", STATUS.format(500)),
            "invalid": _metric(client, "cosyvoice_speech_failures_total", FAILED.format("invalid")),
            "engine_error": _metric(client, "cosyvoice_speech_failures_total", FAILED.format("engine_error")),
            "disconnects": _metric(client, "cosyvoice_speech_disconnects_total")}


def _counted(client, before: dict[str, float], **more: int) -> bool:
    """The counters moved by `more` and no other (the handler counts after the socket closed: wait for it)."""
    expected = {k: v + more.get(k, 0) for k, v in before.items()}
    return wait_until(lambda: _counts(client) == expected)


def _no_error_logged(caplog) -> bool:
    return not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("texts", [[], ["   "], [" ", "?! ", "\n"]], ids=["no-text", "spaces", "punctuation"])
def test_text_with_nothing_to_speak_is_refused(client, engine, caplog, texts) -> None:
    """As POST /v1/audio/speech refuses an empty input: a 400-class error, no audio."""
    before = _counts(client)
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        for text in texts:
            ws.send_json({"type": "text", "text": text})
        ws.send_json({"type": "end"})
        events, audio = _until_done(ws)
    assert not audio and [e["type"] for e in events] == ["error"]
    error = events[0]["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "text")
    assert "nothing to speak" in error["message"]
    assert _counted(client, before, **{"400": 1, "invalid": 1})
    assert wait_until(lambda: _idle(engine)) and _no_error_logged(caplog)


@pytest.mark.parametrize("texts", [[], ["  ", "... "]], ids=["nothing", "spaces-and-dots"])
def test_text_that_stops_arriving_before_a_word_is_refused(client, engine, caplog, texts) -> None:
    """No end message and no word before the idle limit (0.5 s here): refused, not spoken from nothing."""
    before = _counts(client)
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        for text in texts:
            ws.send_json({"type": "text", "text": text})
        events, audio = _until_done(ws)
    assert not audio and [e["type"] for e in events] == ["error"]
    error = events[0]["error"]
    assert error["type"] == "invalid_request_error" and "nothing to speak" in error["message"]
    assert _counted(client, before, **{"400": 1, "invalid": 1})
    assert wait_until(lambda: _idle(engine)) and _no_error_logged(caplog)


BAD_MESSAGES = {  # the frame as sent (str: a text frame, bytes: a binary frame), words of the error
    "malformed-json": ('{"type": "text", "text": "hi"', "not valid JSON"),
    "binary-frame": (b"\x00\x01\x02", "binary frame"),
    "not-an-object": ('["text", "hi"]', "JSON objects"),
    "text-without-text": ('{"type": "text"}', "Text messages are"),
}


@pytest.mark.parametrize("when", ["first", "after-start"])
@pytest.mark.parametrize("bad", BAD_MESSAGES, ids=list(BAD_MESSAGES))
def test_a_bad_message_is_an_invalid_request(client, engine, caplog, when, bad) -> None:
    """Counted as 400 and `invalid`, never as a server error, and logged without a traceback."""
    frame, words = BAD_MESSAGES[bad]
    if when == "first" and bad == "text-without-text":
        words = "first message must be"
    before = _counts(client)
    with client.websocket_connect(URL, headers=AUTH) as ws:
        if when == "after-start":
            ws.send_json({"type": "start", "voice": "alice"})
            assert ws.receive_json()["type"] == "started"
            ws.send_json({"type": "text", "text": "Hello there, this is"})
        ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_text(frame)
        events, _ = _until_done(ws)
    error = events[-1]["error"]
    assert events[-1]["type"] == "error" and error["type"] == "invalid_request_error" and error["code"] is None
    assert words in error["message"]
    assert _counted(client, before, **{"400": 1, "invalid": 1})
    assert wait_until(lambda: _idle(engine)) and _no_error_logged(caplog)


def test_a_client_that_leaves_is_not_a_failure(client, engine, caplog) -> None:
    """Counted as 499 and a disconnect, not as a failure, and logged as one line."""
    caplog.set_level(logging.INFO, logger="cosyvoice_opt.server")
    before = _counts(client)
    with client.websocket_connect(URL, headers=AUTH) as ws:
        ws.send_json({"type": "start", "voice": "alice"})
        assert ws.receive_json()["type"] == "started"
        for _ in range(30):
            ws.send_json({"type": "text", "text": "more and more words to speak "})
        assert ws.receive_json()["type"] == "first_audio"
    assert _counted(client, before, **{"499": 1, "disconnects": 1})
    assert wait_until(lambda: _idle(engine)) and _no_error_logged(caplog)
    assert [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()] == \
        ["speech stream ended early: the client disconnected"]
