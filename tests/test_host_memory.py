"""The engine caps glibc's malloc arenas: threads that start afterwards share two arenas instead of opening one each
(the freed memory that many arenas keep was the server's growing RSS under load)."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

ARENAS = """
import ctypes, ctypes.util, os, re, sys, tempfile, threading
from cosyvoice_opt.engine.host_memory import limit_malloc_arenas
if sys.argv[1] == "capped":
    assert limit_malloc_arenas(2)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
together = threading.Barrier(8)

def work():
    together.wait()  # all alive at once: none can take over an arena another has let go of
    blocks = [libc.malloc(4096) for _ in range(64)]
    together.wait()
    for b in blocks:
        libc.free(b)

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
path = os.path.join(tempfile.mkdtemp(), "info.xml")
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(len(re.findall(r'<heap nr="', open(path).read())))
"""


def _arenas(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}  # no MALLOC_ARENA_MAX from outside
    out = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.system() != "Linux" or "glibc" not in " ".join(platform.libc_ver())
                    or ctypes.util.find_library("c") is None, reason="glibc's malloc arenas only")
def test_threads_share_two_arenas_once_capped():
    assert _arenas("default") > 2  # each of the 8 threads opens its own
    assert _arenas("capped") <= 2
