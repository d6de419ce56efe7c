"""Load tests against this process: the HTTP API served here on loopback, and the clients in a child process.

The clients run in a spawned process so that their Python does not compete with the engine for this process's
GIL, and so that this process's readings (memory, GPU) are the server's alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator

CHILD_START_S = 120.0  # a spawned child imports numpy, httpx and this package before its first job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_process(engine, api_key: str | None = None) -> Iterator[str]:
    """The HTTP API over `engine` on 127.0.0.1 (loopback only) in a thread; yields its base URL."""
    import uvicorn
    from fastapi import FastAPI

    from cosyvoice_opt.server import mount_api

    app = FastAPI()
    mount_api(app, engine, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="loopback-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _serve_jobs(jobs, results) -> None:
    """The child's loop: run each (function, args) and send back ("ok", result) or ("error", message)."""
    results.put(("ok", None))  # started
    while (job := jobs.get()) is not None:
        fn, args = job
        try:
            results.put(("ok", fn(*args)))
        except Exception as e:
            results.put(("error", f"{type(e).__name__}: {e}"))


class ClientProcess:
    """A spawned child that runs module-level functions on request: `call(fn, *args)` returns `fn(*args)` from the
    child (picklable arguments and result) or raises RuntimeError with the child's error."""

    def __init__(self, name: str = "load-clients") -> None:
        ctx = multiprocessing.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._child = ctx.Process(target=_serve_jobs, args=(self._jobs, self._results), name=name, daemon=True)

    def __enter__(self) -> ClientProcess:
        self._child.start()
        self._receive(CHILD_START_S)
        return self

    def __exit__(self, *exc) -> None:
        self._jobs.put(None)
        self._child.join(60)
        if self._child.is_alive():
            self._child.kill()

    def call(self, fn: Callable, *args, timeout: float | None = None):
        self._jobs.put((fn, args))
        return self._receive(timeout)

    def _receive(self, timeout: float | None):
        """The child's next answer; waits in short steps so that a child that died is noticed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                status, value = self._results.get(timeout=1.0)
                break
            except queue.Empty:  # check the child and the deadline
                if not self._child.is_alive():
                    raise RuntimeError(f"the client process ended (exit code {self._child.exitcode})") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("the client process did not answer in time") from None
        if status == "error":
            raise RuntimeError(value)
        return value
