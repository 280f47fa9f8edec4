"""The server's work queue: one worker thread runs the requests' jobs, one at a time."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ragblend.core.fusion import cancellable

from .protocol import ApiError

# ---------------------------------------------------------------------------- the work queue


@dataclass
class Job:
    """One request's work, run by the worker thread; ``emit`` receives its events. Setting
    ``cancelled`` stops it: skipped if still queued, else at the model's next layer or step."""

    run: Callable[["Job"], Any]
    emit: Callable[[Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs jobs one at a time from a bounded queue (the engine computes one prompt at a time)."""

    def __init__(self, queue_size: int):
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.running = 0
        threading.Thread(target=self._loop, name="ragblend-serve-worker", daemon=True).start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(429, "The server is busy (request queue full); retry shortly.",
                           kind="rate_limit_error", code="queue_full") from None

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + self.running

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue
            self.running = 1
            try:
                # Every model pass in this block checks the flag per layer / decoding step and
                # raises fusion.Cancelled once the request has timed out or its client left.
                with cancellable(job.cancelled.is_set):
                    outcome = ("done", job.run(job))
            except BaseException as err:   # handed to the request's handler
                outcome = ("error", err)
            finally:
                self.running = 0
            try:
                job.emit(outcome)
            except RuntimeError:   # the request's event loop is gone; nobody is waiting
                pass
