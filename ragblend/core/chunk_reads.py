"""Where each chunk of a prompt gets its cached KV for the fused prefill: a reader per chunk span,
from the store's tiers, the pieces' memory, or computed now and written back in the background;
which spans read their chunk's lead entry; and disk hits promoted to the memory tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .background import Background
from .fusion.ingest import Ingestion
from .fusion.selection import ReusedSpan
from .plan import StrategyPlan
from .prompt import PromptLayout
from .results import Stats
from .store.pieces import PieceStore, is_piece
from .store.tiers import ChunkReader, MemoryReader, TieredStore


@dataclass
class Found:
    """The cached KV one fusion attempt found for a prompt's chunk spans."""

    spans: list = field(default_factory=list)     # ReusedSpan, one per reader
    readers: list = field(default_factory=list)
    tier_of: dict = field(default_factory=dict)   # chunk key -> tier it came from
    missing: set = field(default_factory=set)     # keys of chunks computed as plain text
    from_store: torch.Tensor | None = None        # bool [N]: tokens whose KV came from the store

    def add(self, span, reader: ChunkReader) -> None:
        self.spans.append(ReusedSpan(span.start, span.end - span.start, span.offset, piece=is_piece(span)))
        self.readers.append(reader)

    def close(self) -> None:
        for reader in dict.fromkeys(self.readers):   # a piece's parts share one reader
            reader.close()

    def count_tiers(self, stats: Stats) -> dict:
        """Chunks served per tier, into ``stats``."""
        tiers = {}
        # a chunk read at one span and missing at another (its lead entry stored, its own not, without
        # write-back) counts as missing only
        served = {key: tier for key, tier in self.tier_of.items() if key not in self.missing}
        for tier in served.values():
            tiers[tier] = tiers.get(tier, 0) + 1
        stats.chunks_reused = len(served) - tiers.get("computed", 0)
        stats.chunks_missing = len(self.missing) + tiers.get("computed", 0)
        stats.tiers = tiers
        return tiers


class ChunkReads:
    """Finds the KV of a prompt's chunks for one engine: ``ingestion`` computes a missing chunk,
    ``index`` learns it, ``background`` writes it back (and promotes disk hits); a piece of a
    conversation's history is read from ``piece_store``."""

    def __init__(self, ingestion: Ingestion, index, background: Background, piece_store: PieceStore):
        self.ingestion, self.index, self.background, self.piece_store = ingestion, index, background, piece_store

    def find(self, layout: PromptLayout, plan: StrategyPlan, stats: Stats, computed: dict, store,
             write_back: bool) -> Found:
        """A reader for every chunk span; a chunk not stored is computed now and written back
        (or, without ``write_back``, left to be computed as plain text inside the prompt).
        ``computed``: the entries computed during this call, by key (a retry reads them again)."""
        # A chunk can appear in several spans (repeated, or split where the prompt's tokens
        # differ from its own); the chunk counts in Stats are of distinct chunks.
        found = Found(from_store=torch.zeros(len(layout.token_ids), dtype=torch.bool))
        lead_spans = self.lead_spans(layout)
        pieces: dict = {}   # one reader per piece, however many parts its span was split into
        try:
            for j, span in enumerate(layout.chunk_spans):
                if not span.token_ids or not plan.reuses:
                    continue
                if is_piece(span):   # from the pieces' memory; one evicted meanwhile is computed as text
                    key = self.ingestion.key_for(span.token_ids, namespace=span.namespace)
                    if key not in pieces:
                        pieces[key] = _open(self.piece_store, key, span.token_ids)
                    reader = pieces[key]
                    if reader is not None:
                        found.add(span, reader)
                        found.tier_of.setdefault(reader.key, reader.tier)
                        found.from_store[span.start:span.end] = True
                    continue
                self._find_chunk(found, span, j in lead_spans, stats, computed, store, write_back)
        except BaseException:
            found.close()
            raise
        return found

    def _find_chunk(self, found: Found, span, lead: bool, stats: Stats, computed: dict, store,
                    write_back: bool) -> None:
        """A reader for one chunk span into ``found``: stored, computed during this call, or
        computed now (and written back); without ``write_back`` a missing one is left out."""
        namespace = self._namespace_of(span, lead, store)
        own_key = self.ingestion.key_for(span.token_ids, namespace=namespace)
        key = self.ingestion.entry_key(own_key, lead)
        # A missing lead entry is a miss even where the chunk's own entry is stored (a store
        # filled before lead entries, a query that stored the own one): reading the own one
        # would answer this prompt differently from a store that has both.
        reader = _read(computed, store, key, span.token_ids)
        if reader is None:
            if not write_back:
                found.missing.add(own_key)
                return  # computed as plain text inside the prompt
            # What a hit would have read, so that a miss (or a failing store) answers the same.
            t = time.perf_counter()
            computed[key] = entry = self.ingestion.compute_entry(list(span.token_ids), lead, namespace)
            self.index.add(own_key, span.token_ids, namespace)
            stats.isolate_s += time.perf_counter() - t
            self.background.submit(store.put, entry)
            reader = MemoryReader(entry, "computed")
        found.add(span, reader)
        # a chunk read from two entries (its lead one first, its own at a repeat) of which one
        # had to be computed counts as missing, as chunks_computed counts it
        if reader.tier == "computed" or own_key not in found.tier_of:
            found.tier_of[own_key] = reader.tier
        if reader.tier != "computed":
            found.from_store[span.start:span.end] = True

    def _namespace_of(self, span, lead: bool, store) -> str:
        """Whose entry a span reads (and writes back): the shared one where the store holds it (an
        operator's corpus, reused by every namespace), else the span's own namespace's."""
        if span.namespace and self.ingestion.entry_key(self.ingestion.key_for(span.token_ids), lead) in store:
            return ""
        return span.namespace

    def lead_spans(self, layout: PromptLayout) -> set[int]:
        """The chunk spans fused from their chunk's lead entry: those of the prompt's first chunk
        (more than one where the prompt's tokens split it, not a repeat of it later), where what
        comes before the chunk is shorter than the sink, i.e. little more than the template's
        opening, which the lead entry was computed after. Empty without lead entries."""
        # pieces have no lead entry: they are kept for later turns, after history, never first
        order = sorted((j for j, span in enumerate(layout.chunk_spans) if not is_piece(span)),
                       key=lambda j: layout.chunk_spans[j].start)
        if self.ingestion.lead_sink_ids is None or not order:
            return set()
        first = layout.chunk_spans[order[0]]
        # A chunk at the very start (no template before it: LMCache's warm-up of one chunk) keeps its own.
        if not 0 < first.start - first.offset < len(self.ingestion.sink_ids):
            return set()
        spans, offset = set(), -1
        for j in order:   # the pieces of one occurrence go on through the chunk; a repeat starts over
            span = layout.chunk_spans[j]
            if span.token_ids != first.token_ids or span.offset <= offset:
                break
            spans.add(j)
            offset = span.offset
        return spans

    def promote(self, store, found: Found) -> None:
        """Chunks served from disk also go to the memory tier, in the background."""
        if isinstance(store, TieredStore):
            for key in dict.fromkeys(r.key for r in found.readers if r.tier == "disk"):
                self.background.submit(_promote_one, store, key)


def _read(computed: dict, store, key: str, token_ids) -> ChunkReader | None:
    """A reader for the entry under ``key``: computed during this call, or stored, or None."""
    return MemoryReader(computed[key], "computed") if key in computed else _open(store, key, token_ids)


def _open(store, key: str, token_ids) -> ChunkReader | None:
    """A reader for a stored chunk, or None; an entry for other tokens is dropped."""
    reader = store.open(key)
    if reader is not None and list(reader.token_ids) != list(token_ids):
        reader.close()
        store.delete(key)
        return None
    return reader


def _promote_one(store: TieredStore, key: str) -> None:
    entry = store.disk.read_uncounted(key)
    if entry is not None:
        store.promote(entry)
