"""research.adaptive: the signals for per-query adaptive recompute and their ranking measures,
on a tiny random model (the measured AUROCs are in docs/notes/adaptive-recompute.md)."""

import math

import pytest
import torch

from ragblend import Chunk, FullReuse, QueryAware
from research.adaptive import (
    NOISE,
    PROBE,
    SIGNALS,
    RecordingQuestionAttention,
    auroc,
    escalate,
    length_scaled_auroc,
    main,
    policy_tables,
    signals,
    spearman,
    tuned_threshold,
)

from ..conftest import PASSAGES, make_tiny_engine

CHUNKS = [f"{a} {b}" for a, b in zip(PASSAGES, PASSAGES[1:] + PASSAGES[:1])]


def test_auroc_and_rank_correlation():
    assert auroc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert auroc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert auroc([0.5, 0.5], [True, False]) == 0.5                       # a tie counts half
    assert math.isnan(auroc([0.1, 0.2], [True, True]))                   # one class only
    assert auroc([0.9, None, 0.1], [True, True, False]) == 1.0           # a missing signal is left out
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_escalation_spends_the_target_where_the_signal_passes_the_threshold():
    def prompt(signal, kl):
        rows = {"shipped": {"kl": kl, "answer_kl": kl, "compute": 0.2},
                "QueryAware(0.30)": {"kl": kl / 4, "answer_kl": kl / 4, "compute": 0.4},
                PROBE: {"kl": 1.0, "answer_kl": 1.0, "compute": 0.05}}
        return {"rows": rows, "signals": {"left_mass": signal, "probe_kl": signal}}

    rows = [prompt(0.1, 0.01), prompt(0.5, 0.02), prompt(0.9, 0.08)]
    # A signal known before the fused pass spends only the target's compute ...
    spent = escalate(rows, "shipped", "QueryAware(0.30)", "left_mass", 0.6)
    assert [c for c, _ in spent] == [0.2, 0.2, 0.4] and spent[2][1]["answer_kl"] == 0.02
    # ... one read off the fused result spends the shipped pass too, less the question pass.
    assert escalate(rows, "shipped", "QueryAware(0.30)", "probe_kl", 0.6)[2][0] == pytest.approx(0.55)
    assert escalate(rows, "shipped", "full", "left_mass", 0.6)[2] == (1.0, {"kl": 0.0, "answer_kl": 0.0,
                                                                            "compute": 1.0})
    # The lowest threshold within a budget of one escalated prompt in three: above the middle prompt's.
    assert tuned_threshold(rows, "shipped", "QueryAware(0.30)", "left_mass", (0.2 + 0.2 + 0.4) / 3) == 0.5
    assert tuned_threshold(rows, "shipped", "QueryAware(0.30)", "left_mass", 0.1) == math.inf
    # A prompt that ran as a full prefill has no signals: never escalated, no threshold of its own.
    skipped = {**prompt(None, 0.0), "signals": {"left_mass": None, "probe_kl": None}}
    assert escalate([skipped], "shipped", "full", "left_mass", 0.0) == [(0.2, skipped["rows"]["shipped"])]
    assert tuned_threshold(rows + [skipped], "shipped", "QueryAware(0.30)", "left_mass", 0.1) == math.inf
    # The tables count escalated prompts past a missing signal (a run made before the signal existed).
    def pooled(signal, kl):
        p = prompt(signal, kl)
        p["rows"][NOISE] = {"kl": 0.05, "answer_kl": 0.05, "compute": 1.0}
        p["signals"] = dict.fromkeys(SIGNALS, signal)
        return p

    raw = {"m/squad": [pooled(0.1, 0.01), pooled(0.9, 0.08), pooled(None, 0.02)]}
    lines = policy_tables(raw, {"m": "shipped"}, "squad", {"m": "QueryAware(0.30)"}, {"m": ("QueryAware(0.30)",)})
    assert any("selected_deviation > 0.1 -> QueryAware(0.30) (33% escalated)" in line for line in lines)


def test_runs_of_other_ladders_pool_and_signals_scaled_by_length_are_ranked(tmp_path, capsys):
    import json

    def prompt(kl, signal, extra):
        rows = {"shipped": {"kl": kl, "answer_kl": kl, "compute": 0.1, "rouge": 1.0, "same_first": 1.0,
                            "same_answer": 1.0},
                NOISE: {"kl": 0.05, "answer_kl": 0.05, "compute": 1.0, "rouge": 1.0, "same_first": 1.0,
                        "same_answer": 1.0}}
        if extra:
            rows["QueryAware(0.15)"] = dict(rows["shipped"], compute=0.15)
        signals = dict.fromkeys(SIGNALS, signal) | {"reused_tokens": 100.0 + 1000 * signal}
        return {"rows": rows, "signals": signals}

    # a bad fusion (answer KL over the noise's median) wherever the signal is high
    first = [prompt(0.1, 0.9, True), prompt(0.01, 0.1, True)]
    second = [prompt(0.2, 0.8, False), prompt(0.02, 0.2, False)]
    raw = {"m/squad": first + second}
    lines = length_scaled_auroc(raw, {"m": "shipped"})
    assert lines[2].startswith("| m (4, 2) |") and set(lines[2].split(" | ")[1:-1]) == {"1.00"}
    paths = []
    for i, rows in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"raw": {"m/squad": rows}, "shipped": {"m": "shipped"}}))
    main(["--from-json", *map(str, paths), "--out", str(tmp_path / "report")])   # one run measured 0.15, one not
    out = capsys.readouterr().out
    assert "## Scaled by prompt length" in out and "QueryAware(0.15)" not in out.split("## Answer level")[0]


def test_the_recording_selection_selects_as_query_aware_and_gives_every_signal(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    segments = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]
    recorder = RecordingQuestionAttention(0.2, cached_attention_scale=0.7)
    recorded = engine.prefill(segments, strategy=recorder)
    plain = engine.prefill(segments, strategy=QueryAware(0.2, per_chunk=0))   # the ratio alone, as recorded
    assert torch.equal(recorded.recomputed, plain.recomputed)
    assert torch.allclose(recorded.logits, plain.logits, atol=1e-5)
    assert recorder.relevance.shape[1] == recorder.left_out.numel()
    assert int((~recorder.left_out).sum()) == math.ceil(0.2 * recorder.left_out.numel() - 1e-9)

    values = signals(recorder, recorded, engine.prefill(segments, strategy=FullReuse()))
    assert set(values) == set(SIGNALS)
    assert 0 < values["left_mass"] < 1 and 0 < values["relevance_entropy"] <= 1
    assert values["selected_deviation"] > 0 and values["probe_kl"] >= 0
    assert values["reused_tokens"] == recorder.left_out.numel()


def test_the_recording_selection_decodes_as_the_shipped_query_aware(tokenizer):
    """The benchmark's 'shipped' row runs the recorder: its answer must be QueryAware's, whose
    cached-attention scale stays in the fused prefill (scale_in_decoding=False by default), so a
    selection with a scale leaves it out of decoding too."""
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    segments = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]
    recorded = engine.prefill(segments, strategy=RecordingQuestionAttention(0.2, cached_attention_scale=0.7))
    assert recorded.key_bias is None and engine.prefill(segments, strategy=QueryAware(0.2)).key_bias is None
    answer = engine.generate(segments, strategy=RecordingQuestionAttention(0.2, cached_attention_scale=0.7),
                             max_new_tokens=12)
    assert answer.token_ids == engine.generate(segments, strategy=QueryAware(0.2, per_chunk=0), max_new_tokens=12).token_ids


def test_a_prompt_run_as_a_full_prefill_is_counted_not_passed_off_as_a_perfect_fusion(tokenizer):
    """One short passage beside a long question: QueryAware runs the exact prefill instead of
    fusing, and the fidelity table says so instead of counting a silent KL of 0."""
    from benchmarks.common import Prompt
    from benchmarks.fidelity import measure, table

    engine = make_tiny_engine("llama", tokenizer)
    short = Prompt([PASSAGES[0]], "Question: " + " ".join(PASSAGES[1:] * 3) + " Who lit the lighthouse?")
    long = Prompt(CHUNKS * 2, "Question: who ran the ferry?")
    results = [measure(engine, p, {"QueryAware(0.10)": QueryAware(0.10)}, greedy_tokens=2) for p in (short, long)]
    assert [r["QueryAware(0.10)"]["full_prefill"] for r in results] == [1.0, 0.0]
    assert results[0]["QueryAware(0.10)"]["kl"] == 0.0
    notes = [line for line in table(results, 2) if "ran as a full prefill" in line]
    assert notes == ["QueryAware(0.10): 1 of 2 prompts ran as a full prefill (fusing would have computed more); "
                     "their KL of 0 judges no fusion."]


def test_the_fidelity_table_reports_the_answers_largest_step(tokenizer):
    from benchmarks.common import Prompt
    from benchmarks.fidelity import NOISE, measure, table

    engine = make_tiny_engine("llama", tokenizer)
    prompt = Prompt(CHUNKS * 2, "Question: who ran the ferry?")
    rows = measure(engine, prompt, {"QueryAware(0.10)": QueryAware(0.10)}, greedy_tokens=6, answer_level=True)
    for name in ("QueryAware(0.10)", NOISE):
        assert rows[name]["answer_kl_peak"] >= rows[name]["answer_kl"] > 0, name
    lines = table([rows], 6)
    assert lines[0].endswith("| largest step KL mean | largest step KL median |")
    assert all(line.count("|") == lines[0].count("|") for line in lines[2:] if line.startswith("| "))
