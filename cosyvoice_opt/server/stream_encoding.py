"""Audio bytes as chunks arrive, for streamed responses: raw pcm, WAV with a streaming header, Ogg/Opus pages, or
server-sent events."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import numpy as np
import soundfile as sf

from cosyvoice_opt.types import AudioChunk

STREAM_FORMATS = ("wav", "pcm", "opus")  # mp3 and flac rewrite their headers at the end: not streamable here


def streaming_wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown (maximal) sizes, as OpenAI streams WAV: decoders read to the end."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" + \
        struct.pack("<I", unknown)


class _Pipe:
    """An append-only file for libsndfile's virtual IO; the Ogg/Opus writer never seeks back."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0

    def write(self, data: bytes) -> int:
        self.buf += data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class StreamEncoder:
    """`fmt` bytes as chunks arrive: raw pcm, WAV with a streaming header, or Ogg/Opus pages."""

    def __init__(self, fmt: str, rate: int) -> None:
        self._header = streaming_wav_header(rate) if fmt == "wav" else b""
        self._pipe = _Pipe()
        self._file = sf.SoundFile(self._pipe, "w", rate, 1, format="OGG", subtype="OPUS") if fmt == "opus" else None

    def feed(self, pcm: np.ndarray, last: bool) -> bytes:
        if self._file is None:
            out, self._header = self._header + pcm.astype("<i2").tobytes(), b""
            return out
        self._file.write(pcm)
        if last:
            self._file.close()
        return self._pipe.take()

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()


def pull(chunks: Iterator[AudioChunk], encoder: StreamEncoder) -> tuple[AudioChunk, bytes]:
    """Next chunk and its encoded bytes (worker thread: both block)."""
    chunk = next(chunks)
    return chunk, encoder.feed(chunk.pcm, chunk.is_last)


def sse(event: dict) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(event)}\n\n".encode()
