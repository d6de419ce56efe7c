"""Voices by name: read-only built-in voices shipped with the project, and saved voices kept on disk.

Built-in voices are the example prompts in `assets/` (`NAME.wav` + its transcript `NAME.txt`): usable from the first
start, never deleted or replaced. OpenAI's voice names (`OPENAI_VOICES`) speak with them, so a client written for
OpenAI works unchanged. Their features are not stored: the engine computes them on first use, through its prompt
cache.

Each saved voice is `<name>.safetensors` (tensors only) + `<name>.json` (metadata). No pickle anywhere, and names are
validated so that no request can read or write outside the store's folder. A saved voice's speech tokens come from
its family's speech tokenizer (v2 for CosyVoice2, v3 for CosyVoice3), so its metadata records the family. It also
holds the prompt audio it was made from, so that a model of the other family can extract its own features from it
(the engine does that; a store reads the audio only for a voice of the other family). Format version 1 predates
CosyVoice3: its voices are CosyVoice2's; versions 1 and 2 hold no audio.

The prompt audio is stored as the frontend reads it before trimming: mono float32 at its own sample rate (both of
the frontend's resamplings, to 16 kHz and to the model's rate, start from it, so any other rate would change the
features), at most `MAX_PROMPT_SECONDS` long. That is 4 bytes per sample, at most 4 x 30 x rate: 1.9 MB at 16 kHz,
2.9 MB at 24 kHz, 5.8 MB at 48 kHz, beside the features' 16.1 kB per second of prompt (0.5 MB for 30 s).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from cosyvoice_opt.config import Family
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.audio import PromptAudio
from cosyvoice_opt.frontend.features import PromptFeatures
from cosyvoice_opt.limits import MAX_PROMPT_SECONDS

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}")
_TENSORS = ("speech_tokens", "embedding", "mel")
_AUDIO = "prompt_audio"  # [1, N] float32, at the metadata's "prompt_sample_rate"
FORMAT_VERSION = 3  # 2: records "family"; 3: holds the prompt audio ("prompt_audio", "prompt_sample_rate")
_FAMILY_NAMES = {Family.COSYVOICE2: "CosyVoice2", Family.COSYVOICE3: "CosyVoice3"}
BUILTIN_DIR = Path(__file__).resolve().parents[2] / "assets"
# OpenAI's voice names -> the built-in voice that speaks for each (by the OpenAI voice's usual gender; fable is
# OpenAI's British voice, en_male is British English). The one table: the API and the README read it.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "en_female", "ash": "en_male", "ballad": "en_male", "coral": "en_female", "echo": "en_male",
    "fable": "en_male", "onyx": "en_male", "nova": "en_female", "sage": "en_female", "shimmer": "en_female",
    "verse": "en_male",
}


class VoiceExists(InputError):
    """A save under a name that is already saved, without asking to overwrite it."""


class ReadOnlyVoice(InputError):
    """A save or delete aimed at a built-in voice (or one of OpenAI's names for them)."""


@dataclass(frozen=True)
class BuiltinVoice:
    """A read-only prompt: `audio` is its file, `prompt_text` the transcript (zero-shot needs it)."""

    name: str
    audio: Path
    prompt_text: str


@dataclass
class SavedVoice:
    """A saved voice: `features` come from `family`'s speech tokenizer; `audio` is the prompt they were extracted
    from (mono, untrimmed, at its own rate), read only by a store of the other family (its own uses the features);
    None otherwise, and for a voice saved without it (format versions 1 and 2)."""

    name: str
    features: PromptFeatures
    meta: dict[str, Any]
    family: Family
    audio: PromptAudio | None = None


def check_name(name: str) -> str:
    """A voice name: 1-64 letters, digits, spaces, `_`, `.` or `-`, starting with a letter or digit, without `..`
    and not ending in a space or dot (both are silently dropped by some filesystems)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name[-1] in " .":
        raise InputError(f"Invalid voice name {str(name)[:80]!r}; use 1-64 letters, digits, spaces, '_', '.' or '-', "
                         "starting with a letter or digit.")
    return name


def _write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """Write through a temporary file in the same folder and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def family_name(family: Family) -> str:
    return _FAMILY_NAMES[family]


def _exists(name: str) -> VoiceExists:
    return VoiceExists(f"A voice named {name!r} is already saved; choose another name or ask to overwrite it.")


def find_builtin_voices(folder: str | os.PathLike | None) -> dict[str, BuiltinVoice]:
    """Every `NAME.wav` in `folder` with a non-empty transcript `NAME.txt` and a valid name (none if no folder)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    found = {}
    for wav in sorted(Path(folder).glob("*.wav")):
        txt = wav.with_suffix(".txt")
        text = txt.read_text(encoding="utf-8").strip() if txt.is_file() else ""
        if text and _NAME.fullmatch(wav.stem):
            found[wav.stem] = BuiltinVoice(wav.stem, wav.resolve(), text)
    return found


class VoiceStore:
    """Saved voices in a folder, plus the read-only built-in voices of `builtin_dir`, for a model of `family`. Safe
    to share between threads."""

    def __init__(self, folder: str | os.PathLike, builtin_dir: str | os.PathLike | None = BUILTIN_DIR,
                 family: Family = Family.COSYVOICE2):
        self.family = Family(family)
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._builtins = find_builtin_voices(builtin_dir)
        self.aliases = {alias: name for alias, name in OPENAI_VOICES.items() if name in self._builtins}

    # ---- built-in voices ---------------------------------------------------------------------------------------
    def builtin_names(self) -> list[str]:
        """The built-in voices' own names (not OpenAI's aliases), sorted."""
        return sorted(self._builtins)

    def builtin(self, name: str) -> BuiltinVoice | None:
        """The built-in voice `name` stands for (its own name or an OpenAI alias), else None."""
        return self._builtins.get(self.aliases.get(name, name)) if isinstance(name, str) else None

    def names(self) -> list[str]:
        """Every voice a request can name without an alias: built-in and saved, sorted."""
        return sorted(set(self._builtins) | set(self.list()))

    def prompt_text(self, name: str) -> str:
        """The transcript a voice was made from ("" when it was saved without one); reads no tensors."""
        builtin = self.builtin(name)
        if builtin is not None:
            return builtin.prompt_text
        return str(self.meta(name).get("prompt_text", ""))

    def meta(self, name: str) -> dict[str, Any]:
        """A saved voice's metadata; reads no tensors."""
        with self._lock:
            return self._meta(name)

    def _meta(self, name: str) -> dict[str, Any]:
        """`meta`, with the lock held (a concurrent save replaces both files under it)."""
        tensors_path, meta_path = self._paths(name)
        if not (tensors_path.is_file() and meta_path.is_file()):
            raise InputError(f"Unknown voice {name!r}; {self._known()}.")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if not isinstance(meta, dict):
                raise ValueError("metadata is not a JSON object")
            return meta
        except (OSError, ValueError) as e:
            raise _unreadable(name) from e

    def families(self, name: str) -> list[Family]:
        """The families a saved voice speaks with: the one whose speech tokens it holds and, when it holds its
        prompt audio, the other too (a model extracts its own features from that audio); reads no tensors."""
        meta = self.meta(name)
        own = _family(name, meta)
        return [own] + ([f for f in Family if f != own] if _audio_rate(name, meta) is not None else [])

    def check_writable(self, name: str, overwrite: bool = True) -> str:
        """Refuse a save before any work: an invalid name, a built-in voice's name, or (without `overwrite`) the name
        of a saved voice."""
        check_name(name)
        if self.builtin(name) is not None:
            raise ReadOnlyVoice(f"{name!r} is a built-in voice and read-only; save yours under another name.")
        if not overwrite and name in self.list():
            raise _exists(name)
        return name

    def _paths(self, name: str) -> tuple[Path, Path]:
        check_name(name)
        tensors, meta = self.folder / f"{name}.safetensors", self.folder / f"{name}.json"
        if tensors.parent != self.folder or meta.parent != self.folder:  # defence in depth; check_name forbids it
            raise InputError(f"Invalid voice name {name!r}.")
        return tensors, meta

    def list(self) -> list[str]:
        """Names of the complete saved voices, sorted."""
        return sorted(p.stem for p in self.folder.glob("*.json")
                      if _NAME.fullmatch(p.stem) and p.with_suffix(".safetensors").is_file())

    def save(self, name: str, features: PromptFeatures, meta: dict[str, Any] | None = None,
             overwrite: bool = True, audio: PromptAudio | None = None) -> None:
        """Save a voice, replacing one of the same name only with `overwrite`. `meta` must be JSON-serialisable
        (prompt text, mode, ...); the family, creation time and format version are added. `audio` is the prompt
        the features were extracted from (mono `[1, N]`, untrimmed, at its own rate): with it the voice speaks
        with either family; without it only with this store's."""
        self.check_writable(name)
        tensors_path, meta_path = self._paths(name)
        tensors = {k: getattr(features, k).detach().to("cpu").contiguous() for k in _TENSORS}
        record = {**(meta or {}), "name": name, "family": self.family.value, "format_version": FORMAT_VERSION,
                  "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        if audio is not None:
            tensors[_AUDIO] = _check_audio(audio)
            record["prompt_sample_rate"] = int(audio.sample_rate)
        text = json.dumps(record, ensure_ascii=False, indent=1)
        with self._lock:  # the existence check under the lock: of two racing saves without overwrite, one wins
            if not overwrite and (tensors_path.exists() or meta_path.exists()):
                raise _exists(name)
            _write_atomic(tensors_path, lambda p: save_file(tensors, p))
            _write_atomic(meta_path, lambda p: Path(p).write_text(text, encoding="utf-8"))

    def load(self, name: str) -> SavedVoice:
        with self._lock:
            meta = self._meta(name)
            family, rate = _family(name, meta), _audio_rate(name, meta)
            try:
                with safe_open(self._paths(name)[0], framework="pt") as f:
                    features = PromptFeatures(*(f.get_tensor(k) for k in _TENSORS))
                    if rate is not None and not _stores_mono_float32(f):
                        raise ValueError("the prompt audio is not mono float32 samples")
                    # only a model of the other family needs the audio (up to a few MB): its own reads the features
                    audio = f.get_tensor(_AUDIO) if rate is not None and family != self.family else None
            except (SafetensorError, OSError, ValueError, KeyError) as e:
                raise _unreadable(name) from e
        return SavedVoice(name, features, meta, family, None if audio is None else PromptAudio(audio, rate))

    def delete(self, name: str) -> None:
        if self.builtin(name) is not None:
            raise ReadOnlyVoice(f"{name!r} is a built-in voice and cannot be deleted; only saved voices can.")
        tensors_path, meta_path = self._paths(name)
        with self._lock:
            if not (tensors_path.exists() or meta_path.exists()):
                raise InputError(f"Unknown voice {name!r}; {self._known()}.")
            tensors_path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)

    def _known(self) -> str:
        names = self.list()
        saved = f"saved voices: {', '.join(names)}" if names else "no voices are saved yet"
        return f"built-in voices: {', '.join(self.builtin_names())}; {saved}" if self._builtins else saved


def _family(name: str, meta: dict[str, Any]) -> Family:
    """The family whose speech tokens a voice holds (format version 1 predates CosyVoice3: CosyVoice2)."""
    try:
        return Family(meta.get("family", Family.COSYVOICE2.value))
    except ValueError:
        raise InputError(f"Saved voice {name!r} names an unknown model family {meta.get('family')!r}; delete it "
                         "and save it again.") from None


def _audio_rate(name: str, meta: dict[str, Any]) -> int | None:
    """The stored prompt audio's sample rate, None when the voice holds no audio."""
    rate = meta.get("prompt_sample_rate")
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise InputError(f"Saved voice {name!r} has an invalid prompt sample rate {rate!r}; delete it and save it "
                         "again.")
    return rate


def _check_audio(audio: PromptAudio) -> torch.Tensor:
    """The prompt audio as stored: mono float32 `[1, N]` on the CPU, no longer than a prompt may be."""
    wav = audio.wav.detach().to("cpu")
    if not _is_mono_float32(wav):
        raise InputError(f"A voice's prompt audio must be mono float32 samples [1, N], got {wav.dtype} "
                         f"{list(wav.shape)}.")
    if wav.shape[1] > MAX_PROMPT_SECONDS * audio.sample_rate:
        raise InputError(f"A voice's prompt audio is {wav.shape[1] / audio.sample_rate:.1f} s long; at most "
                         f"{MAX_PROMPT_SECONDS:g} s is kept.")
    return wav.contiguous()


def _is_mono_float32(wav: torch.Tensor) -> bool:
    return wav.dim() == 2 and wav.shape[0] == 1 and wav.shape[1] > 0 and wav.dtype == torch.float32


def _stores_mono_float32(f: Any) -> bool:
    """Whether an open safetensors file holds prompt audio as saved (`_check_audio`), read from its header only."""
    if _AUDIO not in list(f.keys()):  # the open file answers keys(), not `in`
        return False
    stored = f.get_slice(_AUDIO)
    shape = stored.get_shape()
    return stored.get_dtype() == "F32" and len(shape) == 2 and shape[0] == 1 and shape[1] > 0


def _unreadable(name: str) -> InputError:
    return InputError(f"Saved voice {name!r} is unreadable; delete it and save it again.")
