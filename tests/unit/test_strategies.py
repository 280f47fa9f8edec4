"""core.fusion.strategies: each strategy's parameters are checked where it is made, and a strategy is
read from its name (configuration files, the CLI) with a clear error for what cannot be."""

import pytest

from ragblend import CacheBlend, FullRecompute, FullReuse, InvalidInputError, LegoLink, QueryAware
from ragblend.core.fusion.strategies import STRATEGY_NAMES, strategy_from_name


@pytest.mark.parametrize("make", [lambda: CacheBlend(ratio=0), lambda: CacheBlend(ratio=1.5),
                                  lambda: CacheBlend(ratio=-0.1), lambda: CacheBlend(check_layer=0),
                                  lambda: CacheBlend(gradual=((0, 0.1),)),
                                  lambda: CacheBlend(0.15, gradual=((3, 0.5),)),
                                  lambda: CacheBlend(deviation="query"),
                                  lambda: LegoLink(-1), lambda: LegoLink(2.5)])
def test_bad_strategy_parameters(make):
    with pytest.raises(InvalidInputError):
        make()


def test_every_name_gives_its_strategy():
    assert strategy_from_name("default") is None                       # the engine's own choice
    assert strategy_from_name("default", 0.3) == QueryAware(0.3)
    assert strategy_from_name("full_recompute") == FullRecompute()
    assert strategy_from_name("full_reuse") == FullReuse()
    assert strategy_from_name("legolink", legolink_k=5) == LegoLink(5)
    assert strategy_from_name("cacheblend") == CacheBlend() and strategy_from_name("cacheblend", "auto").ratio == "auto"
    assert strategy_from_name("query_aware") == QueryAware(None)       # the engine's own ratio
    assert set(STRATEGY_NAMES) == {"default", "full_recompute", "full_reuse", "legolink", "cacheblend", "query_aware"}


@pytest.mark.parametrize("name, ratio, match", [
    ("full_reuse", 0.2, "takes no ratio"), ("legolink", 0.2, "takes no ratio"),
    ("query_aware", "auto", "ratio 'auto' is CacheBlend's"), ("default", "auto", "ratio 'auto' is CacheBlend's"),
    ("cache_blend", None, "Unknown strategy 'cache_blend'; choose one of default, "),
    ("query_aware", 1.5, r"ratio must be a number in \(0, 1\]"),
])
def test_a_name_that_cannot_be_used_says_what_to_do(name, ratio, match):
    with pytest.raises(InvalidInputError, match=match):
        strategy_from_name(name, ratio)
