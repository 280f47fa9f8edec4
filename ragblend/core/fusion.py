"""Selection strategies and the layer-wise fused prefill.

The fused prefill walks the layers once. At each layer only the *selected* tokens run
through Q/K/V, attention and the MLP; every other token's K/V for that layer comes from its
chunk's cache, rotated to its position in this prompt. Which tokens are selected is decided
by a :class:`Selection`, which each strategy provides:

* :class:`FullRecompute` — every token, every layer: a normal prefill.
* :class:`FullReuse` — only tokens without a cache (template, question, unknown text).
* :class:`LegoLink` — those, plus the first ``k`` tokens of every chunk but the first (Epic).
* :class:`CacheBlend` — every token up to the check layer; there, the reused tokens whose
  fresh V (or K) deviates most from the cached one are kept (top ``ratio``), the rest drop out.
* :class:`QueryAware` — two stages (ProphetKV, QCFuse): first the question alone reads the
  cached chunks through every layer, and the reused tokens it attends to most are chosen;
  then those tokens, and every token without a cache, are computed from layer 0 on.

Attention uses an exact causal mask: a selected token at position p sees keys at
positions <= p, whether those keys are fresh or cached, and nothing after p.

Reading :func:`fused_prefill` top to bottom: lay out the prompt, let the selection choose
the first tokens, then per layer: assemble K/V (fresh for the selected tokens, cached for
the rest), let the selection refine at its check layers, attention, MLP.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import InvalidInputError, RagblendError
from .model import ModelAdapter, RopeTables

# ---------------------------------------------------------------------------- cancellation


class Cancelled(RagblendError):
    """The computation was stopped by its caller's ``should_stop`` (see :func:`cancellable`)."""


_cancel = threading.local()


@contextlib.contextmanager
def cancellable(should_stop: Callable[[], bool]):
    """Within this block, on this thread, every model pass (fused prefill, chunk precompute,
    decoding step) calls ``should_stop()`` before each layer or step and raises
    :class:`Cancelled` once it returns true. A server uses it to stop the work of a client
    that left or timed out; a thread-local, so the engine's signatures stay as they are."""
    previous = getattr(_cancel, "should_stop", None)
    _cancel.should_stop = should_stop
    try:
        yield
    finally:
        _cancel.should_stop = previous


def check_cancelled() -> None:
    """Raise :class:`Cancelled` if this thread's :func:`cancellable` caller asks to stop."""
    should_stop = getattr(_cancel, "should_stop", None)
    if should_stop is not None and should_stop():
        raise Cancelled("The computation was cancelled by its caller.")

# ---------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class FullRecompute:
    """Recompute every token at every layer (a normal prefill; the quality reference)."""

    name = "full_recompute"

    def selection(self) -> "Selection":
        return EveryToken()


@dataclass(frozen=True)
class FullReuse:
    """Reuse every cached chunk as is; recompute only tokens that have no cache."""

    name = "full_reuse"

    def selection(self) -> "Selection":
        return UncachedTokens()


@dataclass(frozen=True)
class LegoLink:
    """Recompute the first ``k`` tokens of every chunk except the first one (Epic/LegoLink).

    Those tokens were computed as the start of a sequence and soak up attention
    ("attention sink"); recomputing them in context removes most of that distortion.
    """

    k: int = 16
    name = "legolink"

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise InvalidInputError(f"LegoLink k must be an integer >= 0, got {self.k!r}.")

    def selection(self) -> "Selection":
        return UncachedTokens(head=self.k)


@dataclass(frozen=True)
class CacheBlend:
    """Selective recompute of the reused tokens with the highest KV deviation (CacheBlend).

    Layers before ``check_layer`` run over all tokens. At ``check_layer`` every reused token
    is scored by how far its fresh K/V are from the cached ones (``deviation``, see
    :func:`kv_deviation`); the top ``ratio`` of reused tokens, plus every token that was not
    reused, continue through the later layers. ``gradual`` optionally adds later check layers as
    ``((layer, ratio), ...)`` that rescore the still-selected tokens and shrink the set
    (the paper's gradual filtering); ratios are fractions of all reused tokens.

    ``deviation="value"`` (the default) is the paper's score; ``"key"`` scores K before RoPE
    and ``"key_value"`` the sum of both. ``benchmarks/selection.py`` compares them at equal
    compute (``docs/benchmarks.md``): K lowers the mean first-token KL a little on both
    benchmark models but changed more demo answers, so V stays the default.

    ``ratio=1.0`` recomputes everything and equals :class:`FullRecompute`. ``ratio="auto"``
    lets the engine's loading controller pick it (:meth:`BlendEngine.plan`): the larger of
    the quality floor (0.15) and the ratio whose recompute time equals the KV load time.
    """

    ratio: float | str = 0.15
    check_layer: int = 1
    gradual: tuple[tuple[int, float], ...] = ()
    deviation: str = "value"
    name = "cacheblend"

    def __post_init__(self):
        if self.ratio != "auto":
            _check_ratio(self.ratio)
        if self.deviation not in DEVIATIONS:
            raise InvalidInputError(f"CacheBlend deviation must be one of {DEVIATIONS}, got {self.deviation!r}.")
        if isinstance(self.check_layer, bool) or not isinstance(self.check_layer, int) or self.check_layer < 1:
            raise InvalidInputError(f"CacheBlend check_layer must be an integer >= 1, got {self.check_layer!r}.")
        gradual = tuple((int(layer), float(r)) for layer, r in self.gradual)
        object.__setattr__(self, "gradual", gradual)
        previous_layer, previous_ratio = self.check_layer, (1.0 if self.ratio == "auto" else self.ratio)
        for layer, r in gradual:
            _check_ratio(r)
            if layer <= previous_layer or r > previous_ratio:
                raise InvalidInputError(
                    "CacheBlend gradual steps must come at increasing layers after check_layer with "
                    f"non-increasing ratios, got {gradual!r} after ({self.check_layer}, {self.ratio}).")
            previous_layer, previous_ratio = layer, r

    def schedule(self) -> dict[int, float]:
        """Check layers and the fraction of reused tokens kept after each."""
        return {self.check_layer: self.ratio, **dict(self.gradual)}

    def selection(self) -> "Selection":
        if self.ratio == "auto":
            raise InvalidInputError("CacheBlend(ratio='auto') is resolved by the engine; run it through "
                                    "BlendEngine.prefill, or pass a number.")
        return TopScoreSelection(self.schedule(), self.deviation)


@dataclass(frozen=True)
class QueryAware:
    """Recompute the reused tokens the question attends to most (ProphetKV, QCFuse).

    Two stages. First the tokens without a cache (the question, the template) run through
    every layer over the cached chunks as they are, and each reused token is scored by the
    attention the question pays it, summed over layers. Then those tokens and the top
    ``ratio`` of reused tokens are computed from layer 0 on, the rest reused. Unlike
    :class:`CacheBlend`, no layer runs over every token. ``whole_chunks=True`` spends the
    budget on whole chunks first (the most attended ones that fit), then on single tokens.

    ``query_tokens``: whose attention counts: every token after the last chunk (None, the
    question and the template's cue to answer) or only the prompt's last ``query_tokens``
    tokens. The last 4 chose better on SQuAD and MuSiQue, the whole question on the long
    fidelity prompts, where only it stayed within Qwen2.5's order noise
    (``docs/benchmarks.md``).

    ``cached_attention_scale`` (APE's scaling factor): every attention weight on a reused
    token that is not recomputed is multiplied by it before the softmax normalises, in the
    fused prefill and in decoding after it. A chunk computed alone, without the chunks before
    it, draws more attention than it would in context; scaling it down brings the fused
    prefill closer to a full prefill. At equal compute 0.7 lowered the mean KL to full prefill
    on the fidelity prompts and SQuAD of both benchmark models, where 0.5 helped Qwen2.5's long
    prompts more but hurt both models' SQuAD prompts (``docs/benchmarks.md``). 1.0 leaves
    attention as it is.

    ``ratio=None`` takes the engine's own ratio (its calibration's, else the safe default)
    when :meth:`BlendEngine.prefill` runs it: what ``strategy="query_aware"`` without a ratio
    means in the integrations and the CLI.
    """

    ratio: float | None = 0.15
    whole_chunks: bool = False
    query_tokens: int | None = None
    cached_attention_scale: float = 0.7
    name = "query_aware"

    def __post_init__(self):
        if self.ratio is not None:
            _check_ratio(self.ratio)
        scale = self.cached_attention_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise InvalidInputError(f"QueryAware cached_attention_scale must be a number in (0, 1], got {scale!r}.")
        if self.query_tokens is not None and (isinstance(self.query_tokens, bool) or not isinstance(
                self.query_tokens, int) or self.query_tokens < 1):
            raise InvalidInputError(f"QueryAware query_tokens must be an integer >= 1 or None, got {self.query_tokens!r}.")

    def selection(self) -> "Selection":
        if self.ratio is None:
            raise InvalidInputError("QueryAware(ratio=None) takes the engine's ratio; run it through "
                                    "BlendEngine.prefill, or pass a number.")
        return QuestionAttention(self.ratio, self.whole_chunks, self.query_tokens, self.cached_attention_scale)


DEVIATIONS = ("key", "value", "key_value")


def _check_ratio(ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise InvalidInputError(f"ratio must be a number in (0, 1], got {ratio!r}.")


Strategy = FullRecompute | FullReuse | LegoLink | CacheBlend | QueryAware
STRATEGIES = (FullRecompute, FullReuse, LegoLink, CacheBlend, QueryAware)
STRATEGY_NAMES = ("default", *(cls.name for cls in STRATEGIES))


def strategy_from_name(name: str, ratio: float | str | None = None, legolink_k: int = 16) -> Strategy | None:
    """A strategy from its ``name`` (each class's ``name``), as configuration files and the CLI
    give it. ``"default"`` is None, the engine's own (calibrated) choice, unless a ``ratio``
    is given: then it is :class:`QueryAware` at that ratio. ``ratio=None`` keeps CacheBlend's
    default ratio and gives QueryAware the engine's own."""
    takes_no_ratio = {cls.name for cls in STRATEGIES if cls not in (QueryAware, CacheBlend)}
    if ratio is not None and name in takes_no_ratio:
        raise InvalidInputError(f"Strategy {name!r} takes no ratio (it recomputes a fixed set of tokens); "
                                f"drop the ratio, or use 'query_aware' or 'cacheblend' with it.")
    if ratio == "auto" and name != CacheBlend.name:
        raise InvalidInputError(f"ratio 'auto' is CacheBlend's (the loading controller picks it); use strategy "
                                f"'cacheblend' with it, or give {name!r} a number in (0, 1].")
    if name == "default":
        return None if ratio is None else QueryAware(ratio)
    for cls in STRATEGIES:
        if cls.name == name:
            if cls is LegoLink:
                return LegoLink(legolink_k)
            if cls is QueryAware:   # without a ratio: the engine's own (calibrated or safe) one
                return QueryAware(ratio)
            return CacheBlend(ratio=ratio) if cls is CacheBlend and ratio is not None else cls()
    raise InvalidInputError(f"Unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}.")


def check_strategy(strategy, num_layers: int) -> Strategy:
    if not isinstance(strategy, (*STRATEGIES, Selection)):
        raise InvalidInputError(
            f"Unknown strategy {strategy!r}: use CacheBlend(), QueryAware(), LegoLink(k), FullReuse() "
            "or FullRecompute().")
    if isinstance(strategy, CacheBlend) and max(strategy.schedule()) >= num_layers:
        raise InvalidInputError(
            f"CacheBlend check layers {sorted(strategy.schedule())} must be below the model's "
            f"{num_layers} layers.")
    return strategy


# ---------------------------------------------------------------------------- inputs / outputs


@dataclass
class ReusedSpan:
    """A run of prompt positions ``[start, start + num_tokens)`` whose KV comes from a cache."""

    start: int
    num_tokens: int
    offset: int = 0  # where the run starts inside its cached chunk


class LayerSource:
    """Gives the cached K/V of one layer for every reused span, in prompt order.

    ``layer(i)`` returns a list with one ``(K, V)`` per span, each ``[kv_heads, tokens,
    head_dim]`` on the compute device (any float dtype), K before RoPE.
    :mod:`ragblend.core.pipeline` provides implementations (sequential and prefetching).
    """

    load_s: float = 0.0

    def prepare(self, layers: list[int]) -> None:
        """Announce the layers that will be asked for, in order (lets a source read ahead)."""

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError


@dataclass
class FusionPrompt:
    """The prompt as the selection sees it: which positions are reused, in which chunk."""

    num_tokens: int
    spans: list[ReusedSpan]
    reused: torch.Tensor        # bool [N] (on the CPU)
    reused_pos: torch.Tensor    # positions of the reused tokens, in prompt order (compute device)
    chunk_of: torch.Tensor      # for each reused token, the index of its span (compute device)

    @classmethod
    def build(cls, num_tokens: int, spans: list[ReusedSpan], device) -> "FusionPrompt":
        reused = torch.zeros(num_tokens, dtype=torch.bool)
        for span in spans:
            reused[span.start:span.start + span.num_tokens] = True
        sizes = torch.tensor([s.num_tokens for s in spans], dtype=torch.long)
        chunk_of = torch.repeat_interleave(torch.arange(len(spans)), sizes)
        return cls(num_tokens, spans, reused, reused.nonzero().squeeze(1).to(device), chunk_of.to(device))

    @property
    def num_reused(self) -> int:
        return self.reused_pos.numel()

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


@dataclass
class FusedPrefill:
    """Result of :func:`fused_prefill`."""

    logits: torch.Tensor                      # [vocab], next-token logits after the prompt
    keys: list[torch.Tensor]                  # per layer [kv_heads, N, head_dim], after RoPE
    values: list[torch.Tensor]                # per layer [kv_heads, N, head_dim]
    recomputed: torch.Tensor                  # bool [N]: tokens whose last-layer K/V was recomputed
    compute_s: float = 0.0
    layer_positions: list[torch.Tensor] = field(default_factory=list)  # positions computed at each layer
    probe_token_layers: int = 0               # token-layers spent choosing (QueryAware's first stage)
    load_wait_s: float = 0.0                  # time spent waiting for cached layers
    key_bias: torch.Tensor | None = None      # float [N] added to attention scores on each key (decoding too), or None

    @property
    def layer_selected(self) -> list[int]:
        """How many tokens were computed at each layer."""
        return [p.numel() for p in self.layer_positions]

    @property
    def token_layers(self) -> int:
        """All token-layers computed, choosing included (a full prefill computes N x layers)."""
        return sum(self.layer_selected) + self.probe_token_layers


# ---------------------------------------------------------------------------- selections


Probe = Callable[[], torch.Tensor]   # stage one of QueryAware: [layers, reused tokens] relevance


class Selection:
    """Decides which tokens a fused prefill computes at each layer.

    :meth:`first` gives the tokens computed from layer 0 on. At each layer of
    ``check_layers``, once that layer's fresh K/V are known, :meth:`refine` may narrow the
    set (never widen it: a token dropped once has no hidden state to continue from).
    A selection is also accepted wherever a strategy is, so benchmarks can try their own.

    ``cached_attention_scale``: the factor on every attention weight paid to the reused tokens
    that :meth:`first` leaves out (they keep their cached K/V at every layer); see
    :class:`QueryAware`.
    """

    name = "selection"
    check_layers: frozenset[int] = frozenset()
    cached_attention_scale: float = 1.0

    def selection(self) -> "Selection":
        return self

    def first(self, prompt: FusionPrompt, probe: Probe) -> torch.Tensor:
        """Bool [N]: the tokens computed from layer 0. ``probe()`` runs the question
        alone over the cached chunks and returns each reused token's relevance at each layer,
        ``[layers, reused tokens]``, every layer summing to 1 (costly: call it only when needed)."""
        raise NotImplementedError

    def refine(self, prompt: FusionPrompt, step: CheckStep) -> torch.Tensor:
        """Bool [N]: the tokens that go on after ``step.layer`` (a subset of ``step.positions``)."""
        raise NotImplementedError


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


class QuestionAttention(Selection):
    """QueryAware's selection: computed from layer 0 are the tokens without a cache and the
    reused tokens the question attends to most (``ratio`` of the reused tokens).

    With ``whole_chunks``, chunks are taken whole in order of the question's total attention
    while they fit the budget; what remains of it goes to the most attended single tokens.
    ``query_tokens``: the last so many prompt tokens are the question whose attention counts
    (None: every token after the last chunk).
    """

    name = "query_aware"

    def __init__(self, ratio: float, whole_chunks: bool = False, query_tokens: int | None = None,
                 cached_attention_scale: float = 1.0):
        self.ratio, self.whole_chunks, self.query_tokens = ratio, whole_chunks, query_tokens
        self.cached_attention_scale = cached_attention_scale

    def first(self, prompt, probe):
        budget = math.ceil(self.ratio * prompt.num_reused - 1e-9)
        if budget == 0:
            return prompt.with_reused(prompt.reused_pos[:0])
        relevance = probe().sum(dim=0)
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


# ---------------------------------------------------------------------------- attention


def _causal_mask(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Exact causal mask ``[queries, keys]``: key position <= query position (and in the window)."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


@dataclass
class _QueryGroup:
    rows: slice                  # rows of the selected queries
    keys: slice                  # keys this group can see at all
    mask: torch.Tensor | None    # additive mask [rows, keys], or None for plain causal


def attention_plan(query_pos: torch.Tensor, num_keys: int, window: int | None,
                   dtype: torch.dtype, rows_per_group: int = 64,
                   key_bias: torch.Tensor | None = None) -> list[_QueryGroup]:
    """Split the selected queries (sorted by position) into groups that each attend only to
    the keys up to the group's last position.

    A masked SDPA computes every query-key pair, so one big masked call costs about twice
    the causal work; groups recover most of the causal saving. Masks are additive floats,
    built once per selection rather than converted from booleans in every layer.
    ``key_bias`` (float ``[num_keys]``) is added to every query's score on each key.
    """
    n = query_pos.numel()
    if n == num_keys and (window is None or n <= window) and key_bias is None:
        return [_QueryGroup(slice(0, n), slice(0, n), None)]
    groups = []
    for start in range(0, n, rows_per_group):
        rows = slice(start, min(n, start + rows_per_group))
        pos = query_pos[rows]
        first = 0 if window is None else max(0, int(pos[0]) - window + 1)
        keys = slice(first, int(pos[-1]) + 1)
        allowed = _causal_mask(pos, num_keys, window)[:, keys]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
        if key_bias is not None:
            mask += key_bias[keys].to(dtype)
        mask.masked_fill_(~allowed, float("-inf"))
        groups.append(_QueryGroup(rows, keys, mask))
    return groups


def _attend(adapter: ModelAdapter, q, k, v, plan: list[_QueryGroup]) -> torch.Tensor:
    if len(plan) == 1 and plan[0].mask is None:
        return adapter.attention(q, k, v, None)
    return torch.cat([adapter.attention(q[:, g.rows], k[:, g.keys], v[:, g.keys], g.mask) for g in plan])


def attention_weights(adapter: ModelAdapter, q: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor,
                      window: int | None) -> torch.Tensor:
    """Softmax attention ``[heads, queries, keys]`` of (rotated) ``q`` over (rotated) ``keys``."""
    heads, n, dim = q.shape
    kv_heads = keys.shape[0]
    # The query heads that share a K/V head go through one matmul (no repeated keys).
    grouped = q.reshape(kv_heads, heads // kv_heads * n, dim)
    scores = (grouped @ keys.to(q.dtype).transpose(1, 2)).float().view(heads, n, -1) * adapter.scaling
    scores.masked_fill_(~_causal_mask(query_pos, keys.shape[1], window), float("-inf"))
    return torch.softmax(scores, dim=-1)


# ---------------------------------------------------------------------------- the fused prefill


class _KeptLayers(LayerSource):
    """Remembers every layer read from ``source``, so a second walk does not read again."""

    def __init__(self, source: LayerSource):
        self.source, self.kept = source, {}

    def prepare(self, layers):
        self.source.prepare([i for i in layers if i not in self.kept])

    def layer(self, index):
        if index not in self.kept:
            self.kept[index] = self.source.layer(index)
        return self.kept[index]


@torch.inference_mode()
def fused_prefill(adapter: ModelAdapter, token_ids: list[int], spans: list[ReusedSpan],
                  source: LayerSource | None, strategy) -> FusedPrefill:
    """Prefill ``token_ids`` reusing cached KV for ``spans`` as ``strategy`` (or a
    :class:`Selection`) says. With no spans (or :class:`FullRecompute`) this is an
    ordinary causal prefill."""
    t0 = time.perf_counter()
    selection = strategy.selection()
    if isinstance(selection, EveryToken):
        spans = []
    prompt = FusionPrompt.build(len(token_ids), spans, adapter.device)
    ids = torch.tensor(token_ids, device=adapter.device)
    rope = adapter.rope_tables(prompt.num_tokens)
    layers = _KeptLayers(source) if prompt.num_reused else None
    probe_runs = []

    def probe() -> torch.Tensor:
        # Stage one: the question reads the cached chunks as they are (FullReuse), and its
        # attention to each reused token, summed over layers, says what matters to it.
        relevance = torch.zeros(adapter.shape.num_layers, prompt.num_reused, device=adapter.device)
        query_tokens = getattr(selection, "query_tokens", None)
        start = prompt.question_start if query_tokens is None else max(0, prompt.num_tokens - query_tokens)
        run = _walk(adapter, ids, prompt, layers, UncachedTokens().first(prompt, probe), frozenset(),
                    None, rope, observe=_question_attention(adapter, prompt, relevance, start))
        probe_runs.append(run)
        return relevance

    selected = selection.first(prompt, probe) if prompt.num_reused else torch.ones(
        prompt.num_tokens, dtype=torch.bool, device=adapter.device)
    # The question pass already placed every cached K/V: the second pass writes over it
    # (when it recomputes every token the question pass computed, as QueryAware does).
    earlier = probe_runs[0] if probe_runs and bool(selected[probe_runs[0].layer_positions[0]].all()) else None
    key_bias = _cached_key_bias(prompt, selected, selection.cached_attention_scale)
    fused = _walk(adapter, ids, prompt, layers, selected, selection.check_layers if prompt.num_reused else (),
                  selection, rope, earlier=earlier, key_bias=key_bias)
    fused.key_bias = key_bias
    fused.probe_token_layers = sum(run.token_layers for run in probe_runs)
    fused.load_wait_s += sum(run.load_wait_s for run in probe_runs)
    fused.compute_s = time.perf_counter() - t0 - fused.load_wait_s
    return fused


def _cached_key_bias(prompt: FusionPrompt, selected: torch.Tensor, scale: float) -> torch.Tensor | None:
    """APE's scaling as a score bias: ``log(scale)`` on every reused token left out of
    ``selected`` (its K/V stay cached at every layer), 0 elsewhere; None when scale is 1 or
    nothing is left out (attention then keeps its plain causal path)."""
    if scale == 1.0 or not prompt.num_reused:
        return None
    left_out = prompt.reused.to(selected.device) & ~selected
    if not left_out.any():
        return None
    return left_out.float() * math.log(scale)   # float32; cast where the masks are built


def _question_attention(adapter: ModelAdapter, prompt: FusionPrompt, relevance: torch.Tensor, start: int):
    """An observer for :func:`_walk` that writes, at every layer, the attention of the tokens
    from position ``start`` on (the question) to each reused token into ``relevance[layer]``
    (mean over heads and question tokens, normalised to sum 1)."""

    def observe(layer: int, q: torch.Tensor, layer_k: torch.Tensor, positions: torch.Tensor) -> None:
        rows = positions >= start
        if not rows.any():
            return
        weights = attention_weights(adapter, q[:, rows], layer_k, positions[rows], adapter.window(layer))
        on_reused = weights.mean(dim=(0, 1))[prompt.reused_pos]
        relevance[layer] = on_reused / on_reused.sum().clamp_min(1e-12)

    return observe


def _walk(adapter: ModelAdapter, ids: torch.Tensor, prompt: FusionPrompt, layers: LayerSource | None,
          selected: torch.Tensor, check_layers, selection: Selection | None, rope: RopeTables,
          observe=None, earlier: FusedPrefill | None = None, key_bias: torch.Tensor | None = None) -> FusedPrefill:
    """One pass over the layers, computing the ``selected`` tokens (narrowed at check layers).

    ``earlier``: a previous pass over the same prompt whose K/V may be taken over (and
    overwritten): its cached positions are already placed and rotated, and every position
    it computed fresh is selected again here. ``key_bias``: added to every score on each key."""
    n, shape, device = prompt.num_tokens, adapter.shape, adapter.device
    sel_pos = selected.nonzero().squeeze(1)
    if prompt.num_reused:
        first = min(check_layers) if check_layers and sel_pos.numel() == n else 0
        layers.prepare(list(range(first, shape.num_layers)))
    hidden = adapter.embed(ids[sel_pos])
    keys, values, layer_positions = [], [], []
    plans: dict[int | None, list[_QueryGroup]] = {}
    load_wait = 0.0
    last_layer = shape.num_layers - 1
    for layer in range(shape.num_layers):
        check_cancelled()
        cos, sin = rope.layer(layer)   # each layer its own RoPE (Gemma 3: local and global bases differ)
        # 1. K/V of this layer: fresh for the selected tokens, cached (rotated) for the rest.
        x = adapter.attn_input(layer, hidden)
        k_raw, v = adapter.kv(layer, x)
        k = adapter.rope(k_raw, cos[sel_pos], sin[sel_pos])
        all_selected = sel_pos.numel() == n
        if prompt.num_reused and (not all_selected or layer in check_layers):
            t_wait = time.perf_counter()
            cached = layers.layer(layer)
            load_wait += time.perf_counter() - t_wait
        if all_selected:
            layer_k, layer_v = k, v
        elif earlier is not None:
            layer_k, layer_v = earlier.keys[layer], earlier.values[layer]
            layer_k[:, sel_pos], layer_v[:, sel_pos] = k, v
        else:
            layer_k = torch.empty(shape.num_kv_heads, n, shape.head_dim, dtype=k.dtype, device=device)
            layer_v = torch.empty_like(layer_k)
            for span, (cached_k, cached_v) in zip(prompt.spans, cached):
                where = slice(span.start, span.start + span.num_tokens)
                layer_k[:, where] = adapter.rope(cached_k.to(k.dtype), cos[where], sin[where])
                layer_v[:, where] = cached_v
            layer_k[:, sel_pos], layer_v[:, sel_pos] = k, v
        keys.append(layer_k)
        values.append(layer_v)
        layer_positions.append(sel_pos)

        # 2. Selection: at a check layer, the strategy narrows the tokens that go on.
        if layer in check_layers:
            step = CheckStep(layer, sel_pos, k_raw, v, cached)
            rows = selection.refine(prompt, step)[sel_pos]
            sel_pos, x, hidden = sel_pos[rows], x[rows], hidden[rows]
            plans.clear()
        if layer == last_layer:
            # Only the last token's output is used (for the logits); every selected token's
            # K/V of this layer is already in the cache above.
            sel_pos, x, hidden = sel_pos[-1:], x[-1:], hidden[-1:]
            plans.clear()

        # 3. Attention over the assembled K/V, then the MLP.
        window = adapter.window(layer)
        if window not in plans:
            plans[window] = attention_plan(sel_pos, n, window, x.dtype, key_bias=key_bias)
        q = adapter.rope(adapter.q(layer, x), cos[sel_pos], sin[sel_pos])
        if observe is not None:
            observe(layer, q, layer_k, sel_pos)
        attn = _attend(adapter, q, layer_k, layer_v, plans[window])
        hidden = adapter.finish(layer, hidden, attn)

    logits = adapter.logits(hidden[-1:])[0]
    recomputed = torch.zeros(n, dtype=torch.bool)
    recomputed[layer_positions[-1].cpu()] = True
    return FusedPrefill(logits=logits.float(), keys=keys, values=values, recomputed=recomputed,
                        layer_positions=layer_positions, load_wait_s=load_wait)


@torch.inference_mode()
def isolated_kv(adapter: ModelAdapter, sink_ids: list[int], chunk_ids: list[int]):
    """K (before RoPE) and V of ``chunk_ids`` computed alone after ``sink_ids``.

    Returns ``(keys, values)`` each ``[layers, kv_heads, len(chunk_ids), head_dim]``; the
    sink's own K/V are dropped.
    """
    ids = torch.tensor(list(sink_ids) + list(chunk_ids), device=adapter.device)
    start, n = len(sink_ids), ids.numel()
    rope = adapter.rope_tables(n)
    hidden = adapter.embed(ids)
    keys, values = [], []
    for layer in range(adapter.shape.num_layers):
        check_cancelled()
        cos, sin = rope.layer(layer)
        x = adapter.attn_input(layer, hidden)
        k, v = adapter.kv(layer, x)
        keys.append(k[:, start:])
        values.append(v[:, start:])
        if layer == adapter.shape.num_layers - 1:
            break  # the last layer's output is not needed, only its K/V
        q = adapter.q(layer, x)
        plan = attention_plan(torch.arange(n, device=ids.device), n, adapter.window(layer), q.dtype)
        attn = _attend(adapter, adapter.rope(q, cos, sin), adapter.rope(k, cos, sin), v, plan)
        hidden = adapter.finish(layer, hidden, attn)
    return torch.stack(keys), torch.stack(values)


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
    rope = rope.rows(positions)
    bounds = [(a, a + n) for a, n in zip(itertools.accumulate([0, *lengths[:-1]]), lengths)]
    masks = {n: _offset_causal_mask(n, s, device, adapter.dtype) for n in set(lengths)}   # after the sink
    hidden = adapter.embed(ids)
    keys, values = [], []
    for layer in range(adapter.shape.num_layers):
        check_cancelled()
        # 1. K/V of every chunk token at once; they are what is stored.
        cos, sin = rope.layer(layer)
        x = adapter.attn_input(layer, hidden)
        k, v = adapter.kv(layer, x)
        keys.append(k)
        values.append(v)
        if layer == adapter.shape.num_layers - 1:
            break
        # 2. Attention, chunk by chunk: each sees the sink and its own earlier tokens.
        q, k = adapter.rope(adapter.q(layer, x), cos, sin), adapter.rope(k, cos, sin)
        sink_k, sink_v = sink[layer]
        attn = torch.cat([adapter.attention(q[:, a:b], torch.cat([sink_k, k[:, a:b]], 1),
                                            torch.cat([sink_v, v[:, a:b]], 1), masks[b - a]) for a, b in bounds])
        # 3. Output projection and MLP, all tokens at once.
        hidden = adapter.finish(layer, hidden, attn)
    keys, values = torch.stack(keys), torch.stack(values)
    # Copies, not views: an entry must not keep its whole pack alive in the memory tier.
    return [(keys[:, :, a:b].clone(), values[:, :, a:b].clone()) for a, b in bounds]


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


def _offset_causal_mask(n: int, offset: int, device, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[n, offset + n]``: query i (at ``offset + i``) may see keys ``0 .. offset + i``."""
    allowed = torch.arange(offset + n, device=device)[None, :] <= torch.arange(offset, offset + n, device=device)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
