"""The prefix tier (:mod:`~ragblend.core.decode.prefix_cache`) as the prefill runner uses it:
which prompts it serves (the longest stored prefix, where reusing it pays), the prefill over a
hit, and what a finished prefill or answer leaves in it for the next prompt that starts alike."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from .background import Background
from .decode.generate import KVDecoder, near_tie
from .decode.prefix_cache import KeptPrefix, PrefixCache, PrefixHit, PrefixScope, Room, extend_prefix, is_bypassed
from .fusion.ingest import Ingestion
from .fusion.pipeline import SequentialSource
from .fusion.prefill import FusedPrefill
from .model.adapter import ModelAdapter
from .model.decode_weights import DecodeWeights
from .model.kernels import SHORT_PASS_ROWS
from .plan import StrategyPlan
from .prompt import PromptLayout
from .results import Stats

log = logging.getLogger("ragblend")


class PrefixReuse:
    """Reads and fills ``prefix`` (the prefix tier; None: off) for one engine's prefills; model
    passes hold ``lock``. Only the engine's own strategy reads the tier (a strategy the caller
    names runs as asked)."""

    def __init__(self, adapter: ModelAdapter, ingestion: Ingestion, lock, prefix: PrefixCache | None,
                 background: Background | None = None):
        self.adapter, self.ingestion, self.lock = adapter, ingestion, lock
        self.prefix = prefix
        self.background = background   # where an answer's next-turn opening is computed (None: not computed)
        # The weights decoding runs on (set by the engine once they are built; None: this adapter's):
        # a short rest over K/V that were fused or decoded runs on them, as decoding would run those tokens.
        self.decode_weights: DecodeWeights | None = None
        self.kv_dtype = adapter.dtype   # the dtype of the K/V this engine keeps in the tier

    def scope(self, exact: bool, namespace: str) -> PrefixScope:
        """What this engine's K/V in the prefix tier are keyed under, besides their token ids."""
        return PrefixScope(self.ingestion.fingerprint, str(self.kv_dtype), exact, namespace)

    def lookup(self, layout: PromptLayout, plan: StrategyPlan) -> PrefixHit | None:
        """The longest stored prefix of this prompt, exact K/V or fused (uncounted), or None where the
        tier is off or not read for this prompt. Looked up once per prompt: :meth:`reaches` (whether
        pieces are worth marking) and :meth:`hit` (what the prefill reuses) both take it."""
        prefix = self.prefix
        if prefix is None or is_bypassed() or not plan.engine_default:
            return None
        return prefix.lookup([self.scope(exact, layout.namespace) for exact in (True, False)], layout.token_ids)

    def reaches(self, layout: PromptLayout, plan: StrategyPlan, end: int, found: PrefixHit | None) -> bool:
        """Whether ``found`` (:meth:`lookup`'s) covers this prompt's first ``end`` tokens, and
        :meth:`hit` will take it: one it refuses would leave the history to no piece."""
        return found is not None and found.num_tokens >= end and self.pays(layout, plan, found.num_tokens)

    def hit(self, layout: PromptLayout, plan: StrategyPlan, found: PrefixHit | None) -> PrefixHit | None:
        """What the prefill reuses of ``found`` (:meth:`lookup`'s, of this prompt's tokens), counted:
        only a prefix at least as long as the chunk tokens after it, which fusing the whole prompt
        instead could reuse. The whole prompt is a hit only with its stored logits (an exact repeat
        computes nothing); else the last token is computed: its logits are the answer's."""
        prefix = self.prefix   # read once: a caller may switch the tier off meanwhile
        if prefix is None or is_bypassed() or not plan.engine_default:
            return None
        n, hit = len(layout.token_ids), found
        if hit is not None and hit.num_tokens == n and hit.logits is None:
            hit = hit.first(n - 1)   # the whole prompt without its logits: the last token is computed
        if hit is not None and not self.pays(layout, plan, hit.num_tokens):
            hit = None
        prefix.count(hit)
        return hit

    @staticmethod
    def pays(layout: PromptLayout, plan: StrategyPlan, reused: int) -> bool:
        """Whether a prefix of ``reused`` tokens is at least as long as the chunk tokens after it
        (which fusing the whole prompt instead could reuse)."""
        after = sum(span.end - max(span.start, reused) for span in layout.chunk_spans
                    if span.token_ids and span.end > reused) if plan.reuses else 0
        return after <= reused

    def extend(self, layout: PromptLayout, hit: PrefixHit, plan: StrategyPlan, stats: Stats):
        """The prefill of a prompt whose first tokens are ``hit``'s: the rest runs in full over them.
        Returns the fused prefill, its (empty) layer source and the mask of tokens from the tier."""
        n, p = len(layout.token_ids), hit.num_tokens
        adapter = self.adapter
        if hit.logits is not None:   # an exact repeat: nothing to compute
            fused = FusedPrefill(logits=hit.logits, keys=hit.keys, values=hit.values,
                                 recomputed=torch.zeros(n, dtype=torch.bool), key_bias=hit.key_bias,
                                 layer_positions=[torch.arange(0)] * self.adapter.shape.num_layers)
        else:
            adapter, rows_per_pass = self.rest_adapter(hit, n - p)
            with self.lock:
                fused = extend_prefix(adapter, hit, layout.token_ids, rows_per_pass)
                if adapter is not self.adapter and near_tie(fused.logits):
                    # as decoding does: a near tie on the low-bit weights is picked as float32 picks it
                    adapter = self.adapter
                    fused = extend_prefix(adapter, hit, layout.token_ids)
        rest = "its logits too (an exact repeat)" if hit.logits is not None else "the rest computed in full" + (
            " on the decoding weights" if adapter is not self.adapter else "")
        stats.strategy_reason = (f"the first {p} of its {n} tokens were a recent prompt's, their K/V reused from the "
                                 f"prefix tier{'' if hit.scope.exact else ' (as fused or decoded then)'} and {rest}; "
                                 f"the strategy was {plan.reason}")
        from_store = torch.zeros(n, dtype=torch.bool)
        from_store[:p] = True
        return fused, SequentialSource([], self.adapter.device, windows=[]), from_store

    def rest_adapter(self, hit: PrefixHit, rest: int) -> tuple[ModelAdapter, int | None]:
        """The adapter a prompt's ``rest`` tokens after ``hit`` run on, and the most rows a pass
        takes (None: one pass). A few tokens (at most ``SHORT_PASS_ROWS``: a conversation's next
        question) over K/V that were fused or decoded on low-bit weights (not exact) run as decoding
        runs tokens: on its low-bit kernels, in passes of as many rows as they take throughout
        (:meth:`DecodeWeights.short_pass_rows`: 16 where this host measured them faster than
        float32 at 16, or where the decode dtype was named; 8 for a model held quantized or where
        16 measured slower); the first-token change is measured within the order noise
        (docs/benchmarks.md, "Conversations"). Exact K/V stay exact: the rest then runs on the
        prefill's own weights, as does a longer rest, or any where decoding has no low-bit kernel."""
        weights = self.decode_weights
        rows = 0 if weights is None or hit.scope.exact or rest > SHORT_PASS_ROWS else weights.short_pass_rows()
        if rows <= 0:
            return self.adapter, None
        return weights.decoding_adapter(), rows

    def remember(self, layout: PromptLayout, plan: StrategyPlan, fused, hit: PrefixHit | None) -> KeptPrefix | None:
        """Keep this prompt's K/V in the prefix tier; how they were kept (None: not kept).
        A fusion's K/V are kept only for the engine's own strategy (which alone reads them back)."""
        n = len(layout.token_ids)
        exact = hit.scope.exact if hit is not None else all(len(p) == n for p in fused.layer_positions)
        prefix = self.prefix
        if prefix is None or is_bypassed() or not (exact or plan.engine_default):
            return None
        if hit is not None and hit.logits is not None:   # an exact repeat: the tier holds it, logits and all
            return KeptPrefix(hit.scope, hit.key_bias, hit.usable_from)
        self.kv_dtype = fused.keys[0].dtype
        scope = self.scope(exact, layout.namespace)
        # Fused K/V serve only their own prompt again (a repeat is served the logits kept with them);
        # K/V computed over a hit serve what the hit did: the rest ran causally over it, as another
        # prompt holding its tokens would run them (a conversation's branches share its earlier turns).
        usable_from = 0 if exact else (min(hit.usable_from, n - 1) if hit is not None else n - 1)
        try:
            prefix.store(scope, layout.token_ids, fused.keys, fused.values, fused.key_bias,
                         usable_from=usable_from, logits=fused.logits.detach().clone())
        except Exception as err:   # a cache: the answer goes on without it
            log.warning("ragblend: could not keep a prompt's K/V in the prefix tier (%s: %s)", type(err).__name__, err)
            prefix.fault()
            return None
        return KeptPrefix(scope, fused.key_bias, usable_from)

    def remember_answer(self, decoding, exact_decoding: bool) -> None:
        """Keep the K/V of a finished answer's prompt and tokens in the prefix tier (the next turn of
        a conversation starts with them), where its prompt's were kept; as exact only where
        ``exact_decoding`` (decoded on the prefill's weights, over K/V in its dtype). Then, in the
        background, the tokens every next turn starts with (:meth:`opening_after`) are computed
        over them and kept too: the next turn computes only its question."""
        pre, decoder = decoding.prefill, decoding.decoder
        kept: KeptPrefix | None = getattr(pre, "prefix_kept", None)
        prefix = self.prefix
        n = len(pre.token_ids)
        # The last token's K/V are never computed, unless drafts verified past it (an end-of-sequence
        # token accepted in a draft): the answer's own tokens are kept either way.
        answered = min(decoder.length - n, len(decoding.token_ids))
        if prefix is None or kept is None or answered <= 0:
            return
        length, dtype = n + answered, self.kv_dtype   # not past the answer's last kept token
        try:
            opening = self.opening_after(decoding, answered)
            capacity = length + len(opening) + (self.QUESTION_ROOM if opening else 0)
            size = sum(2 * k.shape[0] * capacity * k.shape[2] for k in decoder.keys) * dtype.itemsize
            if size > prefix.max_bytes:
                return   # the tier would refuse it: copy nothing
            # the prompt's own bias (decoding may have run without it), none on the answer's keys
            bias = None if kept.key_bias is None else torch.cat([kept.key_bias, kept.key_bias.new_zeros(answered)])
            # A copy (the answer's buffers are its decoder's), with room for the opening and the next question.
            carried = KVDecoder(decoder.adapter, [k[:, :length] for k in decoder.keys],
                                [v[:, :length] for v in decoder.values], capacity, bias, dtype)
            scope = replace(kept.scope, exact=kept.scope.exact and exact_decoding and decoder.dtype == dtype)
            ids = list(pre.token_ids) + list(decoding.token_ids[:answered])
            # fused or low-bit-decoded K/V serve a repeat or a next turn, which hold this whole prompt
            # (or what the prompt's K/V served: the answer ran causally over them)
            usable_from = 0 if scope.exact else (kept.usable_from if not kept.scope.exact else n - 1)
            self._keep(prefix, scope, ids, carried, usable_from)
            if opening and self.background is not None:   # the answer is out: off its path
                self.background.submit(self._keep_opening, prefix, scope, ids, carried, opening, usable_from)
        except Exception as err:   # the tier never fails an answer that is done
            log.warning("ragblend: could not keep an answer's K/V in the prefix tier (%s: %s)", type(err).__name__, err)
            prefix.fault()

    def opening_after(self, decoding, answered: int) -> list[int]:
        """The tokens the next turn of ``decoding``'s conversation starts with after its first
        ``answered`` answer tokens: the rest of the answer as its text tokenizes (what the next
        prompt holds) and the template's opening of the next user turn; [] for a prompt that is no
        chat, where the answer's text does not tokenize to the tokens generated, or where that would
        be more than a few tokens."""
        layout, prompts = decoding.prefill.layout, self.ingestion.prompts
        # Only a chat is likely to go on (a single-shot query would pay a pass for nothing).
        opening = prompts.next_turn_opening() if layout.chat or layout.conversation else []
        if not opening:
            return []
        ids = (prompts.tokenize(decoding.text) if decoding.text else []) + opening
        if ids[:answered] != list(decoding.token_ids[:answered]) or len(ids) - answered > self.MAX_OPENING_TOKENS:
            return []
        return ids[answered:]

    MAX_OPENING_TOKENS = 16   # an answer's last token and the template's opening of the next user turn
    QUESTION_ROOM = 32   # positions kept free after a conversation's opening for its next question (Room)

    def _keep_opening(self, prefix: PrefixCache, scope: PrefixScope, ids: list[int], carried: KVDecoder,
                      opening: list[int], usable_from: int) -> None:
        """Compute ``opening`` over an answer's K/V (``carried``) and keep all of them (runs on
        the background thread; the shorter entry it extends then goes, :meth:`PrefixCache.store`)."""
        try:
            # Only over the answer's entry as it was kept: not after the tier was cleared (calibration),
            # evicted it or was switched off, where it would come back.
            if self.prefix is not prefix or not prefix.holds(scope, ids):
                return
            with self.lock:
                carried.extend(opening, with_logits=False)
            room = Room(carried.keys, carried.values)   # the next turn's question goes there, not into a copy
            self._keep(prefix, scope, ids + opening, carried, usable_from, extends=len(ids), room=room)
        except Exception as err:   # a cache: the next turn computes the opening itself
            log.warning("ragblend: could not keep a conversation's next-turn opening in the prefix tier (%s: %s)",
                        type(err).__name__, err)
            prefix.fault()

    @staticmethod
    def _keep(prefix: PrefixCache, scope: PrefixScope, ids: list[int], carried: KVDecoder, usable_from: int,
              extends: int | None = None, room: Room | None = None) -> None:
        """Keep the first ``len(ids)`` positions of ``carried``'s buffers (views: later positions
        may still be written, these never are); ``extends``, ``room``: see :meth:`PrefixCache.store`."""
        m = len(ids)
        bias = None if carried.key_bias is None else carried.key_bias[:m]
        prefix.store(scope, ids, [k[:, :m] for k in carried.keys], [v[:, :m] for v in carried.values], bias,
                     usable_from=usable_from, extends=extends, room=room)
