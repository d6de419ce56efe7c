"""Audio frontend: decoding/validation messages, parity of every feature with upstream (all fixture sets), the random
ONNX stand-ins through real onnxruntime, and the prompt cache."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import threading

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio

from cosyvoice_opt import random_model
from cosyvoice_opt.config import Family, FeatureConfig, ModelConfig
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend import features as features_module
from cosyvoice_opt.frontend import onnx_models as onnx_models_module
from cosyvoice_opt.frontend.audio import PromptAudio, decode_audio, resample, resampled_length, trim_silence, validate
from cosyvoice_opt.frontend.features import (
    TOKENIZER_RATE,
    PromptFeatures,
    aligned_length,
    kaldi_fbank,
    prompt_mel,
    prompt_mel_frames,
    start_prompt_features,
    whisper_log_mel,
)
from cosyvoice_opt.frontend.onnx_models import (
    SpeakerEncoder,
    SpeechTokenizer,
)
from cosyvoice_opt.frontend.prompt_cache import PromptCache, prompt_key
from cosyvoice_opt.random_model import TINY_TOKENIZER, write_random_campplus, write_s3_speech_tokenizer
from tests.conftest import parity_params
from tests.tolerances import EXACT, FBANK, LOG_MEL, PROMPT_MEL, RESAMPLE, assert_close


def _encode(x: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _speechlike(rate: int, seconds: float, seed: int = 0, noise: float = 1e-4) -> np.ndarray:
    """Tone bursts (0.3 s on, 0.2 s off) over faint noise: loud frames and pauses, like speech."""
    t = np.arange(int(rate * seconds)) / rate
    rng = np.random.default_rng(seed)
    gate = (t % 0.5) < 0.3
    return (0.3 * gate * np.sin(2 * np.pi * 220 * t) + noise * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    write_s3_speech_tokenizer(d / "speech_tokenizer_v2.onnx", seed=1, **TINY_TOKENIZER)
    write_random_campplus(d / "campplus.onnx", seed=2)
    return SpeechTokenizer(d / "speech_tokenizer_v2.onnx"), SpeakerEncoder(d / "campplus.onnx")


# ---------------------------------------------------------------------------------------------------- parity


def _recipe_args(recipe: str) -> dict[str, str]:
    """The `name=value` arguments of a call written out in a `frontend_config.json` recipe."""
    return dict(re.findall(r"(\w+)=([^,()\s]+)", recipe))


def _load_wav_rate(recipe: str) -> int:
    """The rate of the `load_wav(wav, RATE)` a `frontend_config.json` recipe starts from."""
    found = re.search(r"load_wav\(wav,\s*(\d+)\)", recipe)
    assert found, f"no load_wav(wav, rate) in {recipe!r}"
    return int(found[1])


def _feature_config(spec: dict) -> FeatureConfig:
    """The 24 kHz prompt-mel parameters the set's `prompt_mel24k` recipe states (every one of them)."""
    args = _recipe_args(spec["prompt_mel24k"])
    assert args.pop("center") == "False", "the prompt mel is computed with center=False"
    defaults = FeatureConfig()
    assert set(args) == {f.name for f in dataclasses.fields(FeatureConfig)}, args
    return FeatureConfig(**{k: type(getattr(defaults, k))(float(v)) for k, v in args.items()})


def _fake_speech_tokens(rule: str, n: int) -> torch.Tensor:
    """The ids the set's stand-in speech tokenizer returned: `fake_speech_tokenizer` says `ids = arange(n)*A % M`."""
    found = re.search(r"ids\s*=\s*arange\(n\)\s*\*\s*(\d+)\s*%\s*(\d+)", rule)
    assert found, f"fake_speech_tokenizer rule not understood: {rule!r}"
    return (torch.arange(n, dtype=torch.int32) * int(found[1]) % int(found[2]))[None]


@pytest.mark.parametrize("set_dir", parity_params())
def test_frontend_parity(set_dir, tmp_path, onnx_models):
    cases = torch.load(set_dir / "frontend_io.pt", weights_only=True)
    assert cases, "frontend_io.pt has no cases"
    spec = json.loads((set_dir / "frontend_config.json").read_text())
    feat_cfg = _feature_config(spec)
    tokenizer_rate = _load_wav_rate(spec["speech_tokenizer_input"])
    assert _load_wav_rate(spec["campplus_input"]) == tokenizer_rate == TOKENIZER_RATE  # one 16 kHz signal feeds both
    n_mels = int(_recipe_args(spec["speech_tokenizer_input"])["n_mels"])
    tokenizer, _ = onnx_models
    for name, c in cases.items():
        rate = int(c["sample_rate"])
        pcm = torch.round(c["wav_as_loaded"] * 32768).to(torch.int16).T.numpy()  # the PCM_16 file upstream read
        path = tmp_path / f"{name}.wav"
        sf.write(path, pcm, rate, subtype="PCM_16")
        decoded, file_rate = decode_audio(str(path))  # no validation: parity cases need not be valid prompts
        assert file_rate == rate
        assert_close(torch.from_numpy(decoded), c["wav_as_loaded"], EXACT, msg=name)
        # gradio hands the same file over as (rate, int16 [n, channels])
        np.testing.assert_array_equal(decode_audio((rate, pcm))[0], decoded)
        mono = torch.from_numpy(decoded).mean(0, keepdim=True)  # channel mean, as the engine's prompt path

        wav16k = resample(mono, rate, tokenizer_rate)
        wav24k = resample(mono, rate, feat_cfg.sampling_rate)
        assert_close(wav16k, c["wav16k"], RESAMPLE, msg=name)
        assert_close(wav24k, c["wav24k"], RESAMPLE, msg=name)

        logmel = whisper_log_mel(wav16k, n_mels)
        assert_close(logmel, c["whisper_logmel128"], LOG_MEL, msg=name)
        assert int(c["whisper_len"][0]) == logmel.shape[2]

        fbank = kaldi_fbank(wav16k)
        assert fbank.shape == c["campplus_fbank80_meannorm"].shape, name
        assert_close(fbank, c["campplus_fbank80_meannorm"], FBANK, msg=name)
        assert (fbank - c["campplus_fbank80_meannorm"]).abs().mean() < 1e-4, name

        mel = prompt_mel(wav24k, feat_cfg)
        assert_close(mel, c["prompt_mel24k_raw"], PROMPT_MEL, msg=name)
        assert prompt_mel_frames(wav24k.shape[-1], feat_cfg) == mel.shape[1], name

        n_tokens = int(c["fake_n_tokens"])
        assert tokenizer(logmel).shape == (1, n_tokens), name  # the stand-in model has the released length rule
        n = aligned_length(n_tokens, mel.shape[1])
        tokens, feat = _fake_speech_tokens(spec["fake_speech_tokenizer"], n_tokens)[:, :n], mel[:, : 2 * n]
        assert_close(tokens, c["aligned_prompt_speech_token"], EXACT, msg=name)
        assert_close(feat, c["aligned_prompt_speech_feat"], PROMPT_MEL, msg=name)


# ---------------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("MP3", None)])
def test_formats_decode_from_bytes(fmt, subtype):
    if fmt not in sf.available_formats():
        pytest.skip(f"libsndfile {sf.__libsndfile_version__} has no {fmt} support")
    x = _speechlike(16000, 2.0)
    wav, rate = decode_audio(_encode(x, 16000, fmt, subtype))
    assert rate == 16000
    assert wav.shape[0] == 1 and wav.dtype == np.float32
    assert abs(wav.shape[1] / rate - 2.0) < 0.1
    assert validate(wav, rate) == []


def test_multichannel_file_decodes_channels_first(tmp_path):
    x = np.stack([_speechlike(24000, 1.0, seed=s) for s in range(3)], axis=1)  # [n, 3]
    sf.write(tmp_path / "three.flac", x, 24000, subtype="PCM_24")
    decoded, rate = decode_audio(str(tmp_path / "three.flac"))
    assert rate == 24000 and decoded.shape == (3, 24000) and decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, x.T, rtol=0, atol=2.0**-23)  # 24-bit quantisation only


def test_gradio_multichannel_int16_decodes_like_the_file():
    left = _speechlike(22050, 1.5, seed=1)
    right = _speechlike(22050, 1.5, seed=2)
    pcm = np.round(np.stack([left, right], axis=1) * 32767).astype(np.int16)  # [n, 2]
    decoded, rate = decode_audio((22050, pcm))
    assert rate == 22050 and decoded.shape == (2, pcm.shape[0])
    np.testing.assert_array_equal(decoded, decode_audio(_encode(pcm, 22050))[0])  # as libsndfile reads the WAV


def _err(source) -> str:
    """The one line the prompt path rejects `source` with: decoding first, then validation (as the engine)."""
    with pytest.raises(InputError) as e:
        validate(*decode_audio(source))
    return str(e.value)


def test_empty_bytes_rejected():
    assert _err(b"") == "Prompt audio is empty (0 bytes); upload a WAV, FLAC, OGG or MP3 file of speech."


def test_empty_file_rejected(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    assert _err(str(tmp_path / "empty.wav")) == ("Prompt audio is empty (0 bytes); upload a WAV, FLAC, OGG or MP3 "
                                                 "file of speech.")


def test_not_audio_rejected():
    assert _err(b"this is a text file, not a recording" * 10) == ("Prompt audio could not be decoded; accepted "
                                                                  "formats: WAV, FLAC, OGG or MP3.")


def test_low_sample_rate_rejected():
    assert _err(_encode(_speechlike(8000, 2.0), 8000)) == ("Prompt audio sample rate is 8000 Hz; at least 16000 Hz "
                                                          "is required.")


def test_too_short_rejected():
    assert _err(_encode(_speechlike(16000, 0.2), 16000)) == ("Prompt audio is 0.2 s long; it must be between 0.5 "
                                                            "and 30 s.")


def test_too_long_rejected():
    assert _err(_encode(_speechlike(16000, 40.0), 16000)) == ("Prompt audio is 40.0 s long; it must be between 0.5 "
                                                             "and 30 s.")


def test_silent_rejected():
    assert _err(_encode(np.zeros(32000, np.float32), 16000)) == ("Prompt audio is silent (peak below -60 dBFS); "
                                                                "record or upload audible speech.")


def test_nan_rejected():
    x = _speechlike(16000, 1.0)
    x[100] = np.nan
    msg = "Prompt audio contains NaN or infinite samples; provide finite PCM or float audio."
    assert _err(_encode(x, 16000, subtype="FLOAT")) == msg
    x[100] = np.inf
    assert _err((16000, x)) == msg


def test_clipping_is_a_warning():
    x = np.clip(_speechlike(16000, 2.0) * 10, -1, 1)
    wav, rate = decode_audio(_encode(x, 16000, subtype="FLOAT"))
    assert wav.shape[1] / rate == pytest.approx(2.0)
    warnings = validate(wav, rate)
    assert len(warnings) == 1 and warnings[0].startswith("Prompt audio is clipped (")


def test_noise_is_a_warning():
    warnings = validate(*decode_audio((16000, _speechlike(16000, 2.0, noise=0.1))))
    assert len(warnings) == 1 and warnings[0].startswith("Prompt audio is noisy (estimated SNR ")


def test_trim_silence():
    rate = 16000
    x = np.concatenate([np.zeros(rate // 2), _speechlike(rate, 0.3), np.zeros(int(0.7 * rate))]).astype(np.float32)
    audio = PromptAudio(torch.from_numpy(x)[None], rate)
    trimmed = trim_silence(audio)
    sound = np.nonzero(x)[0]
    kept = np.nonzero(trimmed.wav[0].numpy())[0]
    lead, tail = kept[0] / rate, (trimmed.wav.shape[1] - 1 - kept[-1]) / rate
    assert 0.1 <= lead <= 0.1 + 0.025 and 0.1 - 0.025 <= tail <= 0.1 + 0.025  # margins, to within one frame
    offset = sound[0] - kept[0]
    assert_close(trimmed.wav, audio.wav[:, offset: offset + trimmed.wav.shape[1]], EXACT)
    assert kept.size == sound.size
    with pytest.raises(InputError, match="after trimming silence"):
        trim_silence(audio, margin_s=0.0)


def test_resample_is_torchaudio_default_and_length():
    x = torch.randn(1, 44100)
    y = resample(x, 44100, 16000)
    assert y.shape == (1, 16000)
    assert_close(y, torchaudio.transforms.Resample(44100, 16000)(x), EXACT)  # the same kernel
    assert resample(x, 16000, 16000) is x


# ---------------------------------------------------------------------------------------------------- ONNX


@pytest.mark.parametrize("frames", [1, 2, 7, 100, 311])
def test_random_speech_tokenizer_shapes(onnx_models, frames):
    tokenizer, _ = onnx_models
    assert tokenizer.input_names == ["feats", "feats_length"]
    log_mel = torch.randn(1, 128, frames, generator=torch.Generator().manual_seed(frames))
    ids = tokenizer(log_mel)
    assert ids.dtype == torch.int32
    assert ids.shape == (1, ((frames + 1) // 2 + 1) // 2)
    assert int(ids.min()) >= 0 and int(ids.max()) < 6561
    assert_close(tokenizer(log_mel), ids, EXACT)


def test_random_tokenizer_seed_changes_weights(tmp_path, onnx_models):
    write_s3_speech_tokenizer(tmp_path / "other.onnx", seed=99, **TINY_TOKENIZER)
    log_mel = torch.randn(1, 128, 400, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(SpeechTokenizer(tmp_path / "other.onnx")(log_mel), onnx_models[0](log_mel))


def test_a_full_random_model_brings_a_tokenizer_of_the_released_size(tmp_path, monkeypatch):
    """`full` replaces small stand-ins (an older cache's) with the released sizes (the tokenizer with one block here to
    keep it quick; the released six: 124M parameters); a second call leaves them; they run on their threads."""
    monkeypatch.setattr(random_model, "FULL_TOKENIZER_LAYERS", {Family.COSYVOICE2: 1})
    monkeypatch.setattr(onnx_models_module, "TOKENIZER_THREADS", 3)
    monkeypatch.setattr(onnx_models_module, "SPEAKER_THREADS", 2)
    config = ModelConfig.tiny()
    path, campplus = tmp_path / "speech_tokenizer_v2.onnx", tmp_path / "campplus.onnx"
    random_model.write_frontend_files(tmp_path, config, seed=0)
    small = path.stat().st_size, campplus.stat().st_size
    random_model.write_frontend_files(tmp_path, config, seed=0, full=True)
    written = path.stat(), campplus.stat()
    assert max(small) < 1e6 and written[0].st_size > random_model.FULL_TOKENIZER_BYTES  # 1280 channels, one block
    assert written[1].st_size > random_model.FULL_CAMPPLUS_BYTES
    assert not list(tmp_path.glob("*.partial"))  # written beside, then renamed into place
    random_model.write_frontend_files(tmp_path, config, seed=0, full=True)
    assert (path.stat().st_mtime_ns, campplus.stat().st_mtime_ns) == tuple(w.st_mtime_ns for w in written)
    tokenizer, speaker = SpeechTokenizer(path), SpeakerEncoder(campplus)
    assert tokenizer.runtime.get_session_options().intra_op_num_threads == 3
    assert speaker.runtime.get_session_options().intra_op_num_threads == 2
    for frames in (20, 601):
        embedding = speaker(torch.randn(1, frames, 80, generator=torch.Generator().manual_seed(frames)))
        assert embedding.shape == (1, 192) and torch.isfinite(embedding).all() and embedding.std() > 0
    for frames in (1, 250, 603):
        ids = tokenizer(torch.randn(1, 128, frames, generator=torch.Generator().manual_seed(frames)))
        assert ids.shape == (1, ((frames + 1) // 2 + 1) // 2) and ids.dtype == torch.int32
        assert int(ids.min()) >= 0 and int(ids.max()) < 6561
    assert len(set(ids.flatten().tolist())) > 50  # of 151 frames: the random weights spread over the codes


def test_random_campplus_shapes(onnx_models):
    _, speaker = onnx_models
    assert speaker.input_names == ["input"]
    a = speaker(torch.randn(1, 148, 80))
    assert a.shape == (1, 192) and a.dtype == torch.float32
    assert speaker(torch.randn(1, 20, 80)).shape == (1, 192)
    assert torch.isfinite(a).all()


def test_missing_and_corrupt_onnx_files(tmp_path):
    with pytest.raises(CheckpointError, match="campplus.onnx is missing"):
        SpeakerEncoder(tmp_path / "campplus.onnx")
    (tmp_path / "speech_tokenizer_v2.onnx").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="speech_tokenizer_v2.onnx is not a valid ONNX model"):
        SpeechTokenizer(tmp_path / "speech_tokenizer_v2.onnx")


def test_extract_prompt_features(onnx_models):
    tokenizer, speaker = onnx_models
    rate = 22050
    audio = PromptAudio(torch.from_numpy(_speechlike(rate, 3.1))[None], rate)
    feats = start_prompt_features(audio, tokenizer, speaker, FeatureConfig()).result()
    n_mel = round(3.1 * 24000) // 480
    n_tok = ((round(3.1 * 16000) // 160 + 1) // 2 + 1) // 2
    n = min(n_mel // 2, n_tok)
    assert feats.speech_tokens.shape == (1, n) and feats.speech_tokens.dtype == torch.int32
    assert feats.embedding.shape == (1, 192) and feats.embedding.dtype == torch.float32
    assert feats.mel.shape == (1, 2 * n, 80) and feats.mel.dtype == torch.float32


def test_the_speaker_embedding_is_made_beside_the_tokens(onnx_models):
    """The tokenizer waits until the speaker encoder has started: made one after the other, it would wait in vain."""
    tokenizer, speaker = onnx_models
    started = threading.Event()

    def speaker_started(fbank):
        started.set()
        return speaker(fbank)

    def tokens_once_the_speaker_runs(log_mel):
        assert started.wait(timeout=60), "the speaker embedding did not start before the tokens were made"
        return tokenizer(log_mel)

    audio = PromptAudio(torch.from_numpy(_speechlike(16000, 2.0))[None], 16000)
    feats = start_prompt_features(audio, tokens_once_the_speaker_runs, speaker_started, FeatureConfig()).result()
    plain = start_prompt_features(audio, tokenizer, speaker, FeatureConfig()).result()
    assert_close(feats.embedding, plain.embedding, EXACT)
    assert_close(feats.speech_tokens, plain.speech_tokens, EXACT)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
def test_the_resampled_length_is_what_resample_makes(rate):
    """The tokens' alignment reads the prompt's length at the model rate without resampling it: the same length."""
    for n in (1, 2, 7, 147, 1000, 22051, 48001):
        x = torch.zeros(1, n)
        for target in (16000, 24000):
            assert resampled_length(n, rate, target) == resample(x, rate, target).shape[-1], (n, rate, target)


def test_the_tokenizers_log_mel_is_made_before_the_workers_start(onnx_models, monkeypatch):
    """The log-mel on the way to the speech tokens (the critical path of a new voice) is made before the speaker
    encoder's fbank and the prompt mel start beside it, so their CPU work does not slow it."""
    tokenizer, speaker = onnx_models
    order = []

    def noted(name, fn):
        def run(*args):
            order.append(f"{name} starts")
            out = fn(*args)
            order.append(f"{name} ends")
            return out
        return run

    monkeypatch.setattr(features_module, "whisper_log_mel", noted("log-mel", features_module.whisper_log_mel))
    monkeypatch.setattr(features_module, "kaldi_fbank", noted("fbank", features_module.kaldi_fbank))
    monkeypatch.setattr(features_module, "prompt_mel", noted("mel", features_module.prompt_mel))
    audio = PromptAudio(torch.from_numpy(_speechlike(16000, 2.0))[None], 16000)
    start_prompt_features(audio, tokenizer, speaker, FeatureConfig()).result()
    assert order[:2] == ["log-mel starts", "log-mel ends"] and sorted(order[2:]) == sorted(
        ["fbank starts", "fbank ends", "mel starts", "mel ends"])


def test_the_speech_tokens_come_before_the_mel_and_the_speaker_embedding(onnx_models, monkeypatch):
    """The LLM reads only the speech tokens: they come back (aligned to the mel's length) while the speaker encoder
    and the mel, its resampling to the model rate included, are still being made (here: until the test lets them
    finish), those two as futures that `result()` waits for; the features are the same as made without a wait."""
    tokenizer, speaker = onnx_models
    release, mel_of, resample_of = threading.Event(), features_module.prompt_mel, features_module.resample
    model_rate = FeatureConfig().sampling_rate

    def held(fn):
        def run(*args):
            assert release.wait(timeout=60), "the test never released the workers"
            return fn(*args)
        return run

    def resample_held(wav, orig, target):
        return (held(resample_of) if target == model_rate else resample_of)(wav, orig, target)

    audio = PromptAudio(torch.from_numpy(_speechlike(22050, 2.3))[None], 22050)
    plain = start_prompt_features(audio, tokenizer, speaker, FeatureConfig()).result()
    monkeypatch.setattr(features_module, "prompt_mel", held(mel_of))
    monkeypatch.setattr(features_module, "resample", resample_held)
    returned, box = threading.Event(), []
    threading.Thread(target=lambda: (box.append(start_prompt_features(audio, tokenizer, held(speaker),
                                                                      FeatureConfig())), returned.set())).start()
    try:
        assert returned.wait(timeout=60), "the speech tokens waited for the mel or the speaker embedding"
        pending = box[0]
        assert not pending.mel.done() and not pending.embedding.done()
        assert_close(pending.speech_tokens, plain.speech_tokens, EXACT)
    finally:
        release.set()
    made = pending.result()
    assert_close(made.mel, plain.mel, EXACT)
    assert_close(made.embedding, plain.embedding, EXACT)


# ---------------------------------------------------------------------------------------------------- cache


class _Counting:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, x):
        self.calls += 1
        return self.inner(x)


def test_cache_hit_skips_work(onnx_models):
    tokenizer, speaker = (_Counting(m) for m in onnx_models)
    audio = PromptAudio(torch.from_numpy(_speechlike(16000, 1.0))[None], 16000)
    cache = PromptCache()

    def features(a: PromptAudio, text: str) -> PromptFeatures:
        key = prompt_key(a, text)
        cached = cache.get(key)
        return cached or cache.put(key, start_prompt_features(a, tokenizer, speaker, FeatureConfig()).result())

    first = features(audio, "hello")
    again = features(PromptAudio(audio.wav.clone(), audio.sample_rate), "hello")  # same content, new object
    assert again is first
    assert (tokenizer.calls, speaker.calls) == (1, 1)
    assert (cache.hits, cache.misses) == (1, 1)
    assert features(audio, "other text") is not first
    louder = PromptAudio(audio.wav * 0.5, audio.sample_rate)
    assert features(louder, "hello") is not first
    assert tokenizer.calls == 3 and len(cache) == 3
    assert cache.nbytes == 3 * first.nbytes


def _features(nbytes_each: int) -> PromptFeatures:
    return PromptFeatures(torch.zeros(1, nbytes_each // 4, dtype=torch.int32), torch.zeros(0), torch.zeros(0))


def test_cache_lru_eviction_by_bytes():
    cache = PromptCache(max_bytes=2000)
    a, b, c = (_features(800) for _ in range(3))
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now most recent
    cache.put("c", c)  # 2400 > 2000: evicts b, the least recently used
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
    assert cache.nbytes == 1600
    huge = _features(4000)
    assert cache.put("huge", huge) is huge and cache.get("huge") is None
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_cache_concurrent_misses_share_one_object():
    cache = PromptCache()
    results, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(cache.get("k") or cache.put("k", _features(64)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert len(cache) == 1 and cache.nbytes == 64
