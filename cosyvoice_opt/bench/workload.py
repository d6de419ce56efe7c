"""Synthetic traffic for the benchmarks: voices, texts, request specs and Poisson arrival times.

Everything is drawn from a seed, and each request from its own generator (`seed`, `index`), so request `i` is the
same whatever rate or order it is sent at, and a spec pickles small (a voice is its parameters; the waveform is
made where it is needed). No model or engine is imported here: the sweep, the soak and the serving benchmark share
it, in-process or in a client process.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf

PROMPT_RATE = 16000  # Hz of the synthetic prompts (the frontend's minimum)
TOKENS_PER_SECOND = 25  # CosyVoice2 speech tokens per second of audio
WORDS_PER_SECOND = 2.5  # English speaking rate: text length that matches an audio length
_VOCABULARY = (
    "the a morning river light quiet city garden window story music evening bright small old new green blue warm "
    "cold long short road house friend family teacher student market table paper letter voice song dream cloud "
    "mountain forest ocean island bridge station train ticket coffee bread apple orange summer winter autumn spring "
    "yesterday today tomorrow always never often slowly quickly gently softly carefully happily walks runs sings "
    "reads writes opens closes finds keeps brings takes gives makes sees hears knows thinks remembers builds paints "
    "watches follows carries under over near behind across through between with without before after and but "
    "because while every each some many few little great simple honest careful patient curious"
)
_WORDS = _VOCABULARY.split()


def synthetic_prompt(seconds: float = 3.0, rate: int = PROMPT_RATE, f0: float = 170.0, glide: float = 50.0,
                     glide_hz: float = 0.7, envelope_hz: float = 4.0, noise: float = 0.01,
                     seed: int = 0) -> tuple[int, np.ndarray]:
    """A voiced-sounding signal: a harmonic tone gliding `f0` +- `glide` Hz, with syllable-rate amplitude (sin^2 at
    `envelope_hz`) and seeded noise. The defaults are the sweep's fixed 3 s prompt; other values make other voices,
    so each request of the serving benchmark misses the prompt cache as a new speaker does."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = f0 + glide * np.sin(2 * np.pi * glide_hz * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * envelope_hz * t) ** 2
    hiss = np.random.default_rng(seed).normal(0, noise, t.shape)
    return rate, (0.25 * tone * envelope + hiss).astype(np.float32)


def wav_bytes(rate: int, wave: np.ndarray) -> bytes:
    """16-bit WAV file bytes, as a prompt is uploaded over HTTP."""
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def sentence(rng: np.random.Generator, words: int) -> str:
    """One sentence of `words` words and no inner punctuation, so the frontend keeps it as one text piece."""
    picked = [str(w) for w in rng.choice(_WORDS, size=max(1, words))]
    return " ".join(picked).capitalize() + "."


@dataclass(frozen=True)
class Voice:
    """A synthetic speaker: the parameters of its prompt, and the prompt's transcript."""

    name: str
    seconds: float
    f0: float
    glide: float
    glide_hz: float
    envelope_hz: float
    noise: float
    seed: int
    prompt_text: str

    def audio(self) -> tuple[int, np.ndarray]:
        return synthetic_prompt(self.seconds, PROMPT_RATE, self.f0, self.glide, self.glide_hz, self.envelope_hz,
                                self.noise, self.seed)


@dataclass(frozen=True)
class RequestSpec:
    """One request: its voice, its text and the audio length it asks for."""

    index: int
    voice: Voice
    text: str
    audio_seconds: float

    @property
    def tokens(self) -> int:
        """Speech tokens that make `audio_seconds` (what the in-process transport forces)."""
        return max(1, round(self.audio_seconds * TOKENS_PER_SECOND))


@dataclass(frozen=True)
class Workload:
    """The request distributions: prompt and output lengths uniform over their ranges (seconds), text length from
    the output length at `words_per_second`. A `voice_variant` other than 0 gives each request a twin of its voice
    (same length, pitch and transcript, other noise and name): the same requests, new to the engine's caches, for a
    second transport on the same engine."""

    prompt_seconds: tuple[float, float] = (3.0, 10.0)
    audio_seconds: tuple[float, float] = (2.0, 20.0)
    words_per_second: float = WORDS_PER_SECOND
    seed: int = 0
    voice_variant: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_seconds", "audio_seconds"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name} must be a range 0 < low <= high, got {low}, {high}")

    def request(self, index: int) -> RequestSpec:
        """Request `index`: the same for the same seed, whatever else was drawn before."""
        rng = np.random.default_rng([self.seed, index])
        seconds = float(rng.uniform(*self.prompt_seconds))
        f0 = float(rng.uniform(90.0, 240.0))
        variant = f"-v{self.voice_variant}" if self.voice_variant else ""
        voice = Voice(
            name=f"bench-{self.seed}-{index}{variant}",
            seconds=seconds,
            f0=f0,
            glide=float(rng.uniform(0.05, 0.3)) * f0,
            glide_hz=float(rng.uniform(0.3, 1.5)),
            envelope_hz=float(rng.uniform(1.5, 3.0)),  # sin^2: syllables at twice this rate
            noise=float(rng.uniform(0.003, 0.02)),
            seed=(int(rng.integers(2**31)) + self.voice_variant) % 2**31,
            prompt_text=sentence(rng, round(seconds * self.words_per_second)),
        )
        audio = float(rng.uniform(*self.audio_seconds))
        return RequestSpec(index, voice, sentence(rng, round(audio * self.words_per_second)), audio)


def poisson_arrivals(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of `rate` per second: exponential gaps, seeded."""
    if rate <= 0 or duration <= 0:
        return []
    rng = np.random.default_rng([seed, 0x5EED])
    times: list[float] = []
    t = float(rng.exponential(1 / rate))
    while t < duration:
        times.append(t)
        t += float(rng.exponential(1 / rate))
    return times
