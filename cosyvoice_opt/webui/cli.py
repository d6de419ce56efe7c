"""Flags, launch and the process entry point of the WebUI (`python app.py`, `python -m cosyvoice_opt serve`)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import gradio as gr
from fastapi import FastAPI

from cosyvoice_opt import limits
from cosyvoice_opt.config import COSYVOICE2, FAMILIES, SPEECH_TOKENIZER_CHOICES
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.server import mount_api
from cosyvoice_opt.webui.layout import ASSETS, CSS, WEIGHTS_HELP, build_app, random_notice
from cosyvoice_opt.webui.settings import PRECISIONS

log = logging.getLogger("cosyvoice_opt.webui")


def _queue_wait(value: str) -> float:
    lo, hi = limits.MAX_QUEUE_WAIT_RANGE
    seconds = float(value)
    if not lo <= seconds <= hi:
        raise argparse.ArgumentTypeError(f"must be between {lo:g} and {hi:g} seconds")
    return seconds


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The WebUI's flags (app.py's docstring lists each of them); `prog` names the command in usage lines (default:
    the script's name, app.py)."""
    p = argparse.ArgumentParser(prog=prog, description="CosyVoice2 WebUI (cosyvoice-opt)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-dir", default=None, help="CosyVoice2-0.5B folder (default: COSYVOICE_MODEL_DIR, "
                       "pretrained_models/CosyVoice2-0.5B, else a random-weight model)")
    which.add_argument("--random", choices=["tiny", "full"], default=None,
                       help="random-weight model (tests, demos)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--host", default="0.0.0.0", help="interface to serve on (0.0.0.0 = every interface; "
                   "127.0.0.1 = this machine only)")
    p.add_argument("--share", action="store_true", help="also create a public gradio.live link")
    p.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS])
    p.add_argument("--max-batch-size", type=int, default=64, help="requests the engine decodes together")
    p.add_argument("--max-queue-wait", type=_queue_wait, default=limits.MAX_QUEUE_WAIT_S, metavar="S",
                   help="seconds a request may wait for an engine slot before it is refused as busy "
                   f"(default {limits.MAX_QUEUE_WAIT_S:g}; range {limits.MAX_QUEUE_WAIT_RANGE[0]:g}-"
                   f"{limits.MAX_QUEUE_WAIT_RANGE[1]:g})")
    p.add_argument("--concurrency", type=int, default=16, help="requests the queue lets into the engine at once")
    p.add_argument("--auth", default=None, help="user:pass, or a file with one user:pass per line; logged-in "
                   "users are operators and may change the engine settings")
    p.add_argument("--allow-settings", action="store_true",
                   help="without --auth: let every visitor change the engine settings (precision, max batch "
                   "size, max queue wait); they are read-only otherwise")
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2, help="family of the --random model")
    p.add_argument("--voices-dir", default="voices", help="where saved voices are kept")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the LLM decode step on CUDA: faster decoding, slower to start (see README)")
    p.add_argument("--speech-tokenizer", choices=SPEECH_TOKENIZER_CHOICES, default="auto",
                   help="where a new voice's speech tokens are made: auto = in PyTorch on the GPU when the file is "
                   "the released network (checked against onnxruntime at start), else onnxruntime on the host")
    p.add_argument("--max-file-size", type=int, default=limits.MAX_UPLOAD_MIB,
                   help="upload limit of the web UI in MiB (prompt audio)")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY"),
                   help="bearer token the HTTP API (/v1/*, /health, /metrics) requires (default: COSYVOICE_API_KEY)")
    return p


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The flags, every one checked (--auth included) before anything loads."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.max_batch_size < 1 or args.max_file_size < 1:
        p.error("--concurrency, --max-batch-size and --max-file-size must be >= 1")
    if not 0 < args.port < 65536:
        p.error(f"--port must be from 1 to 65535, got {args.port}")
    parse_auth(args.auth)
    return args


def parse_auth(value: str | None) -> list[tuple[str, str]] | None:
    """`user:pass`, or a file of such lines (blank lines and # comments skipped)."""
    if not value:
        return None
    lines = Path(value).read_text().splitlines() if os.path.isfile(value) else [value]
    pairs = [tuple(line.strip().split(":", 1)) for line in lines if line.strip() and not line.startswith("#")]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit("--auth: expected user:pass, or a file with one user:pass per line")
    return pairs


def exposure_warning(args: argparse.Namespace) -> str | None:
    """Anyone who can reach the port can use the GPU (and, with --allow-settings, reconfigure the engine): say so
    when that is more than this machine."""
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if loopback and not args.share:
        return None
    missing = [flag for flag, value in (("--auth", args.auth), ("--api-key", args.api_key)) if not value]
    if not missing:
        return None
    who = "anyone with the gradio.live share link" if args.share else f"anyone on the network ({args.host})"
    settings = " and change its engine settings (--allow-settings)" if args.allow_settings and not args.auth else ""
    return (f"{who} can use this server{settings}: no {' and no '.join(missing)} set "
            "(--auth guards the web UI, --api-key the HTTP API).")


def _serving(args: argparse.Namespace) -> dict[str, Any]:
    """What `launch` and `mount_ui` both pass to Gradio: login, the example voices, the upload limit, the CSS."""
    return {"auth": parse_auth(args.auth), "allowed_paths": [str(ASSETS)], "max_file_size": args.max_file_size << 20,
            "css": CSS}


def mount_ui(app: FastAPI, demo: gr.Blocks, args: argparse.Namespace) -> None:
    """Serves the page at the root of `app`, behind the routes `app` already has (the cluster's ingress mounts it
    beside the HTTP API, as `launch` does on its own server)."""
    gr.mount_gradio_app(app, demo.queue(default_concurrency_limit=args.concurrency), path="/", **_serving(args))


def launch(demo: gr.Blocks, engine: Any, args: argparse.Namespace) -> str:
    """Serves the page and the HTTP API on one port without blocking; returns the local URL.

    Gradio's own start-up lines are silenced: they suggest `share=True` in `launch()`, which users of this app set
    with --share, so the URL and that hint are logged here instead."""
    app, local_url, share_url = demo.queue(default_concurrency_limit=args.concurrency).launch(
        server_name=args.host, server_port=args.port, share=args.share, prevent_thread_lock=True, quiet=True,
        **_serving(args))
    mount_api(app, engine, args.api_key)  # the OpenAI-style API shares the UI's server and port
    log.info("WebUI and HTTP API on %s (listening on %s:%d)", local_url, args.host, args.port)
    if share_url:
        log.info("public link: %s", share_url)
    elif not args.share:
        log.info("start with --share for a public gradio.live link")
    return local_url


def check_port(host: str, port: int) -> None:
    """Refuses (SystemExit) a port that another process is listening on, before the engine loads for nothing.
    Binds as the server will (address reuse on, so a port in TIME_WAIT is free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"error: --host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise SystemExit(f"error: port {port} on {host} is not free ({e.strerror}); another server may be "
                             "using it: stop it or choose another port with --port") from None


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Loads the engine, serves the WebUI until interrupted, then stops the engine."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own startup probes
    args = parse_args(argv, prog)
    check_port(args.host, args.port)
    warning = exposure_warning(args)
    if warning:
        log.warning(warning)
    # a server exits on a CUDA error that poisons the GPU (code 70), so that its supervisor starts a fresh process
    config = EngineConfig(precision=args.precision, max_batch_size=args.max_batch_size, random_size=args.random,
                          family=args.family, voices_dir=args.voices_dir, compile=args.compile,
                          max_queue_wait=args.max_queue_wait, speech_tokenizer=args.speech_tokenizer,
                          exit_on_fatal=True)
    try:
        engine = Engine.from_model_dir(args.model_dir, config)
    except CosyVoiceError as e:
        sys.exit(f"error: {e}")
    try:
        if engine.info["is_random"]:
            log.warning("%s %s", random_notice(engine, args), WEIGHTS_HELP.replace("`", ""))
        monitor = Monitor().start()
        try:
            demo = build_app(engine, args, monitor, warning)
            launch(demo, engine, args)
            demo.block_thread()
        finally:
            monitor.stop()
    finally:
        engine.close()
