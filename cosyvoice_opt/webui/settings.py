"""Engine-wide settings (precision, max batch size, max queue wait): the operator's controls.

They change the server for every user, so they are read-only unless the server is started with the operator's
credentials. With `--auth`, every logged-in user is an operator; without it, only `--allow-settings` opens them.
The endpoints check the same rule as the page, so a gradio_client caller gets the answer a visitor sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from cosyvoice_opt import limits
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.webui.handlers import engine_call, refuse

log = logging.getLogger("cosyvoice_opt.webui")

PRECISIONS = ["fp32", "fp16", "bf16"]
BATCH_SLIDER_MAX = 256
BATCH_LABEL = "Engine max batch size"
QUEUE_WAIT_LABEL = "Max queue wait (s): longer waits are refused as busy"
PRECISION_LABEL = "Precision"
READ_ONLY = ("Engine settings are read-only on this server: the operator starts it with --auth (and logs in) "
             "or with --allow-settings to change them.")


@dataclass(frozen=True)
class SettingsAccess:
    """Who may change engine-wide settings: logged-in users when `auth` is on, else everyone or no one (`allow`)."""

    auth: bool
    allow: bool
    note: str = READ_ONLY  # what a visitor who may not change them reads, and how to become an operator

    def allows(self, request: gr.Request | None) -> bool:
        if self.auth:
            return request is not None and bool(request.username)
        return self.allow

    def check(self, request: gr.Request | None) -> None:
        """Refuses a settings call from someone who is not an operator, with a line saying how to become one."""
        if not self.allows(request):
            raise gr.Error(self.note, title="Read-only", print_exception=False)


def max_queue_wait(engine: Any) -> float:
    """The engine's current bound on waiting for a slot (the limits.py default on an engine that does not report
    one)."""
    return float(engine.info.get("max_queue_wait", limits.MAX_QUEUE_WAIT_S))


def can_set_queue_wait(engine: Any) -> bool:
    return hasattr(engine, "set_max_queue_wait")


def label(text: str, editable: bool) -> str:
    """A setting's label, marked read-only for a visitor who may not change it (a disabled control looks much like
    an enabled one)."""
    return text if editable else f"{text} (read-only)"


class Settings:
    """The settings endpoints and the panel's per-page-load values over one engine."""

    def __init__(self, engine: Any, access: SettingsAccess) -> None:
        self.engine = engine
        self.access = access

    def panel(self, request: gr.Request) -> tuple:
        """The panel as the engine is now, editable only for operators: runs on every page load, so a page never
        shows the settings of when the app was built."""
        info, editable = self.engine.info, self.access.allows(request)
        batch = info["max_batch_size"]
        note = "" if editable else self.access.note
        wait_editable = editable and can_set_queue_wait(self.engine)
        return (gr.Dropdown(value=info["precision"], interactive=editable, label=label(PRECISION_LABEL, editable)),
                gr.Button(interactive=editable),
                gr.Slider(value=batch, maximum=max(BATCH_SLIDER_MAX, batch), interactive=editable,
                          label=label(BATCH_LABEL, editable)),
                gr.Slider(value=max_queue_wait(self.engine), interactive=wait_editable,
                          label=label(QUEUE_WAIT_LABEL, wait_editable)),
                note)

    def shown(self) -> tuple[gr.Slider, gr.Slider, str]:
        """The batch and queue-wait controls set back to what the engine has, after a value it refused, and a line
        that says so."""
        batch, wait = self.engine.info["max_batch_size"], max_queue_wait(self.engine)
        return (gr.Slider(value=batch, maximum=max(BATCH_SLIDER_MAX, batch)), gr.Slider(value=wait),
                f"Refused: the engine keeps max batch size {batch} and max queue wait {wait:g} s.")

    def set_precision(self, precision: str, request: gr.Request) -> Iterator[str]:
        """Drains in-flight requests and reloads the model in `precision` (fp32, fp16 or bf16). Operators only."""
        self.access.check(request)
        old = self.engine.info["precision"]
        yield f"Draining in-flight requests and reloading in {precision}…"
        start = time.perf_counter()
        try:
            self.engine.set_precision(precision)
        except CosyVoiceError as e:
            log.warning("precision switch %s -> %s refused: %s", old, precision, e)
            gr.Warning(str(e))
            yield f"Still running in {self.engine.info['precision']}: {e}"
            return
        seconds = time.perf_counter() - start
        log.info("precision switched %s -> %s (reloaded in %.1f s)", old, self.engine.info["precision"], seconds)
        yield f"Running in {self.engine.info['precision']} (reloaded in {seconds:.1f} s)."

    def set_max_batch_size(self, max_batch_size: float, request: gr.Request) -> str:
        """Sets how many requests the engine decodes together (from its next step). Operators only."""
        self.access.check(request)
        now = self.engine.info["max_batch_size"]
        if not float(max_batch_size).is_integer():
            raise refuse(f"Max batch size must be a whole number of requests, not {max_batch_size:g}; the engine "
                         f"keeps {now}.")
        engine_call(self.engine.set_max_batch_size, int(max_batch_size))
        log.info("max batch size set to %d", self.engine.info["max_batch_size"])
        return f"Engine max batch size: {self.engine.info['max_batch_size']}."

    def set_max_queue_wait(self, seconds: float, request: gr.Request) -> str:
        """Sets how long a request may wait for a free engine slot before it is refused as busy. Operators only."""
        self.access.check(request)
        if not can_set_queue_wait(self.engine):
            raise gr.Error("This engine has no queue-wait setting.", print_exception=False)
        engine_call(self.engine.set_max_queue_wait, float(seconds))
        now = float(self.engine.info.get("max_queue_wait", seconds))
        log.info("max queue wait set to %g s", now)
        return f"Max queue wait: {now:g} s."
