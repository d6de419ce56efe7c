"""Request and response types on the bottom floor: the frontend, engine, HTTP API, UI and CLI all speak these."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Mode(str, enum.Enum):
    ZERO_SHOT = "zero_shot"  # "3 s clone": prompt audio + its transcript
    CROSS_LINGUAL = "cross_lingual"  # prompt audio only; target text in any language
    INSTRUCT2 = "instruct2"  # prompt audio + a natural-language instruction
    SFT = "sft"  # a saved speaker, no prompt audio


@dataclass
class SynthesisRequest:
    """One text to speak. `prompt_audio` is a path, raw file bytes or a (sample_rate, array) tuple."""

    text: str
    mode: Mode = Mode.ZERO_SHOT
    prompt_audio: str | bytes | tuple[int, np.ndarray] | None = None
    prompt_text: str = ""
    instruct_text: str = ""
    voice: str | None = None  # a saved voice name, instead of prompt audio/text
    stream: bool = True
    speed: float = 1.0
    seed: int = 0
    max_tokens: int | None = None  # cap on generated speech tokens per text piece
    force_tokens: int | None = None  # benchmarks: generate exactly this many tokens, ignoring EOS


@dataclass
class ChunkTimings:
    """Seconds since the request arrived, and where its time went so far."""

    since_arrival: float = 0.0
    frontend: float = 0.0
    llm: float = 0.0
    flow: float = 0.0
    hift: float = 0.0
    batch_size: int = 1  # requests in the LLM batch when this chunk's last token was decoded


@dataclass
class AudioChunk:
    pcm: np.ndarray  # int16, mono
    sample_rate: int
    index: int
    is_last: bool
    tokens: int  # speech tokens generated so far for this request
    timings: ChunkTimings = field(default_factory=ChunkTimings)
    warnings: tuple[str, ...] = ()  # on the first chunk: prompt-quality warnings (clipping, noise)

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate
