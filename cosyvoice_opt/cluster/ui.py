"""The WebUI in the ingress: the page over `RemoteEngine` with read-only engine settings, and its GPU panel with
one row per replica (`ClusterMonitor`)."""

from __future__ import annotations

import time

import pandas as pd
from fastapi import FastAPI

from cosyvoice_opt.cluster.remote_engine import RemoteEngine
from cosyvoice_opt.monitor import history_frame, panel_row


class ClusterMonitor:
    """The WebUI's GPU panel over the replicas: each one samples its own GPU and reports the readings to the board
    with its engine's; the panel has one row per replica and plots their mean."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.has_gpu = str(engine.info.get("device", "")).startswith("cuda")  # the plot's labels, at build time

    def _monitors(self) -> list[tuple[str, dict]]:
        return [(snap["replica"], snap["monitor"]) for snap in self.engine.reports()
                if snap.get("monitor", {}).get("samples")]

    def rows(self) -> list[dict]:
        """The panel's data, one row per replica: its GPU's latest reading (its CPU's and RAM without a GPU)."""
        return [panel_row(name, m["device"], m["has_gpu"], m["samples"][-1]) for name, m in self._monitors()]

    def summary(self) -> str:
        """Markdown for the sidebar panel: a table, one row per replica (named by its Serve replica id)."""
        rows = self.rows()
        if not rows:
            return "**No replica reports yet**"

        def cell(value: float | None, spec: str) -> str:
            return "n/a" if value is None else f"{value:{spec}}"

        lines = ["| Replica | Device | Util % | Memory GiB | °C | W |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['name'].rsplit('#', 1)[-1]} | {r['device']} | {r['util_percent']:.0f} | "
                         f"{r['mem_used_gib']:.1f} / {r['mem_total_gib']:.1f} | {cell(r['temperature_c'], '.0f')} | "
                         f"{cell(r['power_w'], '.0f')} |")
        unit = "GPU" if any(r["gpu"] for r in rows) else "CPU and RAM (no GPU)"
        return f"**{len(rows)} replica(s)**: {unit}; the plot is their mean.\n\n" + "\n".join(lines)

    def history(self) -> pd.DataFrame:
        """The replicas' readings of the last minute, averaged per second and series (`Monitor.history`'s frame)."""
        frames = [history_frame(m["samples"], self.has_gpu, m["time"]) for _, m in self._monitors()]
        if not frames:
            return history_frame([], self.has_gpu, time.time())
        frame = pd.concat(frames)
        frame["seconds"] = frame["seconds"].round()
        return frame.groupby(["seconds", "series"], as_index=False)["percent"].mean()[["seconds", "percent",
                                                                                       "series"]]


SETTINGS_FIXED = ("Engine settings are fixed in a cluster: every replica runs as deployed (`cluster` flags or "
                  "deploy/serve.yaml); redeploy to change them.")


def mount_webui(app: FastAPI, engine: RemoteEngine, flags: list[str]) -> None:
    """The WebUI at the root of `app`, behind its API routes, over `engine`: the page's calls go to the replicas as
    the API's do; its settings are read-only. `flags` are the webui's (`ClusterSettings.webui_flags`)."""
    from cosyvoice_opt import webui  # here: the replicas, which import this package too, never load Gradio
    from cosyvoice_opt.webui.settings import SettingsAccess

    args = webui.parse_args(flags)
    access = SettingsAccess(auth=False, allow=False, note=SETTINGS_FIXED)
    webui.mount_ui(app, webui.build_app(engine, args, ClusterMonitor(engine), access=access), args)
