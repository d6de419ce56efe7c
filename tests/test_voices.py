"""Voices: saved ones round-trip across a restart, names cannot escape the folder, no pickle on disk; built-in ones
come from the assets, answer to OpenAI's voice names and are read-only."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.features import PromptFeatures
from cosyvoice_opt.frontend.voices import (
    OPENAI_VOICES,
    ReadOnlyVoice,
    VoiceExists,
    VoiceStore,
    find_builtin_voices,
)
from tests.conftest import REPO_ROOT

ASSETS = REPO_ROOT / "assets"


def _features(seed: int, n: int = 9) -> PromptFeatures:
    g = torch.Generator().manual_seed(seed)
    return PromptFeatures(torch.randint(0, 6561, (1, n), generator=g, dtype=torch.int32),
                          torch.randn(1, 192, generator=g), torch.randn(1, 2 * n, 80, generator=g))


def test_round_trip_after_restart(tmp_path):
    feats, text = _features(0), "希望你以后能够做的比我还好呦。"
    VoiceStore(tmp_path).save("Alice v2.1", feats, {"prompt_text": text, "mode": "zero_shot"})
    store = VoiceStore(tmp_path)  # a fresh instance: what a server restart sees
    assert store.list() == ["Alice v2.1"]
    voice = store.load("Alice v2.1")
    for name in ("speech_tokens", "embedding", "mel"):
        got, want = getattr(voice.features, name), getattr(feats, name)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert voice.meta["prompt_text"] == text
    assert voice.meta["mode"] == "zero_shot" and voice.meta["name"] == "Alice v2.1" and "created" in voice.meta


def test_save_replaces_and_delete(tmp_path):
    store = VoiceStore(tmp_path)
    store.save("bob", _features(1), {})
    store.save("bob", _features(2, n=4), {"prompt_text": "new"})
    assert store.load("bob").features.speech_tokens.shape == (1, 4)
    store.save("carol", _features(3), {})
    assert store.list() == ["bob", "carol"]
    store.delete("bob")
    assert store.list() == ["carol"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["carol.json", "carol.safetensors"]  # no temp files left


def test_unknown_voice_lists_what_exists(tmp_path):
    store = VoiceStore(tmp_path, builtin_dir=None)
    with pytest.raises(InputError) as e:
        store.load("nobody")
    assert str(e.value) == "Unknown voice 'nobody'; no voices are saved yet."
    store.save("b", _features(0), {})
    store.save("a", _features(1), {})
    with pytest.raises(InputError) as e:
        store.delete("nobody")
    assert str(e.value) == "Unknown voice 'nobody'; saved voices: a, b."
    with pytest.raises(InputError) as e:
        VoiceStore(tmp_path).prompt_text("nobody")
    assert str(e.value) == "Unknown voice 'nobody'; built-in voices: en_female, en_male, zh_male; saved voices: a, b."


@pytest.mark.parametrize("name", ["", "../evil", "a/b", "a\\b", "..", ".hidden", "a..b", "x" * 65, " lead", "trail ",
                                  "dot.", "nul\x00", "new\nline", "/etc/passwd", "C:x"])
def test_bad_names_rejected(tmp_path, name):
    store = VoiceStore(tmp_path / "voices")
    for call in (lambda: store.save(name, _features(0), {}), lambda: store.load(name), lambda: store.delete(name)):
        with pytest.raises(InputError, match="Invalid voice name"):
            call()
    assert list(tmp_path.rglob("*")) == [tmp_path / "voices"]  # nothing written anywhere


def test_files_hold_no_pickle(tmp_path):
    VoiceStore(tmp_path).save("v", _features(0), {"prompt_text": "hi"})
    raw = (tmp_path / "v.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + header_len])  # safetensors: u64 length, JSON header, raw tensor bytes
    assert set(header) - {"__metadata__"} == {"speech_tokens", "embedding", "mel"}
    assert header["speech_tokens"]["dtype"] == "I32" and header["mel"]["dtype"] == "F32"
    meta = json.loads((tmp_path / "v.json").read_text(encoding="utf-8"))
    assert meta["prompt_text"] == "hi"
    for path in tmp_path.iterdir():
        data = path.read_bytes()
        assert not data.startswith(b"\x80") and not data.startswith(b"PK"), path.name  # pickle / torch.save zip


def test_corrupt_voice_is_a_clear_error(tmp_path):
    store = VoiceStore(tmp_path)
    store.save("v", _features(0), {})
    (tmp_path / "v.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match="Saved voice 'v' is unreadable"):
        store.load("v")


def test_saving_over_a_name_needs_overwrite(tmp_path):
    store = VoiceStore(tmp_path)
    store.save("bob", _features(1), {"prompt_text": "first"}, overwrite=False)
    with pytest.raises(VoiceExists, match="A voice named 'bob' is already saved"):
        store.save("bob", _features(2), {"prompt_text": "second"}, overwrite=False)
    with pytest.raises(VoiceExists):
        store.check_writable("bob", overwrite=False)
    assert store.prompt_text("bob") == "first"
    store.save("bob", _features(2), {"prompt_text": "second"})  # overwrite is the default
    assert store.prompt_text("bob") == "second"


def test_builtin_voices_come_from_the_assets(tmp_path):
    store = VoiceStore(tmp_path)  # a fresh store: nothing saved, yet three voices
    assert store.list() == []
    assert store.builtin_names() == ["en_female", "en_male", "zh_male"] == store.names()
    for name in store.builtin_names():
        voice = store.builtin(name)
        assert voice.audio == (ASSETS / f"{name}.wav").resolve() and voice.audio.is_file()
        assert voice.prompt_text == (ASSETS / f"{name}.txt").read_text(encoding="utf-8").strip() != ""
        assert store.prompt_text(name) == voice.prompt_text
    store.save("alice", _features(0), {"prompt_text": "hi"})
    assert store.names() == ["alice", "en_female", "en_male", "zh_male"]


def test_every_openai_voice_name_maps_to_a_builtin_voice(tmp_path):
    assert sorted(OPENAI_VOICES) == ["alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                                     "shimmer", "verse"]
    store = VoiceStore(tmp_path)
    assert store.aliases == OPENAI_VOICES
    for alias, target in OPENAI_VOICES.items():
        assert store.builtin(alias) == store.builtin(target) is not None
        assert store.prompt_text(alias) == store.prompt_text(target)


@pytest.mark.parametrize("name", ["en_female", "zh_male", "alloy", "verse"])
def test_builtin_voices_are_read_only(tmp_path, name):
    store = VoiceStore(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ReadOnlyVoice, match="is a built-in voice and read-only"):
            store.save(name, _features(0), {}, overwrite=overwrite)
    with pytest.raises(ReadOnlyVoice, match="cannot be deleted"):
        store.delete(name)
    assert list(tmp_path.iterdir()) == [] and store.builtin(name) is not None


def test_builtin_folder_is_optional_and_checked(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "good.wav").write_bytes(b"RIFF")
    (assets / "good.txt").write_text("  A transcript.\n", encoding="utf-8")
    (assets / "no_text.wav").write_bytes(b"RIFF")  # zero-shot needs the transcript: not a voice
    (assets / "empty.wav").write_bytes(b"RIFF")
    (assets / "empty.txt").write_text(" \n", encoding="utf-8")
    (assets / ".hidden.wav").write_bytes(b"RIFF")
    (assets / ".hidden.txt").write_text("x", encoding="utf-8")
    assert {n: v.prompt_text for n, v in find_builtin_voices(assets).items()} == {"good": "A transcript."}
    store = VoiceStore(tmp_path / "v", builtin_dir=assets)
    assert store.aliases == {}  # OpenAI's names map only to voices that exist
    assert VoiceStore(tmp_path / "w", builtin_dir=tmp_path / "missing").names() == []
