"""The model names this server answers to: the served model's own id, its family's documented alias, and OpenAI's
speech model names (so that OpenAI clients work unchanged). Any other name is refused as OpenAI does:
404 `model_not_found`."""

from __future__ import annotations

from pathlib import Path

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


def model_ids(info: dict) -> list[str]:
    """The served model's own id (no server paths: a folder's name), its family ("cosyvoice2", as the README's
    examples send), then OpenAI's speech model names."""
    own = info["model"].replace(" ", "-") if info["is_random"] else Path(info["model"]).name
    names = [own, info.get("family", "cosyvoice2"), *OPENAI_MODELS]
    return list(dict.fromkeys(names))  # in order, each once
