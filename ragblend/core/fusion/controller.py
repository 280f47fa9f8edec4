"""Loading controller (CacheBlend §5.1): pick the recompute ratio and the storage tier from
measured costs.

Two costs are measured once per model, device and storage dtype, and cached as JSON under
``<cache>/controller/``:

* the prefill cost per token and layer (a full prefill of a few hundred tokens), and
* each tier's read throughput for KV: memory (copy + dtype conversion) and disk (entry files
  read with the page cache dropped, through the same reader the fusion uses).

From them, for a prompt of ``N`` tokens of which ``R`` are reused:

* recompute time of one layer at ratio r: ``(r * R + (N - R)) * cost_per_token_layer``
* load time of one layer from a tier: ``R * bytes_per_token_layer / throughput(tier)``
* the ratio: the larger of the quality floor (default 0.15) and the r whose recompute time
  equals the load time. With pipelining, recomputing up to that ratio costs no extra TTFT.
* the tier: the cheapest one (disk before memory) whose load time at the floor ratio is not
  more than the recompute time, i.e. that adds no delay.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..model.adapter import ModelAdapter
from ..paths import cache_dir
from ..store.kv import ChunkKV, to_storage
from ..store.tiers import DiskStore, EntrySpec, FileReader, MemoryReader
from .prefill import fused_prefill
from .strategies import FullRecompute

log = logging.getLogger("ragblend")

TIERS_BY_COST = ("disk", "memory")  # cheapest storage first


@dataclass
class Measurements:
    device: str
    compute_s_per_token_layer: float
    bytes_per_token_layer: float
    read_bytes_per_s: dict[str, float]


def _read_measurements(path: Path) -> Measurements | None:
    """The measurements cached at ``path``, or None (logged) for a file that is unreadable or holds
    numbers a plan cannot use (it divides by them): measured again, never trusted."""
    def positive(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        m = Measurements(**data) if isinstance(data, dict) else None
        tiers = m.read_bytes_per_s if m is not None else None
        if (m is not None and isinstance(m.device, str) and positive(m.compute_s_per_token_layer)
                and positive(m.bytes_per_token_layer) and isinstance(tiers, dict) and tiers
                and all(isinstance(t, str) and positive(bw) for t, bw in tiers.items())):
            return m
        why = "values out of range"
    except (OSError, ValueError, TypeError, RecursionError) as err:   # RecursionError: JSON nested too deep
        why = f"{type(err).__name__}: {err}"
    log.warning("ragblend: ignoring the loading controller's measurements in %s (%s); measuring again.", path, why)
    return None


@dataclass
class LoadingPlan:
    """What the controller picks for one prompt."""

    ratio: float                          # CacheBlend recompute ratio to use
    tier: str                             # cheapest tier that adds no delay
    quality_floor: float
    recompute_s_per_layer: float          # at ``ratio``
    load_s_per_layer: dict[str, float]    # per tier, for the reused tokens


class LoadingController:
    """Plans a prefill's ratio and tier from measured compute and read speeds. It needs the
    model (``adapter``), what its entries look like (``spec``, ``kv_dtype``) and a folder on
    the store's device for the read probe (``probe_dir``), not the engine."""

    def __init__(self, adapter: ModelAdapter, spec: EntrySpec, kv_dtype: torch.dtype, probe_dir: Path,
                 quality_floor: float = 0.15, probe_tokens: int = 512):
        self.adapter, self.spec, self.kv_dtype, self.probe_dir = adapter, spec, kv_dtype, Path(probe_dir)
        self.quality_floor = quality_floor
        self.probe_tokens = probe_tokens
        self._measured: Measurements | None = None

    @classmethod
    def for_store(cls, adapter: ModelAdapter, spec: EntrySpec, kv_dtype: torch.dtype, store) -> "LoadingController":
        """A controller whose read probe runs on the device of ``store``'s disk tier (else the cache folder)."""
        disk = getattr(store, "disk", store)
        probe_dir = disk.directory.parent if isinstance(disk, DiskStore) else cache_dir()
        return cls(adapter, spec, kv_dtype, probe_dir)

    @property
    def cache_file(self) -> Path:
        name = f"{self.spec.fingerprint[:16]}-{self.adapter.device.type}-{str(self.kv_dtype).split('.')[-1]}.json"
        return cache_dir() / "controller" / name

    def measurements(self, refresh: bool = False) -> Measurements:
        if self._measured is not None and not refresh:
            return self._measured
        path = self.cache_file
        if path.exists() and not refresh:
            self._measured = _read_measurements(path)
            if self._measured is not None:
                return self._measured
        self._measured = self._measure()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self._measured), indent=2))
            os.replace(tmp, path)
        except OSError as err:   # e.g. a read-only cache dir: the measurements hold for this process only
            log.info("ragblend: could not save the loading controller's measurements to %s (%s)", path, err)
        return self._measured

    def plan(self, prompt_tokens: int, reused_tokens: int, tier: str | None = None) -> LoadingPlan:
        """Ratio and tier for a prompt of ``prompt_tokens`` with ``reused_tokens`` from cache.

        ``tier`` is where the KV is now; the ratio is computed for it (default: the tier
        the controller would pick).
        """
        m = self.measurements()
        fresh = prompt_tokens - reused_tokens
        load = {t: reused_tokens * m.bytes_per_token_layer / bw for t, bw in m.read_bytes_per_s.items()}

        def recompute(r):
            return (r * reused_tokens + fresh) * m.compute_s_per_token_layer

        at_floor = recompute(self.quality_floor)
        no_delay = [t for t in TIERS_BY_COST if t in load and load[t] <= at_floor]
        best = no_delay[0] if no_delay else min(load, key=load.get)
        tier = tier or best
        ratio = self.quality_floor
        if reused_tokens:
            ratio_hidden = (load[tier] / m.compute_s_per_token_layer - fresh) / reused_tokens
            ratio = min(1.0, max(self.quality_floor, ratio_hidden))
        return LoadingPlan(round(ratio, 4), best, self.quality_floor, recompute(ratio), load)

    # ------------------------------------------------------------------ measuring

    def _measure(self) -> Measurements:
        adapter = self.adapter
        shape = adapter.shape
        ids = torch.randint(0, self.spec.vocab_size, (self.probe_tokens,)).tolist()
        fused_prefill(adapter, ids[:32], [], None, FullRecompute())  # warm-up
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fused_prefill(adapter, ids, [], None, FullRecompute())
            best = min(best, time.perf_counter() - t0)
        per_token_layer = best / (self.probe_tokens * shape.num_layers)

        tokens = 2048
        kv = torch.randn(shape.num_layers, shape.num_kv_heads, tokens, shape.head_dim)
        # Token ids stay inside the vocabulary: the probe entry is read back through the
        # same header checks as any entry, which refuse ids a model could not have produced.
        token_ids = [i % self.spec.vocab_size for i in range(tokens)]
        entry = to_storage(ChunkKV("0" * 64, token_ids, kv, kv.clone()), self.kv_dtype)
        layer_bytes = entry.nbytes / shape.num_layers
        bytes_per_token_layer = layer_bytes / tokens
        return Measurements(
            device=str(adapter.device), compute_s_per_token_layer=per_token_layer,
            bytes_per_token_layer=bytes_per_token_layer,
            read_bytes_per_s={"memory": self._memory_throughput(entry, layer_bytes),
                              "disk": self._disk_throughput(entry, layer_bytes)},
        )

    def _read_all_layers(self, reader) -> float:
        adapter = self.adapter
        t0 = time.perf_counter()
        for i in range(adapter.shape.num_layers):
            k, v = reader.layer(i)
            k.to(adapter.device, adapter.dtype), v.to(adapter.device, adapter.dtype)
        return time.perf_counter() - t0

    def _memory_throughput(self, entry: ChunkKV, layer_bytes: int) -> float:
        seconds = min(self._read_all_layers(MemoryReader(entry)) for _ in range(2))
        return layer_bytes * self.adapter.shape.num_layers / seconds

    def _disk_throughput(self, entry: ChunkKV, layer_bytes: int) -> float:
        """Read a freshly written entry with its pages dropped from the OS cache, where the
        OS allows it; otherwise this measures the page cache (reported as is)."""
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.probe_dir, prefix="probe-") as tmp:
            spec = replace(self.spec, sink_ids=None)   # the probe entry's key is made up: no key check
            probe = DiskStore(tmp, spec, max_bytes=1 << 40)
            probe.put(entry)
            for path in Path(tmp).rglob("*.val"):
                drop_page_cache(path)
            handle = probe.cache.get(entry.key, read=True)
            reader = FileReader(handle, entry.key, spec, os.fstat(handle.fileno()).st_size)
            try:
                seconds = self._read_all_layers(reader)
            finally:
                reader.close()
                probe.close()
        return layer_bytes * self.adapter.shape.num_layers / seconds


def drop_page_cache(path: Path) -> None:
    """Ask the OS to forget a file's cached pages, so the next read comes from the device."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
