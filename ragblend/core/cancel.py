"""Cancellation of model passes: a caller's ``should_stop``, asked before each layer or step.

Shared by the fused prefill, chunk precompute and decoding; a thread-local, so the engine's
signatures stay as they are.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

from .errors import RagblendError


class Cancelled(RagblendError):
    """The computation was stopped by its caller's ``should_stop`` (see :func:`cancellable`)."""


_cancel = threading.local()


@contextlib.contextmanager
def cancellable(should_stop: Callable[[], bool]):
    """Within this block, on this thread, every model pass (fused prefill, chunk precompute,
    decoding step) calls ``should_stop()`` before each layer or step and raises
    :class:`Cancelled` once it returns true. A server uses it to stop the work of a client
    that left or timed out; a thread-local, so the engine's signatures stay as they are."""
    previous = getattr(_cancel, "should_stop", None)
    _cancel.should_stop = should_stop
    try:
        yield
    finally:
        _cancel.should_stop = previous


def check_cancelled() -> None:
    """Raise :class:`Cancelled` if this thread's :func:`cancellable` caller asks to stop."""
    should_stop = getattr(_cancel, "should_stop", None)
    if should_stop is not None and should_stop():
        raise Cancelled("The computation was cancelled by its caller.")


class EngineLock:
    """An engine's lock (re-entrant, held for each model pass) that also tells whether another
    thread waits for it (:meth:`waited_for`). Background work that may run long (a conversation's
    pieces) passes that to :func:`cancellable`, so it stops before its next layer when a request
    wants the model, instead of holding it for its whole pass: a plain lock is not fair, so the
    background thread, taking it again for its next pass, kept a server's answers waiting for
    seconds (~12 s behind a 3.6k-token turn's pieces)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._background = threading.local()

    @contextlib.contextmanager
    def background(self):
        """Within this block, on this thread, waiting for the lock is not counted: background
        work (a server storing passages, the pieces) does not make other background work yield."""
        previous = getattr(self._background, "on", False)
        self._background.on = True
        try:
            yield
        finally:
            self._background.on = previous

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        counted = not getattr(self._background, "on", False)
        if counted:
            with self._count_lock:
                self._waiting += 1
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            if counted:
                with self._count_lock:
                    self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def waited_for(self) -> bool:
        """Whether another thread waits to take the lock now (background work aside)."""
        return self._waiting > 0
