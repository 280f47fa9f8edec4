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

    dtype "int8" stores each layer as K int8 [kv_heads, tokens, head_dim], K scales float16
    [kv_heads, head_dim], V int8 [kv_heads, tokens, head_dim], V scales float16
    [kv_heads, tokens] (see :func:`ragblend.core.kv.quantize_int8`).

    dtype "uint4" stores each layer as K codes uint8 [kv_heads, tokens, head_dim / 2] (two 4-bit
    codes a byte), K steps and minimums float16 [kv_heads, 2, ceil(tokens / 32), head_dim], V codes
    uint8 [kv_heads, tokens, head_dim / 2], V steps and minimums float16 [kv_heads, 2, tokens,
    head_dim / 32] (see :func:`ragblend.core.kv.quantize_uint4`).

Every read checks the header (magic, CRCs, size, structure, format version, fingerprint,
shape, the type and range of every number, token ids, file length) and each layer's CRC32.
A failing entry raises :class:`CorruptEntryError` (layer reads) or is reported missing
(open); either way it is deleted so the caller recomputes it. A header is parsed as
hostile input: its CRC only proves it was not torn, not that a ragblend engine wrote it.

Which files of a disk store's folder are its own, and the folder's marker:
:mod:`ragblend.core.store_files`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch

from .errors import InvalidInputError, StoreUnavailableError
from .kv import _NAMESPACE, KV_FORMAT_VERSION, PACKED_4BIT, UINT4_GROUP, ChunkKV, dequantize, key_matches, value_group

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
    remove_store_files,
    safe_disk_class,
)

log = logging.getLogger("ragblend")

MAGIC = b"RBKV"
# A header holds a chunk's token ids (~8 bytes each as JSON) and one CRC per layer; 4 MiB
# is several times what a 128k-token chunk needs, and bounds what a hostile file can cost.
MAX_HEADER_BYTES = 4 << 20
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "int8": torch.int8, "uint4": torch.uint4}


@dataclass(frozen=True)
class EntrySpec:
    """What every entry of one engine must match: model fingerprint, KV shape and the
    vocabulary its token ids index (0: not checked, e.g. for ``ragblend cache stats``).

    ``sink_ids`` (and ``lead_sink_ids``, what lead entries are computed after), where given: an
    entry's key must be the one its header's fingerprint, dtype, namespace and token ids make
    (:func:`~ragblend.core.kv.key_matches`), so that a header edited to say another dtype than the
    bytes were written in is a miss, not garbage served."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 0
    sink_ids: tuple[int, ...] | None = None
    lead_sink_ids: tuple[int, ...] | None = None


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


def _layer_parts(dtype: torch.dtype, kv_heads: int, tokens: int, head_dim: int) -> list[tuple[torch.dtype, tuple]]:
    """The tensors one stored layer holds, in file order: ``(dtype, shape)`` each."""
    kv = (kv_heads, tokens, head_dim)
    if dtype == torch.int8:
        return [(torch.int8, kv), (torch.float16, (kv_heads, head_dim)),
                (torch.int8, kv), (torch.float16, (kv_heads, tokens))]
    if dtype == torch.uint4:
        codes = (kv_heads, tokens, head_dim // 2)
        return [(PACKED_4BIT, codes), (torch.float16, (kv_heads, 2, -(-tokens // UINT4_GROUP), head_dim)),
                (PACKED_4BIT, codes), (torch.float16, (kv_heads, 2, tokens, head_dim // value_group(head_dim)))]
    return [(dtype, kv), (dtype, kv)]


def _nbytes(parts: list[tuple[torch.dtype, tuple]]) -> int:
    return sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in parts)


def _layer_tensors(entry: ChunkKV, index: int) -> list[torch.Tensor]:
    if entry.key_scales is None:
        return [entry.keys[index], entry.values[index]]
    return [entry.keys[index], entry.key_scales[index], entry.values[index], entry.value_scales[index]]


def _dtype_name(dtype: torch.dtype) -> str:
    return next(n for n, d in STORAGE_DTYPES.items() if d == dtype)


def encode_entry(entry: ChunkKV, fingerprint: str) -> bytes:
    """Serialise ``entry`` (in its own dtype) to the binary format above."""
    dtype_name = _dtype_name(entry.storage_dtype)
    layers = [b"".join(_tensor_bytes(t) for t in _layer_tensors(entry, i)) for i in range(entry.keys.shape[0])]
    num_layers, kv_heads, tokens, head_dim = entry.keys.shape
    if dtype_name == "uint4":
        head_dim *= 2   # two codes a byte
    # A shared entry's header is what it always was; a namespaced one says whose it is, so that an
    # engine learning the store (ChunkIndex.learn_store) files it there, also after a restart.
    namespace = {"namespace": entry.namespace} if entry.namespace else {}
    header = json.dumps({
        "format": KV_FORMAT_VERSION, "fingerprint": fingerprint, "key": entry.key, "dtype": dtype_name,
        "layers": num_layers, "kv_heads": kv_heads, "tokens": tokens, "head_dim": head_dim,
        "token_ids": list(entry.token_ids), "token_ids_sha256": _token_hash(entry.token_ids),
        "layer_crc32": [zlib.crc32(b) for b in layers], **namespace,
    }).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, struct.pack("<I", zlib.crc32(header)), *layers])


class ChunkReader:
    """Layer-wise access to one stored chunk. ``layer(i)`` returns ``(K, V)`` as
    ``[kv_heads, tokens, head_dim]`` in the storage dtype."""

    key: str
    token_ids: list[int]
    tier: str
    namespace: str = ""   # the namespace the entry was stored for ("": shared)

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
        self.namespace = entry.namespace

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
        self.namespace = header.get("namespace", "")
        self.parts = _layer_parts(self.dtype, spec.num_kv_heads, len(self.token_ids), spec.head_dim)
        self.crcs = header["layer_crc32"]
        self.layer_bytes = _nbytes(self.parts)
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
        if header_len > min(size, MAX_HEADER_BYTES):
            raise bad("header larger than the file or than any real entry's")
        raw = handle.read(header_len + 4)
        if len(raw) < header_len + 4 or struct.unpack("<I", raw[-4:])[0] != zlib.crc32(raw[:-4]):
            raise bad("header checksum mismatch")
        raw = raw[:-4]
        if not _header_shaped(raw):
            raise bad("header is not shaped like a ragblend header")
        try:
            header = json.loads(raw)
        except ValueError:
            raise bad("unreadable header") from None
        return FileReader._check_header(header, key, spec, size, header_len, bad)

    @staticmethod
    def _check_identity(header, key: str, spec: EntrySpec, bad) -> None:
        """The header is an object written in this format, for this model, key, storage dtype
        and KV shape."""
        if type(header) is not dict:
            raise bad("header is not an object")
        if header.get("format") != KV_FORMAT_VERSION:
            raise bad(f"format version {str(header.get('format'))[:20]} != {KV_FORMAT_VERSION}")
        if header.get("fingerprint") != spec.fingerprint:
            raise bad("written for another model or tokenizer")
        if header.get("key") != key:
            raise bad("stored under another key")
        if type(header.get("dtype")) is not str or header["dtype"] not in STORAGE_DTYPES:
            raise bad("unknown storage dtype")
        if header["dtype"] == "uint4" and spec.head_dim % 2:
            raise bad("uint4 entry for a model whose head_dim is odd")
        if [header.get(n) for n in ("layers", "kv_heads", "head_dim")] != [
                spec.num_layers, spec.num_kv_heads, spec.head_dim]:
            raise bad("KV shape does not match the model")

    @staticmethod
    def _check_header(header, key: str, spec: EntrySpec, size: int, header_len: int, bad) -> dict:
        """Check every field's type and range before using it (nothing here may raise
        anything but :class:`CorruptEntryError`)."""
        def is_int(value, low, high):
            return type(value) is int and low <= value < high

        def int_list(name, low, high):
            values = header.get(name)
            if type(values) is not list or not all(is_int(v, low, high) for v in values):
                raise bad(f"{name} must be a list of integers in [{low}, {high})")
            return values

        FileReader._check_identity(header, key, spec, bad)
        token_ids = int_list("token_ids", 0, spec.vocab_size or 2**31)
        crcs = int_list("layer_crc32", 0, 2**32)
        if not is_int(header.get("tokens"), 1, 2**31) or header["tokens"] != len(token_ids):
            raise bad("token count does not match the token ids")
        if header.get("token_ids_sha256") != _token_hash(token_ids):
            raise bad("token ids do not match their hash")
        namespace = header.get("namespace", "")
        if type(namespace) is not str or not _NAMESPACE.fullmatch(namespace):
            raise bad("namespace must be a plain label")
        if spec.sink_ids is not None and not key_matches(
                key, fingerprint=spec.fingerprint, sink_ids=spec.sink_ids, lead_sink_ids=spec.lead_sink_ids,
                token_ids=token_ids, dtype=header["dtype"], namespace=namespace):
            raise bad(f"header disagrees with its key (dtype {header['dtype']}, namespace, token ids or sink "
                      "are not what the key was made from)")
        if len(crcs) != spec.num_layers:
            raise bad("missing layer checksums")
        parts = _layer_parts(STORAGE_DTYPES[header["dtype"]], spec.num_kv_heads, len(token_ids), spec.head_dim)
        expected = 8 + header_len + 4 + spec.num_layers * _nbytes(parts)
        if size != expected:
            raise bad(f"file is {size} bytes, expected {expected} (truncated or padded)")
        return header

    def fetch(self, index: int) -> bytes:
        with self._lock:  # one handle, possibly read from a prefetch thread
            self.handle.seek(self.data_start + index * self.layer_bytes)
            return self.handle.read(self.layer_bytes)

    def _unpack(self, index: int, buf: bytes) -> list[torch.Tensor]:
        if len(buf) != self.layer_bytes or zlib.crc32(buf) != self.crcs[index]:
            raise CorruptEntryError(self.key, f"layer {index} checksum mismatch")
        tensors, offset = [], 0
        for dtype, shape in self.parts:
            size = _nbytes([(dtype, shape)])
            tensors.append(_tensor_from(buf[offset:offset + size], dtype, shape))
            offset += size
        return tensors

    def decode(self, index: int, buf: bytes):
        tensors = self._unpack(index, buf)
        return dequantize(self.dtype, *tensors) if len(tensors) == 4 else tuple(tensors)

    def read_all(self) -> ChunkKV:
        """The whole entry as stored (an int8 or uint4 entry stays so, with its scales)."""
        layers = [self._unpack(i, self.fetch(i)) for i in range(len(self.crcs))]
        stacked = [torch.stack(parts) for parts in zip(*layers)]
        if len(stacked) == 4:
            keys, key_scales, values, value_scales = stacked
            return ChunkKV(self.key, list(self.token_ids), keys, values, key_scales, value_scales)
        return ChunkKV(self.key, list(self.token_ids), *stacked)

    def close(self) -> None:
        self.handle.close()


# ---------------------------------------------------------------------------- interface


def _header_shaped(raw: bytes) -> bool:
    """Whether ``raw`` is shaped like a header this format writes: one flat object with two flat
    lists. Checked before parsing, so a crafted header cannot exhaust the parser's recursion."""
    return raw.count(b"{") == 1 and raw.count(b"[") == 2


def header_dtype(handle: BinaryIO | None) -> str | None:
    """The dtype the header of an entry file names (``handle``, closed after), or None when it
    is missing or unreadable; a malformed header can raise ValueError or AttributeError."""
    if handle is None:
        return None
    with handle:
        start = handle.read(8)
        if len(start) < 8 or start[:4] != MAGIC:
            return None
        (header_len,) = struct.unpack("<I", start[4:])
        if header_len > MAX_HEADER_BYTES:
            return None
        raw = handle.read(header_len)
        if not _header_shaped(raw):
            return None
        dtype = json.loads(raw).get("dtype")
    return dtype if dtype in STORAGE_DTYPES else None


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
            return False
        with self._lock:
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[entry.key] = entry
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
        return True

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

    def __init__(self, directory: str | os.PathLike, spec: EntrySpec, max_bytes: int = 8 << 30,
                 orphan_age_s: float = 60.0):
        import diskcache

        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise StoreUnavailableError(f"{self.directory} is a file, not a KV store folder")
        check_store_folder(self.directory)   # before diskcache creates or opens anything in it
        self.spec = spec
        self.max_bytes = max_bytes
        self.faults = 0
        self.rejected = 0   # entries dropped on reading as unusable (corrupt, or a header that disagrees with its key)
        self._logged: set[str] = set()
        check_write_lock(self.directory / DATABASE, self.LOCK_TIMEOUT_S)
        # diskcache's own culling drops entries in batches of 10, far more than needed when
        # entries are megabytes each; eviction is done here instead, one entry at a time.
        self.cache = diskcache.Cache(
            str(self.directory), size_limit=max_bytes, eviction_policy="least-recently-used",
            cull_limit=0, disk=safe_disk_class(), statistics=1, timeout=self.LOCK_TIMEOUT_S,
        )
        self._database_id = file_identity(self.directory / DATABASE)
        self.reclaimed = self._reclaim_orphans(orphan_age_s)

    def _reclaim_orphans(self, min_age_s: float) -> int:
        """Remove the store's own entry files that no row names and that are old enough not
        to be another process's write in progress. Returns how many were removed."""
        try:
            named = {row[0] for row in self.cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
            orphans = orphan_entry_files(self.directory, named, min_age_s)
            for name in orphans:
                self.cache.disk.remove(name)
            removed = len(orphans)
        except store_faults() as err:
            self._fault("reclaim unnamed files", err)
            return 0
        if removed:
            log.info("ragblend: removed %d unfinished KV file(s) from %s.", removed, self.directory)
        return removed

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
                           tag=_dtype_name(entry.storage_dtype))
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
        """Delete a store that cannot be opened (see :func:`~ragblend.core.store_files.remove_store_files`)."""
        return remove_store_files(directory)


def open_store(directory: str | os.PathLike, spec: EntrySpec, memory_bytes: int = 2 << 30,
               disk_bytes: int = 8 << 30) -> KVStore:
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
