"""The OpenAI-compatible HTTP API against a real server (uvicorn in a thread) and the tiny random engine, through
the `openai` client and plain httpx."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import urllib.parse
from types import SimpleNamespace

import gradio as gr
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from cosyvoice_opt import limits
from cosyvoice_opt.audio_formats import FORMATS
from cosyvoice_opt.bench.loopback import free_port, serve_in_process
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, InputError
from cosyvoice_opt.frontend.audio import decode_audio
from cosyvoice_opt.frontend.voices import OPENAI_VOICES
from cosyvoice_opt.server import mount_api
from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.metrics import Histogram, engine_readings
from cosyvoice_opt.server.parsing import synthesis_request
from cosyvoice_opt.server.stream_encoding import STREAM_FORMATS
from cosyvoice_opt.types import Mode, SynthesisRequest
from cosyvoice_opt.webui.handlers import Generation
from tests.conftest import REPO_ROOT, wait_until

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
    normal = oai.audio.speech.create(model="cosyvoice2", voice="alice", input=SHORT, response_format="pcm").content
    fast = oai.audio.speech.create(model="tts-1", voice="alice", input=SHORT, response_format="pcm", speed=1.5).content
    assert 0 < len(fast) < len(normal)
    instructed = oai.audio.speech.create(model="cosyvoice2", voice="alice", input=SHORT, response_format="wav",
                                         instructions="Speak slowly and happily.").content
    assert sf.read(io.BytesIO(instructed))[1] == 24000


def test_streaming_starts_before_the_clip_is_done(engine, oai, monkeypatch):
    """The client holds the first chunk's bytes while the engine has not made the second one yet: the engine's
    iterator is held until the client says it has read them (a buffering server would never let it finish)."""
    real_stream = engine.stream
    client_has_first = threading.Event()
    log = []

    def held_stream(request):
        chunks = real_stream(request)
        yield next(chunks)
        log.append("engine: waiting for the client" if client_has_first.wait(60) else "engine: gave up waiting")
        yield from chunks

    monkeypatch.setattr(engine, "stream", held_stream)
    data = bytearray()
    with oai.audio.speech.with_streaming_response.create(model="tts-1", voice="alice", input=LONG,
                                                         response_format="pcm", stream_format="audio") as response:
        assert response.headers["content-type"] == "audio/pcm"
        for part in response.iter_bytes():
            if not data:
                log.append("client: first bytes")
                client_has_first.set()
            data += part
    assert log == ["client: first bytes", "engine: waiting for the client"]
    assert len(data) % 2 == 0 and len(data) // 2 > 24000


def test_a_real_stream_arrives_in_several_chunks(engine, http):
    """Streamed pcm is the engine's chunks as they come: as many audio bytes as the engine made, over more than one
    chunk (the flow makes audio in pieces of a few hundred ms)."""
    chunks = [c for c in engine.stream(SynthesisRequest(text=LONG, voice="alice", mode=Mode.ZERO_SHOT))]
    body = {"model": "cosyvoice2", "input": LONG, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        data = r.read()
    assert len(chunks) > 2
    assert len(data) == 2 * sum(len(c.pcm) for c in chunks)  # same seed, same request: the same audio


@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_streamed_files_decode(http, fmt):
    body = {"model": "cosyvoice2", "input": SHORT, "voice": "alice", "response_format": fmt, "stream_format": "audio"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and "chunked" in r.headers.get("transfer-encoding", "")
        data = r.read()
    if fmt == "pcm":
        assert len(data) // 2 > 2400
    else:
        audio, rate = sf.read(io.BytesIO(data), dtype="int16")
        assert rate == 24000 and len(audio) > 2400


def test_sse_events(http):
    body = {"model": "cosyvoice2", "input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "sse"}
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
    body = {"model": "tts-1", "input": LONG * 3, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        next(r.iter_bytes())
    assert wait_until(lambda: not engine.stats()["running"] and not engine.stats()["waiting"]), \
        "the request kept running after the client left"
    assert engine.stats()["completed"] == before["completed"]  # cancelled, not finished
    name = "cosyvoice_speech_disconnects_total"  # a cancel, not a failure
    assert wait_until(lambda: _metric(http.get("/metrics").text, name) > _metric(metrics_before, name))
    assert _metric(http.get("/metrics").text, "cosyvoice_speech_failures_total", 'reason="engine_error"') == \
        _metric(metrics_before, "cosyvoice_speech_failures_total", 'reason="engine_error"')


def test_a_random_weight_server_takes_the_benchmarks_forced_length(http):
    """`force_tokens` (an extension) makes the speech exactly that many tokens, as the in-process benchmark does."""
    def speech(n: int, **extra) -> httpx.Response:
        body = {"model": "cosyvoice2", "input": SHORT, "voice": "alice", "response_format": "pcm", **extra}
        return http.post("/v1/audio/speech", json={**body, "force_tokens": n})

    samples = {n: len(speech(n).content) // 2 for n in (30, 60)}
    assert samples[30] > 0 and samples[60] == 2 * samples[30]
    for n in (30, 45):
        events = [json.loads(line[len("data: "):]) for line in speech(n, stream_format="sse").text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == {"type": "speech.audio.done", "usage": {"output_tokens": n}}
    for bad in (0, -1, 1.5, True, "10"):
        _assert_error(speech(bad), 400, "force_tokens", "'force_tokens' must be a positive integer")


def test_a_real_model_refuses_the_forced_length():
    real = SimpleNamespace(info={"speakers": [], "model": "/models/CosyVoice2-0.5B", "is_random": False},
                           list_voices=lambda: ["clone"], voices=_FakeVoices({"clone": "hi"}))
    body = {"model": "CosyVoice2-0.5B", "input": SHORT, "voice": "clone"}
    assert synthesis_request(real, body)[0].force_tokens is None
    with pytest.raises(ApiError) as refused:
        synthesis_request(real, {**body, "force_tokens": 100})
    assert (refused.value.status, refused.value.param) == (400, "force_tokens")
    assert "benchmark extension for servers on random weights" in str(refused.value)


# ---- errors ------------------------------------------------------------------------------------------------------
ERRORS = [
    ({"model": "cosyvoice2", "voice": "alice"}, "input", "'input' is required"),
    ({"model": "cosyvoice2", "input": "   ", "voice": "alice"}, "input", "'input' is empty"),
    ({"model": "cosyvoice2", "input": "x" * 4097, "voice": "alice"}, "input", "maximum is 4096"),
    ({"model": "cosyvoice2", "input": SHORT}, "voice", "'voice' is required"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "nobody"}, "voice",
     "Unknown voice 'nobody'; available voices: alice, en_female, en_male, zh_male; OpenAI's voice names also work: "
     "alloy, ash"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "response_format": "aac"}, "response_format",
     "supported: wav, pcm, flac, mp3, opus"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "response_format": "mp3", "stream_format": "audio"},
     "response_format", "cannot be streamed"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "stream_format": "websocket"}, "stream_format",
     "supported: audio, sse"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "speed": 0.1}, "speed", "from 0.5 to 2.0, got 0.1"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "speed": 4.0}, "speed", "from 0.5 to 2.0, got 4.0"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "speed": "fast"}, "speed",
     "from 0.5 to 2.0; got a string"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "speed": 1.5, "response_format": "pcm",
      "stream_format": "sse"}, "speed", "omit stream_format"),
    ({"model": 3, "input": SHORT, "voice": "alice"}, "model", "'model' must be a string"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "instructions": ["x"]}, "instructions",
     "must be a string"),
    ({"model": "cosyvoice2", "input": SHORT, "voice": "alice", "instructions": "x" * 4097}, "instructions",
     "'instructions' is 4097 characters; the maximum is 4096"),
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
    """What only the engine can judge (here: the normalised text has nothing to speak) comes back as 400 with the
    engine's message."""
    r = http.post("/v1/audio/speech", json={"model": "cosyvoice2", "input": "?!... ,,, ---", "voice": "alice"})
    _assert_error(r, 400, None, "nothing to speak")


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
        oai.audio.speech.create(model="cosyvoice2", voice="nobody", input=SHORT)
    assert info.value.status_code == 400 and "available voices: alice" in info.value.message


# ---- API key -----------------------------------------------------------------------------------------------------
ENDPOINTS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/voices"), ("POST", "/v1/voices"),
             ("DELETE", "/v1/voices/alice"), ("POST", "/v1/audio/speech"), ("GET", "/v1/models"),
             ("GET", "/v1/models/tts-1")]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic dGVzdA==", f"Token {KEY}"])
def test_api_key_is_enforced(engine, base, method, path, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.request(method, base + path, headers=headers, json={"input": SHORT, "voice": "alice"})
    error = _assert_error(r, 401, None, "API key")
    assert error["code"] == "invalid_api_key"
    assert "alice" in engine.list_voices()


@pytest.mark.parametrize(("header", "words"), [
    (None, "Missing API key"), ("", "Missing API key"), ("Basic dGVzdA==", "uses the 'Basic' scheme"),
    (f"Token {KEY}", "uses the 'Token' scheme"), ("Bearer", "no API key after 'Bearer'"),
    ("Bearer wrong", "Incorrect API key")])
def test_a_refused_key_says_what_is_wrong(base, header, words):
    r = httpx.get(base + "/v1/models", headers={} if header is None else {"Authorization": header})
    message = _assert_error(r, 401, None, words)["message"]
    assert ("Bearer" in message) == (words != "Incorrect API key"), message


def test_openai_client_with_a_wrong_key(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model="cosyvoice2", voice="alice", input=SHORT)


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


@pytest.mark.parametrize("prompt_text", [None, "", "   \n\t"])
def test_voice_without_transcript_is_refused(http, prompt_text):
    data = {"name": "carol"} if prompt_text is None else {"name": "carol", "prompt_text": prompt_text}
    r = http.post("/v1/voices", data=data, files={"file": ("c.wav", _speech_wav(seed=2), "audio/wav")})
    error = _assert_error(r, 400, "prompt_text", "'prompt_text' is empty")
    assert "zero-shot cloning needs the transcript" in error["message"]
    assert "carol" not in _names(http)


def test_saving_over_a_voice_needs_overwrite(engine, http):
    files = {"file": ("e.wav", _speech_wav(seed=3), "audio/wav")}
    assert http.post("/v1/voices", data={"name": "erin", "prompt_text": "First words."}, files=files).status_code == 201
    try:
        for extra in ({}, {"overwrite": "false"}):
            r = http.post("/v1/voices", data={"name": "erin", "prompt_text": "Second words.", **extra}, files=files)
            error = _assert_error(r, 409, "name", "A voice named 'erin' already exists; send overwrite=true")
            assert error["code"] == "voice_exists"
        assert engine.voices.prompt_text("erin") == "First words."
        r = http.post("/v1/voices", data={"name": "erin", "prompt_text": "Second words.", "overwrite": "true"},
                      files=files)
        assert r.status_code == 200 and r.json()["prompt_text"] == "Second words."
        assert engine.voices.prompt_text("erin") == "Second words."
        r = http.post("/v1/voices", data={"name": "erin", "prompt_text": "x", "overwrite": "perhaps"}, files=files)
        _assert_error(r, 400, "overwrite", "'overwrite' must be true or false")
    finally:
        http.delete("/v1/voices/erin")


VOICE_ERRORS = [
    ({"name": "dave"}, None, "file", "'file' is required"),
    ({"prompt_text": "x"}, b"wav", "name", "'name' is required"),
    ({"name": "../etc", "prompt_text": "x"}, b"wav", "name", "Invalid voice name"),
    ({"name": "dave", "prompt_text": "x"}, b"this is not audio", "file", "could not be decoded"),
    ({"name": "dave", "prompt_text": "word " * 200_000}, b"wav", "prompt_text",
     "'prompt_text' is too long: 1000000 characters, the limit is 4096"),
    ({"name": "dave", "prompt_text": "a " * 2000}, b"wav", "prompt_text", "leaving no room for text"),
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
    ok = 'client="api",endpoint="/v1/audio/speech",status="200"'
    bad = 'client="api",endpoint="/v1/audio/speech",status="400"'
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"}).status_code == 200
    assert http.post("/v1/audio/speech", json={"input": "", "voice": "alice"}).status_code == 400
    after = http.get("/metrics").text
    assert _metric(after, "cosyvoice_requests_total", ok) == _metric(before.text, "cosyvoice_requests_total", ok) + 1
    assert _metric(after, "cosyvoice_requests_total", bad) == _metric(before.text, "cosyvoice_requests_total", bad) + 1
    for name in ("cosyvoice_speech_first_chunk_seconds_count", "cosyvoice_speech_duration_seconds_count",
                 "cosyvoice_speech_audio_seconds_total"):
        assert _metric(after, name) > _metric(before.text, name)
    for reason, more in (("invalid", 1), ("busy", 0)):  # a refused input is not a busy refusal
        assert _metric(after, "cosyvoice_speech_failures_total", f'reason="{reason}"') == \
            _metric(before.text, "cosyvoice_speech_failures_total", f'reason="{reason}"') + more, reason
    completed = 'outcome="completed"'
    assert _metric(after, "cosyvoice_engine_requests_total", completed) == \
        _metric(before.text, "cosyvoice_engine_requests_total", completed) + 1
    for name in ("cosyvoice_engine_running", "cosyvoice_engine_batch_size", "cosyvoice_engine_requests_total",
                 "cosyvoice_engine_max_batch_size", "cosyvoice_engine_flow_pages", "cosyvoice_engine_flow_pages_used",
                 "cosyvoice_engine_flow_prefix_hits_total", "cosyvoice_engine_flow_graph_captures_total"):
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", after, re.MULTILINE), name
    assert 0 <= _metric(after, "cosyvoice_engine_flow_pages_used") <= _metric(after, "cosyvoice_engine_flow_pages")
    for name in ("llm_steps", "llm_busy_seconds", "vocoder_rounds", "vocoder_busy_seconds", "flow_calls"):
        name = f"cosyvoice_engine_{name}_total"  # where each thread's time goes
        assert re.search(rf"^# TYPE {name} counter$", after, re.MULTILINE), name
    for name in ("llm_steps", "vocoder_rounds"):  # counted before the audio they made went out
        name = f"cosyvoice_engine_{name}_total"
        assert _metric(after, name) > _metric(before.text, name), name


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4', "x_sum 3.65",
                            "x_count 4"]


# ---- mode choice and the Gradio server -----------------------------------------------------------------------------
class _FakeVoices:
    aliases = {"alloy": "builtin"}

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def prompt_text(self, name: str) -> str:
        return self.texts[self.aliases.get(name, name)]


@pytest.mark.parametrize(("voice", "instructions", "mode"), [
    ("spk", "", Mode.SFT), ("clone", "", Mode.ZERO_SHOT), ("untranscribed", "", Mode.CROSS_LINGUAL),
    ("clone", "whisper", Mode.INSTRUCT2), ("spk", "whisper", Mode.INSTRUCT2), ("builtin", "", Mode.ZERO_SHOT),
    ("alloy", "", Mode.ZERO_SHOT)])
def test_mode_follows_the_voice(voice, instructions, mode):
    fake = SimpleNamespace(info={"speakers": ["spk"], "model": "random tiny", "is_random": True},
                           list_voices=lambda: ["builtin", "clone", "untranscribed"],
                           voices=_FakeVoices({"clone": "hi", "untranscribed": "", "builtin": "a transcript"}))
    body = {"input": SHORT, "voice": voice, "instructions": instructions, "response_format": "pcm"}
    request, fmt, stream_format = synthesis_request(fake, body)
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
        assert httpx.get(url + "health/live").json() == {"status": "ok"}  # key-free probes
        assert httpx.get(url + "health/ready").json() == {"status": "ok"}
        _assert_error(httpx.get(url + "v1/nothing/here", headers=headers), 404, None, "Unknown URL")
        assert "<html" in httpx.get(url).text.lower()
        assert "error" not in httpx.get(url + "not-an-api-route").text  # Gradio's own 404, not the API's shape
        body = {"input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
        with httpx.stream("POST", url + "v1/audio/speech", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200 and len(r.read()) > 4800
    finally:
        demo.close()


# ---- overload and engine health ----------------------------------------------------------------------------------
def _busy(retry_after: float) -> EngineBusy:
    return EngineBusy("the server is busy (64 streams admitted, 12 waiting); try again in 3 s", retry_after)


@pytest.mark.parametrize(("retry_after", "header"), [(2.2, "3"), (0.0, "1"), (float("nan"), "1")])
def test_busy_engine_is_503_with_retry_after(engine, oai, http, monkeypatch, retry_after, header):
    def refuse(request):
        raise _busy(retry_after)

    def refuse_on_first_chunk(request):
        raise _busy(retry_after)
        yield  # a generator: refused at its first next(), as a request that timed out in the queue

    body = {"input": SHORT, "voice": "alice", "response_format": "pcm"}
    for attribute, fake, extra in [("stream", refuse, {"stream_format": "audio"}),
                                   ("stream", refuse_on_first_chunk, {"stream_format": "sse"}),
                                   ("synthesize", refuse, {})]:
        with monkeypatch.context() as m:
            m.setattr(engine, attribute, fake)
            r = http.post("/v1/audio/speech", json={**body, **extra})
        error = _assert_error(r, 503, None, "the server is busy")
        assert error["code"] == "server_busy" and r.headers["retry-after"] == header
    # the OpenAI client sees a server error it can retry, with the hint
    with monkeypatch.context() as m:
        m.setattr(engine, "synthesize", refuse)
        with pytest.raises(openai.InternalServerError) as info:
            oai.audio.speech.create(model="tts-1", voice="alice", input=SHORT)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == header
    assert info.value.code == "server_busy"
    assert oai.audio.speech.create(model="tts-1", voice="alice", input=SHORT, response_format="pcm").content


def test_busy_requests_are_counted(engine, http, monkeypatch):
    before = http.get("/metrics").text
    monkeypatch.setattr(engine, "synthesize", lambda request: (_ for _ in ()).throw(_busy(1.0)))
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"}).status_code == 503
    after = http.get("/metrics").text
    for name, labels in [("cosyvoice_speech_failures_total", 'reason="busy"'),
                         ("cosyvoice_requests_total", 'client="api",endpoint="/v1/audio/speech",status="503"')]:
        assert _metric(after, name, labels) == _metric(before, name, labels) + 1


def test_probes_need_no_key_and_tell_no_secrets(base):
    for path in ("/health/live", "/health/ready"):
        r = httpx.get(base + path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(base + "/health").status_code == 401  # the detailed view keeps its key


def test_a_dead_engine_is_unready_and_unhealthy(engine, base, http, monkeypatch):
    monkeypatch.setattr(engine, "fatal_error", "the GPU failed (AcceleratorError: an illegal memory access)",
                        raising=False)
    r = httpx.get(base + "/health/ready")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}
    assert httpx.get(base + "/health/live").status_code == 200  # the process itself still answers
    health = http.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy" and "illegal memory access" in health.json()["error"]
    error = _assert_error(http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice"}), 503, None,
                          "must be restarted")
    assert error["code"] == "engine_dead"
    assert _metric(http.get("/metrics").text, "cosyvoice_engine_up") == 0
    monkeypatch.setattr(engine, "fatal_error", None)
    assert httpx.get(base + "/health/ready").status_code == 200 and http.get("/health").status_code == 200
    assert _metric(http.get("/metrics").text, "cosyvoice_engine_up") == 1


# ---- models and unknown URLs -------------------------------------------------------------------------------------
def test_models_in_openai_shape(oai):
    models = oai.models.list().data
    ids = [m.id for m in models]
    assert ids[0] == "random-tiny" and {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)
    assert all(m.object == "model" and m.owned_by == "cosyvoice-opt" and m.created > 0 for m in models)
    assert oai.models.retrieve("tts-1").id == "tts-1"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("whisper-1")
    assert info.value.code == "model_not_found" and "models: random-tiny, cosyvoice2, tts-1" in info.value.message


@pytest.mark.parametrize("model", ["random-tiny", "cosyvoice2", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"])
def test_every_listed_model_and_the_documented_alias_speak(oai, model):
    assert model in [m.id for m in oai.models.list().data] and oai.models.retrieve(model).id == model
    assert oai.audio.speech.create(model=model, voice="alice", input=SHORT, response_format="pcm").content


@pytest.mark.parametrize("model", ["whatever", "tts-2", "COSYVOICE2", ""])
def test_speech_with_an_unknown_model_is_model_not_found(oai, model_work, model):
    with pytest.raises(openai.NotFoundError) as info:
        oai.audio.speech.create(model=model, voice="alice", input=SHORT)
    error = info.value.body
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "models: random-tiny, cosyvoice2, tts-1" in error["message"]
    assert model_work == {"features": 0, "queued": 0}


@pytest.mark.parametrize(("method", "path", "status", "text"), [
    ("GET", "/v1/nothing", 404, "Unknown URL: GET /v1/nothing"),
    ("POST", "/v1/chat/completions", 404, "Unknown URL: POST /v1/chat/completions"),
    ("GET", "/v1", 404, "Unknown URL"),
    ("GET", "/health/deep", 404, "Unknown URL"),
    ("GET", "/v1/audio/speech", 405, "allowed: POST"),
    ("PUT", "/v1/voices", 405, "allowed: GET, HEAD, POST"),
    ("POST", "/health", 405, "allowed: GET, HEAD"),
])
def test_unknown_urls_and_methods_in_openai_shape(http, method, path, status, text):
    error = _assert_error(http.request(method, path), status, None, text)
    assert error["code"] == ("not_found" if status == 404 else "method_not_allowed")


def test_openai_client_on_an_unknown_route(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.embeddings.create(model="text-embedding-3-small", input="hi")
    assert "Unknown URL: POST /v1/embeddings" in info.value.message


# ---- field types ---------------------------------------------------------------------------------------------------
TYPE_ERRORS = [  # fields over {"input": SHORT, "voice": "alice"}, param, message
    ({"input": 123}, "input", "'input' must be a string (the text to speak); got an integer."),
    ({"input": ["Hello"]}, "input", "'input' must be a string (the text to speak); got an array."),
    ({"input": None}, "input", "'input' is required"),
    ({"voice": 5}, "voice", "'voice' must be a string (a voice name) or an object with a string 'id'; got an integer"),
    ({"voice": {"id": ["alice"]}}, "voice", "got an array"),
    ({"voice": ["alice"]}, "voice", "got an array"),
    ({"model": {"id": "tts-1"}}, "model", "'model' must be a string"),
    ({"response_format": 1}, "response_format", "'response_format' must be a string, one of wav, pcm, flac, mp3, "
                                                "opus; got an integer."),
    ({"stream_format": True}, "stream_format", "'stream_format' must be a string, one of audio, sse; got a boolean."),
    ({"speed": "1.0"}, "speed", "'speed' must be a number from 0.5 to 2.0; got a string."),
    ({"speed": [1]}, "speed", "got an array"),
    ({"instructions": 0}, "instructions", "'instructions' must be a string; got an integer."),
    ({"instructions": False}, "instructions", "got a boolean"),
    ({"seed": 1.5}, "seed", "'seed' must be an integer from 0 to 4294967295; got a number."),
    ({"seed": "7"}, "seed", "got a string"),
]


@pytest.mark.parametrize(("fields", "param", "text"), TYPE_ERRORS, ids=[str(f)[:30] for f, _, _ in TYPE_ERRORS])
def test_wrong_field_types_are_named(http, fields, param, text):
    _assert_error(http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice", **fields}), 400, param, text)


def test_null_optional_fields_take_their_defaults(http):
    body = {"input": SHORT, "voice": "alice", "speed": None, "seed": None, "instructions": None, "model": None,
            "response_format": None, "stream_format": None}
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"


# ---- limits ------------------------------------------------------------------------------------------------------
def test_upload_limit_is_the_frontends(http):
    """One number: a prompt one byte over `limits.MAX_UPLOAD_BYTES` is refused by the API (413) and by the frontend
    that the engine and WebUI decode with."""
    over = b"RIFF" + bytes(limits.MAX_UPLOAD_BYTES - 3)
    files = {"file": ("big.wav", over, "audio/wav")}
    _assert_error(http.post("/v1/voices", data={"name": "big", "prompt_text": "x"}, files=files), 413, "file",
                  f"larger than {limits.MAX_UPLOAD_MIB} MiB")
    with pytest.raises(InputError, match=f"limit is {limits.MAX_UPLOAD_MIB} MiB"):
        decode_audio(over)
    with pytest.raises(InputError, match="could not be decoded"):  # at the limit: judged on its content
        decode_audio(over[:-1])


# ---- built-in voices -----------------------------------------------------------------------------------------------
def test_builtin_voices_are_listed(http):
    voices = {v["id"]: v for v in http.get("/v1/voices").json()["data"]}
    for name in ("en_female", "en_male", "zh_male"):
        assert voices[name]["type"] == "builtin"
        assert voices[name]["prompt_text"] == (REPO_ROOT / "assets" / f"{name}.txt").read_text().strip()
    for alias, target in OPENAI_VOICES.items():
        assert voices[alias] == {"object": "voice", "id": alias, "name": alias, "type": "builtin", "alias_of": target}
    assert voices["alice"] == {"object": "voice", "id": "alice", "name": "alice", "type": "saved",
                               "prompt_text": "hello there, this is alice", "families": ["cosyvoice2", "cosyvoice3"]}


def test_an_unreadable_saved_voice_is_listed_with_what_is_wrong(engine, http):
    """One broken file does not break the list: the voice is listed (so that it can be deleted) with its error."""
    folder = engine.voices.folder
    (folder / "broken.safetensors").write_bytes(b"not tensors")
    (folder / "broken.json").write_text("[1, 2]")
    try:
        voices = {v["id"]: v for v in http.get("/v1/voices").json()["data"]}
        assert voices["broken"] == {"object": "voice", "id": "broken", "name": "broken", "type": "saved",
                                    "error": "Saved voice 'broken' is unreadable; delete it and save it again."}
        assert voices["alice"]["families"] == ["cosyvoice2", "cosyvoice3"]
    finally:
        assert http.delete("/v1/voices/broken").status_code == 200


def test_openai_voice_names_speak_with_the_builtin_voices(engine, oai):
    """Every OpenAI voice works through the official client; a built-in voice's features are computed once, then come
    from the engine's prompt cache (an alias shares its target's entry)."""
    misses = engine.prompt_cache.misses
    hits = engine.prompt_cache.hits
    for voice in ("alloy", "en_female", "nova"):
        pcm = oai.audio.speech.create(model="tts-1", voice=voice, input=SHORT, response_format="pcm").content
        assert len(pcm) > 4800
    assert engine.prompt_cache.misses - misses <= 1 and engine.prompt_cache.hits - hits >= 2
    for voice in sorted(set(OPENAI_VOICES) - {"alloy", "nova"}):  # the rest: accepted by the API's checks
        request, _, _ = synthesis_request(engine, {"input": SHORT, "voice": voice})
        assert request.voice == voice and request.mode == Mode.ZERO_SHOT


@pytest.mark.parametrize("name", ["en_female", "zh_male", "alloy", "shimmer"])
def test_builtin_voices_are_read_only(engine, http, name):
    files = {"file": ("x.wav", _speech_wav(), "audio/wav")}
    for extra in ({}, {"overwrite": "true"}):
        r = http.post("/v1/voices", data={"name": name, "prompt_text": "mine now", **extra}, files=files)
        assert _assert_error(r, 409, "name", "is a built-in voice and read-only")["code"] == "voice_read_only"
    r = http.delete(f"/v1/voices/{name}")
    assert _assert_error(r, 403, "name", "is a built-in voice and read-only")["code"] == "voice_read_only"
    assert engine.voices.builtin(name) is not None and name not in engine.voices.list()


# ---- metrics -------------------------------------------------------------------------------------------------------
def test_metrics_count_requests_that_bypass_the_api(engine, http):
    """The WebUI calls the engine directly: its requests show in the engine's counters, not the API's."""
    before = http.get("/metrics").text
    engine.synthesize(SynthesisRequest(text=SHORT, voice="alice"))
    after = http.get("/metrics").text
    completed = 'outcome="completed"'
    assert _metric(after, "cosyvoice_engine_requests_total", completed) == \
        _metric(before, "cosyvoice_engine_requests_total", completed) + 1
    speech_ok = 'client="api",endpoint="/v1/audio/speech",status="200"'
    assert _metric(after, "cosyvoice_requests_total", speech_ok) == \
        _metric(before, "cosyvoice_requests_total", speech_ok)


def test_webui_requests_are_counted_beside_the_api(engine, http, monkeypatch):
    """The WebUI's events count into the same /metrics under client="webui": done, refused inputs (the page's own
    checks and the engine's) and busy refusals, each with the status the API would answer."""
    gen = Generation(engine)
    row = 'client="webui",endpoint="/sft",status="{}"'
    before = http.get("/metrics").text
    assert list(gen.sft(SHORT, "alice", False, 1.0, 0))
    for text, voice in (("", "alice"), (SHORT, "")):  # the engine refuses an empty text; the page a missing voice
        with pytest.raises(gr.Error):
            list(gen.sft(text, voice, False, 1.0, 0))
    monkeypatch.setattr(engine, "synthesize", lambda request: (_ for _ in ()).throw(_busy(1.0)))
    with pytest.raises(gr.Error):
        list(gen.sft(SHORT, "alice", False, 1.0, 0))
    after = http.get("/metrics").text
    for status, more in (("200", 1), ("400", 2), ("503", 1)):
        assert _metric(after, "cosyvoice_requests_total", row.format(status)) == \
            _metric(before, "cosyvoice_requests_total", row.format(status)) + more, status
    for reason, more in (("invalid", 2), ("busy", 1)):
        assert _metric(after, "cosyvoice_speech_failures_total", f'reason="{reason}"') == \
            _metric(before, "cosyvoice_speech_failures_total", f'reason="{reason}"') + more, reason


def test_process_and_model_metrics(http):
    text = http.get("/metrics").text
    assert _metric(text, "process_resident_memory_bytes") > 10 << 20
    assert _metric(text, "process_virtual_memory_bytes") >= _metric(text, "process_resident_memory_bytes")
    assert _metric(text, "process_cpu_seconds_total") > 0
    assert 0 < _metric(text, "process_start_time_seconds") <= time.time()
    assert 0 < _metric(text, "process_open_fds") <= _metric(text, "process_max_fds")
    assert re.search(r"^# TYPE process_cpu_seconds_total counter$", text, re.MULTILINE)
    assert _metric(text, "cosyvoice_model_info", 'model="random tiny",precision="fp32",device="cpu"') == 1


def test_metric_names_follow_prometheus_conventions(http):
    """Counters end in _total and nothing else does; the graph misses are counters."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", http.get("/metrics").text, re.MULTILINE))
    for name, kind in types.items():
        assert (kind == "counter") == name.endswith("_total"), (name, kind)
    for name in ("cosyvoice_engine_flow_graph_misses_total", "cosyvoice_engine_hift_graph_misses_total"):
        assert types.get(name) == "counter", name


def test_metric_help_texts_read_as_sentences(http):
    helps = re.findall(r"^# HELP (\S+) (.*)$", http.get("/metrics").text, re.MULTILINE)
    assert len(helps) > 20
    for name, help_text in helps:
        assert help_text[0].isupper() and help_text.endswith("."), (name, help_text)
        assert "requests or events" not in help_text and "_" not in help_text.split("(")[0], (name, help_text)


def test_warmup_is_not_a_request(tmp_path):
    """A fresh engine has warmed up (one forced request through every model) and served nobody."""
    with Engine.from_model_dir(None, EngineConfig(random_size="tiny", voices_dir=str(tmp_path))) as fresh:
        readings = {name: samples for name, _, _, samples in engine_readings(fresh)}
    outcomes = {labels["outcome"]: value for labels, value in readings["cosyvoice_engine_requests_total"]}
    assert outcomes["completed"] == 0 and outcomes["failed"] == 0


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
    ({"seed": "abc"}, "seed", "'seed' must be an integer from 0 to 4294967295; got a string"),
    ({"seed": True}, "seed", "must be an integer from 0 to 4294967295; got a boolean"),
    ({"input": ", ,"}, None, "nothing to speak"),
    ({"input": "?!... ,,, ---"}, None, "nothing to speak"),
    ({"voice": "../x"}, "voice", "Unknown voice '../x'"),
    ({"voice": "a\x00b"}, "voice", "Unknown voice"),
]


@pytest.mark.parametrize(("fields", "param", "text"), HARDENING, ids=[str(f)[:30] for f, _, _ in HARDENING])
def test_bad_speech_fields_are_refused_before_model_work(http, model_work, fields, param, text):
    body = json.dumps({"input": SHORT, "voice": "alice", **fields})  # NaN and Infinity as Python writes them
    r = http.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
    _assert_error(r, 400, param, text)
    assert model_work == {"features": 0, "queued": 0}
    assert http.post("/v1/audio/speech", json={"input": SHORT, "voice": "alice", "response_format": "pcm"}).content
    assert model_work["queued"] == 1


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
    r = http.post("/v1/voices", data={"name": "big"}, files=files)
    _assert_error(r, 413, "file", "'file' is larger than 20 MiB; upload a short speech prompt")
    robustness = (REPO_ROOT / "docs" / "robustness.md").read_text()
    assert f"413 `{r.json()['error']['message']}`" in robustness  # the message the docs quote is the one sent
    assert "big" not in _names(http)


BAD_PROMPTS = [
    (b"", "empty (0 bytes)"),
    (b"not audio at all" * 10, "could not be decoded"),
    (_speech_wav()[:30], "could not be decoded"),
    (_speech_wav(0.2), "0.2 s long"),
    (_speech_wav(60.0), "60.0 s long"),
]


@pytest.mark.parametrize(("audio", "text"), BAD_PROMPTS, ids=["empty", "not-audio", "truncated", "0.2s", "60s"])
def test_bad_prompt_uploads_are_refused_before_model_work(http, model_work, audio, text):
    files = {"file": ("x.wav", audio, "audio/wav")}
    r = http.post("/v1/voices", data={"name": "dave", "prompt_text": "x"}, files=files)
    _assert_error(r, 400, "file", text)
    assert model_work["features"] == 0 and "dave" not in _names(http)


EVIL_NAMES = ["../x", "..", "a/b", "/etc/passwd", "x" * 300, "a\x00b", "..\\x", ".hidden", "C:\\x"]


@pytest.mark.parametrize("name", EVIL_NAMES, ids=range(len(EVIL_NAMES)))
def test_voice_names_cannot_leave_the_voices_folder(engine, http, name):
    folder = engine.voices.folder
    outside = folder.parent / "x.json"
    outside.write_text("{}")
    before = sorted(p.name for p in folder.parent.rglob("*"))
    files = {"file": ("x.wav", _speech_wav(), "audio/wav")}
    r = http.post("/v1/voices", data={"name": name, "prompt_text": "x"}, files=files)
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


def test_a_raw_stream_that_fails_after_its_headers_ends_incomplete(engine, http, monkeypatch):
    """No error event can follow raw audio: the connection drops before the closing chunk, so a client cannot
    take the short clip for a whole one."""

    def crash_later(request):
        yield SimpleNamespace(pcm=np.zeros(480, np.int16), is_last=False, duration=0.02, tokens=1)
        raise EngineBusy("refused half-way")

    monkeypatch.setattr(engine, "stream", crash_later)
    body = {"input": SHORT, "voice": "alice", "response_format": "pcm", "stream_format": "audio"}
    data = bytearray()
    with pytest.raises(httpx.RemoteProtocolError), http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        for part in r.iter_bytes():
            data += part
    assert len(data) == 960
