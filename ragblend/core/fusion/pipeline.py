"""Layer sources: how the fusion gets layer i of every reused chunk's cached KV.

The fusion asks for layers in increasing order and says up front which ones it will need
(:meth:`LayerSource.prepare`). Two sources:

* :class:`SequentialSource` reads a layer when it is asked for (load, then compute).
* :class:`PrefetchSource` reads ahead in a background thread, so layer i+1 comes off its
  tier while layer i is being fused (CacheBlend §5, CachedAttention §3.2). The thread does
  only the I/O, which waits on the device and leaves the cores to the compute; checking
  and converting a layer (cheap) happens when the fusion takes it. On CUDA the thread also
  checks the layer and copies it into pinned host buffers (the CPU is idle while the GPU
  computes), from any tier, and the copy to the device runs on a side stream from them.

Both return one ``(K, V)`` per chunk, ``[kv_heads, tokens, head_dim]`` on the compute device
in the storage dtype (the fusion converts while placing them), K before RoPE, and both keep
``load_s`` (time spent reading and checking; on CUDA pinning too) and ``wait_s`` (time the fusion waited).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..store.tiers import ChunkReader, MemoryReader
from .prefill import LayerSource


class SequentialSource(LayerSource):
    """Reads layer ``i`` of every chunk when asked."""

    def __init__(self, readers: list[ChunkReader], device: torch.device | str = "cpu",
                 windows: list[slice] | None = None):
        self.readers = readers
        # The token range of each chunk that the prompt uses (all of it, usually).
        self.windows = windows or [slice(None)] * len(readers)
        # Each distinct reader is read once a layer, and its windows cut from that: a conversation's
        # piece is fused in parts (split around the template's control tokens) from one reader.
        self._distinct = list(dict.fromkeys(readers))
        slot = {id(reader): i for i, reader in enumerate(self._distinct)}
        self._slots = [slot[id(reader)] for reader in readers]
        self.device = torch.device(device)
        self.load_s = 0.0
        self.wait_s = 0.0
        # PrefetchSource adds to load_s from its read-ahead thread and the fusion's thread.
        self._load_lock = threading.Lock()

    def _count_load(self, since: float) -> None:
        with self._load_lock:
            self.load_s += time.perf_counter() - since

    def prepare(self, layers: list[int]) -> None:
        pass

    def _fetch(self, index: int) -> list:
        t0 = time.perf_counter()
        raw = [reader.fetch(index) for reader in self._distinct]
        self._count_load(t0)
        return raw

    def _windows(self, index: int, raw: list):
        """``raw`` (one per distinct reader) decoded, then ``(K, V, window)`` per span."""
        decoded = [reader.decode(index, r) for reader, r in zip(self._distinct, raw)]
        return [(*decoded[slot], w) for slot, w in zip(self._slots, self.windows)]

    def _decode(self, index: int, raw: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        parts = [self._to_device(k[:, w], v[:, w]) for k, v, w in self._windows(index, raw)]
        self._count_load(t0)
        return parts

    def _to_device(self, k, v):
        return k.to(self.device), v.to(self.device)

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        out = self._decode(index, self._fetch(index))
        self.wait_s += time.perf_counter() - t0
        return out

    def same_entry(self, before: int, span: int, between: list[int]) -> bool:
        # Only entries in memory: a file read here would race the read-ahead thread on its handle,
        # and the pieces this serves are kept in memory.
        reader = self._distinct[self._slots[span]]
        first, last = self.windows[before], self.windows[span]
        return (self._slots[before] == self._slots[span] and isinstance(reader, MemoryReader)
                and first.stop is not None and last.start is not None
                and list(reader.token_ids[first.stop:last.start]) == between)

    def stretch(self, index: int, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        reader = self._distinct[self._slots[first]]
        k, v = reader.decode(index, reader.fetch(index))
        whole = slice(self.windows[first].start, self.windows[last].stop)
        out = k[:, whole].to(self.device), v[:, whole].to(self.device)
        self._count_load(t0)
        return out

    def close(self) -> None:
        for reader in self._distinct:
            reader.close()


class PrefetchSource(SequentialSource):
    """Reads the needed layers ahead, ``depth`` layers at most, in a background thread."""

    def __init__(self, readers: list[ChunkReader], device: torch.device | str = "cpu",
                 windows: list[slice] | None = None, depth: int = 2, pool: ThreadPoolExecutor | None = None):
        """``pool``: a long-lived one-thread executor to read in (the engine keeps one, so a
        prefill does not start a thread); None makes one for this source alone."""
        super().__init__(readers, device, windows)
        self.depth = depth
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-prefetch")
        self._futures: dict[int, Future] = {}
        self._pending: list[int] = []
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # What the thread does with a layer: read it; on CUDA also check it and pin it (below).
        self._read_ahead = self._fetch if self._stream is None else self._fetch_pinned

    def prepare(self, layers: list[int]) -> None:
        self._pending = list(layers)
        self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            while self._pending and len(self._futures) < self.depth:
                index = self._pending.pop(0)
                self._futures[index] = self._pool.submit(self._read_ahead, index)

    def _fetch_pinned(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``index`` of every chunk read, checked, cut to its window and copied into pinned
        host memory (CUDA only, in the thread: the CPU is idle while the GPU computes). Copied
        from pageable memory in the fusion's own thread, a ~2 GB prompt's KV cost an H100
        0.38 s of waiting (docs/benchmarks.md#scaling-with-the-prompt)."""
        raw = self._fetch(index)
        t0 = time.perf_counter()
        pinned = [(_pinned_copy(k[:, w]), _pinned_copy(v[:, w])) for k, v, w in self._windows(index, raw)]
        self._count_load(t0)
        return pinned

    def _decode(self, index: int, raw: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._stream is None:
            return super()._decode(index, raw)
        return [self._to_device(k, v) for k, v in raw]   # checked and pinned in the thread: only the copy is left

    def _to_device(self, k, v):
        if self._stream is None:
            return super()._to_device(k, v)
        # From pinned host buffers (_fetch_pinned) the copy runs asynchronously on the side
        # stream; the compute stream then waits for exactly this copy, nothing more.
        with torch.cuda.stream(self._stream):
            k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._stream)
        # The tensors were allocated on the side stream but are used on the compute stream:
        # tell the allocator, so their memory is not reused before the compute is done.
        k.record_stream(compute)
        v.record_stream(compute)
        return k, v

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        with self._lock:
            future = self._futures.pop(index, None)
        raw = self._read_ahead(index) if future is None else future.result()
        self._schedule()
        out = self._decode(index, raw)  # raises CorruptEntryError for a bad layer
        self.wait_s += time.perf_counter() - t0
        return out

    def close(self) -> None:
        with self._lock:
            self._pending.clear()
            futures = list(self._futures.values())
            self._futures.clear()
        for future in futures:
            future.cancel()
        # Reads already running must end before their readers close.
        wait(futures)
        if self._own_pool:
            self._pool.shutdown(wait=True)
        super().close()


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied, contiguous, into pinned host memory (a chunk's window is a strided
    view: pinned as it is, its copy to the device would go through a pageable buffer)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
