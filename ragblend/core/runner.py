"""The fused prefill run of one prompt: find each chunk's cached KV (computing and writing
back the missing ones), pick the layer source, run :func:`~ragblend.core.fusion.prefill.fused_prefill`
and count what was reused. Store writes and promotions to the memory tier run in the
background (:class:`Background`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from .decode.prefix_cache import KeptPrefix, PrefixCache, PrefixHit, PrefixScope, extend_prefix, is_bypassed
from .errors import PromptTooLongError
from .fusion.fusion_cost import FusionCost, FusionVerdict
from .fusion.ingest import Ingestion, packs
from .fusion.pipeline import PrefetchSource, SequentialSource
from .fusion.prefill import FusedPrefill, fused_prefill
from .fusion.selection import EveryToken, ReusedSpan
from .fusion.strategies import FullRecompute
from .model.adapter import ModelAdapter
from .model.omp import release_thread_pool
from .plan import StrategyPlan
from .prompt import PromptLayout
from .results import Prefill, PromptTrace, Stats
from .store.pieces import PieceStore, is_piece, last_message_start, piece_namespace, turn_runs, with_pieces
from .store.tiers import ChunkReader, CorruptEntryError, KVStore, MemoryReader, TieredStore

log = logging.getLogger("ragblend")


class Background:
    """Store writes off the TTFT path, one at a time; a failure is kept for :meth:`flush`."""

    def __init__(self):
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-writeback")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        with self._lock:
            # keep unfinished and failed writes; finished good ones need no more attention
            self._pending = [f for f in self._pending if not f.done() or f.exception()]
            self._pending.append(self._writer.submit(fn, *args))

    def flush(self) -> None:
        """Wait for every write submitted so far, then re-raise the first one that failed."""
        with self._lock:
            pending, self._pending = self._pending, []
        failures = [future.exception() for future in pending]   # exception() waits for each
        first = next((err for err in failures if err is not None), None)
        if first is not None:
            raise first


@dataclass
class _Found:
    """The cached KV one fusion attempt found for a prompt's chunk spans."""

    spans: list = field(default_factory=list)     # ReusedSpan, one per reader
    readers: list = field(default_factory=list)
    tier_of: dict = field(default_factory=dict)   # chunk key -> tier it came from
    missing: set = field(default_factory=set)     # keys of chunks computed as plain text
    from_store: torch.Tensor | None = None        # bool [N]: tokens whose KV came from the store


class PrefillRunner:
    """Runs fused prefills for one engine: ``ingestion`` computes missing chunks, ``index``
    learns them, ``loading`` (a function giving the loading controller) settles
    CacheBlend's ``ratio="auto"``; model passes hold ``lock``; ``sentence_end_ids`` (a function
    giving the ids of tokens that end a sentence) is read for selections in runs of sentences;
    ``fusion_cost`` predicts whether fusing a prompt pays (for the engine's own strategy);
    ``pieces``: keep a conversation's turns as pieces fused like chunks (:mod:`ragblend.core.store.pieces`), in
    ``piece_bytes`` of their own memory."""

    def __init__(self, adapter: ModelAdapter, ingestion: Ingestion, index, lock, loading, sentence_end_ids,
                 fusion_cost: FusionCost | None = None, prefix: PrefixCache | None = None, pieces: bool = False,
                 piece_bytes: int = 256 << 20):
        self.adapter, self.ingestion, self.index, self.lock, self.loading = adapter, ingestion, index, lock, loading
        self.sentence_end_ids, self.fusion_cost = sentence_end_ids, fusion_cost
        self.prefix = prefix   # the prefix tier (None: off); the K/V it holds are in kv_dtype
        self.pieces = pieces
        # an evicted piece is no longer looked for: a prompt holding its text computes it as text
        self.piece_store = PieceStore(piece_bytes, lambda entry: index.forget(entry.key, entry.token_ids, entry.namespace))
        self._question_bounds: tuple | None = None   # the template's closing and user-turn opening, made once
        self.kv_dtype = adapter.dtype
        self.background = Background()
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
        layout, pieces = self._with_pieces(layout, plan)
        hit = self._prefix_hit(layout, plan)
        # A stored entry can turn out corrupt mid-fusion; it is then dropped and the
        # prefill restarts, at most once per entry.
        attempts = len(layout.chunk_spans) + 1
        for attempt in range(attempts):
            try:
                if hit is not None:
                    fused, source, from_store = self._extend(layout, hit, plan, stats)
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
        prefill.prefix_kept = self._remember(layout, plan, fused, hit)
        prefill.keeps_pieces = pieces and write_back   # a store kept read-only gets no pieces either
        release_thread_pool()   # the next thread to compute runs at full speed (see .omp)
        return prefill, trace

    def _with_pieces(self, layout: PromptLayout, plan: StrategyPlan) -> tuple[PromptLayout, bool]:
        """``layout`` with the stored pieces of its conversation's earlier turns marked (.pieces), and
        whether this turn's are to be kept once answered. Only a conversation's turns (chat messages
        with earlier turns), and a chat request's first turn, are worth keeping: a single-shot query
        would pay a background pass for text that is never asked again."""
        pieces = self.keeps_pieces and (layout.conversation or layout.chat) and plan.engine_default and plan.reuses \
            and not is_bypassed()
        if pieces and layout.conversation:   # a first turn has no earlier one to find
            end = self.last_message_start(layout.token_ids)
            if not self._prefix_reaches(layout, plan, end):   # else the tier serves all a piece could
                layout = with_pieces(layout, self.index.finder,
                                     start=self.ingestion.prompts.opening_length(layout.token_ids), end=end)
        return layout, pieces

    def _prefix_reaches(self, layout: PromptLayout, plan: StrategyPlan, end: int) -> bool:
        """Whether the prefix tier holds this prompt's first ``end`` tokens (uncounted: :meth:`_prefix_hit`
        counts the lookup that serves it)."""
        prefix = self.prefix
        if prefix is None or not plan.engine_default:
            return False
        hit = prefix.lookup([self.prefix_scope(exact, layout.namespace) for exact in (True, False)],
                            layout.token_ids, limit=end)
        # Only a hit that _prefix_hit will take: one it refuses would leave the history to no piece.
        return hit is not None and hit.num_tokens >= end and self._pays(layout, plan, hit.num_tokens)

    # The prefix tier (.prefix_cache)

    def _prefix_hit(self, layout: PromptLayout, plan: StrategyPlan) -> PrefixHit | None:
        """The stored K/V of the longest prefix of this prompt that it pays to reuse, or None. Only
        the engine's own strategy reads the tier (a strategy the caller names runs as asked), and
        only where the prefix is at least as long as the chunk tokens after it, which fusing the
        whole prompt instead could reuse. The whole prompt is a hit only with its stored logits (an
        exact repeat computes nothing); else the last token is computed: its logits are the answer's."""
        prefix = self.prefix   # read once: a caller may switch the tier off meanwhile
        if prefix is None or is_bypassed() or not plan.engine_default:
            return None
        n = len(layout.token_ids)
        hit = prefix.lookup([self.prefix_scope(exact, layout.namespace) for exact in (True, False)],
                            layout.token_ids, limit=n)
        if hit is not None and hit.num_tokens == n and hit.logits is None:
            hit = hit.first(n - 1)   # the whole prompt without its logits: the last token is computed
        if hit is not None and not self._pays(layout, plan, hit.num_tokens):
            hit = None
        prefix.count(hit)
        return hit

    @staticmethod
    def _pays(layout: PromptLayout, plan: StrategyPlan, reused: int) -> bool:
        """Whether a prefix of ``reused`` tokens is at least as long as the chunk tokens after it
        (which fusing the whole prompt instead could reuse)."""
        after = sum(span.end - max(span.start, reused) for span in layout.chunk_spans
                    if span.token_ids and span.end > reused) if plan.reuses else 0
        return after <= reused

    def prefix_scope(self, exact: bool, namespace: str) -> PrefixScope:
        """What this engine's K/V in the prefix tier are keyed under, besides their token ids."""
        return PrefixScope(self.ingestion.fingerprint, str(self.kv_dtype), exact, namespace)

    def _extend(self, layout: PromptLayout, hit: PrefixHit, plan: StrategyPlan, stats: Stats):
        """The prefill of a prompt whose first tokens are ``hit``'s: the rest runs in full over them."""
        n, p = len(layout.token_ids), hit.num_tokens
        rest = "its logits too (an exact repeat)" if hit.logits is not None else "the rest computed in full"
        stats.strategy_reason = (f"the first {p} of its {n} tokens were a recent prompt's, their K/V reused from the "
                                 f"prefix tier{'' if hit.scope.exact else ' (as fused or decoded then)'} and {rest}; "
                                 f"the strategy was {plan.reason}")
        if hit.logits is not None:   # an exact repeat: nothing to compute
            fused = FusedPrefill(logits=hit.logits, keys=hit.keys, values=hit.values,
                                 recomputed=torch.zeros(n, dtype=torch.bool), key_bias=hit.key_bias,
                                 layer_positions=[torch.arange(0)] * self.adapter.shape.num_layers)
        else:
            with self.lock:
                fused = extend_prefix(self.adapter, hit, layout.token_ids)
        from_store = torch.zeros(n, dtype=torch.bool)
        from_store[:p] = True
        return fused, SequentialSource([], self.adapter.device, windows=[]), from_store

    def _remember(self, layout: PromptLayout, plan: StrategyPlan, fused, hit: PrefixHit | None) -> KeptPrefix | None:
        """Keep this prompt's K/V in the prefix tier; how they were kept (None: not kept).
        A fusion's K/V are kept only for the engine's own strategy (which alone reads them back)."""
        n = len(layout.token_ids)
        exact = hit.scope.exact if hit is not None else all(len(p) == n for p in fused.layer_positions)
        prefix = self.prefix
        if prefix is None or is_bypassed() or not (exact or plan.engine_default):
            return None
        if hit is not None and hit.logits is not None:   # an exact repeat: the tier holds it, logits and all
            return KeptPrefix(hit.scope, hit.key_bias)
        self.kv_dtype = fused.keys[0].dtype
        scope = self.prefix_scope(exact, layout.namespace)
        # fused K/V serve only their own prompt again (a repeat is served the logits kept with them)
        prefix.store(scope, layout.token_ids, fused.keys, fused.values, fused.key_bias,
                     usable_from=0 if exact else n - 1, logits=fused.logits.detach().clone())
        return KeptPrefix(scope, fused.key_bias)

    def remember_answer(self, decoding, exact_decoding: bool) -> None:
        """Keep the K/V of a finished answer's prompt and tokens in the prefix tier (the next turn of
        a conversation starts with them), where its prompt's were kept; as exact only where
        ``exact_decoding`` (decoded on the prefill's weights, over K/V in its dtype)."""
        pre, decoder = decoding.prefill, decoding.decoder
        kept: KeptPrefix | None = getattr(pre, "prefix_kept", None)
        prefix = self.prefix
        n = len(pre.token_ids)
        answered = decoder.length - n   # the last token's K/V are never computed
        if prefix is None or kept is None or not 0 < answered <= len(decoding.token_ids):
            return
        length, dtype = decoder.length, self.kv_dtype
        size = sum(2 * k.shape[0] * length * k.shape[2] for k in decoder.keys) * dtype.itemsize
        if size > prefix.max_bytes:
            return   # the tier would refuse it: copy nothing
        try:
            keys = [k[:, :length].to(dtype, copy=True) for k in decoder.keys]
            values = [v[:, :length].to(dtype, copy=True) for v in decoder.values]
            # the prompt's own bias (decoding may have run without it), none on the answer's keys
            bias = None if kept.key_bias is None else torch.cat([kept.key_bias, kept.key_bias.new_zeros(answered)])
            scope = replace(kept.scope, exact=kept.scope.exact and exact_decoding and decoder.dtype == dtype)
            # fused or low-bit-decoded K/V serve a repeat or a next turn, which hold this whole prompt
            prefix.store(scope, list(pre.token_ids) + list(decoding.token_ids[:answered]), keys, values, bias,
                         usable_from=0 if scope.exact else n - 1)
        except Exception as err:   # the tier never fails an answer that is done
            log.warning("ragblend: could not keep an answer's K/V in the prefix tier (%s: %s)", type(err).__name__, err)

    @property
    def keeps_pieces(self) -> bool:
        """Whether conversations' turns are kept as pieces (switched on, with memory for them)."""
        return self.pieces and self.piece_store.max_bytes > 0

    def remember_pieces(self, decoding, store: KVStore, batch_tokens: int) -> None:
        """Store, in the background, the pieces of a finished answer's prompt and answer that no
        chunk or stored piece covers (:mod:`ragblend.core.store.pieces`), for the next turn of its conversation, in the
        pieces' own memory (``store``, the KV store, is left to the documents)."""
        pre = decoding.prefill
        if pre is not None and getattr(pre, "keeps_pieces", False):
            self.background.submit(self._store_pieces, pre.token_ids, pre.layout, decoding.text, batch_tokens)

    def last_message_start(self, token_ids) -> int:
        """Where a prompt's last message begins (:func:`ragblend.core.store.pieces.last_message_start`)."""
        prompts = self.ingestion.prompts
        control = prompts.text_encoder.control_ids
        if self._question_bounds is None:   # rendering the template takes milliseconds: once
            before, closing = prompts.template_parts(None)
            last = max((i for i, t in enumerate(before) if t in control), default=None)
            self._question_bounds = (closing, [] if last is None else before[last:])
        closing, user_opening = self._question_bounds
        return last_message_start(token_ids, control, closing, user_opening)

    def _store_pieces(self, prompt_ids: list[int], layout: PromptLayout, answer: str, batch_tokens: int) -> None:
        prompts = self.ingestion.prompts
        try:
            # The answer as the next prompt will hold it: its text tokenized (the ids generated need not
            # be the ids of their own text).
            ids = list(prompt_ids) + (prompts.tokenize(answer) if answer else [])
            runs = turn_runs(ids, layout.chunk_spans, question=self.last_message_start(prompt_ids),
                             prompt_tokens=len(prompt_ids), start=prompts.opening_length(ids),
                             history=layout.conversation, control_ids=prompts.text_encoder.control_ids,
                             max_tokens=self.adapter.shape.context_window - len(self.ingestion.sink_ids))
            namespace = piece_namespace(layout.namespace)
            keys = {self.ingestion.key_for(run, namespace=namespace): run for run in runs}
            new = [(key, run) for key, run in keys.items() if key not in self.piece_store]
            # Each piece's own entry only (no lead entry: a piece is never fused from one, see lead_spans),
            # in the pieces' memory; the finder learns it once stored.
            for pack in packs(new, max(batch_tokens, 1), size=lambda item: len(item[1])):
                entries = self.ingestion.compute_entries([run for _, run in pack], False, namespace)
                for (key, run), entry in zip(pack, entries):
                    if self.piece_store.put(entry):
                        self.index.add(key, run, namespace)
        except Exception as err:   # pieces are a cache: the next turn computes their text instead
            log.warning("ragblend: could not store a conversation's pieces (%s: %s)", type(err).__name__, err)

    def _fuse(self, layout, plan: StrategyPlan, stats: Stats, computed: dict, store, prefetch, write_back,
              min_speedup: float):
        """One fusion attempt. Returns the fused prefill, its source, and a mask of the
        prompt tokens whose KV came from the store (not computed during this call)."""
        n = len(layout.token_ids)
        spanned = sum(sp.end - sp.start for sp in layout.chunk_spans if sp.token_ids) if plan.reuses else 0
        if spanned and plan.selection is not None and not plan.selection.cheaper_than_a_prefill(n, spanned):
            # Decided before the store is read or a missing chunk computed: both would be wasted.
            return self._full_prefill(layout, plan, stats, spanned)
        verdict = self.fusion_pays(plan, None, n, spanned, min_speedup) if plan.selection is not None else None
        if verdict is not None and not verdict.pays:   # even with every chunk in memory: decided before reading
            return self._full_prefill(layout, plan, stats, spanned, verdict)
        found = self._find(layout, plan, stats, computed, store, write_back)
        try:
            tiers = _count_tiers(found, stats)
            reused = sum(sp.num_tokens for sp in found.spans)
            plan = plan.with_auto_ratio(self.loading(), n, reused, tiers) if plan.ratio == "auto" else plan
            if reused and not plan.selection.cheaper_than_a_prefill(n, reused):
                # Fewer chunks found than the prompt holds (the rest computed as plain text).
                for reader in found.readers:
                    reader.close()
                return self._full_prefill(layout, plan, stats, reused)
            verdict = self.fusion_pays(plan, found, n, reused, min_speedup)
            if verdict is not None and not verdict.pays:
                for reader in found.readers:
                    reader.close()
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
            for reader in found.readers:
                reader.close()
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
        self._promote(store, [r.key for r in found.readers if r.tier == "disk"])
        return fused, source, found.from_store

    def fusion_pays(self, plan: StrategyPlan, found: _Found | None, n: int, reused: int,
                    min_speedup: float) -> FusionVerdict | None:
        """Whether fusing this prompt, ``reused`` of its ``n`` tokens from the chunks ``found`` (None:
        not looked up yet, all taken to be in memory), is predicted to be at least ``min_speedup``
        times faster than its full prefill on this host (:mod:`ragblend.core.fusion.fusion_cost`). None where that is
        not asked: a strategy the caller named, or ``min_speedup`` 0."""
        if not (plan.engine_default and min_speedup > 0 and reused and self.fusion_cost is not None):
            return None
        disk_tokens = 0 if found is None else sum(
            sp.num_tokens for sp, reader in zip(found.spans, found.readers) if reader.tier == "disk")
        with self.lock:   # the first prompt on a host may measure the constants: model passes
            return self.fusion_cost.verdict(plan.selection, n, reused, disk_tokens, min_speedup)

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

    def _find(self, layout, plan: StrategyPlan, stats: Stats, computed: dict, store, write_back) -> _Found:
        """A reader for every chunk span; a chunk not stored is computed now and written back
        (or, without ``write_back``, left to be computed as plain text inside the prompt)."""
        # A chunk can appear in several spans (repeated, or split where the prompt's tokens
        # differ from its own); the chunk counts in Stats are of distinct chunks.
        found = _Found(from_store=torch.zeros(len(layout.token_ids), dtype=torch.bool))
        lead_spans = self.lead_spans(layout)
        try:
            for j, span in enumerate(layout.chunk_spans):
                if not span.token_ids or not plan.reuses:
                    continue
                if is_piece(span):   # from the pieces' memory; one evicted meanwhile is computed as text
                    reader = _open(self.piece_store, self.ingestion.key_for(span.token_ids, namespace=span.namespace),
                                   span.token_ids)
                    if reader is not None:
                        found.spans.append(ReusedSpan(span.start, span.end - span.start, span.offset))
                        found.readers.append(reader)
                        found.tier_of.setdefault(reader.key, reader.tier)
                        found.from_store[span.start:span.end] = True
                    continue
                lead = j in lead_spans
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
                        continue  # computed as plain text inside the prompt
                    # What a hit would have read, so that a miss (or a failing store) answers the same.
                    t = time.perf_counter()
                    computed[key] = entry = self.ingestion.compute_entry(list(span.token_ids), lead, namespace)
                    self.index.add(own_key, span.token_ids, namespace)
                    stats.isolate_s += time.perf_counter() - t
                    self.background.submit(store.put, entry)
                    reader = MemoryReader(entry, "computed")
                found.spans.append(ReusedSpan(span.start, span.end - span.start, span.offset))
                found.readers.append(reader)
                # a chunk read from two entries (its lead one first, its own at a repeat) of which one
                # had to be computed counts as missing, as chunks_computed counts it
                if reader.tier == "computed" or own_key not in found.tier_of:
                    found.tier_of[own_key] = reader.tier
                if reader.tier != "computed":
                    found.from_store[span.start:span.end] = True
        except BaseException:
            for reader in found.readers:
                reader.close()
            raise
        return found

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

    def _promote(self, store, keys: list[str]) -> None:
        """Chunks served from disk also go to the memory tier, in the background."""
        if isinstance(store, TieredStore):
            for key in dict.fromkeys(keys):
                self.background.submit(_promote_one, store, key)


def _count_tiers(found: _Found, stats: Stats) -> dict:
    """Chunks served per tier, into ``stats``."""
    tiers = {}
    # a chunk read at one span and missing at another (its lead entry stored, its own not, without
    # write-back) counts as missing only
    served = {key: tier for key, tier in found.tier_of.items() if key not in found.missing}
    for tier in served.values():
        tiers[tier] = tiers.get(tier, 0) + 1
    stats.chunks_reused = len(served) - tiers.get("computed", 0)
    stats.chunks_missing = len(found.missing) + tiers.get("computed", 0)
    stats.tiers = tiers
    return tiers


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
