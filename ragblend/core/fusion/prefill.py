"""The fused prefill: one walk over the layers, computing only the selected tokens.

At each layer only the *selected* tokens run through Q/K/V, attention and the MLP; every
other token's K/V for that layer comes from its chunk's cache, rotated to its position in this
prompt. Which tokens are selected is decided by a :class:`~ragblend.core.fusion.selection.Selection`,
which each strategy (:mod:`ragblend.core.fusion.strategies`) provides.

Attention uses an exact causal mask: a selected token at position p sees keys at
positions <= p, whether those keys are fresh or cached, and nothing after p.

Reading :func:`fused_prefill` top to bottom: lay out the prompt, let the selection choose
the first tokens, then :func:`_walk` the layers: the one loop every pass shares
(:func:`~ragblend.core.model.layer_step.run_layers`) with this pass's hooks, :class:`FusedLayers`,
which read in the order each layer runs them: 1. :meth:`~FusedLayers.process_qkv` assembles
the layer's K/V (fresh for the selected tokens, cached for the rest; :func:`process_qkv`);
2. :meth:`~FusedLayers.narrow` is the selection step (the selection refines at its check
layers; the last layer goes on with the last token alone); 3. Q of the tokens that go on,
:meth:`~FusedLayers.attend` over the assembled K/V, and the MLP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..model.adapter import ModelAdapter, RopeTables
from ..model.layer_step import LayerPass, run_layers
from ..model.masks import QueryGroup, attend, attention_plan, attention_weights
from .selection import CheckStep, EveryToken, FusionPrompt, ReusedSpan, Selection, UncachedTokens, selection_for


class LayerSource:
    """Gives the cached K/V of one layer for every reused span, in prompt order.

    ``layer(i)`` returns a list with one ``(K, V)`` per span, each ``[kv_heads, tokens,
    head_dim]`` on the compute device (any float dtype), K before RoPE.
    :mod:`ragblend.core.fusion.pipeline` provides implementations (sequential and prefetching).
    """

    load_s: float = 0.0

    def prepare(self, layers: list[int]) -> None:
        """Announce the layers that will be asked for, in order (lets a source read ahead)."""

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def same_entry(self, before: int, span: int, between: list[int]) -> bool:
        """Whether spans ``before`` and ``span`` are parts of one cached entry (a history piece split
        around the template's control tokens) that holds exactly the tokens ``between`` between
        them, so that :meth:`stretch` can give them."""
        return False

    def stretch(self, index: int, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` of one entry from span ``first``'s start to span ``last``'s end, the
        tokens between its parts included (see :meth:`same_entry`), as :meth:`layer` gives a span's."""
        raise NotImplementedError


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

    def same_entry(self, before, span, between):
        return self.source.same_entry(before, span, between)

    def stretch(self, index, first, last):
        return self.source.stretch(index, first, last)


def _joined_pieces(spans: list[ReusedSpan], layers: LayerSource, token_ids: list[int]) -> list[list[int]]:
    """The spans grouped as the question pass reads them: the consecutive parts of one history piece
    in one group, where the prompt holds exactly the piece's tokens between them (the template's
    control tokens the piece was split around); every other span alone."""
    groups: list[list[int]] = []
    for i, span in enumerate(spans):
        before = spans[i - 1] if i else None
        end = before.start + before.num_tokens if before is not None else span.start
        between = span.start - end
        if (between > 0 and before.piece and span.piece
                and between == span.offset - (before.offset + before.num_tokens)
                and layers.same_entry(i - 1, i, list(token_ids[end:span.start]))):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class _JoinedPieces(LayerSource):
    """The question pass's view of ``layers``: each group of :func:`_joined_pieces` one span, the
    piece's own K/V from its first part's start to its last part's end (one read a layer)."""

    def __init__(self, layers: LayerSource, groups: list[list[int]]):
        self.layers, self.groups = layers, groups

    def prepare(self, layers):
        self.layers.prepare(layers)

    def layer(self, index):
        parts = self.layers.layer(index)
        return [parts[group[0]] if len(group) == 1 else self.layers.stretch(index, group[0], group[-1])
                for group in self.groups]


def _question_pass_prompt(prompt: FusionPrompt, layers: LayerSource,
                          token_ids: list[int]) -> tuple[FusionPrompt, LayerSource]:
    """The prompt and cached layers the question pass reads. Why the pieces joined: the template's
    control tokens between a conversation's history pieces (16 by turn 5) are otherwise computed
    in both passes, 0.07 s of the 0.18 s turn 5 added over turn 1 (docs/runs/conversation-epyc-s44.md).
    The question pass only ranks the reused tokens, so there they are read from the piece; the fused
    pass still computes them (reused there too, they moved the first token outside the order noise)."""
    groups = _joined_pieces(prompt.spans, layers, token_ids)
    if len(groups) == len(prompt.spans):
        return prompt, layers
    spans = [_one_span([prompt.spans[i] for i in group]) for group in groups]
    joined = FusionPrompt.build(prompt.num_tokens, spans, prompt.reused_pos.device)
    # The fused pass takes over this pass's K/V (fused_prefill's `earlier`) and writes its own over
    # every token it computes, the control tokens among them: none of the piece's K/V of them stays.
    return joined, _JoinedPieces(layers, groups)


def _one_span(parts: list[ReusedSpan]) -> ReusedSpan:
    """Consecutive parts of one entry as one span, the entry's tokens between them included."""
    first, last = parts[0], parts[-1]
    if len(parts) == 1:
        return first
    return ReusedSpan(first.start, last.start + last.num_tokens - first.start, first.offset, piece=True)


@torch.inference_mode()
def fused_prefill(adapter: ModelAdapter, token_ids: list[int], spans: list[ReusedSpan],
                  source: LayerSource | None, strategy, sentence_ends: torch.Tensor | None = None) -> FusedPrefill:
    """Prefill ``token_ids`` reusing cached KV for ``spans`` as ``strategy`` (or a
    :class:`Selection`) says. With no spans (or :class:`FullRecompute`) this is an
    ordinary causal prefill. ``sentence_ends`` (bool [N], the tokens ending a sentence) is
    what a selection in runs of sentences reads."""
    t0 = time.perf_counter()
    selection = selection_for(strategy)
    if isinstance(selection, EveryToken):
        spans = []
    prompt = FusionPrompt.build(len(token_ids), spans, adapter.device, sentence_ends)
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
        scoring = adapter.scoring   # the question pass only ranks reused tokens: low-bit kernels may run it
        asked, asked_layers = _question_pass_prompt(prompt, layers, token_ids)
        # the relevance is of the fused prompt's reused tokens (not of the control tokens joined in)
        run = _walk(scoring, ids, asked, asked_layers, UncachedTokens().first(asked, probe), frozenset(),
                    None, rope, observe=_question_attention(scoring, prompt, relevance, start))
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
    """One pass over the layers (:func:`~ragblend.core.model.layer_step.run_layers` with :class:`FusedLayers`),
    computing the ``selected`` tokens (narrowed at check layers).

    ``earlier``: a previous pass over the same prompt whose K/V may be taken over (and
    overwritten): its cached positions are already placed and rotated, and every position
    it computed fresh is selected again here. ``key_bias``: added to every score on each key."""
    n, num_layers = prompt.num_tokens, adapter.shape.num_layers
    fused = FusedLayers(adapter, prompt, layers, selected, check_layers, selection, observe, earlier, key_bias)
    if prompt.num_reused:
        first = min(check_layers) if check_layers and fused.sel_pos.numel() == n else 0
        layers.prepare(list(range(first, num_layers)))
    hidden = run_layers(adapter, ids[fused.sel_pos], rope, fused)
    logits = adapter.logits(hidden[-1:])[0]
    recomputed = torch.zeros(n, dtype=torch.bool)
    recomputed[fused.layer_positions[-1].cpu()] = True
    return FusedPrefill(logits=logits.float(), keys=fused.keys, values=fused.values, recomputed=recomputed,
                        layer_positions=fused.layer_positions, load_wait_s=fused.load_wait)


class FusedLayers(LayerPass):
    """The fused prefill's step at each layer: K/V assembled for the whole prompt, the selection
    narrowing the tokens that go on, attention of those over the assembled K/V.

    ``sel_pos``: the prompt positions computed at the current layer; ``keys``/``values``/
    ``layer_positions``: what each layer assembled and computed, for :class:`FusedPrefill`."""

    def __init__(self, adapter: ModelAdapter, prompt: FusionPrompt, layers: LayerSource | None,
                 selected: torch.Tensor, check_layers, selection: Selection | None, observe=None,
                 earlier: FusedPrefill | None = None, key_bias: torch.Tensor | None = None):
        super().__init__(adapter)
        self.prompt, self.layers, self.check_layers, self.selection = prompt, layers, check_layers, selection
        self.observe, self.earlier, self.key_bias = observe, earlier, key_bias
        self.last = adapter.shape.num_layers - 1
        self.sel_pos = selected.nonzero().squeeze(1)
        self.keys, self.values, self.layer_positions = [], [], []
        self.plans: dict[int | None, list[QueryGroup]] = {}   # per sliding window, until the selection narrows
        self.load_wait = 0.0
        self.kv: LayerKV | None = None    # the current layer's, from process_qkv
        self.dtype = adapter.dtype        # the attention input's (the masks are built in it)

    def process_qkv(self, layer, x, cos, sin):
        # 1. K/V of this layer: fresh for the selected tokens, cached (rotated) for the rest.
        self.kv = kv = process_qkv(self.adapter, layer, x, self.sel_pos, self.prompt, self.layers, cos, sin,
                                   self.earlier, self.check_layers)
        self.keys.append(kv.keys)
        self.values.append(kv.values)
        self.layer_positions.append(self.sel_pos)
        self.load_wait += kv.load_wait_s
        self.dtype = x.dtype
        return None   # Q after the selection step: only the tokens that go on pay it

    def narrow(self, layer):
        """2. The selection step: at a check layer, the strategy narrows the tokens that go on."""
        rows = None
        if layer in self.check_layers:
            step = CheckStep(layer, self.sel_pos, self.kv.fresh_k, self.kv.fresh_v, self.kv.cached)
            rows = self.selection.refine(self.prompt, step)[self.sel_pos]
        if layer == self.last:
            # Only the last token's output is used (for the logits); every selected token's
            # K/V of this layer is already in the cache above.
            rows = slice(-1, None) if rows is None else rows.nonzero().squeeze(1)[-1:]
        if rows is not None:
            self.sel_pos = self.sel_pos[rows]
            self.plans.clear()
        return rows

    def query(self, layer, x, cos, sin):
        q = self.adapter.rope(self.adapter.q(layer, x), cos[self.sel_pos], sin[self.sel_pos])
        if self.observe is not None:
            self.observe(layer, q, self.kv.keys, self.sel_pos)
        return q

    def attend(self, layer, q):
        # 3. Attention over the assembled K/V (the MLP follows in run_layers).
        window = self.adapter.window(layer)
        if window not in self.plans:
            self.plans[window] = attention_plan(self.sel_pos, self.prompt.num_tokens, window, self.dtype,
                                                key_bias=self.key_bias)
        return attend(self.adapter, q, self.kv.keys, self.kv.values, self.plans[window])


@dataclass
class LayerKV:
    """One layer's K/V as :func:`process_qkv` assembles them."""

    keys: torch.Tensor                # [kv_heads, N, head_dim], after RoPE: the whole prompt's
    values: torch.Tensor
    fresh_k: torch.Tensor             # the selected tokens' own K (before RoPE) and V
    fresh_v: torch.Tensor
    cached: list | None               # this layer's cached K/V, one pair per span (None: not read)
    load_wait_s: float = 0.0          # time spent waiting for them


def process_qkv(adapter: ModelAdapter, layer: int, x: torch.Tensor, sel_pos: torch.Tensor, prompt: FusionPrompt,
                layers: LayerSource | None, cos: torch.Tensor, sin: torch.Tensor, earlier: FusedPrefill | None,
                check_layers) -> LayerKV:
    """The per-layer step of the fused prefill (LMCache's ``process_qkv``): this layer's K/V for
    the whole prompt, fresh for the selected tokens at ``sel_pos`` (from their attention input
    ``x``), cached and rotated to its place in this prompt for every other token."""
    n, shape = prompt.num_tokens, adapter.shape
    k_raw, v = adapter.kv(layer, x)
    k = adapter.rope(k_raw, cos[sel_pos], sin[sel_pos])
    all_selected = sel_pos.numel() == n
    cached, wait = None, 0.0
    if prompt.num_reused and (not all_selected or layer in check_layers):
        t_wait = time.perf_counter()
        cached = layers.layer(layer)
        wait = time.perf_counter() - t_wait
    if all_selected:
        layer_k, layer_v = k, v
    elif earlier is not None:
        layer_k, layer_v = earlier.keys[layer], earlier.values[layer]
        layer_k[:, sel_pos], layer_v[:, sel_pos] = k, v
    else:
        layer_k = torch.empty(shape.num_kv_heads, n, shape.head_dim, dtype=k.dtype, device=adapter.device)
        layer_v = torch.empty_like(layer_k)
        for span, (cached_k, cached_v) in zip(prompt.spans, cached):
            where = slice(span.start, span.start + span.num_tokens)
            layer_k[:, where], layer_v[:, where] = cached_k, cached_v
        # One rotation for the whole layer, not one per span: a conversation's pieces make ~20 spans,
        # and a rope call per span cost turn 5 more than the tokens it rotates. The positions rotated
        # here that hold no cached K (the selected ones) are written over just below.
        layer_k = adapter.rope(layer_k, cos[:n], sin[:n])
        layer_k[:, sel_pos], layer_v[:, sel_pos] = k, v
    return LayerKV(layer_k, layer_v, k_raw, v, cached, wait)
