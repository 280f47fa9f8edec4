"""The fusion strategies: which cached tokens a fused prefill recomputes, as settings.

* :class:`FullRecompute` — every token, every layer: a normal prefill.
* :class:`FullReuse` — only tokens without a cache (template, question, unknown text).
* :class:`LegoLink` — those, plus the first ``k`` tokens of every chunk but the first (Epic).
* :class:`CacheBlend` — every token up to the check layer; there, the reused tokens whose
  fresh V (or K) deviates most from the cached one are kept (top ``ratio``), the rest drop out.
* :class:`QueryAware` — two stages (ProphetKV, QCFuse): first the question alone reads the
  cached chunks through every layer, and the reused tokens it attends to most are chosen;
  then those tokens, and every token without a cache, are computed from layer 0 on.

Each strategy's :meth:`selection` gives the :class:`~ragblend.core.fusion.selection.Selection` that
decides per layer; :func:`strategy_from_name` reads a strategy from configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInputError
from .selection import Selection, cacheblend_schedule, selection_for

# QueryAware's floor on the budget for each cached chunk (QueryAware.per_chunk; issue 59, replayed on
# SmolLM2's 120 user-like prompts in docs/notes/answers-by-size.md)
PER_CHUNK = 24


class _Settings:
    """What every strategy has: the Selection it runs (made from its fields, in .selection)."""

    def selection(self) -> Selection:
        return selection_for(self)


@dataclass(frozen=True)
class FullRecompute(_Settings):
    """Recompute every token at every layer (a normal prefill; the quality reference)."""

    name = "full_recompute"


@dataclass(frozen=True)
class FullReuse(_Settings):
    """Reuse every cached chunk as is; recompute only tokens that have no cache."""

    name = "full_reuse"


@dataclass(frozen=True)
class LegoLink(_Settings):
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
class CacheBlend(_Settings):
    """Selective recompute of the reused tokens with the highest KV deviation (CacheBlend).

    Layers before ``check_layer`` run over all tokens. At ``check_layer`` every reused token
    is scored by how far its fresh K/V are from the cached ones (``deviation``, see
    :func:`kv_deviation`); the top ``ratio`` of reused tokens, plus every token that was not
    reused, continue through the later layers. ``gradual`` optionally adds later check layers as
    ``((layer, ratio), ...)`` that rescore the still-selected tokens and shrink the set
    (the paper's gradual filtering); ratios are fractions of all reused tokens.

    ``deviation="value"`` (the default) is the paper's score; ``"key"`` scores K before RoPE
    and ``"key_value"`` the sum of both. ``research/selection.py`` compares them at equal
    compute (``docs/notes/selection-bounds.md``): K lowers the mean first-token KL a little on both
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
        return cacheblend_schedule(self)


@dataclass(frozen=True)
class QueryAware(_Settings):
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
    (``docs/notes/query-aware.md``).

    ``cached_attention_scale`` (APE's scaling factor): every attention weight on a reused
    token that is not recomputed is multiplied by it before the softmax normalises, in the
    fused prefill (and in decoding after it with ``scale_in_decoding=True``). A chunk computed
    alone, without the chunks before it, draws more attention than it would in context; scaling
    it down brings the fused prefill closer to a full prefill. At equal compute 0.7 lowered the
    mean KL to full prefill on the fidelity prompts and SQuAD of both benchmark models, where 0.5
    helped Qwen2.5's long prompts more but hurt both models' SQuAD prompts
    (``docs/notes/attention-scale.md``). 1.0 leaves attention as it is.

    ``scale_in_decoding``: whether the answer's tokens, too, pay the reused tokens left cached
    ``cached_attention_scale`` times the attention (True), or decode over the fused prompt with
    plain attention (False, the default). Over 73 prompts of three models and three sets, with
    the scale in the prefill only the answers' mean KL to full prefill's was lower on 6 of the 9
    model/set pairs (higher on two MuSiQue sets, within their noise) and 1 prompt was over 3x
    the order noise's median instead of 3 (``docs/notes/attention-scale.md``).

    ``neighbour_window``: recompute in runs. A reused token's claim is the question's attention
    averaged over a window this fraction of its chunk long (1/16: 9 tokens of a 150-token
    chunk, 31 of a 500-token one), so the budget goes to runs of neighbours rather than to
    tokens alone among cached ones. 0 (the default) chooses single tokens.
    (``docs/notes/sentence-runs.md``).

    ``sentence_runs``: recompute in runs that follow the text: a reused token's claim is the
    question's attention averaged over its sentence inside its chunk (a sentence ends at a
    token holding ``.``, ``!``, ``?`` or a line break) plus a quarter of its own, so the budget
    goes to the sentences the question reads, whole where it reaches, and to the tokens it reads
    far more than their sentence. Not with ``neighbour_window`` (``docs/notes/sentence-runs.md``).

    ``per_chunk``: the budget is at least this many reused tokens for each cached chunk in the
    prompt (``ratio`` of the reused tokens or ``per_chunk`` times the chunks, whichever is more,
    the latter at most a quarter of them; still chosen by the question's attention). A chunk
    precomputed alone lacks its place after the chunks before it, a repair that does not shrink
    with the chunk: on a user's LlamaIndex prompts of six 128-token chunks, a tenth of the reused
    tokens (13 a chunk) lost three of six sample answers full prefill gave; 24 a chunk kept two of
    them back, and at chunks of 240 tokens and more it changes nothing at 0.10
    (``docs/notes/answers-by-size.md``). 0: the ratio alone.

    ``ratio=None`` (the default) takes the engine's own ratio (its calibration's, else the safe
    default) when :meth:`BlendEngine.prefill` runs it: ``QueryAware()`` is the engine's choice
    made explicit, as ``strategy="query_aware"`` without a ratio is in the integrations and the CLI.
    """

    ratio: float | None = None
    whole_chunks: bool = False
    query_tokens: int | None = None
    cached_attention_scale: float = 0.7
    scale_in_decoding: bool = False
    neighbour_window: float = 0.0
    sentence_runs: bool = False
    per_chunk: int = PER_CHUNK
    name = "query_aware"

    def __post_init__(self):
        if self.ratio is not None:
            _check_ratio(self.ratio)
        scale = self.cached_attention_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise InvalidInputError(f"QueryAware cached_attention_scale must be a number in (0, 1], got {scale!r}.")
        if not isinstance(self.scale_in_decoding, bool):
            raise InvalidInputError(f"QueryAware scale_in_decoding must be True or False, got {self.scale_in_decoding!r}.")
        window = self.neighbour_window
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 1:
            raise InvalidInputError(f"QueryAware neighbour_window must be a fraction of a chunk in [0, 1] "
                                    f"(e.g. 1/16; 0: single tokens), got {window!r}.")
        if not isinstance(self.sentence_runs, bool):
            raise InvalidInputError(f"QueryAware sentence_runs must be True or False, got {self.sentence_runs!r}.")
        if self.sentence_runs and window:
            raise InvalidInputError("QueryAware takes runs of sentences (sentence_runs=True) or of a fraction of "
                                    "the chunk (neighbour_window), not both: set one.")
        if isinstance(self.per_chunk, bool) or not isinstance(self.per_chunk, int) or self.per_chunk < 0:
            raise InvalidInputError(f"QueryAware per_chunk must be an integer >= 0 (tokens recomputed at least for "
                                    f"each cached chunk), got {self.per_chunk!r}.")
        if self.query_tokens is not None and (isinstance(self.query_tokens, bool) or not isinstance(
                self.query_tokens, int) or self.query_tokens < 1):
            raise InvalidInputError(f"QueryAware query_tokens must be an integer >= 1 or None, got {self.query_tokens!r}.")


DEVIATIONS = ("key", "value", "key_value")


def _check_ratio(ratio) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise InvalidInputError(f"ratio must be a number in (0, 1], got {ratio!r}.")


Strategy = FullRecompute | FullReuse | LegoLink | CacheBlend | QueryAware
STRATEGIES = (FullRecompute, FullReuse, LegoLink, CacheBlend, QueryAware)
STRATEGY_NAMES = ("default", *(cls.name for cls in STRATEGIES))


def takes_ratio(name: str) -> bool:
    """Whether the strategy named ``name`` takes a recompute ratio (the others recompute a fixed
    set of tokens); "default" takes one too (QueryAware at that ratio)."""
    return name in ("default", QueryAware.name, CacheBlend.name)


def strategy_from_name(name: str, ratio: float | str | None = None, legolink_k: int = 16) -> Strategy | None:
    """A strategy from its ``name`` (each class's ``name``), as configuration files, the CLI, the
    app and the server's ``ragblend`` field give it. ``"default"`` is None, the engine's own
    (calibrated) choice, unless a ``ratio`` is given: then it is :class:`QueryAware` at that
    ratio. ``ratio=None`` keeps CacheBlend's default ratio and gives QueryAware the engine's own."""
    if ratio is not None and name in STRATEGY_NAMES and not takes_ratio(name):
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
