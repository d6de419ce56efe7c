"""Sampling in a background thread: the one `Sampler`, and the GPU (NVML) or CPU (psutil) `Monitor` built on it.

The WebUI's panel reads the Monitor's short history; the benchmarks read its mean GPU utilisation over their
measured window; the soak samples process memory with a `Sampler` of its own reading, and the serving benchmark reads
`host_memory` at each load's start and end.
"""

from __future__ import annotations

import ctypes
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import pandas as pd
import psutil

GIB = 1 << 30
log = logging.getLogger(__name__)
T = TypeVar("T")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_heap() -> dict:
    """glibc's heap over all arenas: bytes in use (mmapped blocks included) and bytes free but kept. RSS that grows
    with `heap_free_mb` while `heap_in_use_mb` stays is fragmentation, not a leak; {} where glibc is not the libc."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"heap_in_use_mb": round((info.uordblks + info.hblkhd) / 2**20, 1),
            "heap_free_mb": round(info.fordblks / 2**20, 1)}


def host_memory() -> dict:
    """This process's RSS and glibc's heap (`malloc_heap`), in MB."""
    return {"rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1), **malloc_heap()}


@dataclass(frozen=True)
class Sample:
    """One reading. GPU fields are None on a machine without NVML; `util` is then the CPU's."""

    t: float  # time.time()
    util: float  # percent
    mem_used: float  # bytes (GPU memory, or RAM without a GPU)
    mem_total: float
    proc_mem: float | None  # bytes this process holds (GPU memory, or RSS without a GPU)
    temperature: float | None = None  # deg C
    power: float | None = None  # watts


def _nvml_handle():
    """The NVML handle of the GPU this process uses (first of CUDA_VISIBLE_DEVICES), or None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        return pynvml, handle, pynvml.nvmlDeviceGetName(handle)
    except Exception:  # no driver, no device, no library: all mean "no NVIDIA GPU"
        return None


def history_frame(samples: list[Sample], has_gpu: bool, now: float) -> pd.DataFrame:
    """Long-format frame for a line plot: `seconds` (<= 0, relative to `now`, the sampling clock's), `percent`,
    `series`. Shared by `Monitor` and the cluster's panel (whose replicas report their own readings)."""
    unit, mem = ("GPU", "memory") if has_gpu else ("CPU", "RAM")
    rows = []
    for s in samples:
        ago = round(s.t - now, 1)
        rows.append((ago, s.util, f"{unit} util %"))
        rows.append((ago, 100.0 * s.mem_used / s.mem_total, f"{mem} %"))
    return pd.DataFrame(rows, columns=["seconds", "percent", "series"])


def panel_row(name: str, device: str, has_gpu: bool, s: Sample) -> dict:
    """One GPU's (or CPU's) latest reading as the panel and its API show it: rounded, in GiB, None where unread."""
    def gib(value: float | None) -> float | None:
        return None if value is None else round(value / GIB, 2)

    return {"name": name, "device": device, "gpu": has_gpu, "util_percent": round(s.util, 1),
            "mem_used_gib": gib(s.mem_used), "mem_total_gib": gib(s.mem_total), "process_gib": gib(s.proc_mem),
            "temperature_c": s.temperature, "power_w": None if s.power is None else round(s.power, 1)}


class Sampler(Generic[T]):
    """Calls `read()` every `interval` s on a daemon thread and keeps its readings: the last `keep`, or all.

    One sampler serves the WebUI panel, the benchmarks' GPU busy and the soak's memory curve. A slow reading never
    delays the caller, and a failed one (a driver hiccup) skips one point without ending the sampler. Readers copy
    the readings under a lock. As a context manager it reads once on entry and once on exit, so a short window
    still has its two ends.
    """

    def __init__(self, read: Callable[[], T], interval: float, keep: int | None = None, name: str = "sampler"):
        self.read, self.interval, self.name = read, interval, name
        self._readings: deque[T] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sampler[T]:
        """Take a first reading now, then sample in the background (a second call does nothing)."""
        if self._thread is None:
            self._add(self.read())
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 + self.interval)
            self._thread = None

    def __enter__(self) -> Sampler[T]:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._add(self.read())

    def _add(self, reading: T) -> None:
        with self._lock:
            self._readings.append(reading)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                reading = self.read()
            except Exception:  # skip this point; the next one may succeed
                log.debug("%s: reading failed", self.name, exc_info=True)
                continue
            self._add(reading)

    def readings(self) -> list[T]:
        with self._lock:
            return list(self._readings)

    def latest(self) -> T | None:
        with self._lock:
            return self._readings[-1] if self._readings else None


class Monitor:
    """GPU (or CPU) readings every `interval` seconds; keeps `history_s` seconds of them (all with None)."""

    def __init__(self, interval: float = 1.0, history_s: float | None = 60.0):
        self.interval = interval
        keep = None if history_s is None else max(2, int(history_s / interval) + 1)
        self._sampler: Sampler[Sample] = Sampler(self._sample, interval, keep, name="cosyvoice-monitor")
        nvml = _nvml_handle()
        self._nvml, self._handle, self.device_name = nvml if nvml else (None, None, "CPU")
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts psutil's measuring window
        psutil.cpu_percent(None)

    @property
    def has_gpu(self) -> bool:
        return self._handle is not None

    def start(self) -> Monitor:
        self._sampler.start()
        return self

    def stop(self) -> None:
        self._sampler.stop()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def gpu_busy(self, since: float | None = None, until: float | None = None) -> float | None:
        """Mean GPU utilisation (%) of the readings taken in [since, until] (`time.time()`; open ends by default);
        None without a GPU or without a reading in the window."""
        if not self.has_gpu:
            return None
        values = [s.util for s in self._sampler.readings()
                  if (since is None or s.t >= since) and (until is None or s.t <= until)]
        return statistics.fmean(values) if values else None

    def _sample(self) -> Sample:
        if self._handle is None:
            mem = psutil.virtual_memory()
            return Sample(time.time(), psutil.cpu_percent(None), mem.total - mem.available, mem.total,
                          self._proc.memory_info().rss)
        nv, h = self._nvml, self._handle
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        temperature = self._optional(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        power_mw = self._optional(nv.nvmlDeviceGetPowerUsage, h)
        return Sample(
            time.time(),
            float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
            float(mem.used),
            float(mem.total),
            self._process_gpu_memory(),
            None if temperature is None else float(temperature),
            None if power_mw is None else power_mw / 1000.0,
        )

    def _optional(self, fn, *args):
        """Readings some drivers or virtualised GPUs do not support come back as None."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _process_gpu_memory(self) -> float | None:
        """NVML's per-process figure; inside a container (other pid namespace) fall back to torch's reservation."""
        pid = os.getpid()
        try:
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return float(p.usedGpuMemory)
        except self._nvml.NVMLError:
            pass
        torch = sys.modules.get("torch")  # never import torch (or start CUDA) just to monitor
        if torch is not None and torch.cuda.is_initialized():
            return float(torch.cuda.memory_reserved())
        return None

    def latest(self) -> Sample:
        return self._sampler.latest() or self._sample()

    def readings(self) -> list[Sample]:
        """The kept readings, oldest first."""
        return self._sampler.readings()

    def history(self) -> pd.DataFrame:
        """Long-format frame for a line plot: `seconds` (<= 0, relative to now), `percent`, `series`."""
        return history_frame(self._sampler.readings(), self.has_gpu, time.time())

    def rows(self) -> list[dict]:
        """The panel's data, one row per GPU (here: the one this process uses, or the CPU)."""
        return [panel_row("this server", self.device_name, self.has_gpu, self.latest())]

    def summary(self) -> str:
        """Markdown for the sidebar panel."""
        s = self.latest()
        if not self.has_gpu:
            return (
                "**No NVIDIA GPU: running on CPU**\n\n"
                f"CPU: {s.util:.0f} % ({psutil.cpu_count()} cores)  \n"
                f"RAM: {s.mem_used / GIB:.1f} / {s.mem_total / GIB:.1f} GiB  \n"
                f"This process: {s.proc_mem / GIB:.2f} GiB RSS"
            )
        def fmt(value, spec, unit):
            return "n/a" if value is None else f"{value:{spec}} {unit}"

        return (
            f"**{self.device_name}**\n\n"
            f"Utilisation: {s.util:.0f} %  \n"
            f"Memory: {s.mem_used / GIB:.1f} / {s.mem_total / GIB:.1f} GiB  \n"
            f"Temperature: {fmt(s.temperature, '.0f', '°C')}  \n"
            f"Power: {fmt(s.power, '.0f', 'W')}  \n"
            f"This process: {fmt(None if s.proc_mem is None else s.proc_mem / GIB, '.2f', 'GiB')}"
        )
