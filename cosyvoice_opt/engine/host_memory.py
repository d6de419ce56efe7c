"""glibc's malloc arenas, bounded: a server's threads come and go, and each new one may open an arena of its own.

Every request passes through several threads (the HTTP server's workers, the frontend's, the engine's two), and
glibc gives a thread that finds the arenas in use a new one, up to 8 per core. Memory freed into an arena stays
with it, so with many arenas the process holds more and more freed memory that no other thread reuses. Measured on
the H200 host (16 cores) at 8 requests/s for 80 s (docs/benchmarks.md): memory in use stayed at 4.8 GB, while the
free memory kept by the arenas grew from 4 MB to 1.18 GB, and RSS with it (5.7 -> 7.2 GB); with two arenas the free
memory stayed under 0.1 GB and RSS went 5.8 -> 6.1 GB, at the same latency and throughput.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ARENA_ENV = "MALLOC_ARENA_MAX"
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` for the threads that start from now on, unless `MALLOC_ARENA_MAX` is
    already set (glibc then read it at start-up). True when the cap is in force; False without glibc."""
    if os.environ.get(ARENA_ENV):
        return True
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    if not mallopt(_M_ARENA_MAX, arenas):
        log.warning("could not cap malloc arenas at %d", arenas)
        return False
    return True
