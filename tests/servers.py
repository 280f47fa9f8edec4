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
    """Seconds until the ragblend server at ``url`` has an empty queue, its background jobs (the
    passages it stores after answers) done too; fails past ``within_s``."""
    t0 = time.monotonic()
    while (health := httpx.get(f"{url}/health", timeout=10, headers=headers).json())["queue_depth"] or \
            health["background_jobs"]:
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"the server was still computing {within_s} s after the request ended")
        time.sleep(0.05)
    return time.monotonic() - t0


class RunningServer:
    """``ragblend serve``'s app (``create_app(engine, **options)``) under uvicorn in a thread of this
    process; ``stop()`` or leaving a ``with`` block stops it."""

    def __init__(self, engine, **options):
        import uvicorn

        from ragblend.serving.app import create_app, uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # ragblend serve's own uvicorn settings (its HTTP parser and limits)
        config = uvicorn_config(create_app(engine, **options), "127.0.0.1", self.port, log_level="warning")
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


def ragblend_serve(kv_dir: str, *extra: str, timeout_s: float = 300) -> ServerProcess:
    """``ragblend serve`` (the embedded model unless ``extra`` names another) in a child process on a
    free port; its URL is ``.url``. Loading the model took 145 s on a 2-core host at a load of 12."""
    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    return ServerProcess([sys.executable, "-m", "ragblend.cli", "serve", "--port", port, "--kv-dir", kv_dir, *extra],
                         http_ok(f"{url}/health"), "ragblend serve", timeout_s, url=url, stderr=subprocess.DEVNULL)


class HealthPoller:
    """Polls ``url``/health every ``interval_s`` in a thread while a ``with`` block runs; then
    ``latencies`` (seconds), ``failures`` (polls not answered 200) and :meth:`summary`."""

    def __init__(self, url: str, interval_s: float = 0.02, timeout_s: float = 10):
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - t)
                self.failures += not ok
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")

    def summary(self) -> str:
        return (f"{len(self.latencies)} /health polls: p50 {self.percentile(0.5) * 1e3:.1f} ms, p99 "
                f"{self.percentile(0.99) * 1e3:.1f} ms, max {max(self.latencies, default=0) * 1e3:.1f} ms, "
                f"{self.failures} failed")


def header_flood(url: str, total_bytes: int, *, time_limit_s: float = 20, piece_bytes: int = 1 << 16,
                 path: str = "/v1/chat/completions") -> dict:
    """A client sending ``total_bytes`` of request head over raw sockets (header lines of ~1 KB,
    never the blank line that ends a head): whenever the server closes the connection it opens
    another and goes on, until all is sent or ``time_limit_s`` passes. Returns ``sent`` (bytes
    the server's side took, kernel buffers included), ``connections``, ``most_on_one`` (the
    most bytes one connection took), ``statuses`` (the status lines answered) and ``seconds``."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    piece = line * max(1, piece_bytes // len(line))
    sent, connections, most, statuses = 0, 0, 0, {}
    t0 = time.monotonic()
    while sent < total_bytes and time.monotonic() - t0 < time_limit_s:
        connections += 1
        on_this = 0
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.settimeout(2)
            try:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode())
                while sent < total_bytes and time.monotonic() - t0 < time_limit_s:
                    sock.sendall(piece)
                    sent, on_this = sent + len(piece), on_this + len(piece)
            except OSError:   # reset or broken pipe: the server closed it
                pass
            try:
                status = sock.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
            except OSError:
                status = "reset"
        statuses[status] = statuses.get(status, 0) + 1
        most = max(most, on_this)
    return {"sent": sent, "connections": connections, "most_on_one": most, "statuses": statuses,
            "seconds": time.monotonic() - t0}
