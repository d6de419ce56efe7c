"""The WebUI through its public API: gradio_client against in-process apps on the tiny random model."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

import app
from cosyvoice_opt import limits, webui
from cosyvoice_opt.bench.loopback import free_port
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import EngineBusy
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.types import TextStream
from cosyvoice_opt.webui.handlers import NO_INSTRUCTION, NO_TRANSCRIPT, SPEED_WHILE_STREAMING, Generation, on_page
from cosyvoice_opt.webui.layout import VOICE_KEEPS_AUDIO

PROMPT = webui.ASSETS / "en_male.wav"
PROMPT_TEXT = (webui.ASSETS / "en_male.txt").read_text().strip()
# Long enough that the tiny model's minimum length (a multiple of the text tokens) spans several chunks.
TEXT = "Streaming speech synthesis sends audio while the rest of the sentence is still being generated, " * 2
OPERATOR = ("ann", "secret")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_model_dir(None, EngineConfig(random_size="tiny",
                                                   voices_dir=str(tmp_path_factory.mktemp("voices"))))
    yield eng
    eng.close()


@contextmanager
def serve(engine: Engine, *flags: str) -> Iterator[str]:
    """URL of the app served in this process on a free port, launched as `python app.py --random tiny FLAGS`
    launches it (same build_app and launch)."""
    args = webui.parse_args(["--random", "tiny", "--concurrency", "4", "--host", "127.0.0.1",
                             "--port", str(free_port()), *flags])
    monitor = Monitor(interval=0.5).start()
    demo = webui.build_app(engine, args, monitor)
    try:
        yield webui.launch(demo, engine, args)
    finally:
        demo.close()
        monitor.stop()


@pytest.fixture(scope="module")
def server(engine):
    """The default server: engine settings are read-only."""
    with serve(engine) as url:
        yield url


@pytest.fixture(scope="module")
def operator_server(engine):
    with serve(engine, "--allow-settings") as url:
        yield url


@pytest.fixture(scope="module")
def auth_server(engine):
    with serve(engine, "--auth", ":".join(OPERATOR)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False)


def _check_audio(result: tuple, chunks: int | None = None) -> dict:
    """The final (stream, full clip, metrics) outputs: a real 24 kHz int16 clip whose length the metrics report."""
    _, full_path, metrics = result
    data, rate = sf.read(full_path, dtype="int16")
    assert rate == 24000 and data.ndim == 1 and len(data) > 0 and np.abs(data).max() > 0
    assert metrics["audio_s"] == pytest.approx(len(data) / rate, abs=1e-3)
    assert metrics["tokens"] > 0 and metrics["batch_size"] >= 1
    assert 0 < metrics["first_packet_latency_s"] <= metrics["wall_s"]
    assert metrics["rtf"] == pytest.approx(metrics["wall_s"] / metrics["audio_s"], rel=0.01)
    if chunks is not None:
        assert metrics["chunks"] == chunks
    return metrics


def test_zero_shot_streams_several_chunks(client):
    job = client.submit(TEXT, handle_file(PROMPT), PROMPT_TEXT, True, 1.0, 0, api_name="/zero_shot")
    updates = list(job)
    streamed = [u[0] for u in updates if isinstance(u[0], str)]  # one HLS playlist path per streamed chunk
    assert len(streamed) >= 2, "streaming mode should deliver audio in several chunks"
    metrics = _check_audio(job.outputs()[-1], chunks=len(streamed))
    # Chunk counts grow one update at a time: every chunk reached the client as it was made.
    assert [u[2]["chunks"] for u in updates if isinstance(u[0], str)] == list(range(1, metrics["chunks"] + 1))


@pytest.mark.parametrize(("api_name", "inputs"), [
    ("/zero_shot", lambda: (TEXT, handle_file(PROMPT), PROMPT_TEXT)),
    ("/cross_lingual", lambda: ("这个声音是从一段英文录音克隆的。", handle_file(PROMPT))),
    ("/instruct2", lambda: (TEXT, handle_file(PROMPT), "Speak slowly, in a calm and gentle voice.")),
])
def test_each_mode_returns_audio_in_one_piece(client, api_name, inputs):
    _check_audio(client.predict(*inputs(), False, 1.0, 7, api_name=api_name), chunks=1)


def test_saving_over_a_saved_voice_needs_replace_ticked(client, engine):
    """As the HTTP API (409 without overwrite): a second save under a name is refused and the voice kept, unless
    the "replace" box is ticked."""
    meta = engine.voices.folder / "twice.json"
    client.predict("twice", handle_file(PROMPT), PROMPT_TEXT, api_name="/save_voice")
    first = meta.read_text()
    with pytest.raises(AppError) as err:
        client.predict("twice", handle_file(PROMPT), "Another transcript.", api_name="/save_voice")
    assert str(err.value) == ("A voice named 'twice' is already saved: tick \"Replace a saved voice of this name\" "
                              "to overwrite it, or choose another name.")
    assert meta.read_text() == first
    status, _ = client.predict("twice", handle_file(PROMPT), "Another transcript.", True, api_name="/save_voice")
    assert "twice" in status and "Another transcript." in meta.read_text()
    client.predict("twice", api_name="/delete_voice")


def test_saved_voice_lifecycle(client):
    status, dropdown = client.predict("ui test", handle_file(PROMPT), PROMPT_TEXT, api_name="/save_voice")
    assert "ui test" in status and dropdown["value"] == "ui test"
    assert "ui test" in client.predict(api_name="/list_voices")
    updates = list(client.submit(TEXT, "ui test", True, 1.0, 0, api_name="/sft"))
    assert sum(isinstance(u[0], str) for u in updates) >= 1
    _check_audio(updates[-1])
    client.predict("ui test", api_name="/delete_voice")
    assert "ui test" not in client.predict(api_name="/list_voices")


@pytest.mark.parametrize(("api_name", "inputs"), [
    ("/zero_shot", lambda: ("", handle_file(PROMPT), PROMPT_TEXT)),  # nothing to speak
    ("/zero_shot", lambda: (TEXT, None, PROMPT_TEXT)),  # no prompt audio
    ("/sft", lambda: (TEXT, "no such voice")),
])
def test_bad_input_is_a_one_line_error_and_the_server_keeps_serving(client, api_name, inputs):
    with pytest.raises(AppError) as err:
        client.predict(*inputs(), True, 1.0, 0, api_name=api_name)
    message = str(err.value)
    assert message and "\n" not in message and "Traceback" not in message and "/tmp" not in message
    assert client.predict(api_name="/list_voices") is not None  # still serving


def test_cancelled_stream_frees_its_engine_slot(client, engine):
    before = engine.stats()
    job = client.submit(TEXT * 2, handle_file(PROMPT), PROMPT_TEXT, True, 1.0, 0, api_name="/zero_shot")
    deadline = time.monotonic() + 120
    while not job.outputs() and not job.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert job.outputs(), "no chunk arrived"
    job.cancel()
    while (engine.stats()["running"] or engine.stats()["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = engine.stats()
    assert after["running"] == after["waiting"] == 0
    assert after["completed"] == before["completed"], "the request ran to its end instead of being cancelled"


def test_monitor_samples_history_in_the_background():
    monitor = Monitor(interval=0.05, history_s=1.0).start()
    try:
        time.sleep(0.5)
        frame = monitor.history()
        assert list(frame.columns) == ["seconds", "percent", "series"]
        assert frame["seconds"].max() <= 0 and len(frame) >= 2 * 5
        assert frame["percent"].between(0, 100).all()
        time.sleep(1.5)
        assert len(monitor.history()) <= 2 * (int(1.0 / 0.05) + 1)  # bounded to the last history_s
        text = monitor.summary()
        assert ("Memory:" in text) if monitor.has_gpu else ("No NVIDIA GPU: running on CPU" in text)
    finally:
        monitor.stop()


def test_the_engine_panel_shows_each_threads_busy_share_over_its_window(monkeypatch):
    """From the engine's counters at the window's ends; a cluster's summed counters are averaged per replica, and
    nothing is shown until a second has passed."""
    from types import SimpleNamespace

    from cosyvoice_opt.webui import layout

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(layout.time, "monotonic", lambda: clock.now)
    from cosyvoice_opt.engine.counters import STAGE_COUNTERS

    zero = dict.fromkeys(STAGE_COUNTERS, 0)
    base = {"batch_size": 3, "waiting": 0, "completed": 5, "failed": 0, "flow_pages_used": 4, "flow_pages": 64,
            "flow_prefix_hits": 1, "replicas": 2}
    stats = {**base, **zero}
    engine = SimpleNamespace(info={"model": "random tiny", "is_random": True, "precision": "fp32", "device": "cpu",
                                   "max_batch_size": 8}, stats=lambda: stats)
    status = layout.EngineStatus(engine)
    assert "Time" not in status() and "speech tokens" not in status()  # a cluster's info does not say
    engine.info["speech_tokenizer"] = "GPU (PyTorch)"
    assert status().startswith("Model: random tiny · fp32 on cpu · speech tokens: GPU (PyTorch)  \nBatch: 3 running")
    clock.now += 4.0
    stats = {**base, **zero, "llm_steps": 400, "llm_rows": 1200, "llm_busy_seconds": 4.0, "vocoder_rounds": 16,
             "vocoder_chunks": 64, "vocoder_busy_seconds": 6.0}
    text = status()
    assert "Time (last 4 s): LLM 50 % busy, 50 steps/s of 3.0 rows; vocoder 75 % busy, 2.0 rounds/s of 4.0" in text


def test_the_monitor_endpoint_has_one_row_for_this_servers_gpu(client):
    """The GPU panel's data through the API (a cluster's has one row per replica: tests/test_cluster.py)."""
    [row] = client.predict(api_name="/monitor")
    assert row["name"] == "this server" and 0 <= row["util_percent"] <= 100
    assert 0 < row["mem_used_gib"] <= row["mem_total_gib"]


def test_launch_flags(tmp_path: Path):
    assert webui.parse_auth("ann:secret") == [("ann", "secret")]
    users = tmp_path / "users"
    users.write_text("# team\nann:one\n\nbob:two:three\n")
    assert webui.parse_auth(str(users)) == [("ann", "one"), ("bob", "two:three")]
    with pytest.raises(SystemExit):
        webui.parse_auth("no-colon")
    assert webui.exposure_warning(webui.parse_args(["--host", "127.0.0.1"])) is None
    default = webui.exposure_warning(webui.parse_args([]))  # 0.0.0.0: every interface
    assert "network" in default and "--auth" in default and "--api-key" in default
    assert "engine settings" not in default
    assert "engine settings" in webui.exposure_warning(webui.parse_args(["--allow-settings"]))
    assert "share" in webui.exposure_warning(webui.parse_args(["--share", "--host", "127.0.0.1"]))
    only_ui = webui.exposure_warning(webui.parse_args(["--auth", "a:b"]))
    assert "--api-key" in only_ui and "no --auth" not in only_ui
    assert webui.exposure_warning(webui.parse_args(["--share", "--auth", "a:b", "--api-key", "k"])) is None
    assert webui.parse_args(["--max-queue-wait", "2.5"]).max_queue_wait == 2.5
    for bad in (limits.MAX_QUEUE_WAIT_RANGE[0] - 1, limits.MAX_QUEUE_WAIT_RANGE[1] + 1):
        with pytest.raises(SystemExit):
            webui.parse_args(["--max-queue-wait", str(bad)])


def test_app_py_is_the_entry_point_over_the_package_and_documents_every_flag(capsys):
    assert app.main is webui.main
    flags = {opt for action in webui.build_parser()._actions for opt in action.option_strings if opt != "--help"}
    missing = sorted(f for f in flags if f.startswith("--") and f not in app.__doc__)
    assert not missing, f"app.py's docstring does not list {missing}"
    from cosyvoice_opt.__main__ import main as cli_main

    path = list(sys.path)
    with pytest.raises(SystemExit) as done:
        cli_main(["serve", "--help"])  # the package's WebUI, not the top-level app.py through sys.path
    assert done.value.code == 0 and "--allow-settings" in capsys.readouterr().out
    assert sys.path == path


# ---- live text -----------------------------------------------------------------------------------------------------
LIVE_TEXT = "A chat model writes its reply one word at a time and the voice reads each word as soon as it comes. " * 2


def test_live_text_feeds_the_engine_word_by_word_and_streams_audio(client, engine, monkeypatch):
    """/live_text hands the engine a TextStream that receives one push per word, taken by the engine in several
    takes while the text is still open, and speech decoding starts before the last word; the audio streams."""
    sources, takes = [], []
    real = engine.stream

    def spy(request):
        source = request.text
        sources.append(source)
        take = source.take

        def counted():
            pieces, closed = take()
            if pieces or closed:
                takes.append((len(pieces), closed))
            return pieces, closed

        source.take = counted
        return real(request)

    monkeypatch.setattr(engine, "stream", spy)
    words = LIVE_TEXT.split()
    updates = list(client.submit(LIVE_TEXT, handle_file(PROMPT), PROMPT_TEXT, 6.0, 0, api_name="/live_text"))
    (source,) = sources
    assert isinstance(source, TextStream) and source.closed and not source.aborted
    assert len(source.push_times) == len(words) and sum(n for n, _ in takes) == len(words)
    assert sum(n > 0 and not closed for n, closed in takes) >= 2, "the text reached the engine in one piece"
    assert source.unlocked_at in source.push_times[:-1]  # decoding started while words were still to come
    streamed = [u for u in updates if isinstance(u[0], str)]
    assert len(streamed) >= 2
    _check_audio(updates[-1], chunks=len(streamed))


def test_saving_a_voice_says_that_it_speaks_with_both_families(client):
    props = {c["props"].get("elem_id"): c["props"] for c in client.config["components"]}
    assert props["voice_name"]["info"] == VOICE_KEEPS_AUDIO
    assert "CosyVoice2 and CosyVoice3" in VOICE_KEEPS_AUDIO


def test_live_text_speaks_with_a_saved_voice_and_has_example_voices(client):
    updates = list(client.submit(LIVE_TEXT, None, "", 20.0, 0, "en_female", api_name="/live_text"))
    streamed = [u for u in updates if isinstance(u[0], str)]
    assert streamed
    _check_audio(updates[-1], chunks=len(streamed))
    components = {c["props"].get("elem_id"): c for c in client.config["components"]}
    assert components["live_voice"]["type"] == "dropdown"
    examples = components["live_examples"]["props"]
    assert len(examples["samples"]) == len(list(webui.ASSETS.glob("*.wav"))) > 0


@pytest.mark.parametrize(("text", "prompt", "rate", "words"), [
    ("", str(PROMPT), 4.0, "text is empty"),
    ("😀🎉🚀", str(PROMPT), 4.0, "nothing to speak"),
    ("a" * (limits.MAX_TEXT_CHARS + 1), str(PROMPT), 4.0, f"limit is {limits.MAX_TEXT_CHARS}"),
    (LIVE_TEXT, None, 4.0, "prompt"),
    (LIVE_TEXT, str(PROMPT), 0.0, "less than minimum value"),
    (LIVE_TEXT, str(PROMPT), limits.LIVE_WORDS_PER_S_RANGE[1] + 1, "greater than maximum value"),
])
def test_live_text_refuses_bad_input_in_one_line(client, text, prompt, rate, words):
    with pytest.raises(AppError) as err:
        client.predict(text, handle_file(prompt) if prompt else None, PROMPT_TEXT, rate, 0, api_name="/live_text")
    message = str(err.value)
    assert words in message and "\n" not in message and "Traceback" not in message
    assert client.predict(api_name="/list_voices") is not None  # still serving


# ---- hardening -----------------------------------------------------------------------------------------------------
def _wav(tmp_path: Path, name: str, wave: np.ndarray, rate: int = 16000, subtype: str = "PCM_16") -> str:
    path = tmp_path / name
    sf.write(path, wave, rate, subtype=subtype)
    return str(path)


def _tone(seconds: float = 3.0, rate: int = 16000) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def _nan_tone() -> np.ndarray:
    wave = _tone()
    wave[10:20] = np.nan
    return wave


UI_BAD = {  # case -> (text, prompt file maker, speed, seed, words of the message)
    "whitespace text": (" \n\t ", lambda p: str(PROMPT), 1.0, 0, "text is empty"),
    "emoji text": ("😀🎉🚀", lambda p: str(PROMPT), 1.0, 0, "nothing to speak"),
    "20k-char text": ("a" * 20000, lambda p: str(PROMPT), 1.0, 0, f"limit is {limits.MAX_TEXT_CHARS}"),
    "control-char text": ("\x01\x02\x1b", lambda p: str(PROMPT), 1.0, 0, "text is empty"),
    "not audio": (TEXT, lambda p: (p / "x.wav").write_bytes(b"not audio" * 100) and str(p / "x.wav"), 1.0, 0,
                  "could not be decoded"),
    "8 kHz prompt": (TEXT, lambda p: _wav(p, "lo.wav", _tone(rate=8000), 8000), 1.0, 0, "8000 Hz"),
    "0.2 s prompt": (TEXT, lambda p: _wav(p, "short.wav", _tone(0.2)), 1.0, 0, "0.2 s long"),
    "silent prompt": (TEXT, lambda p: _wav(p, "silent.wav", np.zeros(48000, np.float32)), 1.0, 0, "silent"),
    "NaN prompt": (TEXT, lambda p: _wav(p, "nan.wav", _nan_tone(), subtype="FLOAT"), 1.0, 0, "NaN"),
    "speed 0": (TEXT, lambda p: str(PROMPT), 0, 0, "less than minimum value 0.5"),  # gradio's own range check
    "seed -1": (TEXT, lambda p: str(PROMPT), 1.0, -1, "less than minimum value 0"),
    "seed 2**70": (TEXT, lambda p: str(PROMPT), 1.0, 2**70, "greater than maximum value"),
}


@pytest.mark.parametrize("case", list(UI_BAD))
def test_ui_bad_input_is_one_line(client, tmp_path, case):
    text, prompt, speed, seed, words = UI_BAD[case]
    with pytest.raises(AppError) as err:
        client.predict(text, handle_file(prompt(tmp_path)), PROMPT_TEXT, False, speed, seed, api_name="/zero_shot")
    message = str(err.value)
    assert words in message and "\n" not in message and "Traceback" not in message and str(tmp_path) not in message
    _check_audio(client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, 0, api_name="/zero_shot"))


def test_ui_upload_limit(client, server, tmp_path):
    """--max-file-size (default 20 MiB): gradio_client refuses before sending, the server refuses with 413."""
    big = tmp_path / "big.wav"
    big.write_bytes(b"RIFF" + bytes(21 << 20))
    with pytest.raises(ValueError, match="exceeds the maximum file size of 20971520 bytes"):
        client.predict(TEXT, handle_file(str(big)), PROMPT_TEXT, False, 1.0, 0, api_name="/zero_shot")
    with big.open("rb") as f:
        r = httpx.post(f"{server}gradio_api/upload", files={"files": ("big.wav", f, "audio/wav")}, timeout=60)
    assert r.status_code == 413, r.text


def test_ui_voice_names_stay_in_the_folder(client, engine):
    before = sorted(p.name for p in engine.voices.folder.parent.rglob("*"))
    for name in ("../x", "a/b", "/etc/passwd", "x" * 300):
        with pytest.raises(AppError, match="Invalid voice name"):
            client.predict(name, handle_file(PROMPT), PROMPT_TEXT, api_name="/save_voice")
    assert sorted(p.name for p in engine.voices.folder.parent.rglob("*")) == before


def test_ui_internal_errors_hide_paths(client, engine, monkeypatch):
    def crash(*args):
        raise RuntimeError("boom in /secret/path/model.py")

    monkeypatch.setattr(engine, "stream", crash)
    monkeypatch.setattr(engine, "synthesize", crash)
    monkeypatch.setattr(engine, "save_voice", crash)
    for args, api_name in (((TEXT, handle_file(PROMPT), PROMPT_TEXT, True, 1.0, 0), "/zero_shot"),
                           ((TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, 0), "/zero_shot"),
                           (("ok name", handle_file(PROMPT), PROMPT_TEXT), "/save_voice")):
        with pytest.raises(AppError) as err:
            client.predict(*args, api_name=api_name)
        assert "/secret" not in str(err.value) and "Traceback" not in str(err.value)


# ---- streaming and speed -------------------------------------------------------------------------------------------
def test_speed_while_streaming_is_refused_as_the_http_api_refuses_it(client):
    """Streaming cannot stretch the clip: a streamed request at speed 1.5 is refused (not run at 1.0), in every mode;
    the same speed without streaming goes through."""
    _check_audio(client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.5, 0, api_name="/zero_shot"),
                 chunks=1)
    for api_name, inputs in (("/zero_shot", (TEXT, handle_file(PROMPT), PROMPT_TEXT)),
                             ("/cross_lingual", (TEXT, handle_file(PROMPT))),
                             ("/instruct2", (TEXT, handle_file(PROMPT), "Speak slowly.")),
                             ("/sft", (TEXT, "en_female"))):
        with pytest.raises(AppError) as err:
            client.predict(*inputs, True, 1.5, 0, api_name=api_name)
        assert str(err.value) == SPEED_WHILE_STREAMING, api_name


# ---- errors in the tab's own words ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("api_name", "inputs", "message"), [
    ("/zero_shot", (TEXT, None, PROMPT_TEXT), "Add a prompt voice: upload or record a clip of the speaker above (or "
                                              "use a saved one in the Saved voice tab)."),
    ("/zero_shot", (TEXT, str(PROMPT), " "), NO_TRANSCRIPT),
    ("/cross_lingual", (TEXT, None), "Add a prompt voice: upload or record a clip of the speaker above."),
    ("/instruct2", (TEXT, str(PROMPT), ""), NO_INSTRUCTION),
])
def test_missing_fields_are_named_as_the_tab_shows_them(client, api_name, inputs, message):
    inputs = tuple(handle_file(x) if x == str(PROMPT) else x for x in inputs)
    with pytest.raises(AppError) as err:
        client.predict(*inputs, False, 1.0, 0, api_name=api_name)
    assert str(err.value) == message
    assert "mode" not in message and "zero_shot" not in message


def test_the_page_shows_a_failed_generate_in_the_tabs_status_line(engine):
    """The page's version of an endpoint ends normally and writes the reason in its status line (a failed event
    would mark every output "Error"); a good run clears the line and streams as the endpoint does."""
    gen = Generation(engine)
    updates = list(on_page(gen.cross_lingual)(TEXT, None, False, 1.0, 0))
    assert updates[0][3] == "" and len(updates) == 2
    assert updates[-1][3] == "⚠️ Add a prompt voice: upload or record a clip of the speaker above."
    updates = list(on_page(gen.cross_lingual)(TEXT, str(PROMPT), False, 1.0, 0))
    assert updates[0][3] == "" and updates[-1][1][1].size > 0 and updates[-1][2]["chunks"] == 1


def test_out_of_range_inputs_log_one_line(client, capfd, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_opt.webui")
    with pytest.raises(AppError, match="less than minimum value 0"):
        client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, -1, api_name="/zero_shot")
    assert "Traceback" not in capfd.readouterr().err
    assert "input refused: Value -1 is less than minimum value 0." in caplog.text


# ---- engine settings: the operator's -------------------------------------------------------------------------------
SETTINGS_CALLS = (("/set_max_batch_size", 7), ("/set_precision", "fp32"), ("/set_max_queue_wait", 9.5))


def _settings(engine: Engine) -> tuple:
    info = engine.info
    return info["max_batch_size"], info["precision"], info.get("max_queue_wait")


@pytest.mark.parametrize("flags", [(), ("--api-key", "k")], ids=["no flags", "api key only"])
def test_settings_are_read_only_without_operator_credentials(engine, flags):
    with serve(engine, *flags) as url:
        client = Client(url, verbose=False)
        before = _settings(engine)
        for api_name, value in SETTINGS_CALLS:
            with pytest.raises(AppError, match="read-only"):
                client.predict(value, api_name=api_name)
        assert _settings(engine) == before


def test_allow_settings_lets_visitors_change_engine_settings(operator_server, engine, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_opt.webui")
    client = Client(operator_server, verbose=False)
    assert "7" in client.predict(7, api_name="/set_max_batch_size")
    assert engine.info["max_batch_size"] == 7
    status = client.predict("fp32", api_name="/set_precision")
    assert "fp32" in status and engine.info["precision"] == "fp32"
    assert "precision switched" in caplog.text and "fp32" in caplog.text
    assert "9.5" in client.predict(9.5, api_name="/set_max_queue_wait")
    assert engine.info["max_queue_wait"] == 9.5
    with pytest.raises(AppError, match="greater than maximum value"):
        client.predict(limits.MAX_QUEUE_WAIT_RANGE[1] + 1, api_name="/set_max_queue_wait")
    engine.set_max_batch_size(64)
    engine.set_max_queue_wait(limits.MAX_QUEUE_WAIT_S)


def test_a_fractional_max_batch_size_is_refused(operator_server, engine):
    client = Client(operator_server, verbose=False)
    before = engine.info["max_batch_size"]
    with pytest.raises(AppError) as err:
        client.predict(2.5, api_name="/set_max_batch_size")
    assert str(err.value) == f"Max batch size must be a whole number of requests, not 2.5; the engine keeps {before}."
    assert engine.info["max_batch_size"] == before


def test_read_only_settings_say_so(client, operator_server):
    def labels(config: dict) -> dict:
        props = {c["props"].get("elem_id"): c["props"] for c in config["components"]}
        return {name: props[name]["label"] for name in ("precision", "max_batch_size", "max_queue_wait")}

    assert all(text.endswith(" (read-only)") for text in labels(client.config).values())
    assert not any("read-only" in text for text in labels(Client(operator_server, verbose=False).config).values())


def test_with_auth_logged_in_users_are_operators(auth_server, engine):
    with pytest.raises(ValueError):  # the page and every endpoint need a login
        Client(auth_server, verbose=False)
    client = Client(auth_server, auth=OPERATOR, verbose=False)
    assert "5" in client.predict(5, api_name="/set_max_batch_size")
    assert engine.info["max_batch_size"] == 5
    engine.set_max_batch_size(64)


# ---- overload ------------------------------------------------------------------------------------------------------
def _refused(*args):
    raise EngineBusy("the server is busy (64 streams admitted, 8 waiting)", retry_after=2.3)


def _refused_at_first_chunk(*args):
    yield from ()
    _refused()


@pytest.mark.parametrize("where", ["at the call", "at the first chunk"])
def test_busy_engine_says_when_to_retry_and_the_app_keeps_serving(client, engine, monkeypatch, where):
    refuse = _refused if where == "at the call" else _refused_at_first_chunk
    with monkeypatch.context() as patch:
        patch.setattr(engine, "stream", refuse)
        patch.setattr(engine, "synthesize", _refused)
        for stream in (True, False):
            with pytest.raises(AppError) as err:
                client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, stream, 1.0, 0, api_name="/zero_shot")
            assert str(err.value) == f"The server is busy; try again in {math.ceil(2.3)} s."
    _check_audio(client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, 0, api_name="/zero_shot"))


# ---- API description, start-up and logs ----------------------------------------------------------------------------
def test_api_description_names_every_input_and_output(client):
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert {"/zero_shot", "/sft", "/save_voice", "/set_precision", "/set_max_batch_size",
            "/set_max_queue_wait"} <= set(api)
    for name, endpoint in api.items():
        for field in endpoint["parameters"] + endpoint["returns"]:
            assert field["label"] and not field["label"].startswith("value_"), (name, field)
    voice = next(p for p in api["/sft"]["parameters"] if p["parameter_name"] == "voice")
    assert voice["type"]["type"] == "string" and "enum" not in voice["type"]
    assert [r["label"] for r in api["/save_voice"]["returns"]] == ["Voice status", "Voice"]
    assert [r["type"] for r in api["/list_voices"]["returns"]] == [{"type": "array", "items": {"type": "string"}}]


def test_start_up_log_names_the_share_flag(engine, caplog, capsys):
    caplog.set_level(logging.INFO, logger="cosyvoice_opt.webui")
    with serve(engine) as url:
        pass
    out = capsys.readouterr()
    assert "share=True" not in out.out + out.err
    assert url in caplog.text and "--share" in caplog.text


def test_saved_voices_are_logged(client, caplog):
    caplog.set_level(logging.INFO, logger="cosyvoice_opt.webui")
    client.predict("logged", handle_file(PROMPT), PROMPT_TEXT, api_name="/save_voice")
    client.predict("logged", api_name="/delete_voice")
    assert "saved voice 'logged'" in caplog.text and "deleted voice 'logged'" in caplog.text


# ---- limits --------------------------------------------------------------------------------------------------------
def test_ui_limits_are_the_shared_limits(client):
    props = {c["props"].get("elem_id"): c["props"] for c in client.config["components"]}
    assert (props["seed"]["minimum"], props["seed"]["maximum"]) == (0, limits.MAX_SEED)
    assert (props["speed"]["minimum"], props["speed"]["maximum"]) == limits.SPEED_RANGE
    assert (props["max_queue_wait"]["minimum"], props["max_queue_wait"]["maximum"]) == limits.MAX_QUEUE_WAIT_RANGE
    texts = ("zero_shot_text", "zero_shot_prompt_text", "cross_lingual_text", "instruct2_text", "instruct2_instruct",
             "sft_text")
    assert {name: props[name].get("max_length") for name in texts} == dict.fromkeys(texts, limits.MAX_TEXT_CHARS)
    assert client.config["max_file_size"] == limits.MAX_UPLOAD_BYTES
    accepted = f"{limits.MIN_PROMPT_SECONDS:g}-{limits.MAX_PROMPT_SECONDS:g} s accepted"
    best = "{:g}-{:g} s of clear speech clones best".format(*limits.RECOMMENDED_PROMPT_SECONDS)
    for name in ("zero_shot_prompt", "cross_lingual_prompt", "instruct2_prompt", "live_prompt"):
        assert accepted in props[name]["label"] and best in props[name]["label"], props[name]["label"]


def test_the_largest_seed_the_engine_accepts_goes_through(client):
    _check_audio(client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, limits.MAX_SEED,
                                api_name="/zero_shot"))
    with pytest.raises(AppError, match="greater than maximum value"):
        client.predict(TEXT, handle_file(PROMPT), PROMPT_TEXT, False, 1.0, limits.MAX_SEED + 1, api_name="/zero_shot")
