"""Selection strategies and the layer-wise fused prefill.

The fused prefill walks the layers once. At each layer only the *selected* tokens run
through Q/K/V, attention and the MLP; every other token's K/V for that layer comes from its
chunk's cache, rotated to its position in this prompt. Which tokens are selected is the
strategy's business:

* :class:`FullRecompute` — every token, every layer: a normal prefill.
* :class:`FullReuse` — only tokens without a cache (template, question, unknown text).
* :class:`LegoLink` — those, plus the first ``k`` tokens of every chunk but the first (Epic).
* :class:`CacheBlend` — every token up to the check layer; there, the reused tokens whose
  fresh V (or K) deviates most from the cached one are kept (top ``ratio``), the rest drop out.

Attention uses an exact causal mask: a selected token at position p sees keys at
positions <= p, whether those keys are fresh or cached, and nothing after p.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .errors import InvalidInputError
from .model import ModelAdapter

# ---------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class FullRecompute:
    """Recompute every token at every layer (a normal prefill; the quality reference)."""

    name = "full_recompute"


@dataclass(frozen=True)
class FullReuse:
    """Reuse every cached chunk as is; recompute only tokens that have no cache."""

    name = "full_reuse"


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


DEVIATIONS = ("key", "value", "key_value")


def _check_ratio(ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise InvalidInputError(f"ratio must be a number in (0, 1], got {ratio!r}.")


Strategy = FullRecompute | FullReuse | LegoLink | CacheBlend


def check_strategy(strategy, num_layers: int) -> Strategy:
    if not isinstance(strategy, (FullRecompute, FullReuse, LegoLink, CacheBlend)):
        raise InvalidInputError(
            f"Unknown strategy {strategy!r}: use CacheBlend(), LegoLink(k), FullReuse() or FullRecompute().")
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
class FusedPrefill:
    """Result of :func:`fused_prefill`."""

    logits: torch.Tensor                      # [vocab], next-token logits after the prompt
    keys: list[torch.Tensor]                  # per layer [kv_heads, N, head_dim], after RoPE
    values: list[torch.Tensor]                # per layer [kv_heads, N, head_dim]
    recomputed: torch.Tensor                  # bool [N]: tokens whose last-layer K/V was recomputed
    compute_s: float = 0.0
    layer_selected: list[int] = field(default_factory=list)  # tokens computed at each layer


# ---------------------------------------------------------------------------- the fused prefill


def initial_selection(strategy: Strategy, num_tokens: int, spans: list[ReusedSpan]) -> torch.Tensor:
    """Boolean mask of the tokens computed from layer 0 on."""
    if isinstance(strategy, (FullRecompute, CacheBlend)) or not spans:
        return torch.ones(num_tokens, dtype=torch.bool)
    selected = torch.ones(num_tokens, dtype=torch.bool)
    for span in spans:
        selected[span.start:span.start + span.num_tokens] = False
    if isinstance(strategy, LegoLink):
        for span in spans[1:]:
            selected[span.start:span.start + min(strategy.k, span.num_tokens)] = True
    selected[-1] = True  # the last token always runs: its hidden state gives the logits
    return selected


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
                   dtype: torch.dtype, rows_per_group: int = 64) -> list[_QueryGroup]:
    """Split the selected queries (sorted by position) into groups that each attend only to
    the keys up to the group's last position.

    A masked SDPA computes every query-key pair, so one big masked call costs about twice
    the causal work; groups recover most of the causal saving. Masks are additive floats,
    built once per selection rather than converted from booleans in every layer.
    """
    n = query_pos.numel()
    if n == num_keys and (window is None or n <= window):
        return [_QueryGroup(slice(0, n), slice(0, n), None)]
    groups = []
    for start in range(0, n, rows_per_group):
        rows = slice(start, min(n, start + rows_per_group))
        pos = query_pos[rows]
        first = 0 if window is None else max(0, int(pos[0]) - window + 1)
        keys = slice(first, int(pos[-1]) + 1)
        allowed = _causal_mask(pos, num_keys, window)[:, keys]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
        mask.masked_fill_(~allowed, float("-inf"))
        groups.append(_QueryGroup(rows, keys, mask))
    return groups


def _attend(adapter: ModelAdapter, q, k, v, plan: list[_QueryGroup]) -> torch.Tensor:
    if len(plan) == 1 and plan[0].mask is None:
        return adapter.attention(q, k, v, None)
    return torch.cat([adapter.attention(q[:, g.rows], k[:, g.keys], v[:, g.keys], g.mask) for g in plan])


def _keep_top_deviation(deviation: torch.Tensor, candidates: torch.Tensor, keep: int) -> torch.Tensor:
    """Positions of the ``keep`` candidates with the largest deviation."""
    if keep >= candidates.numel():
        return candidates
    top = torch.topk(deviation, keep, sorted=False).indices
    return candidates[top]


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


@torch.inference_mode()
def fused_prefill(adapter: ModelAdapter, token_ids: list[int], spans: list[ReusedSpan],
                  source: LayerSource | None, strategy: Strategy) -> FusedPrefill:
    """Prefill ``token_ids`` reusing cached KV for ``spans`` as ``strategy`` says.

    With no spans (or :class:`FullRecompute`) this is an ordinary causal prefill.
    """
    t0 = time.perf_counter()
    device = adapter.device
    n = len(token_ids)
    ids = torch.tensor(token_ids, device=device)
    if isinstance(strategy, FullRecompute):
        spans = []
    reused = torch.zeros(n, dtype=torch.bool)
    for span in spans:
        reused[span.start:span.start + span.num_tokens] = True
    reused_pos = reused.nonzero().squeeze(1).to(device)
    num_reused = reused_pos.numel()
    schedule = strategy.schedule() if isinstance(strategy, CacheBlend) and num_reused else {}

    selected = initial_selection(strategy, n, spans).to(device)
    sel_pos = selected.nonzero().squeeze(1)
    if num_reused:
        first = min(schedule) if schedule else (0 if sel_pos.numel() < n else adapter.shape.num_layers)
        source.prepare(list(range(first, adapter.shape.num_layers)))
    cos, sin = adapter.rope_tables(n)
    hidden = adapter.embed(ids[sel_pos])
    shape = adapter.shape
    keys, values, layer_selected = [], [], []
    plans: dict[int | None, list[_QueryGroup]] = {}
    load_wait = 0.0

    last_layer = shape.num_layers - 1
    for layer in range(shape.num_layers):
        x = adapter.attn_input(layer, hidden)
        k_raw, v = adapter.kv(layer, x)
        k = adapter.rope(k_raw, cos[sel_pos], sin[sel_pos])
        all_selected = sel_pos.numel() == n
        if num_reused and (not all_selected or layer in schedule):
            t_wait = time.perf_counter()
            cached = source.layer(layer)
            load_wait += time.perf_counter() - t_wait
        if all_selected:
            layer_k, layer_v = k, v  # every token is fresh at this layer
        else:
            # Cached K/V go in span by span (K rotated to where the chunk now sits), then
            # the fresh K/V of the selected tokens overwrite their positions.
            layer_k = torch.empty(shape.num_kv_heads, n, shape.head_dim, dtype=k.dtype, device=device)
            layer_v = torch.empty_like(layer_k)
            for span, (cached_k, cached_v) in zip(spans, cached):
                where = slice(span.start, span.start + span.num_tokens)
                layer_k[:, where] = adapter.rope(cached_k.to(k.dtype), cos[where], sin[where])
                layer_v[:, where] = cached_v
            layer_k[:, sel_pos], layer_v[:, sel_pos] = k, v
        keys.append(layer_k)
        values.append(layer_v)
        layer_selected.append(sel_pos.numel())
        final_pos = sel_pos  # tokens whose K/V this layer computed fresh

        if layer in schedule:
            # Score the selected reused tokens by how far their fresh K/V are from the cached ones.
            cand = reused[sel_pos.cpu()].to(device)
            cand_pos = sel_pos[cand]
            reused_rank = torch.searchsorted(reused_pos, cand_pos)
            deviation = kv_deviation(strategy.deviation, k_raw[:, cand], v[:, cand], cached, reused_rank)
            keep = math.ceil(schedule[layer] * num_reused - 1e-9)
            kept = _keep_top_deviation(deviation, cand_pos, keep)
            new_selected = ~reused.to(device)
            new_selected[kept] = True
            new_selected[-1] = True
            rows = new_selected[sel_pos]  # which of the current rows stay
            sel_pos, x, hidden = sel_pos[rows], x[rows], hidden[rows]
            plans.clear()  # the selection changed

        if layer == last_layer:
            # Only the last token's output is used (for the logits); every selected token's
            # K/V of this layer is already in the cache above.
            sel_pos, x, hidden = sel_pos[-1:], x[-1:], hidden[-1:]
            plans.clear()

        window = adapter.window(layer)
        if window not in plans:
            plans[window] = attention_plan(sel_pos, n, window, x.dtype)
        q = adapter.rope(adapter.q(layer, x), cos[sel_pos], sin[sel_pos])
        attn = _attend(adapter, q, layer_k, layer_v, plans[window])
        hidden = adapter.finish(layer, hidden, attn)

    logits = adapter.logits(hidden[-1:])[0]
    recomputed = torch.zeros(n, dtype=torch.bool)
    recomputed[final_pos.cpu()] = True
    return FusedPrefill(
        logits=logits.float(), keys=keys, values=values, recomputed=recomputed,
        compute_s=time.perf_counter() - t0 - load_wait, layer_selected=layer_selected,
    )


@torch.inference_mode()
def isolated_kv(adapter: ModelAdapter, sink_ids: list[int], chunk_ids: list[int]):
    """K (before RoPE) and V of ``chunk_ids`` computed alone after ``sink_ids``.

    Returns ``(keys, values)`` each ``[layers, kv_heads, len(chunk_ids), head_dim]``; the
    sink's own K/V are dropped.
    """
    ids = torch.tensor(list(sink_ids) + list(chunk_ids), device=adapter.device)
    start, n = len(sink_ids), ids.numel()
    cos, sin = adapter.rope_tables(n)
    hidden = adapter.embed(ids)
    keys, values = [], []
    for layer in range(adapter.shape.num_layers):
        x = adapter.attn_input(layer, hidden)
        q, (k, v) = adapter.q(layer, x), adapter.kv(layer, x)
        keys.append(k[:, start:])
        values.append(v[:, start:])
        if layer == adapter.shape.num_layers - 1:
            break  # the last layer's output is not needed, only its K/V
        plan = attention_plan(torch.arange(n, device=ids.device), n, adapter.window(layer), q.dtype)
        attn = _attend(adapter, adapter.rope(q, cos, sin), adapter.rope(k, cos, sin), v, plan)
        hidden = adapter.finish(layer, hidden, attn)
    return torch.stack(keys), torch.stack(values)
