"""The OpenAI-compatible HTTP API against a real server (uvicorn in a thread) and the tiny random engine, through
the `openai` client and plain httpx."""

from __future__ import annotations

import base64
import io
import json
import re
import time
import urllib.parse
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.server import mount_api
from cosyvoice_opt.server.metrics import Histogram
from cosyvoice_opt.server.openai_api import FORMATS, STREAM_FORMATS, OpenAIApi
from cosyvoice_opt.soak import free_port, serve_in_process
from cosyvoice_opt.types import Mode

KEY = "test-secret"
SHORT = "Hello there."
LONG = ("This is a much longer text for streaming. It has several sentences, so generation takes a while. "
        "The first audio should arrive long before the last one. And here is one more sentence to be sure.")


def _speech_wav(seconds: float = 2.0, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    sf.write(buf, (rng.standard_normal(int(24000 * seconds)) * 3000).astype(np.int16), 24000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_model_dir(None, EngineConfig(random_size="tiny", voices_dir=str(tmp_path_factory.mktemp("v"))))
    eng.save_voice("alice", _speech_wav(), "hello there, this is alice")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine):
    """A server that wants the API key."""
    with serve_in_process(engine, KEY) as url:
        yield url


@pytest.fixture(scope="module")
def open_base(engine):
    """A server without an API key."""
    with serve_in_process(engine, None) as url:
        yield url


@pytest.fixture
def http(base):
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
        yield client


@pytest.fixture
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=300, max_retries=0)


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ---- speech ----------------------------------------------------------------------------------------------------------
def test_openai_client_writes_a_24khz_wav(oai, tmp_path):
    path = tmp_path / "out.wav"
    oai.audio.speech.create(model="cosyvoice2", voice="alice", input=SHORT, response_format="wav").write_to_file(path)
    audio, rate = sf.read(path, dtype="int16")
    assert rate == 24000
    assert sf.info(path).subtype == "PCM_16"
    assert audio.ndim == 1 and len(audio) > 2400 and np.abs(audio).max() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_response_format_decodes(http, fmt):
    r = http.post("/v1/audio/speech", json={"model": "tts-1", "input": SHORT, "voice": "alice", "response_format": fmt})
    assert r.status_code == 200, r.text
    if fmt == "pcm":
        assert r.headers["content-type"] == "audio/pcm" and len(r.content) % 2 == 0
        assert len(np.frombuffer(r.content, "<i2")) > 2400
    else:
        audio, rate = sf.read(io.BytesIO(r.content), dtype="int16")
        assert rate == 24000 and len(audio) > 2400
        assert sf.info(io.BytesIO(r.content)).format == {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}[fmt]


def test_default_format_is_mp3_like_openai(http):
    r = http.post("/v1/audio/speech", json={"model": "tts-1", "input": SHORT, "voice": "alice"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert sf.info(io.BytesIO(r.content)).format == "MP3"


def test_speed_and_instructions(oai):
    normal = oai.audio.speech.create(model="m", voice="alice", input=SHORT, response_format="pcm").content
    fast = oai.audio.speech.create(model="m", voice="alice", input=SHORT, response_format="pcm", speed=1.5).content
    assert 0 < len(fast) < len(normal)
    instructed = oai.audio.speech.create(model="m", voice="alice", input=SHORT, response_format="wav",
                                         instructions="Speak slowly and happily.").content
    assert sf.read(io.BytesIO(instructed))[1] == 24000


def test_streaming_starts_before_the_clip_is_done(oai):
    t0 = time.perf_counter()
    arrivals, data = [], bytearray()
    with oai.audio.speech.with_streaming_response.create(model="m", voice="alice", input=LONG, response_format="pcm",
                                                         stream_format="audio") as response:
        assert response.headers["content-type"] == "audio/pcm"
        for part in response.iter_bytes():
            arrivals.append(time.perf_counter() - t0)
            data += part
    done = time.perf_counter() - t0
    assert len(arrivals) > 2
    assert arrivals[0] < 0.6 * done, f"first bytes at {arrivals[0]:.2f} s of {done:.2f} s"
    assert len(data) % 2 == 0 and len(data) // 2 > 24000


@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_streamed_files_decode(http, fmt):
    body = {"model": "m", "input": SHORT, "voice": "alice", "response_format": fmt, "stream_format": "audio"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and "chunked" in r.headers.get("transfer-encoding", "")
        data = r.read()
    if fmt == "pcm":
        assert len(data) // 2 > 2400
    else:
        audio, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 24000 and len(audio) > 2400


def test_sse_events(http):
    body = {"model": "m", "input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "sse"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) % 2 == 0 and len(pcm) // 2 > 2400


def test_client_disconnect_cancels_the_request(engine, http):
    before = engine.stats()
    metrics_before = http.get("/metrics").text
    body = {"model": "m", "input": LONG * 3, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        next(r.iter_bytes())
    deadline = time.monotonic() + 30
    while engine.stats()["running"] or engine.stats()["waiting"]:
        assert time.monotonic() < deadline, "the request kept running after the client left"
        time.sleep(0.05)
    assert engine.stats()["completed"] == before["completed"]  # cancelled, not finished
    name, labels = "cosyvoice_speech_failures_total", 'reason="client_disconnected"'
    deadline = time.monotonic() + 10
    while _metric(http.get("/metrics").text, name, labels) <= _metric(metrics_before, name, labels):
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---- errors ------------------------------------------------------------------------------------------------------
ERRORS = [
    ({"model": "m", "voice": "alice"}, "input", "'input' is empty"),
    ({"model": "m", "input": "   ", "voice": "alice"}, "input", "'input' is empty"),
    ({"model": "m", "input": "x" * 4097, "voice": "alice"}, "input", "maximum is 4096"),
    ({"model": "m", "input": SHORT}, "voice", "'voice' is required"),
    ({"model": "m", "input": SHORT, "voice": "nobody"}, "voice", "Unknown voice 'nobody'; available voices: alice"),
    ({"model": "m", "input": SHORT, "voice": "alice", "response_format": "aac"}, "response_format",
     "supported: wav, pcm, flac, mp3, opus"),
    ({"model": "m", "input": SHORT, "voice": "alice", "response_format": "mp3", "stream_format": "audio"},
     "response_format", "cannot be streamed"),
    ({"model": "m", "input": SHORT, "voice": "alice", "stream_format": "websocket"}, "stream_format",
     "supported: audio, sse"),
    ({"model": "m", "input": SHORT, "voice": "alice", "speed": 0.1}, "speed", "from 0.25 to 4.0, got 0.1"),
    ({"model": "m", "input": SHORT, "voice": "alice", "speed": 4.5}, "speed", "from 0.25 to 4.0"),
    ({"model": "m", "input": SHORT, "voice": "alice", "speed": "fast"}, "speed", "from 0.25 to 4.0"),
    ({"model": "m", "input": SHORT, "voice": "alice", "speed": 1.5, "response_format": "pcm", "stream_format": "sse"},
     "speed", "omit stream_format"),
    ({"model": 3, "input": SHORT, "voice": "alice"}, "model", "'model' must be a string"),
    ({"model": "m", "input": SHORT, "voice": "alice", "instructions": ["x"]}, "instructions", "must be a string"),
]


def _assert_error(r: httpx.Response, status: int, param: str | None, text: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and text in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


@pytest.mark.parametrize(("body", "param", "text"), ERRORS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(ERRORS)])
def test_speech_errors(http, body, param, text):
    _assert_error(http.post("/v1/audio/speech", json=body), 400, param, text)


def test_body_must_be_a_json_object(http):
    _assert_error(http.post("/v1/audio/speech", content=b"not json"), 400, None, "must be JSON")
    _assert_error(http.post("/v1/audio/speech", json=["x"]), 400, None, "must be a JSON object")


def test_engine_input_error_is_400(http):
    """The engine's own limits (here its narrower speed range) come back as 400 with the engine's message."""
    r = http.post("/v1/audio/speech", json={"model": "m", "input": SHORT, "voice": "alice", "speed": 3.5})
    assert r.status_code == 400 and "speed" in r.json()["error"]["message"]


def test_engine_errors_are_500_without_internals(engine, http, monkeypatch):
    def closed(request):
        raise CosyVoiceError("the engine is closed")

    monkeypatch.setattr(engine, "synthesize", closed)
    error = _assert_error(http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"}), 500, None,
                          "the engine is closed")
    assert error["code"] == "engine_error"

    def crash(request):
        raise RuntimeError("boom in /secret/path/model.py")

    monkeypatch.setattr(engine, "synthesize", crash)
    r = http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"})
    _assert_error(r, 500, None, "Internal server error")
    assert "/secret" not in r.text and "Traceback" not in r.text


def test_openai_client_sees_errors(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.audio.speech.create(model="m", voice="nobody", input=SHORT)
    assert info.value.status_code == 400 and "available voices: alice" in info.value.message


# ---- API key -----------------------------------------------------------------------------------------------------
ENDPOINTS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/voices"), ("POST", "/v1/voices"),
             ("DELETE", "/v1/voices/alice"), ("POST", "/v1/audio/speech")]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic dGVzdA==", f"Token {KEY}"])
def test_api_key_is_enforced(engine, base, method, path, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.request(method, base + path, headers=headers, json={"input": SHORT, "voice": "alice"})
    error = _assert_error(r, 401, None, "API key")
    assert error["code"] == "invalid_api_key"
    assert "alice" in engine.list_voices()


def test_openai_client_with_a_wrong_key(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model="m", voice="alice", input=SHORT)


def test_without_a_key_everything_is_open(open_base):
    assert httpx.get(f"{open_base}/health").status_code == 200
    r = httpx.post(f"{open_base}/v1/audio/speech", json={"input": SHORT, "voice": "alice", "response_format": "pcm"},
                   headers={"Authorization": "Bearer anything"}, timeout=300)
    assert r.status_code == 200 and len(r.content) > 4800


# ---- voices ------------------------------------------------------------------------------------------------------
def _names(http) -> list[str]:
    r = http.get("/v1/voices")
    assert r.status_code == 200 and r.json()["object"] == "list"
    return [v["name"] for v in r.json()["data"]]


def test_voices_round_trip(http):
    assert "bob 2" not in _names(http)
    files = {"file": ("bob.wav", _speech_wav(seed=1), "audio/wav")}
    r = http.post("/v1/voices", data={"name": "bob 2", "prompt_text": "I am bob."}, files=files)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "bob 2" and r.json()["prompt_text"] == "I am bob."
    assert "bob 2" in _names(http)
    speech = http.post("/v1/audio/speech", json={"input": SHORT, "voice": "bob 2", "response_format": "wav"})
    assert speech.status_code == 200 and sf.read(io.BytesIO(speech.content))[1] == 24000
    r = http.delete("/v1/voices/bob 2")
    assert r.status_code == 200 and r.json() == {"object": "voice.deleted", "id": "bob 2", "name": "bob 2",
                                                 "deleted": True}
    assert "bob 2" not in _names(http)
    _assert_error(http.delete("/v1/voices/bob 2"), 404, "name", "No saved voice 'bob 2'; saved voices: alice")


def test_voice_without_transcript_is_usable(http):
    r = http.post("/v1/voices", data={"name": "carol"}, files={"file": ("c.wav", _speech_wav(seed=2), "audio/wav")})
    assert r.status_code == 201, r.text
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "carol"}).status_code == 200
    assert http.delete("/v1/voices/carol").status_code == 200


VOICE_ERRORS = [
    ({"name": "dave"}, None, "file", "'file' is required"),
    ({"prompt_text": "x"}, b"wav", "name", "'name' is required"),
    ({"name": "../etc"}, b"wav", None, "Invalid voice name"),
    ({"name": "dave"}, b"this is not audio", None, "could not be decoded"),
]


@pytest.mark.parametrize(("data", "audio", "param", "text"), VOICE_ERRORS)
def test_voice_upload_errors(http, data, audio, param, text):
    files = {"file": ("x.wav", _speech_wav() if audio == b"wav" else audio, "audio/wav")} if audio else {"x": ("", b"")}
    _assert_error(http.post("/v1/voices", data=data, files=files), 400, param, text)
    assert "dave" not in _names(http)


def test_voice_upload_must_be_multipart(http):
    _assert_error(http.post("/v1/voices", json={"name": "x"}), 400, None, "multipart/form-data")


# ---- status ------------------------------------------------------------------------------------------------------
def test_health(http):
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["is_random"] is True and health["model"] == "random tiny"
    assert health["precision"] == "fp32" and health["device"] == "cpu" and health["sample_rate"] == 24000
    assert {"running", "waiting", "batch_size"} <= set(health["stats"])


def test_metrics_move_after_a_request(http):
    before = http.get("/metrics")
    assert before.headers["content-type"].startswith("text/plain; version=0.0.4")
    ok = 'endpoint="/v1/audio/speech",status="200"'
    bad = 'endpoint="/v1/audio/speech",status="400"'
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"}).status_code == 200
    assert http.post("/v1/audio/speech", json={"input": "", "voice": "alice"}).status_code == 400
    after = http.get("/metrics").text
    assert _metric(after, "cosyvoice_api_requests_total", ok) == _metric(before.text, "cosyvoice_api_requests_total",
                                                                          ok) + 1
    assert _metric(after, "cosyvoice_api_requests_total", bad) == _metric(before.text, "cosyvoice_api_requests_total",
                                                                           bad) + 1
    for name in ("cosyvoice_speech_first_chunk_seconds_count", "cosyvoice_speech_total_seconds_count",
                 "cosyvoice_speech_audio_seconds_total"):
        assert _metric(after, name) > _metric(before.text, name)
    assert _metric(after, "cosyvoice_speech_failures_total", 'reason="rejected"') > \
        _metric(before.text, "cosyvoice_speech_failures_total", 'reason="rejected"')
    for name in ("cosyvoice_engine_running", "cosyvoice_engine_batch_size", "cosyvoice_engine_completed_total",
                 "cosyvoice_engine_max_batch_size", "cosyvoice_engine_flow_pages", "cosyvoice_engine_flow_pages_used",
                 "cosyvoice_engine_flow_prefix_hits_total", "cosyvoice_engine_flow_graph_captures_total"):
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", after, re.MULTILINE), name
    assert 0 <= _metric(after, "cosyvoice_engine_flow_pages_used") <= _metric(after, "cosyvoice_engine_flow_pages")


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4', "x_sum 3.65",
                            "x_count 4"]


# ---- mode choice and the Gradio server -----------------------------------------------------------------------------
class _FakeVoices:
    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def load(self, name: str):
        return SimpleNamespace(meta={"prompt_text": self.texts[name]})


@pytest.mark.parametrize(("voice", "instructions", "mode"), [
    ("spk", "", Mode.SFT), ("clone", "", Mode.ZERO_SHOT), ("untranscribed", "", Mode.CROSS_LINGUAL),
    ("clone", "whisper", Mode.INSTRUCT2), ("spk", "whisper", Mode.INSTRUCT2)])
def test_mode_follows_the_voice(voice, instructions, mode):
    fake = SimpleNamespace(info={"speakers": ["spk"]}, list_voices=lambda: ["clone", "untranscribed"],
                           voices=_FakeVoices({"clone": "hi", "untranscribed": ""}))
    body = {"input": SHORT, "voice": voice, "instructions": instructions, "response_format": "pcm"}
    request, fmt, stream_format = OpenAIApi(fake, None)._synthesis_request(body)
    assert (request.mode, request.voice, request.instruct_text, fmt, stream_format) == \
        (mode, voice, instructions, "pcm", None)


def test_shares_the_gradio_server(engine):
    """The wiring app.py uses: the API on Gradio's own app (UI login and API key are independent)."""
    gr = pytest.importorskip("gradio")
    with gr.Blocks() as demo:
        gr.Markdown("ui")
    app, url, _ = demo.queue().launch(server_name="127.0.0.1", server_port=free_port(), auth=("user", "pass"),
                                      prevent_thread_lock=True, quiet=True)
    try:
        mount_api(app, engine, KEY)
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(url + "health", headers=headers).json()["status"] == "ok"
        assert httpx.get(url + "health").status_code == 401
        assert "<html" in httpx.get(url).text.lower()
        body = {"input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
        with httpx.stream("POST", url + "v1/audio/speech", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200 and len(r.read()) > 4800
    finally:
        demo.close()


# ---- hardening -----------------------------------------------------------------------------------------------------
HARDENING = [  # body fields over {"input": SHORT, "voice": "alice"}, param, words of the message
    ({"input": "😀🎉🚀"}, None, "nothing to speak"),
    ({"input": "\x00\x01\x1b"}, None, "text is empty"),
    ({"input": "x" * 20000}, "input", "maximum is 4096"),
    ({"speed": 0}, "speed", "got 0"),
    ({"speed": -1}, "speed", "got -1"),
    ({"speed": 1e9}, "speed", "got 1000000000.0"),
    ({"speed": float("nan")}, "speed", "got nan"),
    ({"speed": float("inf")}, "speed", "got inf"),
    ({"seed": -1}, "seed", "'seed' must be an integer from 0 to 4294967295, got -1"),
    ({"seed": 2**70}, "seed", "got 1180591620717411303424"),
    ({"seed": "abc"}, "seed", "got abc"),
    ({"seed": True}, "seed", "must be an integer"),
    ({"voice": "../x"}, "voice", "Unknown voice '../x'"),
    ({"voice": "a\x00b"}, "voice", "Unknown voice"),
]


@pytest.mark.parametrize(("fields", "param", "text"), HARDENING, ids=[str(f)[:30] for f, _, _ in HARDENING])
def test_bad_speech_fields_are_quick_400s(http, fields, param, text):
    t0 = time.perf_counter()
    body = json.dumps({"input": SHORT, "voice": "alice", **fields})  # NaN and Infinity as Python writes them
    r = http.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
    elapsed = time.perf_counter() - t0
    _assert_error(r, 400, param, text)
    assert elapsed < 1.0, f"rejected after {elapsed:.3f} s"
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice", "response_format": "pcm"}).content


def test_seed_is_passed_to_the_engine(http):
    def pcm(seed):
        body = {"input": SHORT, "voice": "alice", "response_format": "pcm", "seed": seed}
        return http.post("/v1/audio/speech", json=body).content

    assert pcm(7) == pcm(7) and pcm(7) != pcm(8)


def test_oversized_bodies_are_413(http):
    big = {"input": SHORT, "voice": "alice", "pad": "x" * (2 << 20)}
    _assert_error(http.post("/v1/audio/speech", json=big), 413, None, "larger than 1 MiB")

    def chunked():  # no Content-Length: the cap applies while reading
        yield json.dumps(big).encode()

    _assert_error(http.post("/v1/audio/speech", content=chunked()), 413, None, "larger than 1 MiB")
    files = {"file": ("big.wav", b"RIFF" + bytes(21 << 20), "audio/wav")}
    _assert_error(http.post("/v1/voices", data={"name": "big"}, files=files), 413, None, "larger than 20 MiB")
    assert "big" not in _names(http)


BAD_PROMPTS = [
    (b"", "empty (0 bytes)"),
    (b"not audio at all" * 10, "could not be decoded"),
    (_speech_wav()[:30], "could not be decoded"),
    (_speech_wav(0.2), "0.2 s long"),
    (_speech_wav(60.0), "60.0 s long"),
]


@pytest.mark.parametrize(("audio", "text"), BAD_PROMPTS, ids=["empty", "not-audio", "truncated", "0.2s", "60s"])
def test_bad_prompt_uploads_are_quick_400s(http, audio, text):
    t0 = time.perf_counter()
    r = http.post("/v1/voices", data={"name": "dave"}, files={"file": ("x.wav", audio, "audio/wav")})
    elapsed = time.perf_counter() - t0
    _assert_error(r, 400, None, text)
    assert elapsed < 1.0 and "dave" not in _names(http)


EVIL_NAMES = ["../x", "..", "a/b", "/etc/passwd", "x" * 300, "a\x00b", "..\\x", ".hidden", "C:\\x"]


@pytest.mark.parametrize("name", EVIL_NAMES, ids=range(len(EVIL_NAMES)))
def test_voice_names_cannot_leave_the_voices_folder(engine, http, name):
    folder = engine.voices.folder
    outside = folder.parent / "x.json"
    outside.write_text("{}")
    before = sorted(p.name for p in folder.parent.rglob("*"))
    files = {"file": ("x.wav", _speech_wav(), "audio/wav")}
    r = http.post("/v1/voices", data={"name": name}, files=files)
    assert r.status_code == 400 and "Invalid voice name" in r.json()["error"]["message"]
    r = http.delete("/v1/voices/" + urllib.parse.quote(name, safe=""))
    assert r.status_code in (400, 404)
    r = http.post("/v1/audio/speech", json={"input": SHORT, "voice": name})
    assert r.status_code == 400
    assert sorted(p.name for p in folder.parent.rglob("*")) == before and outside.read_text() == "{}"


def test_internal_errors_while_streaming_hide_paths(engine, http, monkeypatch):
    def crash(request):
        raise RuntimeError("boom in /secret/path/model.py")

    monkeypatch.setattr(engine, "stream", crash)
    body = {"input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
    r = http.post("/v1/audio/speech", json=body)
    _assert_error(r, 500, None, "Internal server error")
    assert "/secret" not in r.text

    def crash_later(request):
        yield SimpleNamespace(pcm=np.zeros(480, np.int16), is_last=False, duration=0.02, tokens=1)
        raise RuntimeError("boom in /secret/path/flow.py")

    monkeypatch.setattr(engine, "stream", crash_later)
    with http.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "Internal server error" in events[-1]["error"]["message"]
    assert "/secret" not in json.dumps(events)
