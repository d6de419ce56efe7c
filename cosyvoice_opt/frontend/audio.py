"""Prompt audio: decode (path, bytes or a gradio (rate, array) tuple), validate, trim, resample.

Decoding uses soundfile (libsndfile): WAV, FLAC, OGG/Vorbis/Opus and, with libsndfile >= 1.1, MP3. Validation turns
every unusable input into an `InputError` with one line saying what was wrong and what is accepted; problems that
still allow cloning (clipping, noise) come back as warnings on the result instead.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import soundfile as sf
import torch
import torchaudio

from cosyvoice_opt import limits
from cosyvoice_opt.errors import InputError

MIN_SAMPLE_RATE = limits.MIN_PROMPT_SAMPLE_RATE
MIN_SECONDS = limits.MIN_PROMPT_SECONDS
MAX_SECONDS = limits.MAX_PROMPT_SECONDS
MAX_FILE_BYTES = limits.MAX_UPLOAD_BYTES
SILENCE_PEAK = 1e-3  # -60 dBFS: below this the whole file counts as silence
CLIP_LEVEL = 0.99
CLIP_FRACTION = 0.01  # warn when >= 1% of samples sit at full scale
MIN_SNR_DB = 10.0  # warn below this estimated speech-to-noise ratio
FORMATS = "WAV, FLAC, OGG or MP3"

AudioSource = str | os.PathLike | bytes | tuple[int, np.ndarray]


@dataclass
class PromptAudio:
    """Mono float32 audio `[1, N]` in [-1, 1] at its original rate, plus non-fatal quality warnings."""

    wav: torch.Tensor
    sample_rate: int
    warnings: list[str] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.wav.shape[-1] / self.sample_rate


def decode_audio(source: AudioSource) -> tuple[np.ndarray, int]:
    """-> (float32 `[channels, n]`, rate), without any validation of the content."""
    if isinstance(source, tuple):
        rate, array = source
        return _array_to_float(np.asarray(array)), int(rate)
    if isinstance(source, bytes | bytearray):
        size = len(source)
        source = io.BytesIO(source)
    elif not os.path.isfile(source):
        raise InputError(f"Prompt audio file was not found; upload a {FORMATS} file of speech.")
    else:
        size = os.path.getsize(source)
    if size == 0:
        raise InputError(f"Prompt audio is empty (0 bytes); upload a {FORMATS} file of speech.")
    if size > MAX_FILE_BYTES:
        raise InputError(f"Prompt audio file is {size / 2**20:.1f} MiB; the limit is {MAX_FILE_BYTES >> 20} MiB "
                         f"(a {MAX_SECONDS:g} s prompt is far smaller).")
    try:
        data, rate = sf.read(source, dtype="float32", always_2d=True)
    except (RuntimeError, TypeError, ValueError) as e:  # LibsndfileError is a RuntimeError
        raise InputError(f"Prompt audio could not be decoded; accepted formats: {FORMATS}.") from e
    return np.ascontiguousarray(data.T), int(rate)


def _array_to_float(array: np.ndarray) -> np.ndarray:
    """Gradio gives `[n]` or `[n, channels]` int16; integer PCM is scaled to [-1, 1] like libsndfile does."""
    if array.size == 0:
        raise InputError(f"Prompt audio is empty (0 samples); upload or record a {FORMATS} file of speech.")
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2:
        raise InputError(f"Prompt audio array has shape {array.shape}; expected [samples] or [samples, channels].")
    if np.issubdtype(array.dtype, np.integer):
        scale = float(2 ** (8 * array.dtype.itemsize - 1))
        offset = scale if np.issubdtype(array.dtype, np.unsignedinteger) else 0.0
        array = (array.astype(np.float64) - offset) / scale
    elif not np.issubdtype(array.dtype, np.floating):
        raise InputError(f"Prompt audio array has dtype {array.dtype}; expected integer PCM or float samples.")
    return np.ascontiguousarray(array.T, dtype=np.float32)


def validate(wav: np.ndarray, rate: int) -> list[str]:
    """Raise `InputError` for unusable audio `[channels, n]`; return warnings for usable but poor audio."""
    if wav.size == 0:
        raise InputError(f"Prompt audio contains no samples; upload a {FORMATS} file of speech.")
    if not np.isfinite(wav).all():
        raise InputError("Prompt audio contains NaN or infinite samples; provide finite PCM or float audio.")
    if rate < MIN_SAMPLE_RATE:
        raise InputError(f"Prompt audio sample rate is {rate} Hz; at least {MIN_SAMPLE_RATE} Hz is required.")
    seconds = wav.shape[1] / rate
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise InputError(f"Prompt audio is {seconds:.1f} s long; it must be between {MIN_SECONDS:g} and "
                         f"{MAX_SECONDS:g} s.")
    peak = float(np.abs(wav).max())
    if peak < SILENCE_PEAK:
        raise InputError("Prompt audio is silent (peak below -60 dBFS); record or upload audible speech.")
    warnings = []
    clipped = float((np.abs(wav) >= CLIP_LEVEL).mean())
    if clipped >= CLIP_FRACTION:
        warnings.append(f"Prompt audio is clipped ({100 * clipped:.1f}% of samples at full scale); "
                        "cloning quality may suffer.")
    snr = _snr_db(wav.mean(axis=0), rate)
    if snr < MIN_SNR_DB:
        warnings.append(f"Prompt audio is noisy (estimated SNR {snr:.0f} dB); a cleaner recording clones better.")
    return warnings


def _frame_db(x: torch.Tensor, rate: int) -> torch.Tensor:
    """RMS level in dB of 25 ms frames every 10 ms (a trailing partial frame is dropped)."""
    win, hop = int(0.025 * rate), int(0.010 * rate)
    if x.shape[-1] < win:
        x = torch.nn.functional.pad(x, (0, win - x.shape[-1]))
    frames = x.unfold(-1, win, hop)
    return 10 * torch.log10(frames.pow(2).mean(-1) + 1e-12)


def _snr_db(mono: np.ndarray, rate: int) -> float:
    """Loud frames (95th percentile) over the noise floor (10th percentile): pauses between words are the floor."""
    level = _frame_db(torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32)), rate)
    return float(torch.quantile(level, 0.95) - torch.quantile(level, 0.10))


def trim_silence(audio: PromptAudio, top_db: float = 60.0, margin_s: float = 0.1) -> PromptAudio:
    """Cut leading/trailing silence.

    Rule: frames of 25 ms every 10 ms; keep from the first to the last frame whose RMS is within `top_db` dB of the
    loudest frame (upstream's old webui used librosa's trim with top_db 60), plus `margin_s` on each side.
    Raises `InputError` when what remains is shorter than the minimum prompt length.
    """
    level = _frame_db(audio.wav[0], audio.sample_rate)
    loud = torch.nonzero(level >= level.max() - top_db).squeeze(1)
    hop, win, margin = int(0.010 * audio.sample_rate), int(0.025 * audio.sample_rate), int(margin_s * audio.sample_rate)
    start = max(int(loud[0]) * hop - margin, 0)
    end = min(int(loud[-1]) * hop + win + margin, audio.wav.shape[-1])
    trimmed = replace(audio, wav=audio.wav[:, start:end])
    if trimmed.duration < MIN_SECONDS:
        raise InputError(f"Prompt audio has only {trimmed.duration:.1f} s of sound after trimming silence; "
                         f"at least {MIN_SECONDS:g} s of speech is required.")
    return trimmed


@lru_cache(maxsize=32)
def _resampler(orig: int, target: int, device: torch.device) -> torchaudio.transforms.Resample:
    return torchaudio.transforms.Resample(orig, target).to(device)


def resampled_length(n: int, orig: int, target: int) -> int:
    """The samples `resample` makes of `n`: ceil(n · target / orig), where torchaudio's kernel cuts its output."""
    g = math.gcd(orig, target)
    return -(-n * (target // g) // (orig // g))


def resample(wav: torch.Tensor, orig: int, target: int) -> torch.Tensor:
    """`torchaudio.transforms.Resample(orig, target)` with default settings, exactly as upstream's `load_wav`."""
    if orig == target:
        return wav
    return _resampler(orig, target, wav.device)(wav)
