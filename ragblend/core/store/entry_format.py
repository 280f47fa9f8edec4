"""The KV entry format: how one chunk's KV is written, read back and checked.

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
    [kv_heads, tokens] (see :func:`ragblend.core.store.kv.quantize_int8`).

    dtype "uint4" stores each layer as K codes uint8 [kv_heads, tokens, head_dim / 2] (two 4-bit
    codes a byte), K steps and minimums float16 [kv_heads, 2, ceil(tokens / 32), head_dim], V codes
    uint8 [kv_heads, tokens, head_dim / 2], V steps and minimums float16 [kv_heads, 2, tokens,
    head_dim / 32] (see :func:`ragblend.core.store.kv.quantize_uint4`).

Every read checks the header (magic, CRCs, size, structure, format version, fingerprint,
shape, the type and range of every number, token ids, file length) and each layer's CRC32.
A failing entry raises :class:`CorruptEntryError` (layer reads) or is reported missing
(open); either way it is deleted so the caller recomputes it. A header is parsed as
hostile input: its CRC only proves it was not torn, not that a ragblend engine wrote it.

The stores (:mod:`ragblend.core.store.tiers`) keep entries; this module is what an entry is.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from .kv import _NAMESPACE, KV_FORMAT_VERSION, PACKED_4BIT, UINT4_GROUP, ChunkKV, dequantize, key_matches, value_group
from .store_files import CorruptEntryError

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
    (:func:`~ragblend.core.store.kv.key_matches`), so that a header edited to say another dtype than the
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


def storage_dtype_name(dtype: torch.dtype) -> str:
    return next(n for n, d in STORAGE_DTYPES.items() if d == dtype)


def encode_entry(entry: ChunkKV, fingerprint: str) -> bytes:
    """Serialise ``entry`` (in its own dtype) to the binary format above."""
    dtype_name = storage_dtype_name(entry.storage_dtype)
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
