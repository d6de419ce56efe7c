"""Request and response types on the bottom floor: the frontend, engine, HTTP API, UI and CLI all speak these."""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np


class Mode(str, enum.Enum):
    ZERO_SHOT = "zero_shot"  # "3 s clone": prompt audio + its transcript
    CROSS_LINGUAL = "cross_lingual"  # prompt audio only; target text in any language
    INSTRUCT2 = "instruct2"  # prompt audio + a natural-language instruction
    SFT = "sft"  # a saved speaker, no prompt audio


class TextStream:
    """Text that arrives while its speech is made (bidirectional streaming, e.g. a voice agent's LLM output): the
    producer `push`es pieces as they come and `close`s at the end; the engine `take`s them between decode steps,
    never blocking on the producer. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pieces: deque[str] = deque()
        self._closed = False
        self.aborted = False  # the producer went away: the request is cancelled, not finished
        self._listener: Callable[[], None] = lambda: None
        self.last_push = time.monotonic()  # when text last arrived (or the stream was made)
        self.push_times: list[float] = []  # monotonic time of each push, in order
        self.closed_at: float | None = None  # monotonic time of close() (or abort())
        # Set by the engine: when the text that let speech decoding start arrived (the push that completed the
        # prompt blocks and the first text block, or the end of the text when it came first), so that a client can
        # time its first audio from its own text rather than from its call.
        self.unlocked_at: float | None = None
        # Set by the engine with the first audio: when the text arrived that the first audio waited for last (the
        # text whose decode cycle made the first chunk's last speech token), which tells the engine's own latency
        # from the time the text took to come.
        self.first_audio_text_at: float | None = None

    def push(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"text pieces are strings, got {type(text).__name__}")
        with self._lock:
            if self._closed:
                raise ValueError("text pushed after close()")
            self._pieces.append(text)
            self.last_push = time.monotonic()
            self.push_times.append(self.last_push)
        self._listener()

    def close(self) -> None:
        """The text is complete."""
        with self._lock:
            if not self._closed:
                self.closed_at = time.monotonic()
            self._closed = True
        self._listener()

    def abort(self) -> None:
        """The producer is gone (a client disconnected): the engine cancels the request and frees what it holds."""
        with self._lock:
            if not self._closed:
                self.closed_at = time.monotonic()
            self._closed = self.aborted = True
        self._listener()

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self) -> tuple[list[str], bool]:
        """The pieces that arrived since the last call, and whether the text is complete."""
        with self._lock:
            pieces = list(self._pieces)
            self._pieces.clear()
            return pieces, self._closed

    def pending(self) -> bool:
        """Something to take: a piece or the end."""
        return bool(self._pieces) or self._closed

    def listen(self, callback: Callable[[], None]) -> None:
        """`callback()` after every push and at close (the engine's wake-up)."""
        self._listener = callback

    @classmethod
    def pump(cls, pieces: Iterable[str], stop: Callable[[], bool] = lambda: False,
             rate: float | None = None) -> TextStream:
        """A stream fed from an iterable by a daemon thread, until it ends or `stop()` holds (checked before each
        push; a producer that blocks forever keeps the thread, not the engine). With `rate`, piece k is pushed
        k / `rate` s after the start, as an LLM streams its output (demos and benchmarks)."""
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        stream = cls()

        def run() -> None:
            start = time.monotonic()
            try:
                for k, piece in enumerate(pieces):
                    if rate is not None:
                        time.sleep(max(0.0, start + k / rate - time.monotonic()))
                    if stop() or stream.closed:
                        return
                    try:
                        stream.push(piece)
                    except ValueError:  # closed or aborted by its consumer meanwhile
                        return
            finally:
                stream.close()

        threading.Thread(target=run, name="cosyvoice-text-pump", daemon=True).start()
        return stream


@dataclass
class SynthesisRequest:
    """One text to speak. `prompt_audio` is a path, raw file bytes or a (sample_rate, array) tuple. `text` may also
    arrive while the speech is made: a `TextStream`, or any iterable of strings (bidirectional streaming)."""

    text: str | TextStream | Iterable[str]
    mode: Mode = Mode.ZERO_SHOT
    prompt_audio: str | bytes | tuple[int, np.ndarray] | None = None
    prompt_text: str = ""
    instruct_text: str = ""
    voice: str | None = None  # a saved voice name, instead of prompt audio/text
    stream: bool = True
    speed: float = 1.0
    seed: int = 0
    max_tokens: int | None = None  # cap on generated speech tokens per text piece
    force_tokens: int | None = None  # benchmarks: exactly this many tokens, ignoring EOS (streamed text: see bistream)


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
