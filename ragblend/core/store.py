"""KV store tiers and the on-disk format.

The engine talks to the small :class:`KVStore` interface. Two tiers implement it:

* :class:`MemoryStore` — an in-process LRU bounded in bytes.
* :class:`DiskStore` — a ``diskcache`` directory: LRU eviction under a size limit,
  process-safe (SQLite), each entry one file written before its row is committed, so a
  killed writer never leaves a torn entry.

:class:`TieredStore` puts memory in front of disk. Reads go layer by layer through
:class:`ChunkReader` so the fusion can load layer i+1 while it computes layer i.

Entry format (no pickle anywhere; all integers little-endian)::

    b"RBKV"                    magic
    u32  header_len
    header                     UTF-8 JSON: format, fingerprint, key, dtype, layers, kv_heads,
                               tokens, head_dim, token_ids, token_ids_sha256, layer_crc32[]
    u32  header_crc32
    layer 0: K bytes, V bytes  each [kv_heads, tokens, head_dim] in ``dtype``
    layer 1: ...               (layer-major: one layer of a chunk is one seek + one read)

Every read checks the header (magic, CRCs, format version, fingerprint, shape, token ids,
file length) and each layer's CRC32. A failing entry raises :class:`CorruptEntryError`
(layer reads) or is reported missing (open); either way it is deleted so the caller
recomputes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch

from .errors import InvalidInputError, RagblendError

log = logging.getLogger("ragblend")
from .kv import KV_FORMAT_VERSION, ChunkKV

MAGIC = b"RBKV"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CorruptEntryError(RagblendError):
    """A stored KV entry failed verification. The store drops it; the engine recomputes it."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"KV entry {key[:12]}... is unusable ({reason}); it is dropped and recomputed.")
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class EntrySpec:
    """What every entry of one engine must match: model fingerprint and KV shape."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _token_hash(token_ids) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # bfloat16 has no numpy dtype: reinterpret its bits as int16.
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _tensor_from(buf: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    t = torch.frombuffer(bytearray(buf), dtype=raw_dtype).reshape(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def encode_entry(entry: ChunkKV, fingerprint: str) -> bytes:
    """Serialise ``entry`` (in its own dtype) to the binary format above."""
    dtype_name = next(n for n, d in STORAGE_DTYPES.items() if d == entry.keys.dtype)
    layers = [_tensor_bytes(entry.keys[i]) + _tensor_bytes(entry.values[i]) for i in range(entry.keys.shape[0])]
    num_layers, kv_heads, tokens, head_dim = entry.keys.shape
    header = json.dumps({
        "format": KV_FORMAT_VERSION, "fingerprint": fingerprint, "key": entry.key, "dtype": dtype_name,
        "layers": num_layers, "kv_heads": kv_heads, "tokens": tokens, "head_dim": head_dim,
        "token_ids": list(entry.token_ids), "token_ids_sha256": _token_hash(entry.token_ids),
        "layer_crc32": [zlib.crc32(b) for b in layers],
    }).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, struct.pack("<I", zlib.crc32(header)), *layers])


class ChunkReader:
    """Layer-wise access to one stored chunk. ``layer(i)`` returns ``(K, V)`` as
    ``[kv_heads, tokens, head_dim]`` in the storage dtype."""

    key: str
    token_ids: list[int]
    tier: str

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def fetch(self, index: int):
        """The raw data of one layer: the I/O part of a read, safe to run in another thread."""
        raise NotImplementedError

    def decode(self, index: int, raw) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify and unpack what :meth:`fetch` returned (the CPU part of a read)."""
        raise NotImplementedError

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(index, self.fetch(index))

    def close(self) -> None:
        pass


class MemoryReader(ChunkReader):
    def __init__(self, entry: ChunkKV, tier: str = "memory"):
        self.entry, self.key, self.token_ids, self.tier = entry, entry.key, entry.token_ids, tier

    def fetch(self, index: int):
        return self.entry.layer(index)

    def decode(self, index: int, raw):
        return raw


class FileReader(ChunkReader):
    """Reads an entry from an open binary file, verifying as it goes."""

    tier = "disk"

    def __init__(self, handle: BinaryIO, key: str, spec: EntrySpec, size: int):
        self.handle, self.key = handle, key
        try:
            header = self._read_header(handle, key, spec, size)
        except BaseException:
            handle.close()
            raise
        self.dtype = STORAGE_DTYPES[header["dtype"]]
        self.token_ids = header["token_ids"]
        self.shape = (header["kv_heads"], header["tokens"], header["head_dim"])
        self.crcs = header["layer_crc32"]
        self.layer_bytes = 2 * self.shape[0] * self.shape[1] * self.shape[2] * self.dtype.itemsize
        self.data_start = handle.tell()
        self._lock = threading.Lock()

    @staticmethod
    def _read_header(handle: BinaryIO, key: str, spec: EntrySpec, size: int) -> dict:
        def bad(reason):
            return CorruptEntryError(key, reason)

        start = handle.read(8)
        if len(start) < 8 or start[:4] != MAGIC:
            raise bad("not a ragblend KV entry")
        (header_len,) = struct.unpack("<I", start[4:])
        if header_len > size:
            raise bad("truncated header")
        raw = handle.read(header_len + 4)
        if len(raw) < header_len + 4 or struct.unpack("<I", raw[-4:])[0] != zlib.crc32(raw[:-4]):
            raise bad("header checksum mismatch")
        try:
            header = json.loads(raw[:-4])
            return FileReader._check_header(header, key, spec, size, header_len, bad)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise bad("unreadable header") from None

    @staticmethod
    def _check_header(header: dict, key: str, spec: EntrySpec, size: int, header_len: int, bad) -> dict:
        if header.get("format") != KV_FORMAT_VERSION:
            raise bad(f"format version {header.get('format')} != {KV_FORMAT_VERSION}")
        if header.get("fingerprint") != spec.fingerprint:
            raise bad("written for another model or tokenizer")
        if header.get("key") != key:
            raise bad("stored under another key")
        if header.get("dtype") not in STORAGE_DTYPES:
            raise bad(f"unknown dtype {header.get('dtype')!r}")
        if (header["layers"], header["kv_heads"], header["head_dim"]) != (
                spec.num_layers, spec.num_kv_heads, spec.head_dim):
            raise bad("KV shape does not match the model")
        if header["tokens"] != len(header["token_ids"]) or _token_hash(header["token_ids"]) != header["token_ids_sha256"]:
            raise bad("token ids do not match their hash")
        if len(header["layer_crc32"]) != header["layers"]:
            raise bad("missing layer checksums")
        itemsize = STORAGE_DTYPES[header["dtype"]].itemsize
        expected = 8 + header_len + 4 + header["layers"] * 2 * header["kv_heads"] * header["tokens"] * header["head_dim"] * itemsize
        if size != expected:
            raise bad(f"file is {size} bytes, expected {expected} (truncated or padded)")
        return header

    def fetch(self, index: int) -> bytes:
        with self._lock:  # one handle, possibly read from a prefetch thread
            self.handle.seek(self.data_start + index * self.layer_bytes)
            return self.handle.read(self.layer_bytes)

    def decode(self, index: int, buf: bytes):
        if len(buf) != self.layer_bytes or zlib.crc32(buf) != self.crcs[index]:
            raise CorruptEntryError(self.key, f"layer {index} checksum mismatch")
        half = self.layer_bytes // 2
        return _tensor_from(buf[:half], self.dtype, self.shape), _tensor_from(buf[half:], self.dtype, self.shape)

    def read_all(self) -> ChunkKV:
        layers = [self.layer(i) for i in range(len(self.crcs))]
        keys = torch.stack([k for k, _ in layers])
        values = torch.stack([v for _, v in layers])
        return ChunkKV(self.key, list(self.token_ids), keys, values)

    def close(self) -> None:
        self.handle.close()


# ---------------------------------------------------------------------------- interface


class KVStore:
    """Interface of a KV store tier. Implementations are thread-safe."""

    def get(self, key: str) -> ChunkKV | None:
        """The whole entry for ``key``, or None when absent or unusable (then dropped)."""
        reader = self.open(key)
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

    def put(self, entry: ChunkKV) -> None:
        """Store ``entry`` under ``entry.key``; all or nothing."""
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

    def put(self, entry: ChunkKV) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[entry.key] = entry
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.nbytes -= entry.nbytes
            return True

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


# diskcache names every value file "xx/yy/<28 hex digits>.val" under its directory; a row
# naming anything else was not written by the store.
_ENTRY_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


def _safe_disk_class():
    """A diskcache ``Disk`` that only ever touches the store's own files.

    The cache database says which file holds each value, so a tampered database could point
    anywhere. This ``Disk`` refuses pickled keys and values (nothing is ever unpickled), and
    opens or deletes a value file only when its name follows the store's own naming scheme,
    it resolves inside the store's directory and it is a regular file (no symlink, FIFO or
    device: opening a FIFO would block the query). Deleting removes the file and at most its
    two empty sub-folders, never a folder above the store.
    """
    import diskcache
    from diskcache.core import MODE_BINARY

    class SafeDisk(diskcache.Disk):
        def get(self, key, raw):
            if not raw:
                raise CorruptEntryError(str(key), "non-string key in the cache database")
            return super().get(key, raw)

        def own_path(self, filename) -> str | None:
            """The full path of one of the store's entry files, or None for any other name."""
            if not isinstance(filename, str) or not _ENTRY_FILE.fullmatch(filename):
                return None
            root = os.path.realpath(self._directory)
            path = os.path.join(root, filename)
            return path if os.path.realpath(path) == path else None  # no symlinked sub-folder

        def fetch(self, mode, filename, value, read):
            if mode != MODE_BINARY:
                raise CorruptEntryError(str(filename), "value not stored as a plain binary file")
            path = self.own_path(filename)
            if path is None:
                raise CorruptEntryError(str(filename), "entry file outside the store's own files")
            # O_NONBLOCK: a FIFO opens at once (and is then refused) instead of waiting for a writer.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise CorruptEntryError(str(filename), "entry is not a regular file")
            os.set_blocking(fd, True)
            handle = os.fdopen(fd, "rb")
            if read:
                return handle
            with handle:
                return handle.read()

        def remove(self, file_path):
            path = self.own_path(file_path)
            if path is None:
                return  # not the store's: never delete it
            with contextlib.suppress(OSError):
                os.remove(path)
            for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only when empty

    return SafeDisk


def store_faults() -> tuple[type[BaseException], ...]:
    """What a disk tier can raise when its files or database fail: I/O errors (full disk,
    read-only or vanished folder), SQLite errors (malformed or locked database) and
    diskcache's lock timeout."""
    import sqlite3

    import diskcache

    return OSError, sqlite3.Error, diskcache.Timeout


class DiskStore(KVStore):
    """KV entries as files in a ``diskcache`` directory, LRU-evicted under ``max_bytes``.

    The store is a cache: when its files or database fail (full disk, read-only or vanished
    folder, malformed or locked database) a read is a miss and a write is skipped. Each kind
    of failure is logged once and every one is counted in ``faults``; lock waits last at
    most ``LOCK_TIMEOUT_S``. Opening the store itself can still raise those errors (see
    :meth:`BlendEngine.from_pretrained`, which then keeps the KV in memory only).
    """

    tier = "disk"
    LOCK_TIMEOUT_S = 0.25

    def __init__(self, directory: str | os.PathLike, spec: EntrySpec, max_bytes: int = 8 << 30):
        import diskcache

        self.directory = Path(directory).expanduser()
        self.spec = spec
        self.max_bytes = max_bytes
        self.faults = 0
        self._logged: set[str] = set()
        # diskcache's own culling drops entries in batches of 10, far more than needed when
        # entries are megabytes each; eviction is done here instead, one entry at a time.
        self.cache = diskcache.Cache(
            str(self.directory), size_limit=max_bytes, eviction_policy="least-recently-used",
            cull_limit=0, disk=_safe_disk_class(), statistics=1, timeout=self.LOCK_TIMEOUT_S,
        )

    def _fault(self, action: str, err: BaseException) -> None:
        self.faults += 1
        kind = f"{action}/{type(err).__name__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("ragblend: the KV store in %s failed to %s (%s: %s); the chunk is computed instead.",
                        self.directory, action, type(err).__name__, err)

    def open(self, key: str, drop_unusable: bool = True) -> ChunkReader | None:
        """A reader for ``key``, or None. An unusable entry is deleted unless
        ``drop_unusable`` is False (e.g. when scanning a directory other models share)."""
        try:
            handle = self.cache.get(key, read=True)
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
        except CorruptEntryError:
            if drop_unusable:
                self.delete(key)
            return None
        except OSError as err:
            self._fault("read", err)
            return None

    def put(self, entry: ChunkKV) -> None:
        """Store ``entry``; on a full disk, read-only folder or locked database it is skipped
        (logged and counted), as a cache may."""
        try:
            self.cache.set(entry.key, io.BytesIO(encode_entry(entry, self.spec.fingerprint)), read=True)
            self._evict()
        except store_faults() as err:
            self._fault("write", err)

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

    def verify(self, key: str) -> str | None:
        """Fully check one entry; the reason it fails, or None when it is sound."""
        try:
            handle = self.cache.get(key, read=True)
        except CorruptEntryError as err:
            return err.reason
        if handle is None:
            return "missing"
        try:
            reader = FileReader(handle, key, self.spec, os.fstat(handle.fileno()).st_size)
            for i in range(self.spec.num_layers):
                reader.layer(i)
        except CorruptEntryError as err:
            return err.reason
        finally:
            handle.close()
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

    def clear(self) -> int:
        return self.cache.clear()

    def close(self) -> None:
        self.cache.close()


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

    def put(self, entry: ChunkKV) -> None:
        self.disk.put(entry)
        self.memory.put(entry)

    def delete(self, key: str) -> bool:
        in_memory = self.memory.delete(key)
        return self.disk.delete(key) or in_memory

    def keys(self) -> Iterator[str]:
        return iter(set(self.memory.keys()) | set(self.disk.keys()))

    def __contains__(self, key: str) -> bool:
        return key in self.memory or key in self.disk

    def stats(self) -> dict:
        return {**self.memory.stats(), **self.disk.stats()}
