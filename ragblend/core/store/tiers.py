"""KV store tiers: where entries are kept (memory, disk, both).

The engine talks to the small :class:`KVStore` interface. Two tiers implement it:

* :class:`MemoryStore` — an in-process LRU bounded in bytes.
* :class:`DiskStore` — a ``diskcache`` directory: LRU eviction under a size limit,
  process-safe (SQLite), each entry one file written before its row is committed, so a
  killed writer never leaves a torn entry.

:class:`TieredStore` puts memory in front of disk. Reads go layer by layer through
:class:`ChunkReader` so the fusion can load layer i+1 while it computes layer i.

The entry format (the codec, :class:`EntrySpec`, the readers) is :mod:`ragblend.core.store.entry_format`,
as diskcache keeps its ``Disk`` (how values are written) apart from its ``Cache`` (where they are kept).
Which files of a disk store's folder are its own, and the folder's marker:
:mod:`ragblend.core.store.store_files`.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

from ..errors import InvalidInputError, StoreUnavailableError
from .disk_limit import check_disk_bytes, settle_limit

# The entry format lives in entry_format; the names callers import from here stay importable here.
from .entry_format import (  # noqa: F401
    MAGIC,
    MAX_HEADER_BYTES,
    STORAGE_DTYPES,
    ChunkReader,
    EntrySpec,
    FileReader,
    MemoryReader,
    _layer_parts,
    _nbytes,
    encode_entry,
    header_dtype,
    storage_dtype_name,
)
from .kv import ChunkKV

# The folder's own files (opening, removing, the marker) live in store_files; the names that
# callers import from here stay importable from here.
from .store_files import (  # noqa: F401
    DATABASE,
    MARKER,
    CorruptEntryError,
    NotAStoreError,
    check_store_folder,
    check_write_lock,
    entry_files,
    file_identity,
    orphan_entry_files,
    reclaim_orphan_files,
    remove_store_files,
    safe_disk_class,
)

log = logging.getLogger("ragblend")

# ---------------------------------------------------------------------------- interface


class KVStore:
    """Interface of a KV store tier. Implementations are thread-safe."""

    faults = 0   # failures of the store's own storage so far, each served as a miss or a skipped write

    def get(self, key: str) -> ChunkKV | None:
        """The whole entry for ``key``, or None when absent or unusable (then dropped)."""
        return self._whole(self.open(key), key)

    def _whole(self, reader: ChunkReader | None, key: str) -> ChunkKV | None:
        """Everything ``reader`` holds, closing it; a corrupt entry is dropped (None)."""
        if reader is None:
            return None
        try:
            return reader.read_all() if isinstance(reader, FileReader) else reader.entry
        except CorruptEntryError:
            self.delete(key)
            return None
        finally:
            reader.close()

    def open(self, key: str, drop_unusable: bool = True) -> ChunkReader | None:
        """A layer-wise reader for ``key``, or None when absent or unusable (then dropped,
        unless ``drop_unusable`` is False)."""
        raise NotImplementedError

    def put(self, entry: ChunkKV) -> bool:
        """Store ``entry`` under ``entry.key``, all or nothing; False when it was not
        stored (too large for the store, or the store failed)."""
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        """Drop ``key``; True if something was removed."""
        raise NotImplementedError

    def keys(self) -> Iterator[str]:
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())


class MemoryStore(KVStore):
    """In-process LRU store bounded by ``max_bytes`` of tensor data.

    An entry larger than the whole budget is not kept (``put`` is then a no-op), so the
    store never exceeds its bound.
    """

    tier = "memory"

    def __init__(self, max_bytes: int = 2 << 30):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidInputError(f"memory_bytes must be an integer >= 0 (0 turns the memory tier off), "
                                    f"got {max_bytes!r}.")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._warned_too_large = False
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, key: str, drop_unusable: bool = True) -> ChunkReader | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        return MemoryReader(entry)

    def get(self, key: str) -> ChunkKV | None:
        reader = self.open(key)
        return None if reader is None else reader.entry

    def put(self, entry: ChunkKV) -> bool:
        size = entry.nbytes
        if size > self.max_bytes:
            self._too_large(size)
            return False
        evicted = []
        with self._lock:
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[entry.key] = entry
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                evicted.append(self._entries.popitem(last=False)[1])
                self.nbytes -= evicted[-1].nbytes
        for gone in evicted:
            self.dropped(gone)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.nbytes -= entry.nbytes
        self.dropped(entry)
        return True

    def _too_large(self, size: int) -> None:
        # Said once: callers count what was not stored, but only this tier knows why. Not for a
        # subclass (the history pieces' store), whose budget is another option, reported apart.
        if type(self) is MemoryStore and self.max_bytes and not self._warned_too_large:   # 0: off on purpose
            self._warned_too_large = True
            log.warning("ragblend: a KV entry of %s is larger than the whole memory tier (memory_bytes=%d, %s), so "
                        "it is not kept there; raise memory_bytes or store smaller KV (kv_dtype).",
                        _size(size), self.max_bytes, _size(self.max_bytes))

    def dropped(self, entry: ChunkKV) -> None:
        """Called (outside the lock) for each entry evicted or deleted; nothing here."""

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict:
        return {"memory": {"entries": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes}}


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# diskcache names every value file "xx/yy/<28 hex digits>.val" under its directory; a row
# naming anything else was not written by the store.
def store_faults() -> tuple[type[BaseException], ...]:
    """What a disk tier can raise when its files or database fail: I/O errors (full disk,
    read-only or vanished folder), SQLite errors (malformed or locked database) and
    diskcache's lock timeout."""
    import sqlite3

    import diskcache

    return OSError, sqlite3.Error, diskcache.Timeout


class DiskStore(KVStore):
    """KV entries as files in a ``diskcache`` directory, LRU-evicted under ``max_bytes``
    (None: the limit saved with the store, see :mod:`.disk_limit`; a limit given is saved).

    The store is a cache: when its files or database fail (full disk, read-only or vanished
    folder, malformed or locked database) a read is a miss and a write is skipped. Each kind
    of failure is logged once and every one is counted in ``faults``; lock waits last at
    most ``LOCK_TIMEOUT_S``. A failed write leaves no file behind, and opening the store
    reclaims entry files that no row names (left by a writer killed mid-write) once they
    are ``orphan_age_s`` old (younger ones may be another process's write in progress).
    Opening the store itself can still raise those errors, within ``LOCK_TIMEOUT_S`` when
    another process holds its lock (see :func:`open_store`, which then keeps the KV in
    memory only).
    """

    tier = "disk"
    LOCK_TIMEOUT_S = 0.25
    DATABASE = DATABASE

    def __init__(self, directory: str | os.PathLike, spec: EntrySpec, max_bytes: int | None = None,
                 orphan_age_s: float = 60.0):
        import diskcache

        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise StoreUnavailableError(f"{self.directory} is a file, not a KV store folder")
        max_bytes = check_disk_bytes(max_bytes)
        check_store_folder(self.directory)   # before diskcache creates or opens anything in it
        self.spec = spec
        self.faults = 0
        self.rejected = 0   # entries dropped on reading as unusable (corrupt, or a header that disagrees with its key)
        self._logged: set[str] = set()
        check_write_lock(self.directory / DATABASE, self.LOCK_TIMEOUT_S)
        # diskcache's own culling drops entries in batches of 10, far more than needed when
        # entries are megabytes each; eviction is done here instead, one entry at a time.
        self.cache = diskcache.Cache(
            str(self.directory), eviction_policy="least-recently-used",
            cull_limit=0, disk=safe_disk_class(), statistics=1, timeout=self.LOCK_TIMEOUT_S,
        )
        # max_bytes None: the limit saved with the store (a named one is saved for later openers)
        self.max_bytes = settle_limit(self.directory, max_bytes, self.cache)
        self._database_id = file_identity(self.directory / DATABASE)
        try:   # entry files no row names, old enough not to be another process's write in progress
            self.reclaimed = reclaim_orphan_files(self.cache, self.directory, orphan_age_s)
        except store_faults() as err:
            self._fault("reclaim unnamed files", err)
            self.reclaimed = 0

    def _fault(self, action: str, err: BaseException) -> None:
        self.faults += 1
        kind = f"{action}/{type(err).__name__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("ragblend: the KV store in %s failed to %s (%s: %s); the chunk is computed instead.",
                        self.directory, action, type(err).__name__, err)

    def open(self, key: str, drop_unusable: bool = True, count: bool = True) -> ChunkReader | None:
        """A reader for ``key``, or None. An unusable entry is deleted unless
        ``drop_unusable`` is False (e.g. when scanning a directory other models share).
        ``count=False`` leaves the hit/miss statistics alone (promotion, verification)."""
        try:
            handle = self.cache.get(key, read=True) if count else self._uncounted_handle(key)
        except CorruptEntryError:
            if drop_unusable:
                self.delete(key)
            return None
        except FileNotFoundError:  # the file vanished under us (evicted or deleted by another process)
            return None
        except store_faults() as err:
            self._fault("read", err)
            return None
        if handle is None:
            return None
        try:
            size = os.fstat(handle.fileno()).st_size if hasattr(handle, "fileno") else len(handle.getvalue())
            return FileReader(handle, key, self.spec, size)
        except CorruptEntryError as err:
            if drop_unusable:   # a lookup of this engine's (not a scan of a folder other models share)
                self._reject(err)
                self.delete(key)
            return None
        except OSError as err:
            self._fault("read", err)
            return None

    def _reject(self, err: CorruptEntryError) -> None:
        """Count an entry found unusable on reading (a miss: the caller computes the chunk), and log
        each reason once."""
        self.rejected += 1
        reason = err.reason.split(" (")[0]
        if f"reject/{reason}" not in self._logged:
            self._logged.add(f"reject/{reason}")
            log.warning("ragblend: dropped the KV entry %s... in %s: %s; the chunk is computed instead.",
                        err.key[:16], self.directory, err.reason)

    def put(self, entry: ChunkKV) -> bool:
        """Store ``entry``; False when it was skipped (logged and counted) because the disk
        is full, the folder is read-only or gone, or the database is locked or broken."""
        disk = self.cache.disk
        try:
            if file_identity(self.directory / DATABASE) != self._database_id:
                raise FileNotFoundError(f"{self.directory / self.DATABASE} was deleted or replaced after the "
                                        "store opened; restart to recreate the store")
            # The tag (diskcache's own column) records the storage dtype, for entries_by_dtype.
            self.cache.set(entry.key, io.BytesIO(encode_entry(entry, self.spec.fingerprint)), read=True,
                           tag=storage_dtype_name(entry.storage_dtype))
        except store_faults() as err:
            if getattr(disk.written, "filename", None):   # written, but its row was never committed
                disk.remove(disk.written.filename)
            self._fault("write", err)
            return False
        finally:
            disk.written.filename = None
        try:
            self._evict()
        except store_faults() as err:
            self._fault("evict", err)
        return True

    def _evict(self) -> None:
        """Drop least-recently-used entries until the store (files + index) fits its limit."""
        while self.cache.volume() > self.max_bytes:
            # raw = 1: string keys only (ragblend's); a foreign pickled key is never touched
            row = self.cache._sql("SELECT key FROM Cache WHERE raw = 1 ORDER BY access_time LIMIT 1").fetchone()
            if row is None:
                break
            self.cache.delete(row[0])

    def delete(self, key: str) -> bool:
        try:
            return bool(self.cache.delete(key))
        except store_faults() as err:
            self._fault("delete", err)
            return False

    def keys(self) -> Iterator[str]:
        try:
            return iter([row[0] for row in self.cache._sql("SELECT key FROM Cache WHERE raw = 1 ORDER BY rowid")])
        except store_faults() as err:
            self._fault("list", err)
            return iter(())

    def __contains__(self, key: str) -> bool:
        try:
            return key in self.cache
        except store_faults() as err:
            self._fault("look up", err)
            return False

    def __len__(self) -> int:
        try:
            return len(self.cache)
        except store_faults() as err:
            self._fault("count", err)
            return 0

    @property
    def nbytes(self) -> int:
        """Bytes of entry files (what the size limit is about), without the SQLite index."""
        return int(self.cache._sql("SELECT COALESCE(SUM(size), 0) FROM Cache").fetchone()[0])

    def _uncounted_handle(self, key: str):
        """The entry's open file, found as ``cache.get(key, read=True)`` finds it, without
        counting a hit or a miss."""
        db_key, raw = self.cache.disk.put(key)
        row = self.cache._sql("SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = ?",
                              (db_key, raw)).fetchone()
        return None if row is None else self.cache.disk.fetch(*row, True)

    def read_uncounted(self, key: str) -> ChunkKV | None:
        """The whole entry, like :meth:`get`, but not counted as a hit (a promotion to the
        memory tier is not a query)."""
        return self._whole(self.open(key, count=False), key)

    def verify(self, key: str) -> str | None:
        """Fully check one entry; the reason it fails, or None when it is sound."""
        reader = None
        try:
            handle = self._uncounted_handle(key)
            if handle is None:
                return "missing"
            reader = FileReader(handle, key, self.spec, os.fstat(handle.fileno()).st_size)
            for i in range(self.spec.num_layers):
                reader.layer(i)
        except CorruptEntryError as err:
            return err.reason
        except store_faults() as err:
            return f"unreadable ({type(err).__name__}: {err})"
        finally:
            if reader is not None:
                reader.close()
        return None

    def stats(self) -> dict:
        try:
            hits, misses = self.cache.stats()  # counted across processes since the store was created
            entries, nbytes = len(self.cache), self.nbytes
        except store_faults() as err:
            self._fault("read its statistics", err)
            hits = misses = entries = nbytes = 0
        return {"disk": {"entries": entries, "bytes": nbytes, "max_bytes": self.max_bytes, "hits": hits,
                         "misses": misses, "faults": self.faults, "directory": str(self.directory)}}

    def entries_by_dtype(self) -> dict[str, dict]:
        """``{dtype: {"entries": n, "bytes": b}}`` over the store's entries (``ragblend cache
        stats``). Entries written since the dtype is tagged are counted from the database;
        older ones from their header ("unreadable" when it cannot be read)."""
        counts: dict[str, dict] = {}

        def add(dtype: str, size: int) -> None:
            row = counts.setdefault(dtype, {"entries": 0, "bytes": 0})
            row["entries"] += 1
            row["bytes"] += size

        try:
            for tag, entries, size in self.cache._sql(
                    "SELECT tag, COUNT(*), COALESCE(SUM(size), 0) FROM Cache WHERE raw = 1 AND tag IS NOT NULL "
                    "GROUP BY tag"):
                counts[str(tag)] = {"entries": int(entries), "bytes": int(size)}
            untagged = self.cache._sql("SELECT key, size FROM Cache WHERE raw = 1 AND tag IS NULL").fetchall()
        except store_faults() as err:
            self._fault("read its statistics", err)
            return counts
        for key, size in untagged:
            add(self._header_dtype(key) or "unreadable", int(size))
        return counts

    def _header_dtype(self, key: str) -> str | None:
        """The dtype an entry's header names, read without counting a hit; None if unreadable."""
        try:
            return header_dtype(self._uncounted_handle(key))
        except (CorruptEntryError, ValueError, AttributeError, *store_faults()):
            return None

    def clear(self) -> int:
        """Delete every entry and reset the hit and miss counts (they describe what was
        cleared); returns how many entries."""
        removed = self.cache.clear()
        self.cache.stats(enable=True, reset=True)
        return removed

    def close(self) -> None:
        self.cache.close()

    @classmethod
    def remove_files(cls, directory: str | os.PathLike) -> int:
        """Delete a store that cannot be opened (see :func:`~ragblend.core.store.store_files.remove_store_files`)."""
        return remove_store_files(directory)


def open_store(directory: str | os.PathLike, spec: EntrySpec, memory_bytes: int = 2 << 30,
               disk_bytes: int | None = None) -> KVStore:
    """A memory tier in front of a disk tier at ``directory``; the memory tier alone, with a
    warning, when the disk tier cannot be opened (read-only folder, broken database...)."""
    memory = MemoryStore(memory_bytes)
    try:
        return TieredStore(memory, DiskStore(directory, spec, disk_bytes))
    except store_faults() as err:  # the KV is a cache: run without its disk tier
        log.warning("ragblend: the KV store in %s cannot be opened (%s: %s); keeping KV in memory only.",
                    directory, type(err).__name__, err)
        return memory


class TieredStore(KVStore):
    """Memory in front of disk. Writes go to both; a disk hit is promoted to memory."""

    def __init__(self, memory: MemoryStore, disk: DiskStore):
        self.memory, self.disk = memory, disk

    def open(self, key: str, drop_unusable: bool = True) -> ChunkReader | None:
        reader = self.memory.open(key)
        if reader is not None:
            return reader
        return self.disk.open(key, drop_unusable)

    def promote(self, entry: ChunkKV) -> None:
        self.memory.put(entry)

    def put(self, entry: ChunkKV) -> bool:
        """True when the entry reached the disk tier (the one that outlives the process)."""
        stored = self.disk.put(entry)
        self.memory.put(entry)
        return stored

    @property
    def faults(self) -> int:
        return self.disk.faults

    def delete(self, key: str) -> bool:
        in_memory = self.memory.delete(key)
        return self.disk.delete(key) or in_memory

    def keys(self) -> Iterator[str]:
        return iter(set(self.memory.keys()) | set(self.disk.keys()))

    def __len__(self) -> int:
        """Entries on disk, without listing them: every entry is written there first and
        the memory tier holds copies (an entry whose disk write failed is not counted)."""
        return len(self.disk)

    def __contains__(self, key: str) -> bool:
        return key in self.memory or key in self.disk

    def stats(self) -> dict:
        return {**self.memory.stats(), **self.disk.stats()}
