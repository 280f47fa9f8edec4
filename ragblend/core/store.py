"""KV stores: where precomputed :class:`~ragblend.core.kv.ChunkKV` entries live.

The engine only talks to the small :class:`KVStore` interface, so tiers can be swapped or
stacked without touching the fusion code. :class:`MemoryStore` is an LRU bounded in bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterator

from .kv import ChunkKV


class KVStore:
    """Interface of a KV store tier. Implementations must be thread-safe."""

    def get(self, key: str) -> ChunkKV | None:
        """The entry for ``key``, or None when absent (or unusable)."""
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

    def __init__(self, max_bytes: int = 2 << 30):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

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
