"""Prompt features, bit-compatible with upstream: whisper log-mel (tokenizer input), kaldi fbank (CAM++ input),
the 24 kHz matcha mel (flow condition) and the token/mel alignment of the zero-shot modes."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torchaudio.compliance import kaldi

from cosyvoice_opt.config import FeatureConfig
from cosyvoice_opt.frontend.audio import PromptAudio, resample, resampled_length

if TYPE_CHECKING:
    from collections.abc import Callable

    from cosyvoice_opt.frontend.onnx_models import SpeakerEncoder

TOKENIZER_RATE = 16000
WHISPER_HOP = 160  # samples per frame of the tokenizer's log-mel
TOKEN_MEL_RATIO = 2
FEATURE_WORKERS = 8  # speaker embeddings and mels made at once: 4 new voices' (the rest queue for a worker)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    linear = f / f_sp
    log = min_log_hz / f_sp + np.log(np.maximum(f, min_log_hz) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log, linear)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@lru_cache(maxsize=8)
def slaney_mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """`librosa.filters.mel` (Slaney scale and area norm) -> float32 `[n_mels, n_fft//2+1]`, rounded like librosa:
    triangles in float64 stored as float32, then scaled by the float64 norm and rounded to float32 again."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.fft.rfftfreq(n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper)).astype(np.float32)
    enorm = 2.0 / (mel_f[2:] - mel_f[:-2])
    weights = (weights.astype(np.float64) * enorm[:, None]).astype(np.float32)
    weights.flags.writeable = False
    return weights


@lru_cache(maxsize=16)
def _filters(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax).copy()).to(device)


@lru_cache(maxsize=8)
def _hann(n: int, device: torch.device) -> torch.Tensor:
    return torch.hann_window(n, device=device)


def whisper_log_mel(wav16k: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """OpenAI whisper's `log_mel_spectrogram`: `[B, N]` 16 kHz -> `[B, n_mels, N // 160]` (tokenizer input)."""
    n_fft, hop = 400, WHISPER_HOP
    spec = torch.stft(wav16k, n_fft, hop, window=_hann(n_fft, wav16k.device), return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = _filters(TOKENIZER_RATE, n_fft, n_mels, 0.0, None, wav16k.device) @ power
    log = torch.clamp(mel, min=1e-10).log10()
    log = torch.maximum(log, log.amax(dim=(-2, -1), keepdim=True) - 8.0)
    return (log + 4.0) / 4.0


def kaldi_fbank(wav16k: torch.Tensor) -> torch.Tensor:
    """CAM++ input: 80-bin kaldi fbank of `[1, N]` 16 kHz audio minus its per-bin mean over time -> `[1, T, 80]`."""
    feat = kaldi.fbank(wav16k, num_mel_bins=80, dither=0, sample_frequency=TOKENIZER_RATE)
    return (feat - feat.mean(dim=0, keepdim=True)).unsqueeze(0)


def prompt_mel(wav: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """Matcha's `mel_spectrogram(center=False)`: `[B, N]` at `cfg.sampling_rate` -> natural-log mel `[B, N // hop, 80]`
    (time-major, the flow's prompt condition)."""
    pad = (cfg.n_fft - cfg.hop_size) // 2
    wav = F.pad(wav.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(wav, cfg.n_fft, hop_length=cfg.hop_size, win_length=cfg.win_size,
                      window=_hann(cfg.win_size, wav.device), center=False, return_complex=True)
    spec = torch.view_as_real(spec)
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    mel = _filters(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax, wav.device) @ mag
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


def prompt_mel_frames(n_samples: int, cfg: FeatureConfig) -> int:
    """Frames that `prompt_mel` makes of `n_samples` samples, known before it runs."""
    pad = (cfg.n_fft - cfg.hop_size) // 2
    return (n_samples + 2 * pad - cfg.n_fft) // cfg.hop_size + 1


def aligned_length(n_tokens: int, mel_frames: int) -> int:
    """Zero-shot rule: a prompt keeps `n = min(mel_frames // 2, n_tokens)` speech tokens and its first `2n` mel
    frames."""
    return min(mel_frames // TOKEN_MEL_RATIO, n_tokens)


def then(future: Future, fn: Callable) -> Future:
    """A future of `fn(result)`, computed in the thread that completes `future` (its error passes through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:
            out.set_exception(e)

    future.add_done_callback(done)
    return out


@dataclass
class PromptFeatures:
    """Everything the model needs from a prompt voice: tokens `[1, n]` int32, CAM++ `[1, 192]`, mel `[1, 2n, 80]`."""

    speech_tokens: torch.Tensor
    embedding: torch.Tensor
    mel: torch.Tensor
    warnings: tuple[str, ...] = ()  # prompt-quality warnings (clipping, noise), shown with the first chunk

    @property
    def nbytes(self) -> int:
        return self.speech_tokens.nbytes + self.embedding.nbytes + self.mel.nbytes


@dataclass
class PendingFeatures:
    """A new prompt's features while worker threads still make the parts that only the flow reads (after the LLM's
    first tokens): its speech tokens (all the LLM reads) are ready, its mel and speaker embedding are futures."""

    speech_tokens: torch.Tensor
    mel: Future[torch.Tensor]
    embedding: Future[torch.Tensor]
    warnings: tuple[str, ...] = ()

    def result(self) -> PromptFeatures:
        """The whole features, once they are made (raises a worker's error)."""
        return PromptFeatures(self.speech_tokens, self.embedding.result(), self.mel.result(), self.warnings)

    def when_made(self, fn: Callable[[PromptFeatures], None]) -> None:
        """Call `fn(features)` once, in the thread that finishes the last part, if every part was made without error
        (a worker thread waits on nothing)."""
        parts, called, lock = (self.mel, self.embedding), [], threading.Lock()

        def check(_: Future) -> None:
            if not all(f.done() and f.exception() is None for f in parts):
                return
            with lock:
                if called:
                    return
                called.append(True)
            fn(self.result())

        for f in parts:
            f.add_done_callback(check)


@lru_cache(maxsize=1)
def _worker_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(FEATURE_WORKERS, thread_name_prefix="cosyvoice-features")


def start_prompt_features(audio: PromptAudio, tokenizer: Callable[[torch.Tensor], torch.Tensor],
                          speaker: SpeakerEncoder, feat_cfg: FeatureConfig,
                          warnings: tuple[str, ...] = ()) -> PendingFeatures:
    """Upstream's zero-shot prompt path: resample to 16 kHz (tokens, speaker) and to the model rate (mel), align.
    The speaker embedding and the mel are made in worker threads (onnxruntime and torch's CPU kernels run without the
    interpreter lock) and come as futures: the caller has the speech tokens as soon as they are made, and a caller
    that needs the whole features (`result()`) waits for the longest of the three, not for their sum. The tokenizer's
    log-mel, on the way to the tokens, is made before the workers start, so that it has the host's cores to itself;
    the tokens' alignment needs only the length of the prompt at the model rate, so its resampling is the mel
    worker's."""
    wav16k = resample(audio.wav, audio.sample_rate, TOKENIZER_RATE)
    log_mel = whisper_log_mel(wav16k)  # before the workers start: their CPU work would slow it (p95 23 ms, run AP)
    embedding = _worker_pool().submit(lambda: speaker(kaldi_fbank(wav16k)))
    mel = _worker_pool().submit(lambda: prompt_mel(resample(audio.wav, audio.sample_rate, feat_cfg.sampling_rate),
                                                   feat_cfg))
    tokens = tokenizer(log_mel)
    samples = resampled_length(audio.wav.shape[-1], audio.sample_rate, feat_cfg.sampling_rate)
    n = aligned_length(tokens.shape[1], prompt_mel_frames(samples, feat_cfg))
    return PendingFeatures(tokens[:, :n].contiguous(),
                           then(mel, lambda m: m[:, : TOKEN_MEL_RATIO * n].contiguous()), embedding, warnings)
