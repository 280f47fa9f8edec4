"""Strategy resolution: what one call fuses with, decided once at its entry.

:func:`resolve_strategy` turns the caller's strategy (or None), the engine's default and its
calibration into a :class:`StrategyPlan`: the strategy with its ratio filled in, where that
came from (``Stats.strategy_reason``), the calibration it came from and the cached-attention
scale. It is the one place a strategy is checked against the model; nothing downstream
parses or checks it again. Only CacheBlend's ``ratio="auto"`` waits for the fused prefill,
which knows the tiers the chunks come from (:meth:`StrategyPlan.with_auto_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .calibration.record import UNCALIBRATED, Calibration
from .errors import InvalidInputError
from .fusion.selection import Selection, cacheblend_schedule, selection_for
from .fusion.strategies import STRATEGIES, CacheBlend, FullRecompute, QueryAware, Strategy

UNCALIBRATED_REASON = ("default for an uncalibrated model: a ratio that stayed within the order noise on every "
                       "benchmark set; run engine.calibrate() to find this model's cheapest safe ratio")
CALLER_REASON = "chosen by the caller"


@dataclass(frozen=True)
class StrategyPlan:
    """How one prefill fuses."""

    strategy: Strategy | Selection   # as the caller gave it (QueryAware(None) keeps its None)
    reason: str                      # why this strategy and ratio (caller's choice, calibration, default)
    calibration_id: str | None = None   # the calibration the strategy or its ratio came from, if one did
    ratio: float | str | None = None    # what this call runs at (None given: the strategy's own)
    # What the fused prefill runs (the strategy's Selection), made once here; None until
    # CacheBlend's "auto" ratio is settled.
    selection: Selection | None = None
    # The engine's own choice (none was given for this call or the engine): it fuses a prompt only
    # where that is predicted to pay (.fusion_cost); a strategy the caller names is run as asked.
    engine_default: bool = False

    def __post_init__(self):
        if self.ratio is None:
            object.__setattr__(self, "ratio", getattr(self.strategy, "ratio", None))
        if self.selection is None and self.ratio != "auto":
            object.__setattr__(self, "selection", selection_for(self.strategy, self.ratio))

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def cached_attention_scale(self) -> float | None:
        return getattr(self.strategy, "cached_attention_scale", None)

    @property
    def reuses(self) -> bool:
        """False for a full recompute, which reads no cached chunk."""
        return not isinstance(self.strategy, FullRecompute)

    def with_auto_ratio(self, loading, prompt_tokens: int, reused_tokens: int, tiers: dict) -> "StrategyPlan":
        """CacheBlend(ratio="auto") at the ratio the loading controller picks for a prompt of
        ``prompt_tokens`` reusing ``reused_tokens`` from these ``tiers`` (the slowest counts);
        any other plan as it is."""
        if not (isinstance(self.strategy, CacheBlend) and self.strategy.ratio == "auto"):
            return self
        tier = "disk" if "disk" in tiers else "memory"
        ratio = loading.plan(prompt_tokens, reused_tokens, tier).ratio
        return replace(self, ratio=ratio, selection=None)


def check_strategy(strategy, num_layers: int) -> Strategy | Selection:
    """``strategy`` if it is one and fits a model of ``num_layers`` layers; a clear error otherwise."""
    if not isinstance(strategy, (*STRATEGIES, Selection)):
        raise InvalidInputError(
            f"Unknown strategy {strategy!r}: use CacheBlend(), QueryAware(), LegoLink(k), FullReuse() "
            "or FullRecompute().")
    check_layers = list(cacheblend_schedule(strategy)) if isinstance(strategy, CacheBlend) else []
    if check_layers and max(check_layers) >= num_layers:
        raise InvalidInputError(
            f"CacheBlend check layers {sorted(check_layers)} must be below the model's {num_layers} layers.")
    return strategy


def default_strategy(calibration: Calibration | None) -> Strategy:
    """An engine's strategy when none is given: its calibration's, else the safe default."""
    return calibration.strategy if calibration else UNCALIBRATED


def resolve_strategy(strategy, *, engine_strategy, engine_chose: bool, calibration: Calibration | None,
                     num_layers: int) -> StrategyPlan:
    """The plan of one call: the caller's ``strategy``, else the engine's own
    (``engine_chose``: the engine was given none and took its calibration's or the default),
    checked against the model, with ``QueryAware(ratio=None)`` at the engine's own ratio."""
    chosen = check_strategy(strategy if strategy is not None else engine_strategy, num_layers)
    from_calibration = calibration is not None and strategy is None and engine_chose
    if strategy is not None or not engine_chose:
        reason = CALLER_REASON
    else:
        reason = calibration.reason if calibration is not None else UNCALIBRATED_REASON
    if isinstance(chosen, QueryAware) and chosen.ratio is None:
        # The engine's own QueryAware ratio, else its calibration's, else the safe default.
        if isinstance(engine_strategy, QueryAware) and engine_strategy.ratio is not None:
            ratio = engine_strategy.ratio
            from_calibration = engine_chose and calibration is not None
        else:
            ratio = calibration.ratio if calibration else UNCALIBRATED.ratio
            from_calibration = calibration is not None
    else:
        ratio = None   # the strategy's own
    return StrategyPlan(chosen, reason, calibration.fingerprint if from_calibration else None, ratio,
                        engine_default=strategy is None and engine_chose)
