"""Filling in the KV of an index's chunks after they are searchable.

Ingestion (``LocalIndex.ingest``) first commits chunks and embeddings, each chunk carrying
the key its KV will be stored under (``KVPrecompute(compute=False)``); the index answers
from then on. :class:`KVFiller` then computes the KV of every chunk whose key is not in the
store, in the foreground (:meth:`KVFiller.run`, what ``ragblend ingest --kv now`` and
``ragblend cache fill`` do) or in a background thread (:meth:`KVFiller.start`).

* **Resumable**: what is left to do is derived each time from the index (the keys in Chroma's
  metadata) and the store (the keys it holds: a chunk is done when the store holds each entry the
  engine keeps for it, its own and its lead entry, lead entries as far as the store has room), so a filler stopped by Ctrl-C, a crash or a
  kill resumes where it stopped, computing nothing twice.
* **Recently retrieved first**: chunks of documents that queries retrieved from go first.
* **Yields to queries**: between passes (one pass is at most ``engine.precompute_batch_tokens``
  chunk tokens, ~1 s on a 2-core CPU) it waits while a query runs (:meth:`KVFiller.query`).
* **One filler per index**, across processes: a second one finds ``kv-fill.lock`` held and
  leaves the work to the first.

A query whose chunks have no KV yet is answered at once: ``KVChunkHints`` marks the retrieved
chunks, and the engine computes a missing chunk's KV in the prefill and stores it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ragblend.core.errors import RagblendError
from ragblend.core.fusion.ingest import packs
from ragblend.core.model.omp import release_thread_pool
from ragblend.core.store.kv import KV_METADATA_KEY

log = logging.getLogger(__name__)

FILL_LOCK_FILE = "kv-fill.lock"
_RECENT_DOCUMENTS = 64   # documents remembered as recently retrieved
_FETCH = 32              # chunks read from Chroma at a time


class KVFillBusyError(RagblendError, RuntimeError):
    """Another process is already computing this index's KV."""


@dataclass
class KVCoverage:
    """How much of an index's KV is computed."""

    chunks: int   # chunks in the index
    keyed: int    # chunks that get KV (the others are too short to find in a prompt, or too long)
    stored: int   # keyed chunks whose own KV entry is in the store
    lead_missing: int = 0   # of those, chunks without their lead entry (None: unknown, no model loaded)

    @property
    def pending(self) -> int:
        return self.keyed - self.stored

    @property
    def to_compute(self) -> int:
        """Chunks a fill computes something for: their own entry, or only their lead entry."""
        return self.pending + (self.lead_missing or 0)

    @property
    def fraction(self) -> float:
        return self.stored / self.keyed if self.keyed else 1.0

    def as_dict(self) -> dict:
        return {"chunks": self.chunks, "keyed": self.keyed, "stored": self.stored, "pending": self.pending,
                "fraction": self.fraction, "lead_missing": self.lead_missing}

    def describe(self) -> str:
        no_kv = self.chunks - self.keyed
        extra = f"; {no_kv} chunk(s) too short or too long to need KV" if no_kv else ""
        if self.lead_missing:
            extra += f"; {self.lead_missing:,} without their lead entry (the KV for a prompt's first passage)"
        return f"KV for {self.stored:,} of {self.keyed:,} chunk(s) ({self.fraction:.1%}), {self.pending:,} to compute{extra}"


def index_pages(collection, include: Sequence[str] = ("metadatas",), page: int = 5000) -> Iterator[dict]:
    """A Chroma collection's chunks ``page`` at a time, in the order Chroma lists them: each
    ``collection.get`` result with ``ids`` and what ``include`` names (a missing list as empty
    metadata / documents, one a chunk)."""
    offset = 0
    while True:
        got = dict(collection.get(include=list(include), limit=page, offset=offset))
        ids = got["ids"] = got["ids"] or []
        for name in include:
            got[name] = got.get(name) or [None] * len(ids)
        if "metadatas" in got:
            got["metadatas"] = [meta or {} for meta in got["metadatas"]]
        yield got
        if len(ids) < page:
            return
        offset += page


def scan_index(collection, page: int = 5000) -> Iterator[tuple[str, str | None, str | None]]:
    """``(node id, KV key or None, document id)`` of every chunk in a Chroma collection,
    in the order Chroma lists them, reading metadata only."""
    for got in index_pages(collection, page=page):
        for node_id, meta in zip(got["ids"], got["metadatas"]):
            yield node_id, meta.get(KV_METADATA_KEY) or None, meta.get("ref_doc_id") or meta.get("document_id")


def mean_chunk_tokens(collection, engine, sample: int = 256) -> int | None:
    """The mean token count (rounded up) of the keyed chunks among the first ``sample`` that
    Chroma lists, as ``engine`` tokenizes the text its model is shown: what a chunk's stored
    entry holds. None when none of them is keyed. A sample, not the whole index: tokenizing a
    large index would cost seconds for a figure that only has to be about right, and a few
    short documents (the case ``chunk_size`` overstates most) are sampled whole."""
    from llama_index.core.vector_stores.utils import metadata_dict_to_node

    from ragblend.vectorstore_hooks.llamaindex import llm_text

    got = next(index_pages(collection, include=("metadatas", "documents"), page=sample))   # the first page alone
    tokens = [engine.count_tokens(llm_text(metadata_dict_to_node(meta, text=text)))
              for meta, text in zip(got["metadatas"], got["documents"]) if meta.get(KV_METADATA_KEY)]
    return -(-sum(tokens) // len(tokens)) if tokens else None


def coverage_of(collection, stored_keys: Iterable[str], lead_key=None) -> KVCoverage:
    """The coverage of a Chroma collection's chunks by a set of stored KV keys: a chunk counts
    as stored by its own entry; with ``lead_key`` (an engine's
    :meth:`~ragblend.core.engine.BlendEngine.lead_key`) the stored ones without their lead entry
    are counted too. Without it this needs no model (``ragblend cache stats``)."""
    stored_keys = stored_keys if isinstance(stored_keys, (set, frozenset)) else set(stored_keys)
    chunks = keyed = stored = lead_missing = 0
    for _, key, _ in scan_index(collection):
        chunks += 1
        if key:
            keyed += 1
            if key in stored_keys:
                stored += 1
                lead = lead_key(key) if lead_key else None
                lead_missing += lead is not None and lead not in stored_keys
    return KVCoverage(chunks, keyed, stored, lead_missing if lead_key else None)


@contextlib.contextmanager
def fill_lock(folder: Path):
    """Hold ``folder/kv-fill.lock`` (an ``flock``, released by the kernel however its holder
    dies) or raise :class:`KVFillBusyError` at once naming the holder's pid."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no cross-process lock
        yield
        return
    fd = os.open(Path(folder) / FILL_LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise KVFillBusyError(f"another process (pid {holder}) is computing the KV of the index at {folder}; "
                                  "it goes on there (`ragblend cache stats` shows the coverage).") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def missing_kv(collection, engine, tried: set[str]) -> tuple[list, list]:
    """What is left to do, derived afresh from the index and the store (so a fill stopped any
    way resumes where it stopped): ``(node id, key, document)`` of the chunks without their own
    entry, and of those with it but without their lead entry; keys in ``tried`` left out."""
    stored = lasting_keys(engine.store)
    own, lead_only = [], []
    for node_id, key, doc in scan_index(collection):
        if not key or key in tried:
            continue
        if key not in stored:
            own.append((node_id, key, doc))
        elif not engine.entries_stored(key, stored):
            lead_only.append((node_id, key, doc))
    return own, lead_only


def lasting_keys(store) -> set[str]:
    """The keys ``store`` holds beyond this process: its disk tier's, when it has one. The memory
    tier's copies of entries another process removed from disk (`ragblend cache clear`, its
    eviction) are dropped, so that a fill computes and stores them again instead of counting them."""
    disk = getattr(store, "disk", None)
    if disk is None:
        return set(store.keys())
    faults = disk.faults
    on_disk = set(disk.keys())
    if disk.faults != faults:   # the listing failed (logged): the memory tier is all there is to go by
        return on_disk | set(store.memory.keys())
    for key in set(store.memory.keys()) - on_disk:
        store.memory.delete(key)
    return on_disk


def store_room(store, own_pending: int) -> int:
    """How many more entries ``store`` holds below 90% of its size, after ``own_pending``
    own entries (an entry's size: the store's mean); unbounded where the store cannot tell."""
    try:
        tiers = store.stats()
    except Exception:   # a store that cannot say (a broken disk tier): no bound from it
        return 1 << 62
    tier = tiers.get("disk") or tiers.get("memory")
    if not tier or not tier.get("entries") or not tier.get("max_bytes"):
        return 1 << 62
    mean = tier["bytes"] / tier["entries"]
    return max(0, int((0.9 * tier["max_bytes"] - tier["bytes"]) / mean) - own_pending)


def _grown_bar(bar, more: int):
    """A progress bar over ``more`` chunks: a new one, or ``bar`` grown by them (a new round)."""
    if bar is None:
        from tqdm.auto import tqdm

        return tqdm(total=more, desc="Computing KV", unit="chunk")
    bar.total = bar.n + more
    bar.refresh()
    return bar


class KVFiller:
    """Computes the KV of a :class:`LocalIndex`'s chunks that have none (see the module doc)."""

    def __init__(self, index):
        self.index = index
        self.engine = index.engine
        self._queries = 0
        self._changed = threading.Condition()
        self._recent: OrderedDict[str, None] = OrderedDict()   # document ids, most recently retrieved last
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._again = threading.Event()   # new chunks arrived while the thread was filling
        self._exiting = False             # the thread found nothing more to do and is ending
        self._warned_unstorable = False
        self._warned_full = False
        self.state = "idle"               # idle | filling | paused for a query | stopped | another process...
        self.error: BaseException | None = None   # what stopped the background thread, if it failed
        self.computed = 0                 # chunks this filler computed
        self.tokens = 0                   # their tokens, each chunk's for the share of its entries computed
        self.compute_s = 0.0              # seconds spent computing them (not waiting for queries)

    # ------------------------------------------------------------------ what queries tell it

    @contextlib.contextmanager
    def query(self):
        """Hold for the time a query runs: the filler starts no new pass meanwhile (a pass it
        is in finishes first, ~1 s at most)."""
        with self._changed:
            self._queries += 1
        try:
            yield
        finally:
            with self._changed:
                self._queries -= 1
                self._changed.notify_all()

    def retrieved(self, document_ids: Iterable[str | None]) -> None:
        """Chunks of these documents are computed before the others (a document asked about
        once is likely to be asked about again)."""
        with self._changed:
            for doc_id in document_ids:
                if doc_id:
                    self._recent.pop(doc_id, None)
                    self._recent[doc_id] = None
            while len(self._recent) > _RECENT_DOCUMENTS:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ state

    def coverage(self) -> KVCoverage:
        """Chunks stored (by their own entry), and how many of those lack their lead entry. With a
        disk tier, what is on disk: another process may have removed entries (``ragblend cache
        clear``, eviction) that this process's memory tier still holds."""
        return coverage_of(self.index.collection, lasting_keys(self.engine.store), self.engine.lead_key)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def rate(self) -> float | None:
        """Chunk tokens computed per second of computing (waits for queries excluded); a chunk
        whose lead entry alone was computed counts half its tokens, as it cost half the work."""
        return self.tokens / self.compute_s if self.compute_s else None

    # ------------------------------------------------------------------ foreground

    def run(self, *, progress: bool = False) -> int:
        """Compute every missing KV now; returns how many chunks were computed. Raises
        :class:`KVFillBusyError` when another process is filling this index. Ctrl-C stops it
        between two passes of the model: what was stored stays, the rest is done next time."""
        with fill_lock(self.index.path):
            before = self.computed
            self._fill(progress)
            return self.computed - before   # chunks, not nodes: identical documents share one chunk's KV

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        """Fill in a daemon thread (a no-op if it is already filling: it rescans when done)."""
        with self._changed:
            self._again.set()
            if self.running and not self._exiting:
                return   # it rescans the index when its round ends
        if self._thread is not None:
            self._thread.join()   # an ending thread still holds the fill lock for an instant
        self._stop.clear()
        self.error, self._exiting, self.state = None, False, "filling"
        release_thread_pool()   # this thread's idle OpenMP workers (the embeddings') would slow the filler's
        self._thread = threading.Thread(target=self._background, name="ragblend-kv-fill", daemon=True)
        self._thread.start()
        _running.add(self)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the thread after its current pass (what it stored stays)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background thread to finish; True if it did. Re-raises its error."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        if self.error is not None:
            raise self.error
        return True

    def _background(self) -> None:
        try:
            with fill_lock(self.index.path):
                while not self._stop.is_set():
                    with self._changed:
                        if not self._again.is_set():
                            self._exiting = True
                            break
                        self._again.clear()
                    self._fill(progress=False)
            self.state = "stopped" if self._stop.is_set() else "idle"
        except KVFillBusyError as err:
            self.state = str(err)
            log.info("ragblend: %s", err)
        except BaseException as err:   # kept for wait() and the coverage display; queries are unaffected
            self.error, self.state = err, f"failed: {type(err).__name__}: {err}"
            log.warning("ragblend: computing the index's KV in the background failed (%s: %s); queries compute "
                        "the KV of the chunks they use. `ragblend cache fill` resumes it.", type(err).__name__, err)

    # ------------------------------------------------------------------ the work

    def _pending(self, tried: set[str]) -> list[tuple[str, str, str | None]]:
        """Chunks without their own entry, then chunks with it but without their lead entry (a
        store filled before lead entries) as far as the store has room for them: lead entries
        are the expendable ones (stored first, so evicted first), and a store too small for
        both would otherwise evict and recompute them on every fill."""
        own, lead_only = missing_kv(self.index.collection, self.engine, tried)
        room = store_room(self.engine.store, len(own))
        if len(lead_only) > room:
            if not self._warned_full:
                self._warned_full = True
                log.warning("ragblend: the KV store has no room for the lead entries of %d chunk(s) (the KV used "
                            "where a chunk is a prompt's first passage; such a prompt computes it). A larger KV "
                            "store keeps them (EngineOptions.disk_bytes).", len(lead_only) - room)
            lead_only = lead_only[:room]
        return own + lead_only

    def _order(self, pending: list) -> list:
        """Chunks of recently retrieved documents first (the most recent first), then index order."""
        with self._changed:
            rank = {doc: i for i, doc in enumerate(reversed(self._recent))}
        if not rank:
            return pending
        return sorted(pending, key=lambda item: rank.get(item[2], len(rank)))   # stable: index order kept

    def _wait_for_queries(self) -> None:
        with self._changed:
            while self._queries and not self._stop.is_set():
                self.state = "paused for a query"
                self._changed.wait(0.5)
            self.state = "filling"

    def _fill(self, progress: bool) -> int:
        """Rounds of: list what is missing, compute it in passes. A round ends when nothing is
        missing, or nothing new (a chunk whose KV could not be stored is tried once per call)."""
        tried: set[str] = set()
        done = 0
        bar = None
        try:
            while not self._stop.is_set():
                pending = self._pending(tried)
                if not pending:
                    break
                if progress:
                    bar = _grown_bar(bar, len(pending))
                while pending and not self._stop.is_set():
                    self._wait_for_queries()
                    pending = self._order(pending)
                    batch, pending = pending[:_FETCH], pending[_FETCH:]
                    done += self._fill_batch(batch, tried, bar)
                    tried.update(key for _, key, _ in batch)   # deleted meanwhile, or failed: not again this call
        finally:
            if bar is not None:
                bar.close()
        return done

    def _fill_batch(self, batch: list, tried: set[str], bar) -> int:
        """Compute and store the KV of ``batch`` (``(node id, key, document)`` of chunks without
        KV) in passes; adds the keys tried to ``tried``. Returns how many were stored."""
        from ragblend.vectorstore_hooks.llamaindex import llm_text

        with self.index.writing:
            nodes = self.index.vector_store.get_nodes(node_ids=[node_id for node_id, _, _ in batch])
            by_id = {node.node_id: node for node in nodes}
            items = [(node_id, key, llm_text(by_id[node_id])) for node_id, key, _ in batch if node_id in by_id]
        done = 0
        for group in self._passes(items):
            self._wait_for_queries()
            if self._stop.is_set():
                break
            with self.index.writing:   # no ingest or delete between the check below and the storing
                # A chunk deleted since the batch was read gets no KV (its document's KV is gone).
                alive = set(self.index.collection.get(ids=[node_id for node_id, _, _ in group], include=[])["ids"])
                passed, group = len(group), [item for item in group if item[0] in alive]
                # Stored meanwhile by a query's write-back: covered, but not computed here (nor timed).
                missing = {key: self.engine.missing_entries(key) for _, key, _ in group}
                stored_before = {key for key, entries in missing.items() if not entries}
                t0 = time.perf_counter()
                with self.engine.lock.background():   # background work: stops no other (core.cancel.EngineLock)
                    refs = self.engine.precompute([text for _, _, text in group], skip_unusable=True) if group else []
                self.compute_s += time.perf_counter() - t0
            for (_, key, _), ref in zip(group, refs):
                tried.add(key)
                if ref is not None and ref.key == key and ref.stored:
                    if key not in stored_before:   # once per chunk: identical documents share its entries
                        stored_before.add(key)
                        self.computed += 1
                        # a chunk counts for the share of its entries computed (its lead entry alone: half)
                        self.tokens += ref.num_tokens * len(missing[key]) // len(self.engine.entry_keys(key))
                    done += 1
                else:
                    self._warn_unstorable(key, ref)
            if bar is not None:
                bar.update(passed)
        return done

    def _passes(self, items: list[tuple[str, str, str]]) -> Iterator[list[tuple[str, str, str]]]:
        """Groups of ``(node id, key, text)`` that fill one pass of the model (``precompute_batch_tokens``)."""
        return packs(items, self.engine.precompute_batch_tokens, size=lambda item: self.engine.count_tokens(item[2]))

    def _warn_unstorable(self, key: str, ref) -> None:
        if self._warned_unstorable:
            return
        self._warned_unstorable = True
        if ref is not None and ref.key != key:
            log.warning("ragblend: the index's chunks were keyed for another model or KV dtype than this engine's; "
                        "their KV is computed by queries instead. Rebuild the index (ragblend ingest --rebuild) to "
                        "key them for this one.")
        elif ref is not None:
            log.warning("ragblend: the KV store did not take a computed chunk (cause logged above); it is tried again "
                        "next time.")


# Background fillers still running when the interpreter exits are stopped after their pass,
# so no KV file is left half-written by a thread killed mid-write.
_running: weakref.WeakSet[KVFiller] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for filler in list(_running):
        filler.stop(timeout=10.0)
