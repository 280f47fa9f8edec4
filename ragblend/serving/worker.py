"""The server's work queue: one worker thread runs the requests' jobs and decodes their answers
together (continuous batching, :mod:`ragblend.core.decode.batching`).

A job's ``run`` does its request's own work (tokenizing, checks; a whole /v1/chunks or
/tokenize request). A completion's ``run`` returns a :class:`Decode` instead of a result: the
worker then prefills it (alone, as before) once the batch has room for it, and from then on
every decoding step advances all the answers in one pass over the weights. Between two steps
the worker takes at most one new job, so a new request waits for one step at most before its
prefill, and the answers under way wait for one prefill at most.

Bounds: ``max_batch`` answers decode together and their KV buffers hold at most
``max_kv_bytes``; a request that does not fit waits (holding the queue behind it, first come
first served) until answers finish, and the queue holds ``queue_size`` requests: beyond it, 429.
A request alone is always served, whatever its size.

One request's failure is its own: a job whose run, prefill or finish raises, an answer whose
sampling fails in a step, or a request cancelled (timed out, its client gone) ends with its
error while the other answers in the batch go on unchanged (``BatchDecoder.step``).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ragblend.core.cancel import Cancelled, cancellable
from ragblend.core.decode.batching import BatchDecoder, Member
from ragblend.core.decode.generate import Decoding

from .options import SERVER_DEFAULTS
from .protocol import ApiError

log = logging.getLogger("ragblend.server")

DEFAULT_MAX_BATCH = SERVER_DEFAULTS.max_batch
DEFAULT_MAX_KV_BYTES = SERVER_DEFAULTS.max_kv_bytes

# ---------------------------------------------------------------------------- the work queue


@dataclass
class Job:
    """One request's work, run by the worker thread; ``emit`` receives its events. Setting
    ``cancelled`` stops it: skipped if still queued, else at the model's next layer or step."""

    run: Callable[["Job"], Any]
    emit: Callable[[Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # A completion whose prompt will read passages being stored (serving.reuse): the storing goes
    # on for it; for any other request the storing yields. A function is asked once, in the worker
    # thread, the first time a storing job runs while this job waits (what it reads may take
    # tokenizing its prompt to know: that cost is paid only then).
    awaits_storing: bool | Callable[[], bool] = False
    # The server's own work (storing passages' KV between requests: serving.reuse), not a client's
    # request: counted apart, so that /health's queue_depth counts requests only.
    background: bool = False

    def awaits(self) -> bool:
        """Whether this job lets a storing job finish (:attr:`awaits_storing`, asked once)."""
        if callable(self.awaits_storing):
            try:
                self.awaits_storing = bool(self.awaits_storing())
            except Exception as err:   # the job's own run reports a bad prompt; here it only does not wait
                log.debug("could not tell whether a request reads passages being stored (%s)", type(err).__name__)
                self.awaits_storing = False
        return self.awaits_storing


@dataclass
class Decode:
    """What a completion's ``run`` returns: the answer to decode in the batch.

    ``start`` prefills the prompt and returns its :class:`~ragblend.core.decode.generate.Decoding`
    (``BlendEngine.begin``); ``kv_bytes`` is the KV memory that decoding will hold (prompt and
    answer); ``finish`` turns the finished decoding into the job's result."""

    start: Callable[[], Decoding]
    kv_bytes: int
    finish: Callable[[Decoding], Any]


class Worker:
    """Runs jobs from a bounded queue in one thread and decodes their answers together."""

    def __init__(self, queue_size: int, max_batch: int = DEFAULT_MAX_BATCH,
                 max_kv_bytes: int | None = DEFAULT_MAX_KV_BYTES):
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.batch = BatchDecoder(max_batch, max_kv_bytes)
        # jobs taken from the queue and not done (the one at hand, and those decoding), by Job.background
        self.running = {False: 0, True: 0}
        threading.Thread(target=self._loop, name="ragblend-serve-worker", daemon=True).start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(429, "The server is busy (request queue full); retry shortly.",
                           kind="rate_limit_error", code="queue_full") from None

    def queued(self) -> list[Job]:
        """The jobs waiting in the queue (not the one running)."""
        with self.jobs.mutex:
            return list(self.jobs.queue)

    def _waiting(self) -> tuple[int, int]:
        """The jobs waiting in the queue: (requests, background jobs)."""
        with self.jobs.mutex:
            background = sum(job.background for job in self.jobs.queue)
            return len(self.jobs.queue) - background, background

    @property
    def depth(self) -> int:
        """Client requests waiting or running (background jobs aside): /health's ``queue_depth``."""
        return self._waiting()[0] + self.running[False]

    @property
    def background_jobs(self) -> int:
        """Background jobs (:attr:`Job.background`) waiting or running."""
        return self._waiting()[1] + self.running[True]

    @property
    def load(self) -> int:
        """Every job waiting or running, requests and background jobs."""
        return self.jobs.qsize() + sum(self.running.values())

    def _loop(self) -> None:
        waiting: tuple[Job, Decode] | None = None   # a prefill waiting for room in the batch
        while True:
            if waiting is None:
                try:   # idle, sleep until a job comes; else only look
                    job = self.jobs.get(block=not len(self.batch))
                except queue.Empty:
                    job = None
                if job is not None and not job.cancelled.is_set():
                    waiting = self._run(job)
            if waiting is not None:
                job, decode = waiting
                if job.cancelled.is_set():
                    waiting = None
                    self._end(job, ("error", Cancelled("The request was cancelled before its prefill.")))
                elif self.batch.fits(decode.kv_bytes):
                    waiting = None
                    self._start(job, decode)
            if len(self.batch):
                self._step()

    def _run(self, job: Job) -> tuple[Job, Decode] | None:
        """Run ``job``; its Decode if it has an answer to decode, else None (it is done)."""
        self.running[job.background] += 1
        try:
            # Every model pass in this block checks the flag per layer and raises
            # fusion.Cancelled once the request has timed out or its client left.
            with cancellable(job.cancelled.is_set):
                result = job.run(job)
        except BaseException as err:   # handed to the request's handler
            self._end(job, ("error", err))
            return None
        if isinstance(result, Decode):
            return job, result
        self._end(job, ("done", result))
        return None

    def _start(self, job: Job, decode: Decode) -> None:
        try:
            with cancellable(job.cancelled.is_set):
                decoding = decode.start()
        except BaseException as err:
            self._end(job, ("error", err))
            return
        self.batch.add(decoding, (job, decode))

    def _step(self) -> None:
        for member in list(self.batch.members):   # a client gone (or timed out) frees its slot now
            job, _ = member.tag
            if job.cancelled.is_set():
                self.batch.remove(member)
                self._end(job, ("error", Cancelled("The request was cancelled during its answer.")))
        if not len(self.batch):
            return
        try:
            # each token goes out before the pass that computes the next (a first token waits for none)
            events = self.batch.step(deliver=self._deliver)
        except BaseException as err:   # a failure outside any one answer's work (step isolates those): all end
            log.error("a batched decoding step failed", exc_info=err)
            for member in list(self.batch.members):
                self.batch.remove(member)
                self._end(member.tag[0], ("error", err))
            return
        self._deliver(events)   # the answers whose own pass failed

    def _deliver(self, events) -> None:
        for event in events:
            job, decode = event.member.tag
            if event.error is not None:   # this answer's own failure (its sampling, say): it alone ends
                log.warning("an answer failed during its decoding (%s); the others in its batch go on",
                            type(event.error).__name__)   # its handler logs the traceback
                self._end(job, ("error", event.error))
                continue
            if event.delta:
                self._emit(job, ("item", event.delta))
            if event.finished:
                self._finish(event.member, job, decode)

    def _finish(self, member: Member, job: Job, decode: Decode) -> None:
        try:
            outcome = ("done", decode.finish(member.decoding))
        except BaseException as err:
            outcome = ("error", err)
        self._end(job, outcome)

    def _end(self, job: Job, outcome) -> None:
        self.running[job.background] -= 1
        self._emit(job, outcome)

    @staticmethod
    def _emit(job: Job, item) -> None:
        try:
            job.emit(item)
        except RuntimeError:   # the request's event loop is gone; nobody is waiting
            pass

