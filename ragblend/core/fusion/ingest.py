"""Ingestion: chunk texts -> token ids -> storage entries in the KV store.

A chunk's KV is computed in isolation after the sink prefix (:func:`isolated_kv`), several
chunks packed into one pass (:func:`packed_isolated_kv`, the sink's own K/V computed once:
:func:`sink_kv`), and turned into a storage entry in the engine's KV dtype
(:meth:`Ingestion.storage_entry`). :meth:`Ingestion.precompute` is what
:meth:`BlendEngine.precompute <ragblend.BlendEngine.precompute>` runs.

A chunk has two entries when the engine keeps *lead* KV (``lead_chunk_kv``, the default): one
computed after the sink (the template's opening and a neutral passage: the chunk as a passage in
the middle of a prompt), and one computed right after the template's opening (the chunk as the
first passage of a prompt, where it is used so). A prompt's first chunk reads the second, every
other chunk the first (docs/notes/lead-entries.md).
"""

from __future__ import annotations

import itertools
import logging
import operator
from typing import Iterable, Sequence

import torch

from ..cancel import EngineLock
from ..errors import InvalidInputError, PromptTooLongError
from ..model.adapter import ModelAdapter
from ..model.layer_step import LayerPass, run_layers
from ..model.masks import attend, attention_plan, offset_causal_mask
from ..model.omp import release_thread_pool
from ..prompt import ChunkFinder, PromptBuilder, TooLong, check_text
from ..store.kv import QUANTIZED_DTYPES, ChunkKV, ChunkRef, chunk_key, lead_key, to_storage
from ..store.tiers import EntrySpec, KVStore

log = logging.getLogger("ragblend")


class Ingestion:
    """Computes and stores chunk entries for one model, sink prefix and KV dtype.

    ``lock`` serialises model passes with the engine's other users (prefill, decoding).
    ``index`` (a :class:`~ragblend.core.store.chunk_index.ChunkIndex`, optional) learns every
    chunk precomputed, so it is found in flat prompts. ``lead_sink_ids``: what a chunk's lead
    entry is computed after (the template's opening), None for no lead entries.
    """

    def __init__(self, adapter: ModelAdapter, prompts: PromptBuilder, sink_ids: list[int], fingerprint: str,
                 kv_dtype: torch.dtype, lock: EngineLock | None = None, index=None,
                 lead_sink_ids: list[int] | None = None):
        self.adapter, self.prompts, self.sink_ids = adapter, prompts, sink_ids
        self.lead_sink_ids = lead_sink_ids
        self.fingerprint, self.kv_dtype = fingerprint, kv_dtype
        self.lock = lock or EngineLock()
        self.index = index
        self._sink_kv: dict[bool, list] = {}   # the sinks' K/V, computed once each (see compute_entries)
        self._warned_unstored = False

    @property
    def variants(self) -> tuple[bool, ...]:
        """Which entries each chunk gets, as values of ``lead``: the lead entry (where the engine
        keeps them) and the chunk's own, in the order precompute stores them."""
        return (True, False) if self.lead_sink_ids is not None else (False,)

    def sink_for(self, lead: bool) -> list[int]:
        """What a chunk's entry is computed after: the sink, or (``lead``) the lead sink."""
        return self.lead_sink_ids if lead and self.lead_sink_ids is not None else self.sink_ids

    @property
    def entry_spec(self) -> EntrySpec:
        """What a stored entry must match to be this model's chunk KV."""
        shape, vocab_size = self.adapter.shape, self.adapter.hf_model.get_input_embeddings().num_embeddings
        lead = None if self.lead_sink_ids is None else tuple(self.lead_sink_ids)
        return EntrySpec(self.fingerprint, shape.num_layers, shape.num_kv_heads, shape.head_dim, vocab_size,
                         tuple(self.sink_ids), lead)

    def key_for(self, token_ids: Sequence[int], lead: bool = False, namespace: str = "") -> str:
        """The key a chunk of these token ids is stored under for ``namespace`` (see
        :func:`ragblend.core.store.kv.chunk_key`); ``lead``: its lead entry's (the chunk's own key where the
        engine keeps no lead entries)."""
        own = chunk_key(self.fingerprint, self.sink_ids, list(token_ids), str(self.kv_dtype), namespace)
        return self.entry_key(own, lead)

    def entry_key(self, own_key: str, lead: bool) -> str:
        """The key of one of a chunk's entries (``lead``: its lead entry, where the engine keeps them),
        from the chunk's own key."""
        return self.lead_key(own_key) if lead and self.lead_sink_ids is not None else own_key

    def lead_key(self, own_key: str) -> str | None:
        """The key of the lead entry of the chunk whose own key is ``own_key``; None without lead entries."""
        return None if self.lead_sink_ids is None else lead_key(own_key, self.lead_sink_ids)

    def remember(self, text: str, namespace: str = "") -> str:
        """Declare ``text`` a chunk of ``namespace`` in the index (returns its key), so flat prompts
        have it marked even when its KV is not stored: it is then computed in isolation and written back."""
        ids = self.prompts.tokenize(text)
        key = self.key_for(ids, namespace=namespace)
        self.index.add(key, ids, namespace)
        return key

    def precompute(self, texts, store: KVStore, *, batch_tokens: int, progress: bool = False,
                   skip_unusable: bool = False, namespace: str = "") -> list[ChunkRef | None]:
        """Compute and store in ``store`` each chunk text's KV (each of its :attr:`variants`), up to
        ``batch_tokens`` chunk tokens a pass, skipping entries already stored; every text is checked
        before anything is stored. With ``skip_unusable`` (for ingestion hooks) a chunk empty, longer
        than the window or shorter than ``ChunkFinder.MIN_RUN`` gets None, not an error. A
        :class:`~ragblend.core.store.kv.ChunkRef` names the chunk's own entry and says whether it is ``stored`` (a failing
        store is a warning; queries then compute that chunk). The entries are ``namespace``'s
        ("": shared, found in every prompt; see :func:`~ragblend.core.store.kv.chunk_key`)."""
        texts, tokenized = self.tokenize_chunks(texts, skip_unusable)
        return self.precompute_ids(tokenized, store, batch_tokens=batch_tokens, progress=progress, namespace=namespace)

    def precompute_ids(self, tokenized: list[list[int] | None], store: KVStore, *, batch_tokens: int,
                       progress: bool = False, namespace: str = "") -> list[ChunkRef | None]:
        """:meth:`precompute` of chunks given as token ids, checked by the caller (None: skipped)."""
        refs: list[ChunkRef | None] = [None] * len(tokenized)
        todo: dict[str, tuple[int, list[int]]] = {}   # key -> (first index, ids), an entry not stored yet
        keys = [None if ids is None else self.key_for(ids, namespace=namespace) for ids in tokenized]
        for i, (ids, key) in enumerate(zip(tokenized, keys)):
            if ids is None:
                continue
            if self.index is not None:
                self.index.add(key, ids, namespace)
            if key in todo or any(self.entry_key(key, lead) not in store for lead in self.variants):
                todo.setdefault(key, (i, ids))
            else:
                refs[i] = ChunkRef(key, len(ids), True)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(tokenized), initial=len(tokenized) - len(todo), desc="Precomputing KV", unit="chunk")
        for batch in packs(list(todo.items()), batch_tokens):
            stored = self._store_missing([ids for _, (_, ids) in batch], store, namespace)
            for (key, (i, ids)), ok in zip(batch, stored):
                refs[i] = ChunkRef(key, len(ids), ok)
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        for i, key in enumerate(keys):   # repeats of a text share its first occurrence's entry
            if key is not None and refs[i] is None:
                refs[i] = refs[todo[key][0]]
        self._warn_unstored(refs)
        release_thread_pool()   # see .omp
        return refs

    def _store_missing(self, chunks: list[list[int]], store: KVStore, namespace: str = "") -> list[bool]:
        """Compute and store each chunk's entries (each of :attr:`variants`) that ``store`` lacks, one
        pass per variant; per chunk, whether its own entry was stored."""
        stored = [True] * len(chunks)
        for lead in self.variants:   # lead entries first: an LRU store full of them evicts them, not the own ones
            missing = [i for i, ids in enumerate(chunks) if self.key_for(ids, lead, namespace) not in store]
            entries = self.compute_entries([chunks[i] for i in missing], lead, namespace) if missing else []
            for i, entry in zip(missing, entries):
                ok = store.put(entry)
                if not lead:
                    stored[i] = ok
        return stored

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens a chunk (or piece) can hold: it follows the sink in the context window."""
        return self.adapter.shape.context_window - len(self.sink_ids)

    def tokenize_chunks(self, texts: str | Iterable[str], skip_unusable: bool):
        """``(texts, token ids)``, every text checked before anything is stored; with
        ``skip_unusable`` an unusable chunk's ids are None instead of an error."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Iterable):
            raise InvalidInputError(f"precompute takes a chunk text or a list of them, got {type(texts).__name__}.")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInputError(f"precompute takes chunk texts (str); item {i} is {type(text).__name__}.")
            check_text(text, f"chunk {i}")
        window, limit = self.adapter.shape.context_window, self.max_chunk_tokens
        # TooLong: more than limit tokens, found without tokenizing a long text whole
        tokenized = [self.prompts.tokenize_bounded(t, limit) for t in texts]
        for i, ids in enumerate(tokenized):
            if skip_unusable and (isinstance(ids, TooLong) or len(ids) < ChunkFinder.MIN_RUN):
                tokenized[i] = None
                continue
            if isinstance(ids, TooLong):
                raise PromptTooLongError(
                    f"chunk {i} has {ids}; at most {limit} fit in the context window "
                    f"({window}) after the sink prefix. Split it into smaller chunks.")
            if not ids or not texts[i].strip():
                raise InvalidInputError(f"chunk {i} is empty or only whitespace; drop such chunks before precomputing.")
        return texts, tokenized

    def checked_ids(self, chunks: Iterable[Sequence[int]]) -> list[list[int]]:
        """Chunks given as token ids, as lists of ints, each of this model's vocabulary and short
        enough to follow the sink in the context window; else a clear error naming the chunk."""
        window, limit, vocab = self.adapter.shape.context_window, self.max_chunk_tokens, self.entry_spec.vocab_size
        chunks = [token_id_list(ids, f"chunk {i}", vocab) for i, ids in enumerate(chunks)]
        for i, ids in enumerate(chunks):
            if len(ids) > limit:
                raise PromptTooLongError(f"chunk {i} has {len(ids)} tokens; at most {limit} fit in the context "
                                         f"window ({window}) after the sink prefix. Split it.")
        return chunks

    def _warn_unstored(self, refs: list[ChunkRef | None]) -> None:
        unstored = sum(ref is not None and not ref.stored for ref in refs)
        if unstored and not self._warned_unstored:
            self._warned_unstored = True
            log.warning("ragblend: %d of %d chunk(s) could not be stored in the KV store (cause logged above); "
                        "queries compute them instead. ChunkRef.stored says which.", unstored, len(refs))

    def compute_entry(self, token_ids: list[int], lead: bool = False, namespace: str = "") -> ChunkKV:
        """A chunk's KV computed in isolation after the sink prefix (``lead``: after the lead sink),
        in the storage dtype, keyed for ``namespace``."""
        return self.compute_entries([token_ids], lead, namespace)[0]

    def compute_entries(self, chunks: list[list[int]], lead: bool = False, namespace: str = "") -> list[ChunkKV]:
        """Several chunks' entries, computed in one pass after the sink (``lead``: the lead sink),
        whose K/V are computed once per engine (a sliding window shorter than sink + chunk needs
        the one-at-a-time path, which computes the sink each time)."""
        adapter, sink = self.adapter, self.sink_for(lead)
        windows = [w for i in range(adapter.shape.num_layers) if (w := adapter.window(i)) is not None]
        if windows and len(sink) + max(map(len, chunks)) > min(windows):
            entries = []
            for ids in chunks:
                with self.lock:
                    keys, values = isolated_kv(adapter, sink, ids)
                entries.append(self.storage_entry(ids, keys, values, lead, namespace))
            return entries
        with self.lock:
            if lead not in self._sink_kv:
                self._sink_kv[lead] = sink_kv(adapter, sink)
            kvs = packed_isolated_kv(adapter, sink, chunks, sink=self._sink_kv[lead])
        return [self.storage_entry(ids, keys, values, lead, namespace) for ids, (keys, values) in zip(chunks, kvs)]

    def storage_entry(self, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor,
                      lead: bool = False, namespace: str = "") -> ChunkKV:
        """The entry of a chunk's float K/V, in the storage dtype where its values fit."""
        entry = ChunkKV(self.key_for(token_ids, lead, namespace), list(token_ids), keys, values, namespace=namespace)
        stored = to_storage(entry, self.kv_dtype)
        if self.kv_dtype in QUANTIZED_DTYPES:
            # int8 and uint4 entries are read back in float16: they need float16's range too.
            fits = max(keys.abs().max(), values.abs().max()) <= torch.finfo(torch.float16).max
        else:
            fits = torch.isfinite(stored.keys).all() and torch.isfinite(stored.values).all()
        if not fits:
            # Out of the storage dtype's range: keep float32 (the key still names the storage dtype).
            stored = ChunkKV(entry.key, entry.token_ids, keys.float(), values.float(), namespace=namespace)
        return stored.to_cpu()


def token_id_list(ids, what: str, vocab: int) -> list[int]:
    """``ids`` as a list of Python ints (numpy's and torch's integers too, not bools), each in
    ``[0, vocab)``; else an :class:`InvalidInputError` naming ``what``."""
    try:
        if isinstance(ids, (str, bytes, set, frozenset, dict)):   # no ids, or in no order
            raise TypeError
        ids = list(ids)
        if any(isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool for t in ids):
            raise TypeError
        ids = [operator.index(t) for t in ids]
    except TypeError:
        ids = None
    if not ids or not all(0 <= t < vocab for t in ids):
        raise InvalidInputError(f"{what} must be a non-empty list of integer token ids in [0, {vocab}).")
    return ids


def packs(items: Iterable, max_tokens: int, size=lambda item: len(item[1][1])):
    """Consecutive groups of items of at most ``max_tokens`` tokens in all (a longer item goes
    alone); ``size(item)``: its tokens (default: of ``(key, (index, ids))`` items)."""
    pack, tokens = [], 0
    for item in items:
        n = size(item)
        if pack and tokens + n > max_tokens:
            yield pack
            pack, tokens = [], 0
        pack.append(item)
        tokens += n
    if pack:
        yield pack


@torch.inference_mode()
def isolated_kv(adapter: ModelAdapter, sink_ids: list[int], chunk_ids: list[int]):
    """K (before RoPE) and V of ``chunk_ids`` computed alone after ``sink_ids``.

    Returns ``(keys, values)`` each ``[layers, kv_heads, len(chunk_ids), head_dim]``; the
    sink's own K/V are dropped.
    """
    ids = torch.tensor(list(sink_ids) + list(chunk_ids), device=adapter.device)
    entry = IsolatedLayers(adapter, len(sink_ids), ids.numel())
    run_layers(adapter, ids, adapter.rope_tables(ids.numel()), entry)
    return torch.stack(entry.keys), torch.stack(entry.values)


@torch.inference_mode()
def packed_isolated_kv(adapter: ModelAdapter, sink_ids: list[int], chunks: list[list[int]],
                       sink: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """:func:`isolated_kv` of several chunks in one pass: what ingestion calls.

    The sink is computed once; the chunks' tokens then go through every linear layer together
    (one big matmul instead of one per chunk) and each chunk attends only to the sink and to
    itself, so its K/V equal those of computing it alone (up to float rounding). Returns one
    ``(keys, values)`` per chunk, as :func:`isolated_kv` does. ``sink``: the sink's K/V from
    :func:`sink_kv`, when the caller keeps them between calls.
    """
    device, s = adapter.device, len(sink_ids)
    lengths = [len(c) for c in chunks]
    rope = adapter.rope_tables(s + max(lengths))
    sink = sink if sink is not None else sink_kv(adapter, sink_ids)
    ids = torch.tensor([t for c in chunks for t in c], device=device)
    positions = torch.cat([torch.arange(s, s + n, device=device) for n in lengths])
    bounds = [(a, a + n) for a, n in zip(itertools.accumulate([0, *lengths[:-1]]), lengths)]
    entry = PackedLayers(adapter, sink, bounds)
    run_layers(adapter, ids, rope.rows(positions), entry)
    keys, values = torch.stack(entry.keys), torch.stack(entry.values)
    # Copies, not views: an entry must not keep its whole pack alive in the memory tier.
    return [(keys[:, :, a:b].clone(), values[:, :, a:b].clone()) for a, b in bounds]


class EntryLayers(LayerPass):
    """A precompute pass: ``keys``/``values`` keep each layer's K (before RoPE) and V from row
    ``start`` on (what is stored). The last layer's output is not needed, only its K/V."""

    stop_after_kv = True

    def __init__(self, adapter: ModelAdapter, start: int = 0):
        super().__init__(adapter)
        self.start, self.keys, self.values = start, [], []

    def process_qkv(self, layer, x, cos, sin):
        k, v = self.adapter.kv(layer, x)
        self.keys.append(k[:, self.start:])
        self.values.append(v[:, self.start:])
        self.k, self.v, self.angles = k, v, (cos, sin)   # K rotated in attend: the last layer has none
        return None


class IsolatedLayers(EntryLayers):
    """Precompute of one sequence (:func:`isolated_kv`): causal attention over its own K/V."""

    def __init__(self, adapter: ModelAdapter, start: int, num_tokens: int):
        super().__init__(adapter, start)
        self.positions, self.plans = torch.arange(num_tokens, device=adapter.device), {}

    def attend(self, layer, q):
        window, n = self.adapter.window(layer), self.positions.numel()
        if window not in self.plans:   # once per sliding window, not in every layer
            self.plans[window] = attention_plan(self.positions, n, window, q.dtype)
        return attend(self.adapter, q, self.adapter.rope(self.k, *self.angles), self.v, self.plans[window])


class PackedLayers(EntryLayers):
    """Precompute of several chunks packed in one pass (:func:`packed_isolated_kv`): every chunk
    token through the linear layers at once, attention chunk by chunk, each chunk seeing the
    ``sink``'s K/V (rotated, per layer) and its own earlier tokens; ``bounds``: each chunk's rows."""

    def __init__(self, adapter: ModelAdapter, sink: list[tuple[torch.Tensor, torch.Tensor]],
                 bounds: list[tuple[int, int]]):
        super().__init__(adapter)
        self.sink, self.bounds, s = sink, bounds, sink[0][0].shape[1]
        self.masks = {n: offset_causal_mask(n, s, adapter.device, adapter.dtype) for n in {b - a for a, b in bounds}}

    def attend(self, layer, q):
        k, v, (sink_k, sink_v) = self.adapter.rope(self.k, *self.angles), self.v, self.sink[layer]
        return torch.cat([self.adapter.attention(q[:, a:b], torch.cat([sink_k, k[:, a:b]], 1),
                                                 torch.cat([sink_v, v[:, a:b]], 1), self.masks[b - a])
                          for a, b in self.bounds])


@torch.inference_mode()
def sink_kv(adapter: ModelAdapter, sink_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the sink's rotated K and its V, from a causal prefill of the sink alone."""
    shape = adapter.shape
    if not sink_ids:
        empty = torch.empty(shape.num_kv_heads, 0, shape.head_dim, dtype=adapter.dtype, device=adapter.device)
        return [(empty, empty)] * shape.num_layers
    keys, values = isolated_kv(adapter, [], sink_ids)   # the sink is a chunk with nothing before it
    rope = adapter.rope_tables(len(sink_ids))
    return [(adapter.rope(k, *rope.layer(layer)), v) for layer, (k, v) in enumerate(zip(keys, values))]
