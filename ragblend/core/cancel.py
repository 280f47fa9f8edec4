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
