"""Store writes off the TTFT path: the prefill runner hands chunk write-backs, promotions to the
memory tier and a conversation's pieces to one background thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .model.omp import release_thread_pool


class Background:
    """Store writes off the TTFT path, one at a time; a failure is kept for :meth:`flush`."""

    def __init__(self):
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-writeback")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        with self._lock:
            # keep unfinished and failed writes; finished good ones need no more attention
            self._pending = [f for f in self._pending if not f.done() or f.exception()]
            self._pending.append(self._writer.submit(_released, fn, *args))

    def pending(self) -> int:
        """The writes submitted and not finished (waiting or running)."""
        with self._lock:
            return sum(not future.done() for future in self._pending)

    def flush(self) -> None:
        """Wait for every write submitted so far, then re-raise the first one that failed."""
        with self._lock:
            pending = list(self._pending)
        failures = [future.exception() for future in pending]   # exception() waits for each
        with self._lock:   # counted by pending() until done; a failure is raised once
            self._pending = [future for future in self._pending if future not in pending]
        first = next((err for err in failures if err is not None), None)
        if first is not None:
            raise first


def _released(fn, *args):
    """``fn(*args)``, then this thread's OpenMP workers handed back (.model.omp): a kept idle team
    makes the next thread's passes slower on a host with few cores."""
    try:
        return fn(*args)
    finally:
        release_thread_pool()
