"""The fused prefill run of one prompt: find each chunk's cached KV (computing and writing
back the missing ones), pick the layer source, run :func:`~ragblend.core.fusion.prefill.fused_prefill`
and count what was reused. The runner delegates to named parts: the chunks' KV are found by
:class:`~.chunk_reads.ChunkReads`, the prefix tier is read and filled by
:class:`~.prefix_reuse.PrefixReuse`, a conversation's pieces are marked and kept by
:class:`~.history_pieces.HistoryPieces`; store writes and promotions to the memory tier run in the
background (:class:`~.background.Background`)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .background import Background
from .chunk_reads import ChunkReads, Found
from .decode.prefix_cache import PrefixCache
from .errors import PromptTooLongError
from .fusion.fusion_cost import FusionCost, FusionVerdict
from .fusion.ingest import Ingestion
from .fusion.pipeline import PrefetchSource, SequentialSource
from .fusion.prefill import fused_prefill
from .fusion.selection import EveryToken, floor_chunks
from .fusion.strategies import FullRecompute
from .history_pieces import HistoryPieces
from .model.adapter import ModelAdapter
from .model.omp import release_thread_pool
from .plan import StrategyPlan
from .prefix_reuse import PrefixReuse
from .prompt import PromptLayout
from .results import Prefill, PromptTrace, Stats
from .store.pieces import PieceStore, is_piece
from .store.tiers import CorruptEntryError, KVStore

__all__ = ["Background", "PrefillRunner"]


class PrefillRunner:
    """Runs fused prefills for one engine: ``ingestion`` computes missing chunks, ``index``
    learns them, ``loading`` (a function giving the loading controller) settles
    CacheBlend's ``ratio="auto"``; model passes hold ``lock``; ``sentence_end_ids`` (a function
    giving the ids of tokens that end a sentence) is read for selections in runs of sentences;
    ``fusion_cost`` predicts whether fusing a prompt pays (for the engine's own strategy);
    ``prefix``: the prefix tier (None: off); ``pieces``: keep a conversation's turns as pieces fused
    like chunks (:mod:`ragblend.core.store.pieces`), in ``piece_bytes`` of their own memory."""

    def __init__(self, adapter: ModelAdapter, ingestion: Ingestion, index, lock, loading, sentence_end_ids,
                 fusion_cost: FusionCost | None = None, prefix: PrefixCache | None = None, pieces: bool = False,
                 piece_bytes: int = 256 << 20):
        self.adapter, self.ingestion, self.index, self.lock, self.loading = adapter, ingestion, index, lock, loading
        self.sentence_end_ids, self.fusion_cost = sentence_end_ids, fusion_cost
        self.background = Background()
        self.prefixes = PrefixReuse(adapter, ingestion, lock, prefix, self.background)
        self.history = HistoryPieces(adapter, ingestion, index, self.background, self.prefixes, pieces, piece_bytes)
        self.reads = ChunkReads(ingestion, index, self.background, self.history.piece_store)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-prefetch")  # disk read-ahead

    def run(self, layout: PromptLayout, plan: StrategyPlan, store: KVStore, *, prefetch: bool,
            write_back: bool, t0: float, min_speedup: float = 0.0) -> tuple[Prefill, PromptTrace]:
        """The fused prefill of ``layout`` as ``plan`` says, reading ``store``; ``t0``: when the call began.
        ``min_speedup``: the engine's own strategy fuses only where predicted at least this much
        faster than a full prefill (0: always)."""
        n, window = len(layout.token_ids), self.adapter.shape.context_window
        if n > window:
            raise PromptTooLongError(f"The prompt has {n} tokens but the model's context window is {window}; "
                                     "pass fewer or shorter chunks.")
        stats = Stats(prompt_tokens=n, strategy=plan.name, strategy_reason=plan.reason)
        faults_before = store.faults
        computed: dict = {}  # chunks computed during this call, by key
        found = self.prefixes.lookup(layout, plan)   # the tier looked up once per prompt: pieces and prefill
        layout, pieces = self.history.mark(layout, plan, found)
        hit = self.prefixes.hit(layout, plan, found)
        # A stored entry can turn out corrupt mid-fusion; it is then dropped and the
        # prefill restarts, at most once per entry.
        attempts = len(layout.chunk_spans) + 1
        for attempt in range(attempts):
            try:
                if hit is not None:
                    fused, source, from_store = self.prefixes.extend(layout, hit, plan, stats)
                    break
                fused, source, from_store = self._fuse(layout, plan, stats, computed, store, prefetch, write_back,
                                                       min_speedup)
                break
            except CorruptEntryError as err:
                store.delete(err.key)
                if attempt == attempts - 1:
                    raise
        stats.ttft_s = time.perf_counter() - t0
        stats.recomputed_tokens = int(fused.recomputed.sum())
        stats.compute_fraction = fused.token_layers / (n * self.adapter.shape.num_layers)
        stats.reused_tokens = int((from_store & ~fused.recomputed).sum())
        stats.cache_hit_tokens = int(from_store.sum())
        stats.chunks_computed = len({tuple(entry.token_ids) for entry in computed.values()})   # chunks, not entries
        stats.load_s, stats.load_wait_s, stats.compute_s = source.load_s, source.wait_s, fused.compute_s
        stats.store_faults = store.faults - faults_before
        stats.prefix_tokens = 0 if hit is None else hit.num_tokens
        stats.history_tokens = sum(int(from_store[span.start:span.end].sum()) for span in layout.chunk_spans
                                   if is_piece(span)) if hit is None and not stats.fusion_skipped else 0
        # A skipped fusion computed every chunk token as plain text: none counts as a chunk's.
        trace = PromptTrace(layout.token_ids, fused.recomputed, [] if stats.fusion_skipped else layout.chunk_spans)
        # The bias the answer's tokens keep: none unless the strategy asks for it (QueryAware's
        # scale_in_decoding; a Selection without the setting decodes as QueryAware's default).
        decoding_bias = fused.key_bias if getattr(plan.strategy, "scale_in_decoding", False) else None
        prefill = Prefill(layout.token_ids, fused.logits, stats, fused.keys, fused.values,
                          fused.recomputed, layout, decoding_bias)
        prefill.prefix_kept = self.prefixes.remember(layout, plan, fused, hit)
        prefill.keeps_pieces = pieces and write_back   # a store kept read-only gets no pieces either
        prefill.exact = hit.scope.exact if hit is not None else all(len(p) == n for p in fused.layer_positions)
        release_thread_pool()   # the next thread to compute runs at full speed (see .omp)
        return prefill, trace

    # What the engine, the server and the tests reach through the runner: its parts' state, by the
    # names they had before the parts were split out.

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix tier (None: off); a caller may switch it off or share another engine's."""
        return self.prefixes.prefix

    @prefix.setter
    def prefix(self, prefix: PrefixCache | None) -> None:
        self.prefixes.prefix = prefix

    @property
    def pieces(self) -> bool:
        """Whether conversations' turns are to be kept as pieces (switched on; see :attr:`keeps_pieces`)."""
        return self.history.enabled

    @pieces.setter
    def pieces(self, enabled: bool) -> None:
        self.history.enabled = enabled

    @property
    def piece_store(self) -> PieceStore:
        """The pieces' own memory."""
        return self.history.piece_store

    @property
    def keeps_pieces(self) -> bool:
        """Whether conversations' turns are kept as pieces (switched on, with memory for them)."""
        return self.history.keeps

    def last_message_start(self, token_ids) -> int:
        """Where a prompt's last message begins (:meth:`.HistoryPieces.last_message_start`)."""
        return self.history.last_message_start(token_ids)

    def lead_spans(self, layout: PromptLayout) -> set[int]:
        """The chunk spans fused from their chunk's lead entry (:meth:`.ChunkReads.lead_spans`)."""
        return self.reads.lead_spans(layout)

    def remember_answer(self, decoding, exact_decoding: bool) -> None:
        """Keep a finished answer's K/V in the prefix tier (:meth:`.PrefixReuse.remember_answer`)."""
        self.prefixes.remember_answer(decoding, exact_decoding)

    def remember_pieces(self, decoding, store: KVStore, batch_tokens: int) -> None:
        """Store, in the background, the pieces of a finished answer's prompt and answer that no
        chunk or stored piece covers (:meth:`.HistoryPieces.remember`), for the next turn of its
        conversation, in the pieces' own memory (``store``, the KV store, is left to the documents)."""
        self.history.remember(decoding, batch_tokens)

    # The fused prefill, or the full one where fusing would not pay

    def _fuse(self, layout, plan: StrategyPlan, stats: Stats, computed: dict, store, prefetch, write_back,
              min_speedup: float):
        """One fusion attempt. Returns the fused prefill, its source, and a mask of the
        prompt tokens whose KV came from the store (not computed during this call)."""
        n = len(layout.token_ids)
        spanned = sum(sp.end - sp.start for sp in layout.chunk_spans if sp.token_ids) if plan.reuses else 0
        chunks = sum(1 for sp in layout.chunk_spans if sp.token_ids and not is_piece(sp))   # the floor's (not pieces)
        if spanned and plan.selection is not None and not plan.selection.cheaper_than_a_prefill(n, spanned, chunks):
            # Decided before the store is read or a missing chunk computed: both would be wasted.
            return self._full_prefill(layout, plan, stats, spanned)
        verdict = self.fusion_pays(plan, None, n, spanned, min_speedup, chunks) if plan.selection is not None else None
        if verdict is not None and not verdict.pays:   # even with every chunk in memory: decided before reading
            return self._full_prefill(layout, plan, stats, spanned, verdict)
        found = self.reads.find(layout, plan, stats, computed, store, write_back)
        try:
            tiers = found.count_tiers(stats)
            reused = sum(sp.num_tokens for sp in found.spans)
            plan = plan.with_auto_ratio(self.loading(), n, reused, tiers) if plan.ratio == "auto" else plan
            if reused and not plan.selection.cheaper_than_a_prefill(n, reused, floor_chunks(found.spans)):
                # Fewer chunks found than the prompt holds (the rest computed as plain text).
                found.close()
                return self._full_prefill(layout, plan, stats, reused)
            verdict = self.fusion_pays(plan, found, n, reused, min_speedup, floor_chunks(found.spans))
            if verdict is not None and not verdict.pays:
                found.close()
                return self._full_prefill(layout, plan, stats, reused, verdict)
            stats.predicted_speedup = verdict.speedup if verdict is not None else None
            stats.ratio, stats.cached_attention_scale = plan.ratio, plan.cached_attention_scale
            windows = [slice(sp.offset, sp.offset + sp.num_tokens) for sp in found.spans]
            # Reading ahead pays off for slow tiers, and on a GPU (the thread stages each layer in
            # pinned memory while the GPU computes); from memory to a CPU it would only take CPU
            # from the compute.
            if prefetch and ("disk" in tiers or self.adapter.device.type == "cuda"):
                source = PrefetchSource(found.readers, self.adapter.device, windows=windows, pool=self._reader)
            else:
                source = SequentialSource(found.readers, self.adapter.device, windows=windows)
        except BaseException:
            found.close()
            raise
        sentence_ends = None
        if getattr(plan.selection, "sentence_runs", False):
            ends = self.sentence_end_ids()
            sentence_ends = torch.tensor([t in ends for t in layout.token_ids], dtype=torch.bool)
        try:
            with self.lock:
                fused = fused_prefill(self.adapter, layout.token_ids, found.spans, source, plan.selection, sentence_ends)
        finally:
            source.close()
        self.reads.promote(store, found)
        return fused, source, found.from_store

    def fusion_pays(self, plan: StrategyPlan, found: Found | None, n: int, reused: int,
                    min_speedup: float, chunks: int = 1) -> FusionVerdict | None:
        """Whether fusing this prompt, ``reused`` of its ``n`` tokens (in ``chunks`` chunks) from the chunks ``found`` (None:
        not looked up yet, all taken to be in memory), is predicted to be at least ``min_speedup``
        times faster than its full prefill on this host (:mod:`ragblend.core.fusion.fusion_cost`). None where that is
        not asked: a strategy the caller named, or ``min_speedup`` 0."""
        if not (plan.engine_default and min_speedup > 0 and reused and self.fusion_cost is not None):
            return None
        disk_tokens = 0 if found is None else sum(
            sp.num_tokens for sp, reader in zip(found.spans, found.readers) if reader.tier == "disk")
        with self.lock:   # the first prompt on a host may measure the constants: model passes
            return self.fusion_cost.verdict(plan.selection, n, reused, disk_tokens, min_speedup, chunks)

    def exact_prefill(self, token_ids: list[int]):
        """The full prefill of ``token_ids`` (every token through every layer, nothing read from the
        store): what a fused answer that starts to loop falls back to (.decode.repeats)."""
        source = SequentialSource([], self.adapter.device, windows=[])
        try:
            with self.lock:
                return fused_prefill(self.adapter, list(token_ids), [], source, EveryToken())
        finally:
            source.close()

    def _full_prefill(self, layout, plan: StrategyPlan, stats: Stats, cached: int,
                      verdict: FusionVerdict | None = None):
        """The exact full prefill, where ``plan``'s fusion would compute more than it (QueryAware
        runs the uncached tokens twice: see Selection.cheaper_than_a_prefill), or where it is
        predicted not to be clearly faster (``verdict``). Nothing is read from the store; the stats
        say what ran and why."""
        n = len(layout.token_ids)
        stats.strategy, stats.ratio, stats.cached_attention_scale = FullRecompute.name, None, None
        stats.chunks_reused, stats.chunks_missing, stats.tiers, stats.fusion_skipped = 0, 0, {}, True
        if verdict is None:
            stats.skip_reason = f"fusing would compute more than a full prefill ({cached} of {n} tokens cached)"
            stats.strategy_reason = (f"{plan.name} at ratio {plan.ratio} would compute more than a full prefill of "
                                     f"this prompt ({cached} of {n} tokens in cached chunks), so it ran as one; the "
                                     f"strategy was {plan.reason}")
        else:
            stats.skip_reason, stats.predicted_speedup = verdict.reason, verdict.speedup
            stats.strategy_reason = (f"{plan.name} at ratio {plan.ratio} was {verdict.reason} (under "
                                     f"{verdict.min_speedup:g}x{'' if verdict.measured else ', from default constants'}"
                                     f"), so the exact full prefill ran; the strategy was {plan.reason}")
        source = SequentialSource([], self.adapter.device, windows=[])
        try:
            with self.lock:
                fused = fused_prefill(self.adapter, layout.token_ids, [], source, EveryToken())
        finally:
            source.close()
        return fused, source, torch.zeros(n, dtype=torch.bool)
