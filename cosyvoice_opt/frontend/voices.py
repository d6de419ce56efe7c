"""Saved voices: a prompt's features kept on disk so later requests (and SFT mode) can use them by name.

Each voice is `<name>.safetensors` (tensors only) + `<name>.json` (metadata). No pickle anywhere, and names are
validated so that no request can read or write outside the store's folder.
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

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cosyvoice_opt.errors import InputError
from cosyvoice_opt.frontend.features import PromptFeatures

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}")
_TENSORS = ("speech_tokens", "embedding", "mel")
FORMAT_VERSION = 1


@dataclass
class SavedVoice:
    name: str
    features: PromptFeatures
    meta: dict[str, Any]


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


class VoiceStore:
    """A folder of saved voices. Safe to share between threads."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

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

    def save(self, name: str, features: PromptFeatures, meta: dict[str, Any] | None = None) -> None:
        """Save (or replace) a voice. `meta` must be JSON-serialisable (prompt text, mode, ...); the creation time
        and format version are added."""
        tensors_path, meta_path = self._paths(name)
        tensors = {k: getattr(features, k).detach().to("cpu").contiguous() for k in _TENSORS}
        record = {**(meta or {}), "name": name, "format_version": FORMAT_VERSION,
                  "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        text = json.dumps(record, ensure_ascii=False, indent=1)
        with self._lock:
            _write_atomic(tensors_path, lambda p: save_file(tensors, p))
            _write_atomic(meta_path, lambda p: Path(p).write_text(text, encoding="utf-8"))

    def load(self, name: str) -> SavedVoice:
        tensors_path, meta_path = self._paths(name)
        with self._lock:
            if not (tensors_path.is_file() and meta_path.is_file()):
                raise InputError(f"Unknown voice {name!r}; {self._known()}.")
            try:
                tensors = load_file(tensors_path)
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                features = PromptFeatures(*(tensors[k] for k in _TENSORS))
            except (SafetensorError, OSError, ValueError, KeyError) as e:
                raise InputError(f"Saved voice {name!r} is unreadable; delete it and save it again.") from e
        return SavedVoice(name, features, meta)

    def delete(self, name: str) -> None:
        tensors_path, meta_path = self._paths(name)
        with self._lock:
            if not (tensors_path.exists() or meta_path.exists()):
                raise InputError(f"Unknown voice {name!r}; {self._known()}.")
            tensors_path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)

    def _known(self) -> str:
        names = self.list()
        return f"saved voices: {', '.join(names)}" if names else "no voices are saved yet"
