"""The engine's own strategy fuses a prompt only where that is predicted to pay (core.fusion.fusion_cost):
a short prompt runs as the exact full prefill and says why; a long one fuses; a strategy the
caller names is run as asked; the constants are measured once per host and model and kept."""

import json

import pytest
import torch

from ragblend import Chunk, FullRecompute, QueryAware
from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion import fusion_cost
from ragblend.core.fusion.fusion_cost import CostConstants, FusionCost, full_prefill_s, fused_prefill_s
from ragblend.core.fusion.selection import QuestionAttention
from ragblend.core.options import EngineOptions
from ragblend.serving.app import Metrics
from tests.conftest import PASSAGES, make_tiny_engine

# A host where a pass's fixed cost and the cached tokens' placing weigh as on SmolLM2 (short
# prompts do not pay), and one where only rows count (every fusion that saves rows pays).
OVERHEAD = CostConstants(layer_s=2e-4, row_s=4e-6, pair_s=1.5e-9, cached_s=4e-7, measured=True)
ROWS_ONLY = CostConstants(layer_s=0.0, row_s=1e-6, pair_s=0.0, cached_s=0.0, measured=True)
QUESTION = "Question: who ran the ferry between the two islands?"


@pytest.fixture
def engine(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    engine = make_tiny_engine("llama", tokenizer, min_fusion_speedup=1.3)
    engine.precompute(PASSAGES)
    return engine


def test_a_short_prompt_runs_as_the_exact_full_prefill_and_says_why(engine):
    engine.fusion_cost.use(OVERHEAD)
    segments = [Chunk(p) for p in PASSAGES[:2]] + [QUESTION]
    pre = engine.prefill(segments)
    stats = pre.stats
    assert stats.fusion_skipped and stats.strategy == "full_recompute" and stats.reused_tokens == 0
    assert stats.skip_reason.startswith("predicted ") and f"prompt {stats.prompt_tokens} tokens" in stats.skip_reason
    assert stats.predicted_speedup < 1.3 and "so the exact full prefill ran" in stats.strategy_reason
    assert engine.fusion_skips == 1 and engine.last_skip_reason == stats.skip_reason
    assert torch.equal(pre.logits, engine.prefill(segments, strategy=FullRecompute()).logits)
    engine.generate(segments, max_new_tokens=2)
    assert engine.fusion_skips == 2 and engine.last_stats.fusion_skipped


def test_a_prompt_whose_fusion_is_predicted_cheap_fuses(engine):
    engine.fusion_cost.use(ROWS_ONLY)
    stats = engine.prefill([Chunk(p) for p in PASSAGES] + [QUESTION]).stats
    assert not stats.fusion_skipped and stats.strategy == "query_aware" and stats.reused_tokens > 0
    assert stats.predicted_speedup >= 1.3 and engine.fusion_skips == 0 and stats.skip_reason == ""


def test_a_strategy_the_caller_names_is_run_as_asked(engine, tokenizer):
    engine.fusion_cost.use(OVERHEAD)
    segments = [Chunk(p) for p in PASSAGES[:2]] + [QUESTION]
    asked = engine.prefill(segments, strategy=QueryAware(0.3)).stats
    assert not asked.fusion_skipped and asked.strategy == "query_aware" and asked.predicted_speedup is None
    # an engine built with a strategy: the caller's too
    own = make_tiny_engine("llama", tokenizer, strategy=QueryAware(0.3), min_fusion_speedup=1.3)
    own.fusion_cost.use(OVERHEAD)
    own.precompute(PASSAGES[:2])
    assert not own.prefill(segments).stats.fusion_skipped
    # and min_fusion_speedup=0 fuses whatever the prediction
    engine.min_fusion_speedup = 0
    assert not engine.prefill(segments).stats.fusion_skipped and engine.fusion_skips == 0


def test_the_constants_are_measured_once_and_kept_for_the_next_engine(engine, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(fusion_cost, "trusted", lambda first, second: True)   # as on a quiet host
    assert not engine.fusion_cost.measured
    measured = engine.fusion_cost.constants()
    assert measured.measured and measured.valid() and measured.row_s > 0
    files = list((tmp_path / "host").glob("fusion-cost-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["value"]["row_s"] == measured.row_s

    def must_not_measure(adapter):
        raise AssertionError("measured again")

    monkeypatch.setattr(fusion_cost, "measure_constants", must_not_measure)
    again = make_tiny_engine("llama", tokenizer, min_fusion_speedup=1.3)
    assert again.fusion_cost.known() == measured and again.fusion_cost.constants() == measured
    again.precompute(PASSAGES[:2])
    again.prefill([Chunk(p) for p in PASSAGES[:2]] + [QUESTION])   # decides from the kept constants


def test_a_failed_measurement_falls_back_to_the_scaled_defaults(engine, monkeypatch):
    def broken(adapter):
        raise RuntimeError("no timer")

    monkeypatch.setattr(fusion_cost, "measure_constants", broken)
    constants = engine.fusion_cost.constants()
    assert not constants.measured and constants.valid()
    engine.prefill([Chunk(p) for p in PASSAGES[:2]] + [QUESTION])   # still answers
    assert "from default constants" in engine.last_stats.strategy_reason or not engine.last_stats.fusion_skipped


def test_the_predicted_speedup_grows_with_the_prompt_at_a_fixed_template_and_question():
    selection, layers, fresh = QuestionAttention(0.1), 30, 45
    speedups = []
    for reused in (200, 400, 1000, 3000):
        n = reused + fresh
        fused, computed = fused_prefill_s(OVERHEAD, layers, selection, n, reused)
        speedups.append(full_prefill_s(OVERHEAD, layers, n) / fused)
        assert computed == fresh + selection.budget(reused)
    assert speedups == sorted(speedups) and speedups[0] < 1.3 < speedups[-1]
    # reading the cached KV from disk makes the fusion dearer
    n = 1045
    memory, _ = fused_prefill_s(OVERHEAD, layers, selection, n, 1000)
    disk, _ = fused_prefill_s(OVERHEAD, layers, selection, n, 1000, disk_tokens=1000, disk_bytes_per_token_layer=768)
    assert disk > memory


def test_the_prediction_prices_the_budgets_floor_for_each_chunk(engine):
    selection, layers, fresh = QuestionAttention(0.1, per_chunk=24), 30, 45
    one, computed_one = fused_prefill_s(OVERHEAD, layers, selection, 745, 700)
    six, computed_six = fused_prefill_s(OVERHEAD, layers, selection, 745, 700, chunks=6)
    assert computed_one == fresh + 70 and computed_six == fresh + 144 and six > one
    # the engine predicts with the prompt's chunk count (rows only: full / fused = n / (2 fresh + budget))
    engine.fusion_cost.use(ROWS_ONLY)
    engine.strategy = QueryAware(0.1)   # the engine's own, at SmolLM2's calibrated ratio
    pre = engine.prefill([Chunk(p) for p in PASSAGES] + [QUESTION])
    spanned = sum(s.end - s.start for s in pre.layout.chunk_spans)
    n, budget = pre.stats.prompt_tokens, engine.resolve().selection.budget(spanned, len(pre.layout.chunk_spans))
    assert budget > engine.resolve().selection.budget(spanned)   # the floor is in force on these short chunks
    assert pre.stats.predicted_speedup == pytest.approx(n / (2 * (n - spanned) + budget))


def test_the_skip_count_reaches_the_servers_metrics():
    from ragblend.core.results import Stats

    metrics = Metrics()
    metrics.answer(Stats(fusion_skipped=True, skip_reason="predicted 1.1x"))
    metrics.answer(Stats())
    assert "ragblend_fusion_skipped_total 1\n" in metrics.text(0, None)


@pytest.mark.parametrize("bad", [-1, "1.3", True, float("nan")])
def test_a_bad_min_fusion_speedup_is_a_clear_error(bad):
    with pytest.raises(InvalidInputError, match="min_fusion_speedup"):
        EngineOptions(min_fusion_speedup=bad)


def test_fusion_cost_of_an_unknown_selection_is_not_predicted(engine):
    class Custom(QuestionAttention.__mro__[1]):   # a bare Selection
        pass

    assert FusionCost(engine.adapter, engine.model_fingerprint, 2, OVERHEAD).verdict(Custom(), 500, 400) is None


def test_ragblend_info_says_where_the_default_strategy_fuses(engine, capsys):
    from ragblend.cli import _print_fusion_cost

    _print_fusion_cost(engine, measure=False)   # nothing measured yet: the scaled defaults, said so
    said = capsys.readouterr().out
    assert "fuses a prompt where predicted at least 1.3x faster" in said and "not measured on this host yet" in said
    engine.fusion_cost.use(ROWS_ONLY)
    _print_fusion_cost(engine, measure=False)
    at = engine.fusion_cost.break_even(engine.resolve().selection)
    assert at == 195 and f"from about {at} prompt tokens" in capsys.readouterr().out   # 45 fresh, QueryAware(0.3)


def test_a_busy_or_unsteady_measurement_is_not_kept_for_the_host(engine, tmp_path, monkeypatch):
    c = fusion_cost.default_constants(engine.adapter)
    slow = fusion_cost.CostConstants(c.layer_s, c.row_s * 3, c.pair_s, c.cached_s, measured=True)
    assert fusion_cost.trusted(c, c, load=0.5)
    assert not fusion_cost.trusted(c, slow, load=0.5)              # two measurements 3x apart
    assert not fusion_cost.trusted(c, c, load=40.0)                # an oversubscribed host
    monkeypatch.setattr(fusion_cost, "trusted", lambda first, second: False)
    constants = engine.fusion_cost.constants()
    assert not constants.measured                                  # the scaled defaults, not the busy timing
    (path,) = (tmp_path / "host").glob("fusion-cost-*.json")       # kept unsettled: measured again when quiet
    assert json.loads(path.read_text())["settled"] is False


def synthetic_timings(truth: CostConstants, noise: list[float]) -> list:
    """Per-layer timings of the measurement's prefills on a host whose costs are ``truth``, each
    off by its share of ``noise`` (a busy host's jitter)."""
    terms = [fusion_cost.full_prefill_terms(1, n) for n in fusion_cost.FULL_SIZES]
    n = fusion_cost.FUSED_FRESH + fusion_cost.FUSED_CACHED
    terms += [fusion_cost.fused_prefill_terms(1, s, n, fusion_cost.FUSED_CACHED)[0] for s in fusion_cost.FUSED_SELECTIONS]
    return [(t, fusion_cost.seconds(truth, t) * (1 + e)) for t, e in zip(terms, noise, strict=True)]


@pytest.mark.parametrize("truth", [OVERHEAD, ROWS_ONLY, CostConstants(3e-3, 3e-5, 6e-8, 0.0, measured=True)])
def test_the_fit_recovers_the_constants_from_exact_timings(truth):
    fitted = fusion_cost.fit_constants(synthetic_timings(truth, [0.0] * 7))
    for name in ("layer_s", "row_s", "pair_s", "cached_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)
    assert fitted.measured and fitted.valid()


def test_the_fit_predicts_the_fused_speedup_within_the_timings_noise_and_never_goes_negative():
    # 5% jitter either way on each timing: the predicted speed-up of QueryAware(0.1) on prompts of
    # 300-3,000 tokens stays within ~10% of the true one, and no constant comes out negative
    # (solving three full prefills exactly had put the jitter into a pass's fixed cost)
    jitter = [0.05, -0.05, 0.05, -0.05, 0.05, -0.05, 0.05]
    fitted = fusion_cost.fit_constants(synthetic_timings(OVERHEAD, jitter))
    assert min(fitted.layer_s, fitted.row_s, fitted.pair_s, fitted.cached_s) >= 0
    selection = QuestionAttention(0.1)
    for n in (300, 800, 1500, 3000):
        def speedup(c):
            return full_prefill_s(c, 30, n) / fused_prefill_s(c, 30, selection, n, n - 90)[0]
        assert speedup(fitted) == pytest.approx(speedup(OVERHEAD), rel=0.1)


def test_measuring_times_the_fused_prefills_as_they_run(engine, monkeypatch):
    # the fit sees QueryAware's two passes as fusion runs them, not only full prefills
    ran, real = [], fusion_cost.fused_prefill

    def recording(adapter, ids, spans, source, selection):
        ran.append((type(selection).__name__, len(ids), sum(s.num_tokens for s in spans)))
        return real(adapter, ids, spans, source, selection)

    monkeypatch.setattr(fusion_cost, "fused_prefill", recording)
    constants = fusion_cost.measure_constants(engine.adapter, rounds=1)
    assert constants.measured and constants.valid() and constants.row_s > 0
    assert ("QuestionAttention", 768, 720) in ran and ("UncachedTokens", 768, 720) in ran
    assert {n for name, n, _ in ran if name == "EveryToken"} >= set(fusion_cost.FULL_SIZES)
