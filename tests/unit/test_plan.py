"""Strategy resolution (ragblend.core.plan): one plan per call, made at its entry."""

import pytest

from ragblend.core.calibration.record import UNCALIBRATED
from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion.selection import QuestionAttention, TopScoreSelection
from ragblend.core.fusion.strategies import CacheBlend, QueryAware
from ragblend.core.plan import CALLER_REASON, UNCALIBRATED_REASON, resolve_strategy
from tests.conftest import make_tiny_engine


def test_the_plan_fills_the_ratio_says_why_and_makes_the_selection_once():
    own = resolve_strategy(None, engine_strategy=UNCALIBRATED, engine_chose=True, calibration=None, num_layers=4)
    assert (own.strategy, own.reason, own.calibration_id) == (UNCALIBRATED, UNCALIBRATED_REASON, None)
    assert isinstance(own.selection, QuestionAttention) and own.selection.ratio == UNCALIBRATED.ratio
    # QueryAware(None) runs at the engine's own QueryAware ratio.
    caller = resolve_strategy(QueryAware(None), engine_strategy=QueryAware(0.2), engine_chose=False,
                              calibration=None, num_layers=4)
    assert (caller.ratio, caller.reason) == (0.2, CALLER_REASON)
    # ... and so does QueryAware() with settings of its own: the ratio is the engine's, not a constant
    windowed = resolve_strategy(QueryAware(neighbour_window=1 / 16), engine_strategy=QueryAware(0.1), engine_chose=True,
                                calibration=None, num_layers=4)
    assert windowed.ratio == 0.1 and windowed.selection.neighbour_window == 1 / 16
    with pytest.raises(InvalidInputError, match="must be below the model's 4 layers"):
        resolve_strategy(CacheBlend(check_layer=4), engine_strategy=UNCALIBRATED, engine_chose=True,
                         calibration=None, num_layers=4)


def test_cacheblends_auto_ratio_waits_for_the_tiers():
    class Loading:
        def plan(self, prompt_tokens, reused_tokens, tier):
            return type("Plan", (), {"ratio": 0.5 if tier == "disk" else 0.25})()

    auto = resolve_strategy(CacheBlend(ratio="auto"), engine_strategy=UNCALIBRATED, engine_chose=True,
                            calibration=None, num_layers=4)
    assert auto.selection is None and auto.ratio == "auto"
    settled = auto.with_auto_ratio(Loading(), 100, 80, {"memory": 1, "disk": 1})
    assert settled.ratio == 0.5 and isinstance(settled.selection, TopScoreSelection)


def test_the_engine_resolves_once_and_reports_the_plan(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, strategy=QueryAware(0.3))
    plan = engine.resolve(QueryAware(None))
    out = engine.prefill(["A plain prompt with no chunks at all."], strategy=plan)
    assert (out.stats.strategy, out.stats.ratio, out.stats.strategy_reason) == ("query_aware", 0.3, CALLER_REASON)
