"""The engine's chunk side (:class:`ChunksMixin`): chunks' keys, their stored entries, precompute.

:class:`~ragblend.core.engine.BlendEngine` has two sides, as ragblend's data flow has two times.
At ingestion a chunk's text becomes token ids, a key and stored entries (its own and, where the
engine keeps them, its lead entry): that is this mixin, what the vector-store hooks, the KV
filler, the cache commands and the server's ``/v1/chunks`` call. At query time prompts are laid
out, fused and answered: the engine itself and :class:`~.generation.GenerationMixin`. The work is
:class:`~ragblend.core.fusion.ingest.Ingestion`'s; these methods bind it to the engine's store and
settings, and count what is precomputed against the store's budget
(:class:`~ragblend.core.store.kv_budget.BudgetWarnings`). Of the engine they use ``ingestion``,
``prompts``, ``store``, ``entry_spec``, ``budget`` and ``precompute_batch_tokens``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .prompt import ChunkFinder
from .store.kv import ChunkRef, check_namespace, lead_key
from .store.kv_budget import Projection


class ChunksMixin:
    """The chunk side of :class:`~ragblend.core.engine.BlendEngine`: keys, entries, precompute, forget."""

    min_chunk_tokens = ChunkFinder.MIN_RUN   # shorter chunks are never found in flat prompts: hooks skip them

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype new chunk KV is stored in (their keys name it); settable."""
        return self.ingestion.kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype) -> None:
        self.ingestion.kv_dtype = dtype

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (no special tokens): what a chunk is keyed by."""
        return self.prompts.tokenize(text)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def key_of(self, text: str, *, namespace: str = "") -> str:
        """The key a chunk text's KV is stored under for ``namespace`` (see :func:`ragblend.core.store.kv.chunk_key`)."""
        return self.ingestion.key_for(self.tokenize(text), namespace=check_namespace(namespace))

    def is_own_tokenization(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` are what this engine makes of some text, the only ids that may become
        a stored chunk: see :meth:`.text_encoder.TextEncoder.is_own_tokenization`."""
        return self.prompts.text_encoder.is_own_tokenization(token_ids)

    def lead_key(self, key: str) -> str | None:
        """The key of the lead entry of the chunk keyed ``key``; None where the engine keeps none."""
        return self.ingestion.lead_key(key)

    def entry_keys(self, key: str) -> tuple[str, ...]:
        """The keys of the entries this engine keeps for the chunk keyed ``key``: its own, and its
        lead entry's where the engine keeps lead entries."""
        lead = self.lead_key(key)
        return (key,) if lead is None else (key, lead)

    def missing_entries(self, key: str, stored=None) -> list[str]:
        """The entries this engine keeps for the chunk keyed ``key`` that are not in ``stored``
        (a set of keys, or by default this engine's store)."""
        stored = self.store if stored is None else stored
        return [entry for entry in self.entry_keys(key) if entry not in stored]

    def entries_stored(self, key: str, stored=None) -> bool:
        """Whether every entry this engine keeps for the chunk keyed ``key`` is in ``stored``."""
        return not self.missing_entries(key, stored)

    def precompute(self, texts: str | Iterable[str], *, progress: bool = False,
                   skip_unusable: bool = False, namespace: str = "") -> list[ChunkRef | None]:
        """Compute and store each chunk text's KV: see :meth:`ragblend.core.fusion.ingest.Ingestion.precompute`. ``namespace``
        ("": shared, the default) is who may find the chunks in flat prompts (see :meth:`find_chunks`)."""
        refs = self.ingestion.precompute(texts, self.store, batch_tokens=self.precompute_batch_tokens,
                                         progress=progress, skip_unusable=skip_unusable,
                                         namespace=check_namespace(namespace))
        return self.budget.count(refs, self.store, self.kv_dtype)   # warned once if the store cannot keep them

    def precompute_ids(self, chunks: Iterable[Sequence[int]], *, namespace: str = "") -> list[ChunkRef]:
        """:meth:`precompute` of chunks given as token ids (a server's client may send ids: LMCache
        warms a chunk by sending it alone), each of this model's vocabulary and short enough to
        follow the sink in the context window (:meth:`~ragblend.core.fusion.ingest.Ingestion.checked_ids`).
        A server stores only ids that pass :meth:`is_own_tokenization`, in the sender's namespace."""
        refs = self.ingestion.precompute_ids(self.ingestion.checked_ids(chunks), self.store,
                                             batch_tokens=self.precompute_batch_tokens,
                                             namespace=check_namespace(namespace))
        return self.budget.count(refs, self.store, self.kv_dtype)

    def kv_projection(self, chunks: int, tokens_per_chunk: int, *, warn: bool = True) -> Projection:
        """The projected size of the KV of ``chunks`` chunks of ``tokens_per_chunk`` tokens in this
        engine's stored dtype (both entries of a chunk where it keeps lead entries), against its
        store's budget. ``warn``: log once (per engine) when the budget holds only part of it."""
        return self.budget.project(self.store, self.kv_dtype, chunks, tokens_per_chunk, warn=warn)

    def forget(self, keys: Iterable[str]) -> int:
        """Drop the stored KV of these chunk keys (e.g. when their document is deleted), each
        chunk's lead entry with it, also where this engine keeps none (another engine on the store
        may); returns how many chunk keys had an entry."""
        removed, opening = 0, self.entry_spec.lead_sink_ids
        for key in keys:
            lead = lead_key(key, list(opening)) if opening is not None else None
            had_lead = lead is not None and bool(self.store.delete(lead))
            removed += bool(self.store.delete(key)) or had_lead
        return removed

    def remember_chunk(self, text: str, *, namespace: str = "") -> str:
        """Declare ``text`` a chunk, stored or not: see :meth:`ragblend.core.fusion.ingest.Ingestion.remember`."""
        return self.ingestion.remember(text, check_namespace(namespace))
