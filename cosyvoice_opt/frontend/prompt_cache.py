"""LRU cache of prompt features, bounded in bytes: the same voice reused across requests skips both ONNX models."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

from cosyvoice_opt.frontend.audio import PromptAudio
from cosyvoice_opt.frontend.features import PromptFeatures


def prompt_key(audio: PromptAudio, prompt_text: str = "") -> str:
    """sha256 of the decoded mono float32 samples, the sample rate and the prompt text."""
    samples = audio.wav.detach().to("cpu", dtype=torch.float32).contiguous().numpy().astype("<f4", copy=False)
    h = hashlib.sha256(samples.tobytes())
    h.update(f"|{samples.size}|{audio.sample_rate}|".encode())
    h.update(prompt_text.encode())
    return h.hexdigest()


class PromptCache:
    """Thread-safe LRU of `PromptFeatures` by total tensor bytes; entries larger than the budget are not kept."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> PromptFeatures | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: str, value: PromptFeatures) -> PromptFeatures:
        """Store `value` (unless `key` is already present, in which case the stored one wins) and return the stored
        one, so concurrent misses for one key all end up sharing a single object."""
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                self._entries.move_to_end(key)
                return existing
            if value.nbytes > self.max_bytes:
                return value
            self._entries[key] = value
            self.nbytes += value.nbytes
            while self.nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
            return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
