"""A saved voice speaks with either model family (CPU, tiny random models): it holds its prompt audio, and an engine
of the other family extracts its own features from that audio, equal to what it extracts from the same audio
directly, without rewriting the file. A voice without audio (format versions 1 and 2) of the other family is
refused with a message that says what to do."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors import safe_open

from cosyvoice_opt.config import Family
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.audio import PromptAudio
from cosyvoice_opt.frontend.features import PromptFeatures
from cosyvoice_opt.frontend.voices import FORMAT_VERSION, VoiceStore
from cosyvoice_opt.types import SynthesisRequest
from tests.tolerances import ELEMENTWISE, EXACT, NETWORK, PROMPT_MEL, assert_close

RATE = 22050  # neither the tokenizer's 16 kHz nor the model's 24 kHz: a voice must keep the rate it came at
FRAME = 480  # output samples per mel frame


def stereo_prompt(seconds: float = 2.5, seed: int = 0) -> bytes:
    """A stereo 22.05 kHz WAV whose channels differ, with silence around the sound (the frontend trims it) and 2%
    of it clipped (the frontend warns)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(RATE * seconds)) / RATE
    tone = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    wav = np.stack([tone, 0.5 * tone + 0.05 * rng.standard_normal(t.size)], axis=1)
    wav[: RATE // 4] = wav[-RATE // 4:] = 0.0
    wav[RATE: RATE + RATE // 20] = 1.0
    buf = io.BytesIO()
    sf.write(buf, wav.astype(np.float32), RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("voices")


def _engine(family: str, seed: int, voices_dir: Path) -> Engine:
    """Different seeds: the two families' random speech tokenizers and speaker encoders differ, as the released
    v2 and v3 tokenizers do."""
    return Engine.from_model_dir(None, EngineConfig(random_size="tiny", family=family, seed=seed, device="cpu",
                                                    warmup=False, voices_dir=str(voices_dir)))


@pytest.fixture(scope="module")
def engines(voices_dir):
    cv2 = _engine("cosyvoice2", 0, voices_dir)
    cv3 = _engine("cosyvoice3", 1, voices_dir)
    yield {Family.COSYVOICE2: cv2, Family.COSYVOICE3: cv3}
    cv2.close()
    cv3.close()


def _assert_same(got: PromptFeatures, want: PromptFeatures) -> None:
    """The same features: the speech tokens exactly, the speaker embedding and the mel within their networks' and
    the log-mel's rounding (another family's tokens, embedding or mel is off by far more)."""
    for name, tol in (("speech_tokens", EXACT), ("embedding", NETWORK), ("mel", PROMPT_MEL)):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, tol, msg=name)


def _differ(a: PromptFeatures, b: PromptFeatures) -> bool:
    return any(getattr(a, n).shape != getattr(b, n).shape or not torch.equal(getattr(a, n), getattr(b, n))
               for n in ("speech_tokens", "embedding", "mel"))


def _files(voices_dir: Path, name: str) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in voices_dir.glob(f"{name}.*")}


@pytest.mark.parametrize("saver, user", [(Family.COSYVOICE2, Family.COSYVOICE3),
                                         (Family.COSYVOICE3, Family.COSYVOICE2)])
def test_a_voice_speaks_with_the_other_family(engines, voices_dir, saver, user):
    """Saved by one family's engine, the voice speaks through the other's with the features that engine extracts
    from the same audio directly (computed again here from an empty cache, not read back from it); a repeat is a
    cache hit; the saver keeps its stored features; the file is never rewritten."""
    save, use = engines[saver], engines[user]
    name, wav = f"from {saver.value}", stereo_prompt(seed=len(saver.value))
    save.save_voice(name, wav, "A prompt of my voice.")
    before = _files(voices_dir, name)
    assert sorted(before) == [f"{name}.json", f"{name}.safetensors"]

    saved = use.voices.load(name)
    assert saved.family == saver and saved.audio is not None
    use.prompt_cache.clear()
    features = use.voice_features(saved)
    hits = use.prompt_cache.hits
    assert use.voice_features(use.voices.load(name)) is not None and use.prompt_cache.hits == hits + 1
    use.prompt_cache.clear()
    direct = use.prompt_features(wav)
    _assert_same(features, direct)
    assert direct.warnings and features.warnings == ()  # as a voice's stored features: the save showed its warnings
    assert _differ(features, saved.features)  # the other family's tokenizer, encoder and mel settings
    _assert_same(save.voice_features(save.voices.load(name)), saved.features)  # the saver: the stored features

    audio = use.synthesize(SynthesisRequest(text="Hello there.", voice=name, mode="zero_shot", force_tokens=30,
                                            stream=False))
    assert len(audio.pcm) == 30 * 2 * FRAME and np.abs(audio.pcm.astype(np.int64)).max() > 0
    assert _files(voices_dir, name) == before  # the voice keeps serving both families


def test_a_saved_voice_holds_its_prompt_audio_as_the_frontend_read_it(engines, voices_dir):
    """Format 3: the prompt audio is mono (the channels' mean), untrimmed, float32 at its own rate, beside the
    features, and the metadata records the rate and the version."""
    engine = engines[Family.COSYVOICE2]
    wav = stereo_prompt(seed=7)
    engine.save_voice("kept", wav, "Some words.")
    meta = json.loads((voices_dir / "kept.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION == 3
    assert meta["family"] == "cosyvoice2" and meta["prompt_sample_rate"] == RATE
    with safe_open(voices_dir / "kept.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["embedding", "mel", "prompt_audio", "speech_tokens"]
        stored = f.get_tensor("prompt_audio")
    data, rate = sf.read(io.BytesIO(wav), dtype="float32", always_2d=True)
    want = torch.from_numpy(np.ascontiguousarray(data.T)).mean(dim=0, keepdim=True)
    assert rate == RATE and stored.dtype == torch.float32
    assert_close(stored, want, ELEMENTWISE)  # the channels' mean (taking one channel is off by the signal's size)
    assert engine.voices.families("kept") == [Family.COSYVOICE2, Family.COSYVOICE3]


def _old_format(voices_dir: Path, family: Family, name: str, features: PromptFeatures) -> None:
    """A voice as format version 2 wrote it: features and metadata, no audio."""
    VoiceStore(voices_dir, builtin_dir=None, family=family).save(name, features, {"prompt_text": "Old words."})
    meta_path = voices_dir / f"{name}.json"
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"format_version": 2}))


@pytest.mark.parametrize("saver, user", [(Family.COSYVOICE2, Family.COSYVOICE3),
                                         (Family.COSYVOICE3, Family.COSYVOICE2)])
def test_an_old_voice_of_the_other_family_is_refused(engines, voices_dir, saver, user):
    """Without audio there is nothing to extract the other family's features from: a clear refusal that says what
    to do; the voice still speaks with its own family, and its file is not touched."""
    name = f"old {saver.value}"
    stored = engines[saver].prompt_features(stereo_prompt(seed=3))
    _old_format(voices_dir, saver, name, stored)
    before = _files(voices_dir, name)
    made, here = ("CosyVoice2", "CosyVoice3") if saver == Family.COSYVOICE2 else ("CosyVoice3", "CosyVoice2")
    message = (rf"^Saved voice '{name}' was made with a {made} model \(its speech tokens are {made}'s\) and holds no "
               rf"prompt audio, so it cannot speak with this {here} model; save it again from its audio with this "
               r"model, under this or another name\. A voice saved again keeps its prompt audio and speaks with either "
               r"family\.$")
    with pytest.raises(InputError, match=message):
        engines[user].synthesize(SynthesisRequest(text="Hello there.", voice=name, mode="zero_shot",
                                                  force_tokens=30, stream=False))
    assert engines[user].voices.families(name) == [saver]
    _assert_same(engines[saver].voice_features(engines[saver].voices.load(name)), stored)
    assert _files(voices_dir, name) == before


# ---- the store ---------------------------------------------------------------------------------------------------
def _features(n: int = 9) -> PromptFeatures:
    g = torch.Generator().manual_seed(0)
    return PromptFeatures(torch.randint(0, 6561, (1, n), generator=g, dtype=torch.int32),
                          torch.randn(1, 192, generator=g), torch.randn(1, 2 * n, 80, generator=g))


def _audio(seconds: float = 1.0, rate: int = 44100) -> PromptAudio:
    return PromptAudio(torch.randn(1, int(seconds * rate), generator=torch.Generator().manual_seed(1)), rate)


def test_store_round_trips_the_audio_and_its_rate(tmp_path):
    audio = _audio()
    VoiceStore(tmp_path, builtin_dir=None, family=Family.COSYVOICE3).save("v", _features(), audio=audio)
    voice = VoiceStore(tmp_path, builtin_dir=None).load("v")  # a store of the other family reads it unchanged
    assert voice.family == Family.COSYVOICE3 and voice.audio.sample_rate == 44100
    assert torch.equal(voice.audio.wav, audio.wav)  # a file round trip: the same bits
    # its own family's store uses the features: the audio (up to a few MB) is not read for every request
    own = VoiceStore(tmp_path, builtin_dir=None, family=Family.COSYVOICE3).load("v")
    assert own.audio is None and own.family == Family.COSYVOICE3 and torch.equal(own.features.mel, _features().mel)
    VoiceStore(tmp_path, builtin_dir=None).save("w", _features())
    assert VoiceStore(tmp_path, builtin_dir=None).load("w").audio is None
    assert "prompt_sample_rate" not in json.loads((tmp_path / "w.json").read_text())


@pytest.mark.parametrize("audio, text", [
    (PromptAudio(torch.zeros(2, 16000), 16000), r"must be mono float32 samples \[1, N\], got torch.float32 \[2, "),
    (PromptAudio(torch.zeros(1, 16000, dtype=torch.float64), 16000), "got torch.float64"),
    (_audio(30.5, 16000), "prompt audio is 30.5 s long; at most 30 s is kept"),
])
def test_store_refuses_audio_that_is_not_a_prompt(tmp_path, audio, text):
    store = VoiceStore(tmp_path, builtin_dir=None)
    with pytest.raises(InputError, match=text):
        store.save("v", _features(), audio=audio)
    assert store.list() == []


@pytest.mark.parametrize("rate", [0, "44100", 2.5, True])
def test_a_bad_stored_rate_is_named(tmp_path, rate):
    store = VoiceStore(tmp_path, builtin_dir=None)
    store.save("v", _features(), audio=_audio())
    meta_path = tmp_path / "v.json"
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"prompt_sample_rate": rate}))
    with pytest.raises(InputError, match=f"Saved voice 'v' has an invalid prompt sample rate {rate!r}"):
        store.load("v")


def test_a_rate_without_its_audio_is_unreadable(tmp_path):
    store = VoiceStore(tmp_path, builtin_dir=None)
    store.save("v", _features())
    meta_path = tmp_path / "v.json"
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"prompt_sample_rate": 16000}))
    with pytest.raises(InputError, match="Saved voice 'v' is unreadable; delete it and save it again"):
        store.load("v")
