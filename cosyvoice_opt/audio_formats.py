"""The audio file formats the project writes (the HTTP API's `response_format`, the CLI's `-o` file name): one table
and one encoder, so both offer the same formats with the same settings."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import soundfile as sf

from cosyvoice_opt.errors import InputError

FORMATS = ("wav", "pcm", "flac", "mp3", "opus")  # whole files, all written by libsndfile (pcm: raw s16le)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg"}
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
              "opus": ("OGG", "OPUS")}


def encode_clip(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """A whole int16 mono clip as a `fmt` file (`pcm`: raw little-endian 16-bit samples, no header)."""
    if fmt == "pcm":
        return pcm.astype("<i2").tobytes()
    buf = io.BytesIO()
    container, subtype = _SOUNDFILE[fmt]
    sf.write(buf, pcm, rate, format=container, subtype=subtype)
    return buf.getvalue()


def format_for_path(path: str | os.PathLike) -> str:
    """The format a file name asks for by its extension (case-insensitive); `InputError` names the ones accepted."""
    fmt = Path(path).suffix.lower().removeprefix(".")
    if fmt not in FORMATS:
        what = f"unsupported extension '.{fmt}'" if fmt else "no extension"
        raise InputError(f"Output file {os.fspath(path)!r} has {what}; use one of "
                         f"{', '.join('.' + f for f in FORMATS)}.")
    return fmt
