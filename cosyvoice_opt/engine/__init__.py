"""The streaming engine: `Engine.from_model_dir(...)`, then `stream` / `synthesize` requests.

`Engine` and `EngineConfig` are imported lazily, so that light modules (`engine.types`, `engine.token2wav`)
import without pulling in the whole engine and its frontend (which itself uses `engine.types`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosyvoice_opt.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    if name in __all__:
        from cosyvoice_opt.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
