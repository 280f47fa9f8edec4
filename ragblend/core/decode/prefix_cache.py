"""The prefix tier: the K/V of prompts (and answers) computed recently, reused by any prompt that
starts with the same tokens.

An exact repeat, or the next turn of a conversation, begins with tokens whose K/V the engine has
just computed. :class:`PrefixCache` keeps those K/V in memory, bounded in bytes (least recently
used first out), indexed as vLLM's automatic prefix caching does: the token ids in blocks of
``block_tokens``, each block's hash that of its tokens and of the block before it, so that equal
hashes mean equal prefixes. A prompt finds the longest stored prefix of its ids, token by token
past the last whole block, and reuses its K/V as they are: the rest of the prompt runs through
every layer over them (:func:`extend_prefix`). A hit's logits are the logits of the computation
that stored it, within float noise; an exact repeat computes nothing: an entry keeps the logits
after its prompt (a few hundred KiB), as llama.cpp's prompt cache does.

What makes K/V differ is in the root of every chain (:class:`PrefixScope`): the model (weights
and their form), the K/V's dtype, whether they are exact, and the namespace (a server's tenant),
so that nothing is ever found across namespaces. The chat template needs no part of its own: it is
in the token ids. A stored entry whose ids or shapes do not match is a miss, and is dropped.

Example::

    cache = PrefixCache(64 << 20)
    scope = PrefixScope(model="sha...", dtype="torch.float32", exact=True)
    cache.store(scope, prompt_ids, keys, values)
    hit = cache.lookup([scope], prompt_ids + more_ids)   # hit.num_tokens == len(prompt_ids)
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..fusion.prefill import FusedPrefill
from .generate import KVDecoder

log = logging.getLogger("ragblend")
BLOCK_TOKENS = 16   # vLLM's default block size
MAX_KEPT_LOGITS = 4   # next-token logits kept per entry (its longest prompts'): see PrefixCache._keep_logits


@dataclass(frozen=True)
class PrefixScope:
    """Everything stored K/V depend on besides the token ids: the root of each hash chain."""

    model: str          # the engine's fingerprint: the weights and the form they are computed in
    dtype: str          # the stored K/V's dtype
    exact: bool         # K/V a causal prefill computes (False: a fusion's, or low-bit decoding's)
    namespace: str = ""   # whose prompts they were ("": the shared namespace)


@dataclass(frozen=True)
class KeptPrefix:
    """How a prompt's K/V were kept: its scope, and the score bias its own prefill ran with (the
    answer's K/V are kept with it, so that a repeat's last token sees what the first one did)."""

    scope: PrefixScope
    key_bias: torch.Tensor | None
    usable_from: int   # the shortest hit its K/V serve (:attr:`PrefixEntry.usable_from`; 0: any)


class Room:
    """Free positions after an entry's K/V in the buffers that hold them (``keys``, ``values``: per
    layer ``[kv_heads, capacity, head_dim]``, the entry's tokens first). The first prompt that
    extends the whole entry may write its own tokens' K/V there instead of copying the entry's into
    new buffers (tens of MB over a long conversation, ~10% of a next turn's prefill): taken once,
    for good, since the K/V written there are then that prompt's (and kept in the tier with it)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self._free = threading.Lock()   # held for good by the one prompt that takes the room

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def take(self) -> bool:
        """Whether the room is this caller's (never again anyone else's)."""
        return self._free.acquire(blocking=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class PrefixEntry:
    """The K/V of one token sequence: per layer ``[kv_heads, tokens, head_dim]``, K after RoPE."""

    scope: PrefixScope
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_bias: torch.Tensor | None   # float [tokens] on each key's attention scores (QueryAware), or None
    nbytes: int
    blocks: list[int]               # the chain hashes of its whole blocks
    usable_from: int = 0            # the shortest hit it serves (fused K/V: the whole prompt they were fused for)
    key: int = -1                   # what the cache holds it under
    # the next-token logits after its first p tokens, by p (its prompt's: an exact repeat computes nothing)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    room: Room | None = None        # free positions after its K/V, for the first prompt that extends all of it


@dataclass
class PrefixHit:
    """The first ``num_tokens`` tokens of a prompt, found stored: their K/V (views, not to be written)."""

    num_tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_bias: torch.Tensor | None
    scope: PrefixScope
    logits: torch.Tensor | None = None   # the logits after all ``num_tokens`` (a whole prompt stored with its logits)
    room: Room | None = None   # its entry's room (a hit of the whole entry): see :func:`extend_prefix`
    # The shortest hit its entry serves: a prompt computed over this hit serves, in turn, any prompt
    # holding these first ``usable_from`` tokens (its other tokens ran causally over them).
    usable_from: int = 0

    def first(self, num_tokens: int) -> PrefixHit:
        """The hit of its first ``num_tokens`` tokens only (views), without logits."""
        bias = None if self.key_bias is None else self.key_bias[:num_tokens]
        return PrefixHit(num_tokens, [k[:, :num_tokens] for k in self.keys], [v[:, :num_tokens] for v in self.values],
                         bias, self.scope, usable_from=min(self.usable_from, num_tokens))


class PrefixCache:
    """Recently computed K/V by token-id prefix, within ``max_bytes`` (LRU); thread-safe."""

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS):
        self.max_bytes, self.block_tokens = int(max_bytes), block_tokens
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()   # LRU first
        # chain hash -> the entries holding that block, most recent last
        self._blocks: dict[int, dict[int, None]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = self.evictions = 0
        self.faults = 0   # K/V that could not be kept (an answer's, an opening's): logged, and counted here

    def chain(self, scope: PrefixScope, token_ids: Sequence[int]) -> list[int]:
        """The chain hashes of the whole blocks of ``token_ids`` under ``scope``."""
        h, hashes, size = hash(scope), [], self.block_tokens
        for start in range(0, len(token_ids) - size + 1, size):
            h = hash((h, tuple(token_ids[start:start + size])))
            hashes.append(h)
        return hashes

    def lookup(self, scopes: Sequence[PrefixScope], token_ids: Sequence[int], limit: int | None = None) -> PrefixHit | None:
        """The longest stored prefix of ``token_ids`` (at most ``limit`` tokens) under any of
        ``scopes``; None when none holds a whole block of it (:meth:`count` counts it). A hit of
        all of ``token_ids`` carries the logits after them where they were kept."""
        token_ids = list(token_ids)
        limit = len(token_ids) if limit is None else min(limit, len(token_ids))
        best: PrefixHit | None = None
        with self._lock:
            for scope in scopes:
                hit = self._longest(scope, token_ids, limit)
                if hit is not None and (best is None or hit.num_tokens > best.num_tokens):
                    best = hit
        return best

    def count(self, hit: PrefixHit | None) -> None:
        """Count a lookup whose hit was used (or None: a miss, or a hit not worth using)."""
        with self._lock:
            if hit is None:
                self.misses += 1
            else:
                self.hits += 1
                self.hit_tokens += hit.num_tokens

    def fault(self) -> None:
        """Count K/V that could not be kept (the caller logged why): a cache fails quietly, not unseen."""
        with self._lock:
            self.faults += 1

    def _matches(self, scope: PrefixScope, token_ids: list[int], limit: int) -> list[tuple[PrefixEntry, int]]:
        """The entries holding a prefix of ``token_ids[:limit]`` under ``scope``, each with the length
        it holds, the most recent first."""
        depths: list[dict[int, None]] = []   # the holders of each whole block matched, in order
        for h in self.chain(scope, token_ids[:limit]):
            holders = self._blocks.get(h)
            if not holders:
                break
            depths.append(holders)
        found, prompt = [], tuple(token_ids[:limit])
        for key in reversed(list(depths[0]) if depths else []):   # each holds the first block (most recent first)
            entry = self._entries.get(key)
            if entry is None or entry.scope != scope:   # another scope's blocks: a hash collision, a miss
                continue
            # its deepest block matched (holding a block's hash means holding those before it)
            lo, hi = 0, len(depths) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if key in depths[mid] else (lo, mid - 1)
            # Every token compared, so that a hash collision (or an entry that is not what its
            # blocks say) is a miss: the blocks its hashes matched at once, then token by token.
            held = (lo + 1) * self.block_tokens
            length = held if entry.token_ids[:held] == prompt[:held] else 0
            for a, b in zip(entry.token_ids[length:limit], prompt[length:]):
                if a != b:
                    break
                length += 1
            if length < self.block_tokens:
                log.warning("ragblend: a prefix entry's ids differ from its blocks'; dropped")
                self._drop(entry)
                continue
            found.append((entry, length))
        return found

    def _longest(self, scope: PrefixScope, token_ids: list[int], limit: int) -> PrefixHit | None:
        # Fused K/V were selected for their whole prompt (QueryAware: by its question): an entry serves
        # no hit shorter than its usable_from, and a prompt that shares only their front (the chunks,
        # not the question) fuses anew, unless a shorter entry serves it.
        # Among the longest (the most recent first), one keeping the logits after the whole prompt (a
        # repeat computes nothing).
        servable = sorted(((entry, length) for entry, length in self._matches(scope, token_ids, limit)
                           if length >= entry.usable_from),
                          key=lambda match: (-match[1], match[1] not in match[0].logits or match[1] < len(token_ids)))
        match = next((match for match in servable if self._sound_or_dropped(match[0])), None)
        if match is None:
            return None
        entry, length = match
        logits = entry.logits.get(length) if length == len(token_ids) else None
        self._entries.move_to_end(entry.key)
        bias = None if entry.key_bias is None else entry.key_bias[:length]
        room = entry.room if length == len(entry.token_ids) else None   # the positions after a shorter hit are taken
        return PrefixHit(length, [k[:, :length] for k in entry.keys], [v[:, :length] for v in entry.values], bias,
                         entry.scope, None if logits is None else logits.clone(), room, entry.usable_from)

    def _sound_or_dropped(self, entry: PrefixEntry) -> bool:
        """Whether ``entry`` is sound; dropped where it is not (checked only for the entry a lookup
        serves or a store keeps: checking every candidate cost ~50 us each, per lookup)."""
        if self._sound(entry):
            return True
        self._drop(entry)
        return False

    @staticmethod
    def _sound(entry: PrefixEntry) -> bool:
        """Whether an entry's tensors hold its tokens (anything else is a miss, and dropped)."""
        n = len(entry.token_ids)
        shapes = {tuple(t.shape[::2]) for t in (*entry.keys, *entry.values)}
        ok = len(entry.keys) == len(entry.values) > 0 and len(shapes) == 1 and \
            all(t.shape[1] == n and str(t.dtype) == entry.scope.dtype for t in (*entry.keys, *entry.values))
        ok = ok and (entry.key_bias is None or entry.key_bias.shape == (n,))
        if not ok:
            log.warning("ragblend: a prefix entry's K/V do not match its %d tokens; dropped", n)
        return ok

    def holds(self, scope: PrefixScope, token_ids: Sequence[int]) -> bool:
        """Whether an entry of exactly ``token_ids`` is held under ``scope`` (not a longer one)."""
        with self._lock:
            return self._holds(scope, list(token_ids))

    def _holds(self, scope: PrefixScope, token_ids: list[int]) -> bool:
        n = len(token_ids)
        return any(length == n == len(entry.token_ids) for entry, length in self._matches(scope, token_ids, n))

    def store(self, scope: PrefixScope, token_ids: Sequence[int], keys: list[torch.Tensor],
              values: list[torch.Tensor], key_bias: torch.Tensor | None = None, usable_from: int = 0,
              logits: torch.Tensor | None = None, extends: int | None = None, room: Room | None = None) -> bool:
        """Keep the K/V of ``token_ids`` (held as given: nothing may write to them later). Entries
        it makes redundant (a prefix of it in its scope that serves no shorter hit than it does) go;
        the least recently used go while the total is over the budget. Returns whether it was kept
        (not when shorter than a block, larger than the budget, or already held by a longer entry
        that serves all it would). ``usable_from``: the shortest prefix of
        it a lookup may be served (for fused K/V, their whole prompt's); ``logits``: the next-token
        logits after all of ``token_ids`` (kept as given), which an exact repeat is served; ``extends``:
        kept only while the entry of the first ``extends`` ids is held as it was stored (an entry
        extended after the tier was cleared or evicted it does not come back); ``room``: the buffers
        ``keys`` and ``values`` are the first positions of (:class:`Room`), counted in its bytes."""
        token_ids = tuple(token_ids)
        kept_logits = {} if logits is None else {len(token_ids): logits}
        if room is not None:
            nbytes = room.nbytes + sum(t.numel() * t.element_size() for t in kept_logits.values())
        else:
            nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values, *kept_logits.values()))
        nbytes += 0 if key_bias is None else key_bias.numel() * key_bias.element_size()
        if len(token_ids) < self.block_tokens or nbytes > self.max_bytes:
            return False
        blocks = self.chain(scope, token_ids)
        entry = PrefixEntry(scope, token_ids, keys, values, key_bias, nbytes, blocks, usable_from, logits=kept_logits,
                            room=room)
        with self._lock:
            if extends is not None and not self._holds(scope, list(token_ids[:extends])):
                return False
            holder = next((held for held, length in self._matches(scope, list(token_ids), len(token_ids))
                           if length == len(token_ids) and held.usable_from <= usable_from
                           and self._sound_or_dropped(held)), None)
            if holder is not None:   # a longer entry holds these tokens, and serves every hit of them
                self._entries.move_to_end(holder.key)
                if logits is not None and holder.usable_from == usable_from:   # computed over it (a race's fresh fusion was not)
                    self.nbytes += self._keep_logits(holder, len(token_ids), logits)
                    self._evict()
                return False
            # A stored prefix of this one serves nothing this one does not, unless it serves shorter
            # hits (a fused prompt's entry, which another prompt sharing only its front extended:
            # a conversation's turn before it branched, see :attr:`PrefixHit.usable_from`).
            for older in [self._entries[i] for i in self._blocks.get(blocks[0], ())]:   # every prefix holds it
                if older.scope == scope and len(older.token_ids) <= len(token_ids) and \
                        usable_from <= older.usable_from and token_ids[:len(older.token_ids)] == older.token_ids:
                    self._drop(older)
                    for p, kept in older.logits.items():   # its prompt's logits still serve a repeat
                        self._keep_logits(entry, p, kept)
            entry.key = next(self._ids)
            self._entries[entry.key] = entry
            for h in blocks:
                self._blocks.setdefault(h, {})[entry.key] = None
            self.nbytes += entry.nbytes
            self._evict()
        return True

    @staticmethod
    def _keep_logits(entry: PrefixEntry, num_tokens: int, logits: torch.Tensor) -> int:
        """Keep in ``entry`` the logits after its first ``num_tokens`` tokens, where it serves a hit
        of that length and has none yet; the bytes it grew by. An entry keeps the logits of its
        ``MAX_KEPT_LOGITS`` longest prompts: a conversation's entry holds every turn, and a repeat is
        most often of the latest (a retry, a regenerated answer)."""
        if num_tokens in entry.logits or num_tokens < entry.usable_from:
            return 0
        entry.logits[num_tokens] = logits
        added = logits.numel() * logits.element_size()
        while len(entry.logits) > MAX_KEPT_LOGITS:
            dropped = entry.logits.pop(min(entry.logits))
            added -= dropped.numel() * dropped.element_size()
        entry.nbytes += added
        return added

    def _evict(self) -> None:
        """Drop the least recently used entries while the total is over the budget."""
        while self.nbytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries.values())))
            self.evictions += 1

    def _drop(self, entry: PrefixEntry) -> None:
        del self._entries[entry.key]
        self.nbytes -= entry.nbytes
        for h in entry.blocks:
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(entry.key, None)
                if not holders:
                    del self._blocks[h]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._blocks.clear()
            self.nbytes = 0

    def info(self) -> dict:
        """What the tier holds and has served: for ``ragblend info`` and a server's ``/metrics``."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                    "evictions": self.evictions, "faults": self.faults}

    def __len__(self) -> int:
        return len(self._entries)


# Set while a caller times fusion against a full prefill (integrations.compare.fusion_only): the
# tier is neither read nor written in this context (a contextvar: other threads answer as usual).
_BYPASSED: contextvars.ContextVar[bool] = contextvars.ContextVar("ragblend_prefix_bypassed", default=False)


@contextlib.contextmanager
def bypassed():
    """Within it, this thread's (and context's) prompts neither read nor fill the prefix tier."""
    token = _BYPASSED.set(True)
    try:
        yield
    finally:
        _BYPASSED.reset(token)


def is_bypassed() -> bool:
    return _BYPASSED.get()


@torch.inference_mode()
def extend_prefix(adapter, hit: PrefixHit, token_ids: list[int], rows_per_pass: int | None = None) -> FusedPrefill:
    """The prefill of ``token_ids`` whose first ``hit.num_tokens`` tokens are ``hit``'s: the others
    run through every layer over the hit's K/V, as a causal prefill of them would (in one pass, or
    passes of at most ``rows_per_pass`` rows: the most a decoding twin's low-bit kernels take).
    Their K/V go into the room after the hit's (:class:`Room`) where it fits them and is free,
    else into new buffers the hit's K/V are copied into first."""
    t0 = time.perf_counter()
    n, start = len(token_ids), hit.num_tokens
    room = hit.room
    if room is not None and room.capacity >= n and room.take():
        decoder = KVDecoder.over(adapter, room.keys, room.values, start, hit.key_bias)
    else:
        decoder = KVDecoder(adapter, hit.keys, hit.values, n, hit.key_bias, dtype=hit.keys[0].dtype)
    rest = token_ids[start:]
    size = rows_per_pass or len(rest)
    for first in range(0, len(rest), size):
        logits = decoder.extend(rest[first:first + size], last_only=True, with_logits=first + size >= len(rest))
    recomputed = torch.zeros(n, dtype=torch.bool)
    recomputed[start:] = True
    key_bias = None if decoder.key_bias is None else decoder.key_bias[:n]
    computed = [torch.arange(start, n)] * adapter.shape.num_layers
    return FusedPrefill(logits=logits[-1].float(), keys=[k[:, :n] for k in decoder.keys],
                        values=[v[:, :n] for v in decoder.values], recomputed=recomputed,
                        compute_s=time.perf_counter() - t0, layer_positions=computed, key_bias=key_bias)
