"""Selections: which tokens a fused prefill computes at each layer.

A strategy (:mod:`ragblend.core.fusion.strategies`) is settings; its selection is what runs. The
prefill loop (:mod:`ragblend.core.fusion.prefill`) asks :meth:`Selection.first` for the tokens
computed from layer 0 and, at each check layer, :meth:`Selection.refine` for those that go on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError


@dataclass
class ReusedSpan:
    """A run of prompt positions ``[start, start + num_tokens)`` whose KV comes from a cache."""

    start: int
    num_tokens: int
    offset: int = 0  # where the run starts inside its cached chunk
    # a piece of the conversation's history (ragblend.core.store.pieces), not a retrieved chunk:
    # QueryAware's per-chunk floor (QuestionAttention.budget) does not count it
    piece: bool = False


@dataclass
class FusionPrompt:
    """The prompt as the selection sees it: which positions are reused, in which chunk."""

    num_tokens: int
    spans: list[ReusedSpan]
    reused: torch.Tensor        # bool [N] (on the CPU)
    reused_pos: torch.Tensor    # positions of the reused tokens, in prompt order (compute device)
    chunk_of: torch.Tensor      # for each reused token, the index of its span (compute device)
    # for each reused token, the index of its sentence among the spans' sentences (a sentence
    # ends at a span's end too); None when the prompt's sentence ends were not given
    sentence_of: torch.Tensor | None = None

    @classmethod
    def build(cls, num_tokens: int, spans: list[ReusedSpan], device,
              sentence_ends: torch.Tensor | None = None) -> "FusionPrompt":
        """``sentence_ends``: bool [N], the tokens that end a sentence (optional)."""
        reused = torch.zeros(num_tokens, dtype=torch.bool)
        for span in spans:
            reused[span.start:span.start + span.num_tokens] = True
        sizes = torch.tensor([s.num_tokens for s in spans], dtype=torch.long)
        chunk_of = torch.repeat_interleave(torch.arange(len(spans)), sizes)
        positions = reused.nonzero().squeeze(1)
        sentence_of = None
        if sentence_ends is not None:
            # a new sentence after a sentence's end and at each span's start
            starts = torch.ones_like(positions, dtype=torch.bool)
            starts[1:] = sentence_ends[positions[:-1]] | (chunk_of[1:] != chunk_of[:-1])
            sentence_of = (starts.long().cumsum(0) - 1).to(device)
        return cls(num_tokens, spans, reused, positions.to(device), chunk_of.to(device), sentence_of)

    @property
    def num_reused(self) -> int:
        return self.reused_pos.numel()

    @property
    def num_chunks(self) -> int:
        """The spans of retrieved chunks, which QueryAware's per-chunk floor counts (not pieces)."""
        return floor_chunks(self.spans)

    @property
    def question_start(self) -> int:
        """First position after the last reused span: the question and the template's end."""
        end = max((s.start + s.num_tokens for s in self.spans), default=0)
        return min(end, self.num_tokens - 1)

    def with_reused(self, chosen: torch.Tensor) -> torch.Tensor:
        """Bool [N] on the compute device: every token without a cache, the ``chosen``
        positions, and the last token (its hidden state gives the logits)."""
        selected = ~self.reused.to(self.reused_pos.device)
        selected[chosen] = True
        selected[-1] = True
        return selected


@dataclass
class CheckStep:
    """What a selection sees at one of its check layers."""

    layer: int
    positions: torch.Tensor          # prompt positions computed fresh at this layer (sorted)
    fresh_k: torch.Tensor            # [kv_heads, len(positions), head_dim], K before RoPE
    fresh_v: torch.Tensor
    cached: list[tuple[torch.Tensor, torch.Tensor]]   # this layer's cached K/V, one pair per span


Probe = Callable[[], torch.Tensor]   # stage one of QueryAware: [layers, reused tokens] relevance


class Selection:
    """Decides which tokens a fused prefill computes at each layer.

    :meth:`first` gives the tokens computed from layer 0 on. At each layer of
    ``check_layers``, once that layer's fresh K/V are known, :meth:`refine` may narrow the
    set (never widen it: a token dropped once has no hidden state to continue from).
    A selection is also accepted wherever a strategy is, so benchmarks can try their own.

    ``cached_attention_scale``: the factor on every attention weight paid to the reused tokens
    that :meth:`first` leaves out (they keep their cached K/V at every layer), in the fused
    prefill only unless the selection sets ``scale_in_decoding = True``; see :class:`QueryAware`.
    """

    name = "selection"
    check_layers: frozenset[int] = frozenset()
    cached_attention_scale: float = 1.0

    def first(self, prompt: FusionPrompt, probe: Probe) -> torch.Tensor:
        """Bool [N]: the tokens computed from layer 0. ``probe()`` runs the question
        alone over the cached chunks and returns each reused token's relevance at each layer,
        ``[layers, reused tokens]``, every layer summing to 1 (costly: call it only when needed)."""
        raise NotImplementedError

    def refine(self, prompt: FusionPrompt, step: CheckStep) -> torch.Tensor:
        """Bool [N]: the tokens that go on after ``step.layer`` (a subset of ``step.positions``)."""
        raise NotImplementedError

    def cheaper_than_a_prefill(self, num_tokens: int, num_reused: int, chunks: int = 1) -> bool:
        """Whether fusing a prompt of ``num_tokens`` tokens, ``num_reused`` of them cached (in
        ``chunks`` chunks), computes fewer token-layers than a full prefill of it."""
        return True


class EveryToken(Selection):
    """A normal prefill: every token at every layer."""

    def first(self, prompt, probe):
        return torch.ones(prompt.num_tokens, dtype=torch.bool, device=prompt.reused_pos.device)


class UncachedTokens(Selection):
    """Only the tokens without a cache, plus the first ``head`` tokens of every chunk but the first."""

    def __init__(self, head: int = 0):
        self.head = head

    def first(self, prompt, probe):
        chosen = [torch.arange(s.start, s.start + min(self.head, s.num_tokens)) for s in prompt.spans[1:]]
        chosen = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)
        return prompt.with_reused(chosen.to(prompt.reused_pos.device))


def kv_deviation(kind: str, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                 cached: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached K (before RoPE) and/or V.

    ``fresh_k``/``fresh_v`` are ``[kv_heads, tokens, head_dim]`` for the candidate tokens;
    ``rows`` are those tokens' indices into the reused tokens, whose cached K/V are the
    concatenation of ``cached`` (one pair per span). ``"key_value"`` adds the two distances,
    each divided by its mean over the candidates, since K and V live on different scales.
    """
    def distance(fresh: torch.Tensor, which: int) -> torch.Tensor:
        old = torch.cat([pair[which] for pair in cached], dim=1)[:, rows].to(fresh.dtype)
        return (fresh - old).pow(2).sum(dim=(0, 2))

    if kind == "key":
        return distance(fresh_k, 0)
    if kind == "value":
        return distance(fresh_v, 1)
    dk, dv = distance(fresh_k, 0), distance(fresh_v, 1)
    return dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12)


# score(rows, fresh_k, fresh_v, cached) -> one score per candidate (higher = keep)
Score = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list], torch.Tensor]


class TopScoreSelection(Selection):
    """CacheBlend's selection: every token up to the first check layer; at each check layer,
    keep the reused tokens with the highest ``score`` (``ratio`` of all reused tokens).

    ``schedule`` maps check layers to ratios. ``score`` is the name of a K/V deviation
    (see :func:`kv_deviation`) or any function ``(rows, fresh_k, fresh_v, cached) ->
    scores``, where ``rows`` index the candidates among the prompt's reused tokens.
    """

    name = "cacheblend"

    def __init__(self, schedule: dict[int, float], score: str | Score = "value"):
        self.schedule = dict(schedule)
        self.check_layers = frozenset(self.schedule)
        if isinstance(score, str):
            kind = score
            score = lambda rows, k, v, cached: kv_deviation(kind, k, v, cached, rows)  # noqa: E731
        self.score = score

    def first(self, prompt, probe):
        return torch.ones(prompt.num_tokens, dtype=torch.bool, device=prompt.reused_pos.device)

    def refine(self, prompt, step):
        selected_reused = prompt.reused.to(step.positions.device)[step.positions]
        candidates = step.positions[selected_reused]
        rows = torch.searchsorted(prompt.reused_pos, candidates)
        scores = self.score(rows, step.fresh_k[:, selected_reused], step.fresh_v[:, selected_reused], step.cached)
        keep = math.ceil(self.schedule[step.layer] * prompt.num_reused - 1e-9)
        if keep < candidates.numel():
            candidates = candidates[torch.topk(scores, keep, sorted=False).indices]
        return prompt.with_reused(candidates)


# Under QueryAware(sentence_runs=True) a reused token's claim is its sentence's mean attention
# plus this share of its own: a sentence read throughout still comes whole, and so does a token
# the question reads far more than the rest of its sentence. Sentences alone (a share of 1e-4)
# moved Qwen2.5's first token nearly 3x further than single tokens on SQuAD; 0.25 brought it
# back and kept the answers' mend, where 1 and 4 lost it (docs/notes/sentence-runs.md).
SENTENCE_OWN_SHARE = 0.25
# QueryAware's floor of per_chunk tokens a chunk recomputes at most this share of the reused tokens:
# chunks shorter than per_chunk / FLOOR_SHARE are repaired in proportion, so that tiny chunks (a
# sentence each) are not recomputed whole, which would leave nothing to fuse.
FLOOR_SHARE = 0.25


def floor_chunks(spans) -> int:
    """How many of ``spans`` (:class:`ReusedSpan`) QueryAware's per-chunk floor counts: the retrieved chunks, not a conversation's pieces. Why: the floor repairs a
    document chunk computed without the chunks before it (docs/notes/answers-by-size.md); counting
    each part of every earlier turn (a piece is split around the template's control tokens, four
    parts a turn) raised turn 5's recompute from 233 to 494 tokens, where without the floor the
    pieces' first-token KL was within the order noise (docs/benchmarks.md, conversations)."""
    return sum(1 for span in spans if not span.piece)


class QuestionAttention(Selection):
    """QueryAware's selection: computed from layer 0 are the tokens without a cache and the
    reused tokens the question attends to most (``ratio`` of the reused tokens).

    With ``whole_chunks``, chunks are taken whole in order of the question's total attention
    while they fit the budget; what remains of it goes to the most attended single tokens.
    ``query_tokens``: the last so many prompt tokens are the question whose attention counts
    (None: every token after the last chunk). ``neighbour_window``: a token's claim is the
    question's attention averaged over a window this fraction of its chunk long, centred on
    it, so the chosen tokens come in runs with their neighbours (0: each token alone).
    ``sentence_runs``: averaged over its sentence instead (the prompt's ``sentence_of``), plus a
    share of its own (:meth:`by_sentence`). ``per_chunk``: the budget is at least this many tokens
    for each cached chunk (:meth:`budget`).
    """

    name = "query_aware"

    def __init__(self, ratio: float, whole_chunks: bool = False, query_tokens: int | None = None,
                 cached_attention_scale: float = 1.0, neighbour_window: float = 0.0, sentence_runs: bool = False,
                 per_chunk: int = 0):
        self.ratio, self.whole_chunks, self.query_tokens = ratio, whole_chunks, query_tokens
        self.cached_attention_scale, self.neighbour_window = cached_attention_scale, neighbour_window
        self.sentence_runs, self.per_chunk = sentence_runs, per_chunk

    def cheaper_than_a_prefill(self, num_tokens: int, num_reused: int, chunks: int = 1) -> bool:
        # The uncached tokens run twice (the question pass, then the fused pass) when any
        # reused token is to be chosen: over a mostly uncached prompt that is more than a prefill.
        budget = self.budget(num_reused, chunks)
        return budget == 0 or 2 * (num_tokens - num_reused) + budget < num_tokens

    def budget(self, num_reused: int, chunks: int = 1) -> int:
        """Reused tokens recomputed: ``ratio`` of them, but at least ``per_chunk`` for each of the
        ``chunks`` cached chunks, up to :data:`FLOOR_SHARE` of them. Why a floor per chunk: what a
        chunk precomputed alone lacks is its place after the chunks before it, a repair that does
        not shrink with the chunk; on six 128-token chunks a tenth of them (13 a chunk) lost 3 of 6
        sample answers, 24 a chunk kept 2 back (docs/notes/answers-by-size.md)."""
        floor = min(self.per_chunk * chunks, math.ceil(FLOOR_SHARE * num_reused - 1e-9))
        return max(math.ceil(self.ratio * num_reused - 1e-9), floor)

    def scores(self, prompt: FusionPrompt, relevance: torch.Tensor) -> torch.Tensor:
        """Each reused token's claim to be recomputed, from its ``[layers, reused tokens]``
        relevance: the question's attention summed over the layers, pooled over each token's
        window (:meth:`window`) or sentence (:meth:`by_sentence`) inside its chunk."""
        summed = relevance.sum(dim=0)
        if self.sentence_runs:
            return self.by_sentence(prompt, summed.float())
        if not self.neighbour_window:
            return summed
        summed, start = summed.float(), 0
        pooled = torch.empty_like(summed)
        for span in prompt.spans:   # a window never reaches into the next chunk
            end = start + span.num_tokens
            pooled[start:end] = self.pool(summed[start:end], self.window(span.num_tokens))
            start = end
        return pooled

    def window(self, num_tokens: int) -> int:
        """How many tokens, centred on a token of a ``num_tokens``-long chunk, its claim is pooled
        over: ``neighbour_window`` of the chunk, odd so that it is centred."""
        return max(1, round(self.neighbour_window * num_tokens)) | 1

    def pool(self, claims: torch.Tensor, window: int) -> torch.Tensor:
        """One chunk's claims averaged over ``window`` tokens around each (fewer at its ends).
        Why: a token recomputed alone among cached neighbours moved a few answers further from
        full prefill's than recomputing none (docs/notes/sentence-runs.md)."""
        if window == 1:
            return claims
        return F.avg_pool1d(claims[None, None], window, stride=1, padding=window // 2,
                            count_include_pad=False)[0, 0, :claims.numel()]

    @staticmethod
    def by_sentence(prompt: FusionPrompt, claims: torch.Tensor) -> torch.Tensor:
        """Each token's claim averaged over its sentence, plus :data:`SENTENCE_OWN_SHARE` of its
        own. Why sentences: single tokens among cached neighbours moved a few answers away from
        full prefill's, and windows of a fixed length cut across what the text says
        (docs/notes/sentence-runs.md)."""
        if prompt.sentence_of is None:
            raise InvalidInputError("QueryAware(sentence_runs=True) needs the prompt's sentence ends; run it "
                                    "through BlendEngine.prefill.")
        sentence = prompt.sentence_of
        totals = torch.zeros(int(sentence[-1]) + 1, device=claims.device).index_add_(0, sentence, claims)
        lengths = torch.bincount(sentence, minlength=totals.numel()).to(claims.dtype)
        return (totals / lengths)[sentence] + SENTENCE_OWN_SHARE * claims

    def first(self, prompt, probe):
        budget = self.budget(prompt.num_reused, prompt.num_chunks)
        if budget == 0:
            return prompt.with_reused(prompt.reused_pos[:0])
        relevance = self.scores(prompt, probe())
        chosen = torch.zeros(prompt.num_reused, dtype=torch.bool, device=relevance.device)
        if self.whole_chunks:
            per_chunk = torch.zeros(len(prompt.spans), device=relevance.device).index_add_(
                0, prompt.chunk_of, relevance)
            for chunk in torch.argsort(per_chunk, descending=True).tolist():
                members = prompt.chunk_of == chunk
                if int(chosen.sum() + members.sum()) > budget:
                    break
                chosen |= members
        remaining = budget - int(chosen.sum())
        if remaining > 0:
            rest = relevance.masked_fill(chosen, float("-inf"))
            chosen[torch.topk(rest, remaining, sorted=False).indices] = True
        return prompt.with_reused(prompt.reused_pos[chosen])


def cacheblend_schedule(strategy, ratio: float | str | None = None) -> dict[int, float | str]:
    """A CacheBlend strategy's check layers and the fraction of reused tokens kept after each,
    the first at ``ratio`` (None: the strategy's own)."""
    return {strategy.check_layer: strategy.ratio if ratio is None else ratio, **dict(strategy.gradual)}


def selection_for(strategy, ratio: float | str | None = None) -> Selection:
    """What ``strategy`` (settings from :mod:`.strategies`, or already a :class:`Selection`) runs,
    at ``ratio`` (None: the strategy's own). Reads the strategy's fields only, so the plan of a
    call (:mod:`ragblend.core.plan`) is made without calling back into the strategy."""
    if isinstance(strategy, Selection):
        return strategy
    ratio = getattr(strategy, "ratio", None) if ratio is None else ratio
    if strategy.name == "full_recompute":
        return EveryToken()
    if strategy.name == "full_reuse":
        return UncachedTokens()
    if strategy.name == "legolink":
        return UncachedTokens(head=strategy.k)
    if strategy.name == "cacheblend":
        if ratio == "auto":
            raise InvalidInputError("CacheBlend(ratio='auto') is resolved by the engine; run it through "
                                    "BlendEngine.prefill, or pass a number.")
        return TopScoreSelection(cacheblend_schedule(strategy, ratio), strategy.deviation)
    if strategy.name == "query_aware":
        if ratio is None:
            raise InvalidInputError("QueryAware(ratio=None) takes the engine's ratio; run it through "
                                    "BlendEngine.prefill, or pass a number.")
        return QuestionAttention(ratio, strategy.whole_chunks, strategy.query_tokens, strategy.cached_attention_scale,
                                 strategy.neighbour_window, strategy.sentence_runs, strategy.per_chunk)
    raise InvalidInputError(f"Unknown strategy {strategy!r}: use CacheBlend(), QueryAware(), LegoLink(k), "
                            "FullReuse() or FullRecompute().")
