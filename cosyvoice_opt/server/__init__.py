"""HTTP API served beside the WebUI: `mount_api(app, engine, api_key)`."""

from cosyvoice_opt.server.openai_api import mount_api

__all__ = ["mount_api"]
