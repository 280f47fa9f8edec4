"""Servers on 127.0.0.1 for the benchmarks and the tests: a free port, ``ragblend serve``'s app in a
uvicorn thread or any server in a child process, started and waited for, and a wait for the queue
to empty. One copy, so that every harness starts and stops its servers the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx


class ServerDidNotStart(RuntimeError):
    """A server did not answer in time, or its process ended before it did."""


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def non_loopback_address() -> str | None:
    """This machine's address on its outgoing interface (no packet is sent), or None: where to
    check from that a server bound to 127.0.0.1 is not reachable over the network."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def reachable(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` opens."""
    try:
        socket.create_connection((address, port), timeout=3).close()
        return True
    except OSError:
        return False


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness check: ``url`` answers 200."""
    return lambda: httpx.get(url, timeout=2).status_code == 200


def wait_until_up(ready: Callable[[], bool], what: str, timeout_s: float,
                  process: subprocess.Popen | None = None, interval_s: float = 0.2) -> None:
    """Poll ``ready()`` (an exception counts as not yet) until it is true; raise
    :class:`ServerDidNotStart` past ``timeout_s`` or as soon as ``process`` has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except Exception:   # connection refused, a half-started server: not up yet
            pass
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            raise ServerDidNotStart(f"{what} did not start")
        time.sleep(interval_s)


def wait_idle(url: str, within_s: float = 60, headers: dict | None = None) -> float:
    """Seconds until the ragblend server at ``url`` has an empty queue; fails past ``within_s``."""
    t0 = time.monotonic()
    while httpx.get(f"{url}/health", timeout=10, headers=headers).json()["queue_depth"]:
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"the server was still computing {within_s} s after the request ended")
        time.sleep(0.05)
    return time.monotonic() - t0


class RunningServer:
    """``ragblend serve``'s app (``create_app(engine, **options)``) under uvicorn in a thread of this
    process; ``stop()`` or leaving a ``with`` block stops it."""

    def __init__(self, engine, **options):
        import uvicorn

        from ragblend.serving.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, **options), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until_up(lambda: self.server.started, "the server", timeout_s=30, interval_s=0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """A server in a child process, waited for until ``ready()``; ``stop()`` ends it (and, with
    ``own_session``, the processes it started: ``ragblend app`` starts streamlit)."""

    def __init__(self, args: list[str], ready: Callable[[], bool], what: str, timeout_s: float,
                 url: str | None = None, own_session: bool = False, **popen):
        self.url = url
        self.process = subprocess.Popen(args, start_new_session=own_session, **popen)
        self.own_session = own_session
        try:
            wait_until_up(ready, what, timeout_s, process=self.process)
        except ServerDidNotStart:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process.poll() is None:
            if self.own_session:
                os.killpg(self.process.pid, signal.SIGTERM)
            else:
                self.process.terminate()
        self.process.wait(timeout=30)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ragblend_serve(kv_dir: str, *extra: str, timeout_s: float = 120) -> ServerProcess:
    """``ragblend serve`` (the embedded model unless ``extra`` names another) in a child process on a
    free port; its URL is ``.url``."""
    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    return ServerProcess([sys.executable, "-m", "ragblend.cli", "serve", "--port", port, "--kv-dir", kv_dir, *extra],
                         http_ok(f"{url}/health"), "ragblend serve", timeout_s, url=url, stderr=subprocess.DEVNULL)
