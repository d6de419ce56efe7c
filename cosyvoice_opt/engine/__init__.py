"""The streaming engine: `Engine.from_model_dir(...)`, then `stream` / `synthesize` requests.

The request/response types live one floor down in `cosyvoice_opt.types`, so the frontend uses them without
importing the engine.
"""

from cosyvoice_opt.engine.engine import Engine, EngineConfig, check_request

__all__ = ["Engine", "EngineConfig", "check_request"]
