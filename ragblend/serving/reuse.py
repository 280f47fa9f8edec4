"""Reuse for any client, with no setup: the server stores the KV of the passages it sees.

A client that knows nothing of ragblend (ChatOpenAI in a LangChain retrieval chain, LlamaIndex's
OpenAILike, the openai SDK) sends its retrieved documents as plain text. The server splits that
text where frameworks join documents (:func:`~ragblend.serving.protocol.passages`) and, once the
answer is complete, computes and stores each new passage's KV as a chunk. The next prompt that
holds the same passages finds them in the store, as the engine finds any stored chunk in a flat
prompt, and reuses their KV.

The storing runs as jobs of the server's worker (the one thread that runs the model), queued only
when no request is waiting, a bounded number of tokens at a time. A request that arrives while a
storing job computes makes it yield: the job stops before its next layer (``core.cancel``) and
puts its passages back, so the request waits for one layer of one passage at most, never for the
whole job. A passage that cannot be stored (store full or broken, the job refused) is only a
miss: its next prompt computes it.

Each passage is stored in the namespace of the request it came from (its tenant's: see
:meth:`~ragblend.serving.app.Server.namespace_of`), so only that tenant's prompts ever find it: one
client's system prompt, history and documents never answer another's ``cached_tokens``.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Iterable

from ragblend.core.cancel import Cancelled, cancellable
from ragblend.core.engine import BlendEngine
from ragblend.core.prompt import PromptLayout

from .protocol import ApiError
from .worker import Job

log = logging.getLogger("ragblend.server")

MAX_PENDING = 512   # passages waiting to be stored; beyond it the oldest are dropped (misses)
MAX_LABEL_CHARS = 40   # a first line this short, before a found document, is a label ("Context:"), not text


def outside_found_chunks(texts: Iterable[str], layout: PromptLayout, decode: Callable[[list[int]], str]) -> list[str]:
    """The passages of ``texts`` that lie inside no chunk ``layout`` found (one the store holds, or held
    and the prefill computes again and writes back).

    A document of several paragraphs splits into several passages (at its paragraph breaks); where
    the prompt found the whole document stored (ingested, or stored by an earlier request), its
    paragraphs need no entries of their own: storing them would hold the worker for seconds, and the
    conversation's next turn, which holds them too, would wait for that storing to end. A span may
    stop a token short of its chunk's edge, where the prompt's token there merged with the break
    beside it (Qwen2's and Llama 3's ``".\n\n"`` is one token): the text compared reaches one token
    past each end of the span, so that the document's last (or first) paragraph counts as inside it too.
    A passage whose first line is a short label glued to a found document (``"Context:\n" + document``,
    as many RAG prompts put it) counts as inside it too: the label alone is no passage worth storing."""
    read = [decode(list(span.token_ids[max(span.offset - 1, 0):span.offset + span.end - span.start + 1]))
            for span in layout.chunk_spans]

    def inside(text: str) -> bool:
        label, _, rest = text.partition("\n")
        rest = rest.strip() if len(label) <= MAX_LABEL_CHARS else ""
        return any(text in chunk or (rest and rest in chunk) for chunk in read)
    return [text for text in texts if not inside(text)]


class PassageKeeper:
    """Stores the KV of passages from requests, in the worker, between requests.

    ``submit`` queues a :class:`Job` on the worker (a background one); ``load()`` counts the
    jobs waiting or running there, its own included (the worker's ``load``): storing starts only
    at 0, when no request is waiting, prefilling or decoding.
    ``batch_tokens`` bounds one job's work (the tokens it computes); a request arriving during
    it makes it yield at the next layer (its passages wait for the next idle moment).
    """

    def __init__(self, engine: BlendEngine, submit: Callable[[Job], None], load: Callable[[], int], *,
                 queued: Callable[[], list[Job]] | None = None, batch_tokens: int = 2048, max_pending: int = MAX_PENDING):
        self.engine, self.submit, self.load, self.batch_tokens = engine, submit, load, batch_tokens
        self.queued = queued   # the worker's waiting jobs; None: any waiting job makes storing yield
        self.pending: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()   # (namespace, text)
        self.storing: set[tuple[str, str]] = set()   # the passages of the storing job under way
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.scheduled = False   # a storing job is queued or running
        self.stored = self.failed = 0

    def add(self, texts: Iterable[str], namespace: str = "", layout: PromptLayout | None = None) -> None:
        """Remember passages to store in ``namespace`` once the worker is free (call after the answer).
        ``layout``: the answered prompt's; a passage inside a chunk found in it is left out
        (:func:`outside_found_chunks`)."""
        if layout is not None:
            texts = outside_found_chunks(texts, layout, self.engine.tokenizer.decode)
        with self.lock:
            for text in texts:
                self.pending[namespace, text] = None
                self.pending.move_to_end((namespace, text))
            self._drop_oldest()
        self.schedule()

    def _drop_oldest(self) -> None:
        """Keep at most ``max_pending`` passages waiting, dropping from the front (call under the lock)."""
        while len(self.pending) > self.max_pending:
            self.pending.popitem(last=False)

    def awaits(self, texts: Iterable[str], namespace: str = "") -> bool:
        """Whether a prompt with these passages would read some that wait to be stored (or are
        being stored) in ``namespace``: its request is better off letting the storing finish."""
        with self.lock:
            return any((namespace, text) in self.pending or (namespace, text) in self.storing for text in texts)

    def awaited_by(self, texts: list[str], namespace: str, ids_of: Callable[[], list[int]], own: str,
                   reads_tier: bool = True) -> bool | Callable[[], bool]:
        """Whether a request with these passages (stored in ``namespace``) lets the storing finish
        (``Job.awaits_storing``): False at once where none of them waits to be stored; else a
        function the worker asks while a storing job runs. It tokenizes the prompt (``ids_of``) and
        looks up the prefix tier in ``own``, the request's tenant's namespace (``reads_tier``
        False: its strategy does not read the tier): a passage inside the prefix the tier holds is
        not read from the store (a conversation's next turn computes only its last tokens), and the
        rest of a prompt the tier holds at least half of is computed in full: such a request never waits."""
        if not self.awaits(texts, namespace):
            return False

        def decide() -> bool:
            ids = ids_of()
            held = self.engine.prefix_held(ids, own) if reads_tier else 0
            # A prompt the tier holds at least half of extends the held prefix, the rest computed in
            # full (PrefixReuse.extend): it reads no stored passage. A shorter prefix may go unused (.pays).
            return 2 * held < len(ids) and self.awaits(texts, namespace)
        return decide

    def _request_waits(self) -> bool:
        """Whether a request waits that the storing job should yield to: any, but one that
        awaits the passages being stored (``Job.awaits``)."""
        if self.queued is None:
            return self.load() > 1   # this job, and a request behind it
        return any(not job.awaits() for job in self.queued())

    def pending_count(self) -> int:
        """Passages not stored yet (``ragblend_kv_fill_pending`` on /metrics): waiting, or in the
        storing job under way, so the gauge reads 0 only once ``_stored_total`` has counted them."""
        with self.lock:
            return len(self.pending.keys() | self.storing)

    def schedule(self, own: int = 0) -> None:
        """Queue a storing job if passages wait, none is queued, and the worker has no other
        work (``own``: the jobs of ours the worker counts, 1 from inside a storing job)."""
        with self.lock:
            if self.scheduled or not self.pending or self.load() > own:
                return
            self.scheduled = True
        try:
            self.submit(Job(self._run, lambda outcome: None, background=True))
        except ApiError:   # the queue filled meanwhile: the next answer schedules it again
            with self.lock:
                self.scheduled = False

    def _take(self, namespace: str = "") -> list[str]:
        """New passages of ``namespace`` (not stored yet, long enough to be found) up to ``batch_tokens``."""
        engine, taken, tokens = self.engine, [], 0
        limit = engine.context_window // 2   # a passage longer than that is no RAG chunk
        while tokens < self.batch_tokens:
            with self.lock:
                item = next((item for item in self.pending if item[0] == namespace), None)
                if item is None:
                    break
                del self.pending[item]
            ids = engine.tokenize(item[1])
            if not engine.min_chunk_tokens <= len(ids) <= limit or any(
                    engine.entries_stored(engine.ingestion.key_for(ids, namespace=ns)) for ns in {"", namespace}):
                continue   # too short or long, or stored (shared, or by a query's write-back)
            taken.append(item[1])
            tokens += len(ids)
        return taken

    def _run(self, job: Job) -> None:
        """The storing job (worker thread). Never raises: a failure is logged and counted."""
        try:
            with self.lock:   # one namespace a job: the oldest passage's
                namespace = next(iter(self.pending))[0] if self.pending else ""
            texts = self._take(namespace)
            if texts:
                self._store(job, texts, namespace)
        except Exception as err:   # a broken store...: these passages are misses
            self.failed += 1
            log.warning("could not store passages' KV (%s: %s); their next prompts compute them",
                        type(err).__name__, err)
        finally:
            with self.lock:
                self.scheduled, self.storing = False, set()
        self.schedule(own=1)   # more passages wait: go on while no request does

    def _store(self, job: Job, texts: list[str], namespace: str) -> None:
        """Store ``texts``' KV, yielding to any request that arrives meanwhile."""
        # A request waiting stops the model pass before its next layer, so that it waits one
        # layer, not this whole job (unless it will read these passages: then it lets it finish).
        with self.lock:
            self.storing = {(namespace, text) for text in texts}
        try:
            # background work itself: its waits for the model stop no other background work (core.cancel.EngineLock)
            with cancellable(lambda: job.cancelled.is_set() or self._request_waits()), self.engine.lock.background():
                refs = self.engine.precompute(texts, skip_unusable=True, namespace=namespace)
        except Cancelled:
            self._put_back(texts, namespace)
            log.debug("storing %d passage(s) yielded to a request; they wait for the next idle moment", len(texts))
            return
        stored = sum(ref is not None and ref.stored for ref in refs)
        self.stored += stored
        self.failed += len(texts) - stored
        log.debug("stored the KV of %d of %d new passage(s)", stored, len(texts))

    def _put_back(self, texts: list[str], namespace: str) -> None:
        """Return passages a yielding job took to the front of the queue (those it had stored
        already are skipped when taken again)."""
        with self.lock:
            for text in reversed(texts):
                self.pending[namespace, text] = None
                self.pending.move_to_end((namespace, text), last=False)
            self._drop_oldest()
