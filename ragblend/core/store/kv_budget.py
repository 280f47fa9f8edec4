"""What a model's stored KV weighs, and whether a KV budget holds it.

A chunk's entry holds, per layer, K and V for every KV head and token (see the entry format in
:mod:`.tiers`): ``layers x kv_heads x head_dim x 2`` values a token, in the stored dtype, plus the
scales of a quantized one and a header (~8 bytes a token id). An engine that keeps lead entries
(the default) stores two entries a chunk. From that, :func:`project` says how large an index's
KV will be and how much of it a store's budget keeps: a chunk whose KV was evicted is computed
at query time, so an index larger than its budget loses most of what fusion saves.

    python -m benchmarks.kv_sizes    # the table for the benchmark models and 1-8B shapes
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .tiers import STORAGE_DTYPES, _layer_parts, _nbytes

log = logging.getLogger("ragblend")

# An entry's header: ~330 bytes of fields, ~8 bytes a token id (as JSON), ~12 a layer's CRC.
HEADER_BYTES, HEADER_BYTES_PER_TOKEN, HEADER_BYTES_PER_LAYER = 330, 8, 12
# Why the default stored dtype is what it is (``ragblend info`` prints it): benchmarks.kv_dtypes.
DEFAULT_KV_DTYPE_WHY = ("float16 stays the default: int8 measured within the order noise on SmolLM2, Qwen2.5 and "
                        "Gemma 3 but on 2 prompts each, uint4 changed a SmolLM2 answer (docs/benchmarks.md, 'Stored "
                        "KV dtypes').")
# The size of the chunks figures are quoted for (a typical RAG chunk).
CHUNK_TOKENS = 512


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape its KV size depends on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: dict) -> "KVShape":
        """From a Hugging Face ``config.json``'s fields (a dict)."""
        heads = config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads)


def entry_bytes(shape: KVShape, tokens: int, dtype: torch.dtype | str) -> int:
    """Bytes of one stored entry of ``tokens`` tokens in ``dtype``: its layers and its header."""
    dtype = STORAGE_DTYPES[dtype] if isinstance(dtype, str) else dtype
    layer = _nbytes(_layer_parts(dtype, shape.num_kv_heads, tokens, shape.head_dim))
    return (shape.num_layers * layer + HEADER_BYTES + HEADER_BYTES_PER_TOKEN * tokens
            + HEADER_BYTES_PER_LAYER * shape.num_layers)


def bytes_per_token(shape: KVShape, dtype: torch.dtype | str, chunk_tokens: int = CHUNK_TOKENS) -> float:
    """Stored bytes a token of a ``chunk_tokens``-token chunk costs (one entry; headers and scales
    included, which is why the chunk size matters a little)."""
    return entry_bytes(shape, chunk_tokens, dtype) / chunk_tokens


@dataclass(frozen=True)
class Projection:
    """The projected size of an index's KV against the budget of the store that keeps it.

    ``budget`` is the tier judged: the disk tier where the store has one, since only it outlives
    the process (the next process finds nothing of what the memory tier held); a memory-only
    store's own limit otherwise (``persists`` False). ``memory`` is the memory tier's limit beside
    a disk tier, said alongside."""

    chunks: int
    bytes: int               # all of it
    budget: int | None       # the judged tier's limit in bytes; None: unbounded
    dtype: str               # the stored dtype ("" when unknown, e.g. several)
    basis: str = ""          # what the figure is made of, e.g. "float16, 2 entries of ~512 tokens a chunk"
    memory: int | None = None   # the memory tier's limit, where the judged tier is a disk tier
    persists: bool = True    # False: a memory-only store, which keeps nothing for the next process

    @property
    def share_kept(self) -> float:
        """The share of the index's KV the budget holds (1.0: all of it)."""
        if self.budget is None or self.bytes <= self.budget:
            return 1.0
        return self.budget / self.bytes

    @property
    def fits(self) -> bool:
        return self.share_kept >= 1.0

    def describe(self, flags: bool = False) -> str:
        """One line: ``KV for 10,000 chunks: 12.3 GB projected (...); KV budget 8.0 GiB (disk tier...) holds
        65%: ...``. ``flags``: the advice names the CLI's flags (``--disk-bytes 40GiB``), not the options."""
        line = f"KV for {self.chunks:,} chunks: {_gb(self.bytes)} projected" + (f" ({self.basis})" if self.basis else "")
        if self.budget is None:
            return line + "."
        budget = f"KV budget {_gib(self.budget)} ({self._tiers()})"
        if self.fits:
            return f"{line}; {budget} holds all of it."
        knob = "disk_bytes" if self.persists else "memory_bytes"
        raise_to = f"{knob} to {size_arg(self.bytes, ' ')}"
        if flags:
            raise_to = f"--{knob.replace('_', '-')} to {size_arg(self.bytes)}"
        return (f"{line}; {budget} holds {self.share_kept:.0%}: the rest is computed at query time. "
                f"Raise {raise_to} or more, or store smaller KV ({_cheaper(self.dtype, flags)}).")

    def _tiers(self) -> str:
        if not self.persists:
            return "memory only: none of it outlives the process"
        if self.memory is None:
            return "disk tier"
        return f"disk tier, kept across processes; the memory tier's {_gib(self.memory)} lasts one process"


def project(shape: KVShape, dtype: torch.dtype | str, chunks: int, tokens_per_chunk: int, entries_per_chunk: int,
            budget: int | None, *, memory: int | None = None, persists: bool = True) -> Projection:
    """The projected KV of ``chunks`` chunks of ``tokens_per_chunk`` tokens each, ``entries_per_chunk``
    entries each (2 where the engine keeps lead entries), against ``budget`` (see :class:`Projection`
    for ``memory`` and ``persists``)."""
    name = dtype if isinstance(dtype, str) else next(n for n, d in STORAGE_DTYPES.items() if d == dtype)
    total = chunks * entries_per_chunk * entry_bytes(shape, max(tokens_per_chunk, 1), name)
    entries = "1 entry" if entries_per_chunk == 1 else f"{entries_per_chunk} entries"
    return Projection(chunks, total, budget, name, f"{name}, {entries} of ~{tokens_per_chunk} tokens a chunk",
                      memory, persists)


def store_budget(store) -> int | None:
    """The most bytes ``store`` keeps for the next process: its disk tier's limit where it has one
    (the memory tier is lost when the process ends, however large), else its own limit (a
    memory-only store: for this process); None when it has no limit."""
    disk = getattr(store, "disk", None)
    tier = disk if disk is not None else getattr(store, "memory", None) or store
    limit = getattr(tier, "max_bytes", None)
    return limit if isinstance(limit, int) else None


def store_tiers(store) -> dict:
    """``store``'s budget as :func:`project` takes it: ``budget``, ``memory`` and ``persists``."""
    disk, memory = getattr(store, "disk", None), getattr(store, "memory", None)
    persists = disk is not None or getattr(store, "tier", "") == "disk"
    limit = getattr(memory, "max_bytes", None) if disk is not None else None
    return {"budget": store_budget(store), "memory": limit if isinstance(limit, int) and limit else None,
            "persists": persists}


class BudgetWarnings:
    """One engine's warnings that its KV store's budget is too small, each logged once: when the
    store cannot keep the KV of every chunk precomputed through the engine (:meth:`count`), and when
    it cannot keep even one prompt's chunks (:meth:`check_prompt`). Either way the chunks it evicts
    are computed at query time, so fusion saves little. ``entries_per_chunk``: 2 where the engine
    keeps lead entries."""

    def __init__(self, shape: KVShape, entries_per_chunk: int):
        self.shape, self.entries_per_chunk = shape, entries_per_chunk
        self.warned: set[str] = set()           # "index", "prompt"
        self.precomputed: dict[str, int] = {}   # key -> tokens of every chunk precomputed through the engine

    def project(self, store, dtype: torch.dtype, chunks: int, tokens_per_chunk: int, *, warn: bool = True) -> Projection:
        """:func:`project` against ``store``'s budget; ``warn``: log once when the budget holds only part of it."""
        projection = project(self.shape, dtype, chunks, tokens_per_chunk, self.entries_per_chunk,
                             **store_tiers(store))
        if warn and not projection.fits and "index" not in self.warned:
            self.warned.add("index")
            log.warning("ragblend: %s", projection.describe())
        return projection

    def count(self, refs: list, store, dtype: torch.dtype) -> list:
        """``refs`` (of chunks just precomputed), counted: warn once when ``store`` cannot keep the
        KV of all the chunks counted so far, at their mean size."""
        for ref in refs:
            if ref is not None:
                self.precomputed[ref.key] = ref.num_tokens
        if self.precomputed:
            tokens = -(-sum(self.precomputed.values()) // len(self.precomputed))
            self.project(store, dtype, len(self.precomputed), tokens)
        return refs

    def check_prompt(self, chunk_tokens: list[int], store, dtype: torch.dtype) -> None:
        """Say once when ``store`` cannot hold even one prompt's chunks (of ``chunk_tokens`` tokens
        each): the prompt is answered, the chunks the store cannot keep computed each time."""
        if "prompt" in self.warned or not chunk_tokens:
            return
        # The next prompt may be this process's: a chunk kept in either tier is reused, so the larger counts.
        tiers = store_tiers(store)
        budget = max(limit for limit in (tiers["budget"], tiers["memory"]) if limit is not None) \
            if tiers["budget"] is not None else None
        needed = sum(entry_bytes(self.shape, tokens, dtype) for tokens in chunk_tokens)
        if budget is not None and needed > budget:
            self.warned.add("prompt")
            knobs = "memory_bytes / disk_bytes" if tiers["persists"] else "memory_bytes"
            log.warning("ragblend: a prompt's %d chunk(s) need %s of KV, more than the KV store keeps (%s): they are "
                        "answered, the chunks it cannot keep computed at each query. Raise %s, or store smaller KV "
                        "(kv_dtype).", len(chunk_tokens), _gib(needed), _gib(budget), knobs)


def _cheaper(dtype: str, flags: bool = False) -> str:
    smaller = {"float32": "float16", "float16": "int8", "bfloat16": "int8", "int8": "uint4"}.get(dtype)
    if not smaller:
        return "fewer chunks"
    return f"--kv-dtype {smaller}" if flags else f"kv_dtype='{smaller}'"


def size_arg(n: int, sep: str = "") -> str:
    """``n`` bytes as a CLI size (``37.6GiB``; ``sep``: between number and unit), rounded up so that it
    holds ``n``: what to raise a limit to."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale or unit == "KiB":
            return f"{math.ceil(n / scale * 10) / 10:g}{sep}{unit}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB" if n >= 2**18 else f"{n / 2**10:.1f} KiB"
