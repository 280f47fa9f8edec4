"""The benchmark helpers that need no download: the evaluation sets read from ../shared/data, SQuAD
metrics, model names, and the selection-bounds study's scores (on a tiny model)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.common import (
    answer_contained,
    best_over_answers,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    paragraphs,
    prompt_sets,
    rag_samples,
    read_data,
    rouge_l,
)
from benchmarks.decode import near_tie_line, teacher_forced_steps
from benchmarks.models import model_path
from ragblend import CacheBlend, Chunk
from research.bounds import true_v_deviation, whole_chunk_scores, with_score

from ..conftest import PASSAGES, make_tiny_engine


def test_the_squad_format_sets_are_read_from_the_shared_data(tmp_path):
    """``squad:N`` prompts and the corpus paragraphs come from the SQuAD-shifts files in ../shared/data
    (never a download): 6 chunks, one of them holding an answer, the same samples every run."""
    samples = rag_samples(20)
    assert len(samples) == 20 and samples == rag_samples(20)
    for sample in samples:
        assert len(sample["chunks"]) == 6 and len(set(sample["chunks"])) == 6
        assert any(answer in sample["chunks"][sample["gold"]] for answer in sample["answers"])
    prompts = prompt_sets(["squad:4-6"], tmp_path / "no-musique.json")["squad"]
    assert [p.chunks for p in prompts] == [s["chunks"] for s in samples[4:6]]
    corpus = paragraphs()
    assert len(corpus) > 3000 and len(set(corpus)) == len(corpus)
    with pytest.raises(SystemExit, match="shared/data"):
        read_data(tmp_path / "absent.json")


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Rollo, of Normandy!") == "rollo of normandy"
    assert exact_match("the Rollo.", "Rollo") == 1.0 and exact_match("Rollo the Walker", "Rollo") == 0.0
    assert f1_score("Super Bowl LI", "Super Bowl LI") == 1.0
    assert f1_score("peat swamps", "peat swamps or small ponds") == pytest.approx(2 * 1 * 0.4 / 1.4)
    assert f1_score("nothing alike", "Rollo") == 0.0
    assert best_over_answers(exact_match, "In 999", ["999", "In 999"]) == 1.0


def test_answer_extraction_and_containment():
    assert extract_answer("\n  Answer: The Broncos won. They beat the Panthers.\nmore") == "The Broncos won."
    assert extract_answer("Rollo") == "Rollo" and extract_answer("") == ""
    assert answer_contained("The Denver Broncos won Super Bowl 50.", "Denver Broncos") == 1.0
    assert answer_contained("Denverite fans", "Denver") == 0.0  # whole words only
    assert answer_contained("anything", "the") == 0.0  # an answer that normalises to nothing never matches


def test_model_names():
    assert model_path("smollm2") is None
    with pytest.raises(ValueError, match="smollm2"):
        model_path("gpt-5")


def test_rouge_l():
    assert rouge_l("the ferry is the Sanderling", "the ferry is the Sanderling") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("a", "") == 0.0 and rouge_l("x y", "a b") == 0.0
    # LCS "the Sanderling" (2 of 3 candidate tokens, 2 of 4 reference tokens)
    assert rouge_l("the Sanderling ferry", "it is the Sanderling") == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))


def test_whole_chunk_scores_rank_chunks_before_tokens():
    # Chunk 0 holds the single largest deviation, chunk 1 the largest mean.
    deviation = torch.tensor([9.0, 0.0, 0.0, 5.0, 4.0, 1.0, 2.0, 0.5])
    scores = whole_chunk_scores(torch.arange(8), deviation, [3, 2, 3])
    assert set(scores.topk(2).indices.tolist()) == {3, 4}          # all of chunk 1
    assert set(scores.topk(4).indices.tolist()) == {3, 4, 0, 1}    # then chunk 0's top tokens
    # Candidates can be a subset of the reused tokens (rows index into all of them).
    sub = whole_chunk_scores(torch.tensor([0, 5, 6]), torch.tensor([9.0, 1.0, 2.0]), [3, 2, 3])
    assert sub.argmax() == 0


def test_true_v_deviation_sums_normalised_layers_after_the_check_layer():
    torch.manual_seed(0)
    full = [torch.randn(2, 6, 4) for _ in range(3)]
    positions = torch.tensor([1, 2, 4])
    cached = torch.stack([v[:, positions] for v in full])
    cached[1, :, 0] += 1.0    # token 0 off at layer 1 only
    cached[2, :, 2] += 10.0   # token 2 off at layer 2 only, on a larger scale
    cached[0, :, 1] += 100.0  # layer 0 (before the check layer) does not count
    dev = true_v_deviation(full, cached, positions, check_layer=1)
    # Each layer is divided by its mean, so the two off tokens weigh the same.
    assert dev.tolist() == pytest.approx([3.0, 0.0, 3.0])


def test_a_replaced_score_drives_the_selection(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer)
    engine.precompute(PASSAGES[:3])
    segments = [Chunk(c) for c in PASSAGES[:3]] + ["Question: who ran the ferry?"]
    spans = engine.prompts.build(segments).chunk_spans
    reused = torch.cat([torch.arange(s.start, s.end) for s in spans])
    keep = math.ceil(0.2 * reused.numel() - 1e-9)  # as the engine counts
    own = engine.prefill(segments, strategy=CacheBlend(0.2)).recomputed[reused]
    # Favour the last reused tokens: exactly those are recomputed.
    favour_last = with_score(lambda rows, deviation, sizes: rows.float(), CacheBlend(0.2))
    forced = engine.prefill(segments, strategy=favour_last).recomputed[reused]
    assert forced.nonzero().squeeze(1).tolist() == list(range(reused.numel() - keep, reused.numel()))
    assert not torch.equal(forced, own)
    # The engine's own score is untouched.
    assert torch.equal(engine.prefill(segments, strategy=CacheBlend(0.2)).recomputed[reused], own)


def test_peers_decode_the_same_number_of_tokens_and_skip_what_is_missing(tokenizer, monkeypatch):
    import sys

    from benchmarks.peers import HFPeer, RagblendPeer, make_peers

    engine = make_tiny_engine("llama", tokenizer)
    question = "Who ran the ferry?"
    layout = engine.build_prompt([Chunk(p) for p in PASSAGES[:2]] + [question])
    monkeypatch.setitem(sys.modules, "llama_cpp", None)      # as if it were not installed
    peers, notes = make_peers("smollm2", engine, PASSAGES[:2], layout.chunk_spans[0].start, 5, 1024)
    assert "llama-cpp-python" not in peers and notes["llama-cpp-python"].startswith("skipped")
    for name, peer in peers.items():
        ttft, total = peer.answer([Chunk(p) for p in PASSAGES[:2]] + [question] if isinstance(peer, RagblendPeer)
                                  else layout.token_ids)
        assert 0 < ttft <= total, name
    assert engine.last_stats.generated_tokens == 5 and engine.last_stats.chunks_reused == 2
    assert "ragblend, decode_dtype='int4'" in peers   # the default's decoding beside 4-bit decoding
    prefixed = peers["transformers, cached system prefix"]
    assert isinstance(prefixed, HFPeer) and prefixed.prefix_cache.get_seq_length() == layout.chunk_spans[0].start


def test_runs_of_neighbours_recompute_a_window_around_what_the_question_attends_to(tokenizer):
    from benchmarks.fidelity import QuestionAttentionInRuns
    from ragblend.core.fusion.selection import FusionPrompt, ReusedSpan

    # two chunks of 20 tokens at 2..22 and 22..42, the question after them
    prompt = FusionPrompt.build(48, [ReusedSpan(2, 20), ReusedSpan(22, 20)], "cpu")
    relevance = torch.full((3, 40), 0.001)
    relevance[:, 5] = 1.0    # a peak inside the first chunk (position 7)
    relevance[:, 20] = 0.9   # ... and one on the second chunk's first token (position 22)
    chosen = QuestionAttentionInRuns(0.2, run=5).first(prompt, lambda: relevance)   # a budget of 8
    reused_chosen = sorted(p for p in chosen.nonzero().squeeze(1).tolist() if prompt.reused[p])
    # the run of 5 around position 7, and the 3 tokens of the second chunk whose window holds its
    # first: a window stays inside its chunk, so the first chunk's last tokens (20, 21) are not taken
    assert reused_chosen == [5, 6, 7, 8, 9, 22, 23, 24]
    assert chosen[:2].all() and chosen[42:].all()   # the uncached tokens are always computed
    # max-pooled: each peak with its neighbours, the strongest first (7 +- 2, then 22 and the
    # next two, the peak first within its window); the same budget of 8
    peaks = QuestionAttentionInRuns(0.2, run=5, pool="max").first(prompt, lambda: relevance)
    assert sorted(p for p in peaks.nonzero().squeeze(1).tolist() if prompt.reused[p]) == [5, 6, 7, 8, 9, 22, 23, 24]
    # a window as a fraction of the chunk: 1/4 of 20 tokens is 5, the same selection
    by_fraction = QuestionAttentionInRuns(0.2, run=1 / 4).first(prompt, lambda: relevance)
    assert torch.equal(by_fraction, chosen)
    # end to end on a tiny model: a fused prefill with the variant runs and computes its budget
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(PASSAGES[:2])
    pre = engine.prefill([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), "What is it?"],
                         strategy=QuestionAttentionInRuns(0.3, run=9))
    assert 0 < pre.stats.compute_fraction < 1 and pre.logits.isfinite().all()


def test_answer_quality_scores_each_answerer_against_the_gold_answers(tokenizer):
    """research.answer_quality: full prefill, the shipped strategy and the reversed order each
    answer; a gold answer equal to full prefill's own reply scores it as having the answer."""
    from benchmarks.common import Prompt
    from research.answer_quality import ANSWERERS, score

    engine = make_tiny_engine("llama", tokenizer)
    prompt = Prompt(PASSAGES[:3], "Question: who ran the ferry?", ["a gold answer no tiny model writes"])
    row = score(engine, prompt, greedy_tokens=6)
    assert set(row) == set(ANSWERERS)
    assert all(0 <= r["f1"] <= 1 and r["has_answer"] == 0.0 for r in row.values())
    own = row["full prefill"]["text"]
    if own.strip(" .,!?"):   # a reply of punctuation alone normalises to nothing
        rescored = score(engine, Prompt(PASSAGES[:3], prompt.question, [own]), greedy_tokens=6)
        assert rescored["full prefill"]["has_answer"] == 1.0


def test_sample_questions_reverse_the_chunks_and_keep_the_rest_in_place():
    from ragblend.core.prompt import ChunkSpan, PromptLayout
    from research.sample_questions import questions, reversed_chunks

    a, b = (10, 11, 12), (20, 21)
    layout = PromptLayout([1, 2, 10, 11, 12, 3, 20, 21, 4], [ChunkSpan(2, 5, a), ChunkSpan(6, 8, b)])
    flipped = reversed_chunks(layout)
    assert flipped.token_ids == [1, 2, 20, 21, 3, 10, 11, 12, 4]
    assert [(s.start, s.end, s.token_ids) for s in flipped.chunk_spans] == [(2, 4, b), (5, 8, a)]
    partial = PromptLayout([1, 11, 12, 3, 20, 4], [ChunkSpan(1, 3, a, offset=1), ChunkSpan(4, 5, b)])
    assert reversed_chunks(partial).token_ids == [1, 20, 3, 11, 12, 4]   # a span's own part of its chunk
    assert len(questions()) >= 8 and all(q and gold for q, gold in questions())


def test_fidelity_tables_pool_earlier_runs_without_a_model(tmp_path, capsys):
    """`benchmarks.fidelity --from-json a.json b.json`: a set's prompts from two runs in one table."""
    import json

    from benchmarks.fidelity import NOISE, main

    def prompt(kl):
        row = {"compute": 0.1, "kl": kl, "same_first": 1.0, "rouge": 1.0, "answer_kl": kl, "same_answer": 1.0}
        return {"QueryAware(0.10)": row, NOISE: dict(row, compute=1.0, kl=0.1, answer_kl=0.1)}

    for name, kls in (("a", [0.01, 0.02]), ("b", [0.5])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"m/musique": [prompt(kl) for kl in kls]}))
    main(["--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "## m/musique (3 prompts, pooled)" in out
    assert "| QueryAware(0.10) | 10.0% | 0.1767 | 0.0200 |" in out   # mean and median over all three
    assert "| 1 |" in out   # 0.5 is over 3x the noise's median answer KL


def test_the_scaling_benchmark_times_a_shape_with_random_weights(monkeypatch, tmp_path):
    """``benchmarks.scaling --shape``: a random-weight model of a named shape, its chunks read
    from the memory store and from a disk store (every chunk token from the store both times)."""
    import benchmarks.scaling as scaling

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(scaling.SHAPES, "tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2,
                                                     max_position_embeddings=8192))
    lines = scaling.measure_shape("tiny", "cpu", [1024], runs=1, ratio=0.15)
    row = lines[-2].strip("|").split("|")
    assert int(row[0].replace(",", "")) > 900 and float(row[2]) > 0 and float(row[3]) > 0
    memory_hits, disk_hits = (int(x.replace(",", "")) for x in row[-1].split("/"))
    assert memory_hits == disk_hits > 900


def test_answer_preview_selects_as_queryaware_on_the_relevance_it_is_given(tokenizer):
    """``research.answer_preview``: a selection on a relevance given in advance fuses exactly as
    QueryAware does when given the relevance QueryAware's own first pass measured; with answer
    tokens after the prompt, that first pass sees them and the relevance changes."""
    from ragblend import QueryAware
    from research.answer_preview import GivenRelevance, relevance_with_answer

    engine = make_tiny_engine("qwen2", tokenizer, kv_dtype="float32")
    engine.precompute(PASSAGES[:3])
    layout = engine.prompts.build([Chunk(p) for p in PASSAGES[:3]] + ["Question: who ran the ferry?"], None)
    recorder = GivenRelevance(0.2)
    measured = engine.prefill(layout, strategy=recorder)
    again = engine.prefill(layout, strategy=GivenRelevance(0.2, recorder.relevance))
    assert torch.equal(again.recomputed, measured.recomputed) and torch.equal(again.logits, measured.logits)
    assert torch.equal(engine.prefill(layout, strategy=QueryAware(0.2, per_chunk=0)).recomputed, measured.recomputed)
    with_answer = relevance_with_answer(engine, layout, tokenizer.encode(" the ferry was run by"), 0.2)
    assert with_answer.shape == recorder.relevance.shape and not torch.equal(with_answer, recorder.relevance)


def test_the_near_tie_table_compares_each_steps_top_two_with_the_reference_layers(tokenizer):
    """Float32 decoding matches the reference layers' margins; 4-bit weights quantized at load
    move them, and the row counts the steps under NEAR_TIE and the picks that differ."""
    segments = [Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), "Question: who ran the ferry?"]
    exact = make_tiny_engine("llama", tokenizer, decode_dtype="float32", prompt_lookup_num_tokens=0)
    four = make_tiny_engine("llama", tokenizer, decode_dtype="int4", decode_kv_dtype="float32")
    pre = exact.prefill(segments)
    answer = exact.generate(segments, max_new_tokens=10).token_ids
    same = teacher_forced_steps(exact, pre, answer)
    moved = teacher_forced_steps(four, exact.prefill(segments), answer)
    assert len(same) == len(moved) == len(answer) - 1
    assert all(step["gap_error"] < 1e-4 and not step["differs"] and step["kl"] < 1e-6 for step in same)
    assert max(step["gap_error"] for step in moved) > 1e-3
    cells = near_tie_line("tiny", "int4", moved).strip("| ").split(" | ")
    assert cells[:3] == ["tiny", "int4", str(len(moved))]
    assert int(cells[6]) == sum(step["differs"] for step in moved)


def test_the_user_like_benchmark_judges_each_bucket_by_issue_59s_rule():
    """``benchmarks.userlike``: a repeating answer is three of the same words in a row, and a setting
    fails a bucket on lost accuracy, KL over the order noise, a repeat full prefill does not give,
    or a fused prefill slower than full prefill's beyond the timing noise."""
    from benchmarks.userlike import judge, repeats, timing_noise

    assert repeats("The answer is: 2022-09-24 2022-09-24 2022-09-24")
    assert repeats("a king size king size king size")
    assert not repeats("a 2-in-1, which is a 2-in-1, a 2-in-1,") and not repeats("The Sanderling.")
    assert not repeats("the cat sat on the mat by the door")
    # lists say their frame again with new words in it: not a degenerate answer
    assert not repeats("The first step is to mix, the second step is to bake, the third step is to cool.")

    def row(right=1.0, kl=0.01, repeating=False, cpu=0.5, skipped=False):
        return {"full_right": 1.0, "full_repeats": False, "noise_kl": 0.02, "full_cpu": 1.0, "full_cpu_again": 1.02,
                "always_right": right, "always_kl": kl, "always_repeats": repeating, "always_cpu": cpu,
                "always_skipped": skipped}

    noise = timing_noise([row()] * 4)
    assert noise == 0.05   # the floor: the two full prefills differ by 2%
    assert judge([row()] * 20, "always", noise) == []
    assert judge([row()] * 19 + [row(right=0.0)], "always", noise) == []          # 1 in 20 lost: within
    # 10 right against 7 of 60 (the 600-1,200 bucket of 2026-12-06): exactly 1 in 20, within
    edge = [row()] * 7 + [row(right=0.0)] * 3 + [{**row(right=0.0), "full_right": 0.0}] * 50
    assert judge(edge, "always", noise) == []
    assert judge([row()] * 8 + [row(right=0.0)], "always", noise) == ["accuracy 89% against 100%"]
    assert "KL median" in " ".join(judge([row(kl=0.05)] * 3, "always", noise))
    assert judge([row(), row(repeating=True)], "always", noise) == ["1 repeating answer(s) full prefill does not give"]
    assert judge([row(cpu=1.2)], "always", noise) == ["1 fused prompt(s) slower than full prefill beyond noise"]
    assert judge([row(cpu=1.2, skipped=True)], "always", noise) == []   # a skipped prompt ran the full prefill


def test_the_user_like_benchmark_shows_the_order_noises_own_answers():
    """Beside the rule's verdict, the bucket's order noise (full prefill, chunks reversed): its gold
    accuracy and repeats, so that a lost answer can be read against what the order alone loses; rows
    of older runs (or one chunk retrieved) have none."""
    from benchmarks.userlike import noise_answers

    rows = [{"noise_right": 1.0, "noise_repeats": False}, {"noise_right": 0.0, "noise_repeats": True},
            {"noise_right": None, "noise_repeats": None}, {}]
    assert noise_answers(rows) == "50%, 1"
    assert noise_answers([{}, {"noise_right": None}]) == "-"


def test_accuracy_intervals_are_wilsons_and_the_paired_difference_newcombes():
    """A bucket's accuracies carry Wilson's 95% interval and the default against full prefill
    Newcombe's paired one: the Bentur et al. (2009) table of Fagerland, Lydersen and Laake (2014)
    gives -0.286 [-0.507, -0.026]; agreeing answers narrow the interval, unpaired they would not."""
    from benchmarks.common import paired_difference, wilson_interval

    assert wilson_interval(0, 10)[0] == 0.0 and 0.27 < wilson_interval(0, 10)[1] < 0.28
    low, high = wilson_interval(5, 10)
    assert math.isclose(low, 1 - high) and 0.23 < low < 0.24
    # 1 both right, 1 only the first, 7 only the second, 12 neither
    first, second = [1, 1] + [0] * 19, [1, 0] + [1] * 7 + [0] * 12
    value, low, high = paired_difference([bool(x) for x in first], [bool(x) for x in second])
    assert (round(value, 3), round(low, 3), round(high, 3)) == (-0.286, -0.507, -0.026)
    # 40 prompts, 2 lost and none gained: the difference is -5%, its interval spans 0 and stays narrow
    value, low, high = paired_difference([True] * 8 + [False] * 32, [True] * 10 + [False] * 30)
    assert math.isclose(value, -0.05) and -0.2 < low < -0.05 < 0 < high < 0.05
    assert paired_difference([True, False], [True, False]) == (0.0, *paired_difference([True, False], [True, False])[1:])
    with pytest.raises(ValueError):
        paired_difference([True], [])


def test_the_user_like_benchmark_fills_only_the_buckets_asked_for_up_to_a_cap(tmp_path):
    """``--buckets 600-1200 1200-2000 --prompts N``: a question's configurations go to the emptiest
    buckets asked for that hold fewer than N prompts, two at most; the report reads saved rows back
    and shows the intervals beside the rule, for the buckets asked for only."""
    import json

    from benchmarks.userlike import choose_prompts, interval_lines, main, parse_bucket

    estimates = {128: [120, 240, 360, 480, 600, 720], 512: [500, 1000, 1500, 2000, 2500, 3000]}
    wanted = {(600, 1200): 3, (1200, 2000): 1}
    chosen = choose_prompts(estimates, wanted, None, 0)
    assert len(chosen) == 2 and chosen[0] == (512, 3)           # 1,200-2,000 first: it is the emptier
    assert choose_prompts(estimates, wanted, 3, 0) == [(512, 3)]  # 600-1,200 is full
    assert choose_prompts(estimates, {(600, 1200): 3}, 3, 0) == []
    assert parse_bucket("600-1200") == (600, 1200)
    with pytest.raises(Exception, match="none of"):
        parse_bucket("600-1300")

    def row(tokens, full, default, noise):
        return {"model": "m", "tokens": tokens, "default": "always", "full_right": full, "always_right": default,
                "noise_right": noise, "noise_kl": 0.05, "always_kl": 0.01, "full_repeats": False,
                "always_repeats": False, "noise_repeats": False, "full_ttft": 2.0, "always_ttft": 1.0,
                "full_cpu": 2.0, "full_cpu_again": 2.0, "always_cpu": 1.0, "always_skipped": False}

    rows = [row(700, 1.0, 1.0, 1.0)] * 18 + [row(700, 1.0, 0.0, 0.0)] * 2 + [row(1500, 0.0, 0.0, None)] * 3
    lines = interval_lines(rows, [(600, 1200), (1200, 2000)])
    cells = [line for line in lines if line.startswith("| m | 600-1200")][0].strip("| ").split(" | ")
    assert cells[2:] == ["20", "100% [84%, 100%]", "90% [70%, 97%]", "90% [70%, 97%]", cells[6], cells[7],
                         "+0.0% [-15.7%, +15.7%]", "no"]
    assert cells[6].startswith("-10.0% [") and cells[7].startswith("-10.0% [")
    no_noise = [line for line in lines if line.startswith("| m | 1200-2000")][0]
    assert "| 0% [0%, 56%] | - | +0.0% [" in no_noise and no_noise.endswith("| - | - | yes |")
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"rows": rows, "notes": ["- a note"]}))
    main(["--rows", str(saved), "--buckets", "600-1200", "--out", str(tmp_path)])
    report = (tmp_path / "userlike.md").read_text()
    assert "| m | 600-1200 | 20 | always (0), default |" in report and "1200-2000" not in report
    assert "- a note" in report


def test_the_user_like_benchmark_lets_the_cpu_lock_go_only_after_holding_it_a_while(tmp_path):
    """``--lock``: held across prompts for ``--lock-minutes``, then let go between two of them; a
    job waiting on the same lock (``flock`` takes flock(2) too) gets it then."""
    import fcntl

    from benchmarks.userlike import CpuLock

    path = tmp_path / "cpu.lock"

    def free() -> bool:
        with open(path, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other, fcntl.LOCK_UN)
            return True

    lock = CpuLock(path, hold_s=3600)
    with lock.hold():
        assert not free()
    assert not free()                 # between two prompts, well inside the hold
    lock.release()
    assert free()
    brief = CpuLock(path, hold_s=0)
    with brief.hold():
        assert not free()
    assert free()                     # held its time: let go after the block
    with CpuLock(None).hold():        # no path, no lock
        assert free()


def test_fidelity_judges_gold_answers_and_repeats_beside_the_reference():
    """``benchmarks.fidelity``: each row's gold answer and repeat, and the reference's own, in the table."""
    from benchmarks.fidelity import NOISE, gold_in, table

    assert gold_in("The Sanderling.", ["Sanderling"]) == 1.0 and gold_in("LCT app", ["Sanderling"]) == 0.0
    assert gold_in(None, ["x"]) != gold_in(None, ["x"]) and gold_in("x", []) != gold_in("x", [])   # nan

    def row(gold, repeating, **more):
        return {"kl": 0.01, "compute": 0.2, "rouge": 0.5, "same_first": 1.0, "full_prefill": 0.0, "gold": gold,
                "repeats": repeating, **more}

    results = [{"default": row(1.0, 0.0), NOISE: row(0.0, 0.0, reference_gold=1.0, reference_repeats=0.0)},
               {"default": row(0.0, 1.0), NOISE: row(1.0, 0.0, reference_gold=1.0, reference_repeats=1.0)}]
    lines = table(results, 32)
    assert "gold answer | repeating answers |" in lines[0]
    assert lines[2].endswith("| 50% | 1 |") and lines[3].endswith("| 50% | 0 |")
    assert "Full prefill (the reference): gold answer 100%, repeating answers 1." in lines


def test_the_user_like_benchmark_fills_size_buckets_from_the_retrieved_chunks():
    """A configuration is chosen where the retrieved chunks put the prompt well inside the bucket, the
    chunk sizes taken in turn; the Reddit set's one huge article becomes documents of 5 paragraphs."""
    from benchmarks.common import SQUAD_SHIFTS
    from benchmarks.userlike import PROMPT_OVERHEAD, choose_config, squad_corpus

    estimates = {128: [120, 240, 360, 480, 600, 720], 512: [500, 1000, 1500, 2000, 2500, 3000]}
    assert choose_config(estimates, (300, 600), 0) == (128, 3)      # 360 + the overhead, near the middle
    low, high = 2000, 3200
    chunk_size, top_k = choose_config(estimates, (low, high), 0)
    assert chunk_size == 512 and low < estimates[512][top_k - 1] + PROMPT_OVERHEAD < high
    assert {choose_config(estimates, (600, 1200), turn)[0] for turn in range(2)} == {128, 512}
    assert choose_config({128: [100, 200]}, (2000, 3200), 0) is None

    documents, questions = squad_corpus(SQUAD_SHIFTS[0], 10)
    assert len(documents) == 6 and len(questions) == 10
    for item in questions:
        assert any(answer in document for answer in item["answers"] for document in documents)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), offsets=st.data(),
       ratio=st.floats(0.01, 1.0), head=st.integers(0, 48), seed=st.integers(0, 2**16))
def test_chunk_heads_within_the_budget_give_every_chunk_its_floor(sizes, offsets, ratio, head, seed):
    """``benchmarks.fidelity``'s chunk-start variants: within the budget, the recompute is the ratio's
    exactly and every chunk but the first gets its first tokens, as many as the budget can give each;
    on top of it, the heads come besides the question's choice."""

    from benchmarks.fidelity import QuestionAttentionWithHeads
    from ragblend.core.fusion.selection import FusionPrompt, QuestionAttention, ReusedSpan

    spans, position = [], 3
    for size in sizes:
        spans.append(ReusedSpan(position, size, offset=offsets.draw(st.integers(0, 3))))
        position += size + 1                              # a fresh token between chunks
    prompt = FusionPrompt.build(position + 4, spans, "cpu")
    relevance = torch.rand(prompt.num_reused, generator=torch.Generator().manual_seed(seed))[None]
    within = QuestionAttentionWithHeads(ratio, head, within_budget=True)
    selected = within.first(prompt, lambda: relevance)
    budget = within.budget(prompt.num_reused)
    assert int(selected[prompt.reused].sum()) == budget and selected[~prompt.reused].all()
    floor = min(head, budget // max(1, len(spans) - 1))
    on_top = QuestionAttentionWithHeads(ratio, head).first(prompt, lambda: relevance)
    plain = QuestionAttention(ratio, cached_attention_scale=0.7).first(prompt, lambda: relevance)
    assert (on_top >= plain).all()
    for span in spans[1:]:
        owed = min(max(0, floor - span.offset), span.num_tokens)
        assert selected[span.start:span.start + owed].all()
        heads = min(max(0, head - span.offset), span.num_tokens)
        assert on_top[span.start:span.start + heads].all()


def test_the_model_sizes_report_gives_the_whole_process_beside_the_engines_own_memory():
    """Issue 55's memory is judged on the engine's own RSS; the whole process's is never hidden."""
    from benchmarks.model_sizes import report

    gb = 10 ** 9
    memory_only = {"shape": "qwen2.5-1.5b", "file_bytes": 1 * gb, "threads": 2, "process_rss": 2 * gb,
                   "ragblend_rss": int(1.5 * gb), "library_rss": int(0.25 * gb), "weights_bytes": int(1.1 * gb),
                   "ragblend_rss_with_kv": int(1.6 * gb), "ragblend_peak": 3 * gb, "prompt_tokens": 37,
                   "short_prompt_s": 2.0, "load_s": 9.0}
    lines = report([memory_only], tokens=8, runs=1)
    row = next(line for line in lines if line.startswith("| qwen2.5-1.5b"))
    assert row == ("| qwen2.5-1.5b | 1.00 | 2.00 (2.00x) | 1.50 (1.50x) | 0.25 | 1.25 (1.25x) | 1.10 (1.10x) | "
                   "1.60 (1.60x) | - |")
    assert not any("TTFT" in line for line in lines)   # --memory-only: no timed rounds to report


def test_the_model_sizes_ratios_are_timed_in_the_same_rounds_with_the_rows_each_computed(tokenizer):
    """``--ratios``: each QueryAware ratio but the engine's default is a peer of its own on the
    same precomputed chunks; the report gives per ratio the rows computed and llama.cpp / fused."""
    from benchmarks.model_sizes import ratio_peers, report, timed_rounds
    from benchmarks.peers import RagblendPeer

    engine = make_tiny_engine("llama", tokenizer)
    sample = {"chunks": PASSAGES[:4], "question": "Who ran the ferry?"}
    result = {"default_ratio": engine.resolve().ratio, "ratios": [0.3, 0.1]}
    assert result["default_ratio"] == 0.3   # uncalibrated
    peers = {"ragblend default": RagblendPeer(engine, sample["chunks"], 2), **ratio_peers(engine, "ragblend", result, 2)}
    assert list(peers) == ["ragblend default", "ragblend QueryAware 0.10"]
    times, rows = timed_rounds("tiny", engine, peers, sample, runs=1)
    default, low = rows["ragblend default"], rows["ragblend QueryAware 0.10"]
    assert low["prompt"] == default["prompt"] and 0 < low["uncached"] == default["uncached"]
    assert low["uncached"] < low["recomputed"] < default["recomputed"] and not low["skipped"]

    result.update(shape="tiny", file_bytes=10 ** 9, threads=2, process_rss=1, ragblend_rss=1, library_rss=0,
                  weights_bytes=1, ragblend_rss_with_kv=1, ragblend_peak=1, prompt_tokens=default["prompt"],
                  load_s=1.0, kv_bytes_per_token=1024, precompute_s=1.0, rows=rows,
                  ttft_s={"ragblend default": 2.0, "ragblend QueryAware 0.10": 1.0, "llama-cpp-python": 5.0},
                  decode_tps={"ragblend default": 10.0})
    lines = report([result], tokens=2, runs=1)
    assert any(line.startswith("- 0.10: the ratio SmolLM2 calibrates to") for line in lines)
    row = next(line for line in lines if line.startswith("| tiny | default | 0.10 |"))
    computed = low["recomputed"] + low["uncached"]
    assert row.endswith(f"| {computed} | {low['prompt'] / computed:.1f}x | 1.00 | 5.0x |")


def test_the_user_like_replay_reads_its_candidates_and_tables_lost_and_gained_answers():
    """``benchmarks.userlike --replay``: a candidate is QueryAware at a ratio with a floor for each
    chunk (as shipped, a given one, or none), and the table counts, per bucket, the answers each
    setting lost and gained against full prefill, and the repeats full prefill does not give."""
    from benchmarks.userlike_replay import candidate, replay_table
    from ragblend.core.fusion.strategies import PER_CHUNK

    assert (candidate("0.2").ratio, candidate("0.2").per_chunk) == (0.2, PER_CHUNK)
    assert candidate("0.1/0").per_chunk == 0 and candidate("0.1/32").per_chunk == 32
    assert candidate("0.1/24s").spread and not candidate("0.1/24").spread
    assert candidate("0.1").cached_attention_scale == 0.7   # QueryAware's, as the engine runs it

    def row(full, default, other, repeating=False):
        return {"tokens": 800, "same_prompt": True, "reproduced": True, "full_right": full, "full_repeats": False,
                "noise_right": full, "noise_kl": 0.05, "full_ttft_now": 2.0,
                **{f"{name}_{key}": value for name, right in (("default", default), ("0.1/0", other))
                   for key, value in (("right", right), ("kl", 0.01), ("repeats", repeating and name == "0.1/0"),
                                      ("ttft", 1.0), ("recomputed", 160))}}

    rows = [row(1.0, 1.0, 0.0), row(1.0, 0.0, 0.0), row(0.0, 1.0, 0.0, repeating=True), row(0.0, 0.0, 0.0)]
    lines = replay_table(rows, ["0.1/0"], [(600, 1200)])
    assert "4 the same prompt (token count), 4 with the stored default answer" in lines[0]
    default, other = (next(line for line in lines if f"| {name} |" in line) for name in ("default", "0.1/0"))
    assert "| 2 / 2 (1, 1) |" in default and "| 0 / 2 (2, 0) |" in other
    assert other.split("|")[8].strip() == "1" and "2.00x" in default and "20.0%" in default
