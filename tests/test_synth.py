"""The `synth` command line: the output file's extension picks one of the API's formats; a file it cannot write is
refused before any model loads, with one line on stderr and exit code 1."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_opt import synth
from cosyvoice_opt.audio_formats import FORMATS

ARGS = ["--random", "tiny", "--voice", "en_female", "--text", "Hello there."]


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a run that had to be refused first")

    monkeypatch.setattr(synth.Engine, "from_model_dir", refuse)


@pytest.mark.parametrize(("output", "message"), [
    ("out.aac", "Output file 'out.aac' has unsupported extension '.aac'; use one of .wav, .pcm, .flac, .mp3, .opus."),
    ("out", "Output file 'out' has no extension; use one of .wav, .pcm, .flac, .mp3, .opus."),
    ("no/such/folder/out.wav", "Output folder 'no/such/folder' does not exist; create it or write elsewhere."),
    ("taken.wav", "Output file 'taken.wav' is a folder; name a file, e.g. 'taken.wav/out.wav'."),
    ("/proc/out.wav", "Output file '/proc/out.wav' cannot be written (No such file or directory); write elsewhere."),
])
def test_unwritable_outputs_are_refused_before_synthesis(tmp_path, monkeypatch, capsys, no_model, output, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken.wav").mkdir()  # a folder where the output file would go
    assert synth.main([*ARGS, "-o", output]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["taken.wav"] and not any((tmp_path / "taken.wav").iterdir())


def test_an_existing_output_survives_the_check(tmp_path):
    path = tmp_path / "keep.wav"
    path.write_bytes(b"old")
    assert synth.check_output(str(path)) == "wav" and path.read_bytes() == b"old"
    assert synth.check_output(str(tmp_path / "new.flac")) == "flac" and not (tmp_path / "new.flac").exists()


def test_bad_options_are_refused_before_synthesis(tmp_path, capsys, no_model):
    assert synth.main([*ARGS, "--speed", "3", "-o", str(tmp_path / "x.wav")]) == 1
    assert capsys.readouterr().err == "error: speed must be a number between 0.5 and 2.0, got 3.0\n"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_is_written(tmp_path, capsys, fmt):
    path = tmp_path / f"Out.{fmt.upper()}"  # the extension is matched without regard to case
    assert synth.main([*ARGS, "--voices-dir", str(tmp_path / "voices"), "-o", str(path)]) == 0
    assert f"wrote {path} ({fmt})" in capsys.readouterr().out
    data = path.read_bytes()
    if fmt == "pcm":
        assert len(data) % 2 == 0 and np.abs(np.frombuffer(data, "<i2")).max() > 0
        return
    info = sf.info(io.BytesIO(data))
    assert info.format == {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}[fmt]
    assert info.samplerate == 24000 and info.channels == 1 and info.frames > 2400
