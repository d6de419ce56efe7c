"""The Gradio WebUI: a page over a ready engine, its launch, and the `python app.py` entry point.

layout.py builds the page (components, limits from limits.py, events); handlers.py turns UI values into engine
calls (generation, voices, prompt checks); settings.py holds the operator's engine-wide settings and who may change
them; cli.py parses the flags, launches the server (or mounts the page on another app: the cluster's ingress) and
runs it.
"""

from cosyvoice_opt.webui.cli import (
    build_parser,
    exposure_warning,
    launch,
    main,
    mount_ui,
    parse_args,
    parse_auth,
)
from cosyvoice_opt.webui.layout import ASSETS, build_app

__all__ = ["ASSETS", "build_app", "build_parser", "exposure_warning", "launch", "main", "mount_ui", "parse_args",
           "parse_auth"]
