"""Query-aware selection and strategy names, on tiny random models (calibration: test_calibration.py)."""

import math

import pytest
import torch

from ragblend import Chunk, FullRecompute, QueryAware, RagblendError
from ragblend.core.fusion.selection import FusionPrompt, QuestionAttention, ReusedSpan
from ragblend.core.fusion.strategies import strategy_from_name
from ragblend.core.prompt import PromptBuilder

from ..conftest import PASSAGES, make_tiny_engine

CHUNKS = [f"{a} {b}" for a, b in zip(PASSAGES, PASSAGES[1:] + PASSAGES[:1])]


def test_question_attention_takes_the_most_attended_tokens():
    spans = [ReusedSpan(2, 4), ReusedSpan(7, 3)]          # positions 2-5 and 7-9 are reused
    prompt = FusionPrompt.build(12, spans, "cpu")
    relevance = torch.tensor([0.1, 0.9, 0.2, 0.3, 0.8, 0.05, 0.4])
    selected = QuestionAttention(3 / 7).first(prompt, lambda: relevance[None])   # one layer
    assert selected.nonzero().squeeze(1).tolist() == [0, 1, 3, 6, 7, 9, 10, 11]  # fresh + the top 3


def test_the_budget_is_at_least_per_chunk_tokens_for_each_cached_chunk():
    floor = QuestionAttention(0.1, per_chunk=24)
    assert floor.budget(700, chunks=6) == 144      # six 128-token chunks: 24 each, not 70
    assert floor.budget(1440, chunks=3) == 144     # three 480-token chunks: the ratio's 144, not 72
    assert floor.budget(100, chunks=6) == 25       # 17-token chunks: a quarter of them at most
    assert QuestionAttention(0.5, per_chunk=24).budget(100, chunks=6) == 50   # a larger ratio as it is
    assert QuestionAttention(0.1).budget(700, chunks=6) == 70   # per_chunk 0: the ratio alone
    # still the question's choice: the floor adds the most attended tokens, wherever they are
    spans = [ReusedSpan(1, 4), ReusedSpan(5, 4), ReusedSpan(9, 4)]
    prompt = FusionPrompt.build(15, spans, "cpu")
    relevance = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0])
    selected = QuestionAttention(0.1, per_chunk=1).first(prompt, lambda: relevance[None])
    assert selected.nonzero().squeeze(1).tolist() == [0, 5, 6, 11, 13, 14]   # 3 of 12 reused, not 2
    assert QuestionAttention(0.1, per_chunk=4).budget(12, chunks=3) == 3     # a quarter at most


@pytest.mark.parametrize("bad", [-1, 2.5, True, "24"])
def test_a_bad_per_chunk_is_a_clear_error(bad):
    with pytest.raises(RagblendError, match="per_chunk"):
        QueryAware(0.1, per_chunk=bad)


def test_whole_chunks_fill_the_budget_with_the_most_attended_chunk_first():
    spans = [ReusedSpan(0, 4), ReusedSpan(4, 3)]
    prompt = FusionPrompt.build(9, spans, "cpu")
    relevance = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.25])  # totals: chunk 0 0.4, chunk 1 0.75
    selected = QuestionAttention(5 / 7, whole_chunks=True).first(prompt, lambda: relevance[None])
    # chunk 1 (total 0.75) whole, then the budget's remaining 2 tokens from chunk 0
    assert selected[4:7].all() and int(selected[:4].sum()) == 2


def test_a_neighbour_window_chooses_runs_inside_each_chunk():
    spans = [ReusedSpan(0, 16), ReusedSpan(16, 16)]
    prompt = FusionPrompt.build(34, spans, "cpu")
    relevance = torch.full((32,), 0.01)
    relevance[3] = 1.0                                   # an isolated peak in chunk 0
    relevance[18:23] = 0.6                               # a dense stretch in chunk 1
    alone = QuestionAttention(5 / 32).first(prompt, lambda: relevance[None])
    assert alone[3] and int(alone[18:23].sum()) == 4     # single tokens: the peak first
    # a window of 1/4 of a chunk (4 tokens, made odd: 5): the dense stretch outranks the peak
    runs = QuestionAttention(5 / 32, neighbour_window=0.25).first(prompt, lambda: relevance[None])
    assert runs[18:23].all() and not runs[:16].any()
    assert QuestionAttention(0.5, neighbour_window=0.25).window(16) == 5
    with pytest.raises(RagblendError, match="neighbour_window"):
        QueryAware(0.2, neighbour_window=2)


def test_sentence_runs_choose_the_sentences_the_question_reads():
    spans = [ReusedSpan(0, 12), ReusedSpan(12, 8)]
    ends = torch.zeros(22, dtype=torch.bool)
    ends[[3, 9, 15]] = True              # sentences 0-3, 4-9, 10-11 (the span ends), 12-15, 16-19
    prompt = FusionPrompt.build(22, spans, "cpu", ends)
    assert prompt.sentence_of.tolist() == [0] * 4 + [1] * 6 + [2] * 2 + [3] * 4 + [4] * 4
    relevance = torch.full((20,), 0.01)
    relevance[1] = 0.8                   # a peak alone in sentence 0
    relevance[12:16] = 0.4               # sentence 3, read throughout
    selected = QuestionAttention(4 / 20, sentence_runs=True).first(prompt, lambda: relevance[None])
    assert selected[12:16].all() and int(selected[:12].sum()) == 0
    alone = QuestionAttention(4 / 20).first(prompt, lambda: relevance[None])
    assert alone[1]                      # single tokens: the peak first
    # a token read far more than its sentence comes before a sentence read evenly (claim: its
    # sentence's mean 0.34 plus a quarter of its own 2.0, against 0.4 + 0.1)
    relevance[4:10] = torch.tensor([0.01, 0.01, 2.0, 0.01, 0.01, 0.01])
    peak = QuestionAttention(4 / 20, sentence_runs=True).first(prompt, lambda: relevance[None])
    assert peak[6] and int(peak[12:16].sum()) == 3 and int(peak[:20].sum()) == 4
    # a sentence only partly in the budget gives its most attended tokens first
    relevance[4:10] = torch.tensor([0.5, 0.9, 0.5, 0.5, 0.5, 0.4])   # mean 0.55, over sentence 3
    partial = QuestionAttention(5 / 20, sentence_runs=True).first(prompt, lambda: relevance[None])
    assert partial[4:9].all() and not partial[9] and not partial[12:16].any()
    with pytest.raises(RagblendError, match="sentence ends"):
        QuestionAttention(0.2, sentence_runs=True).first(FusionPrompt.build(22, spans, "cpu"), lambda: relevance[None])
    with pytest.raises(RagblendError, match="not both"):
        QueryAware(0.2, sentence_runs=True, neighbour_window=1 / 16)
    with pytest.raises(RagblendError, match="sentence_runs"):
        QueryAware(0.2, sentence_runs="yes")


def test_sentence_runs_spend_the_same_budget_end_to_end(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    segments = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]
    alone = engine.prefill(segments, strategy=QueryAware(0.25))
    runs = engine.prefill(segments, strategy=QueryAware(0.25, sentence_runs=True))
    assert runs.stats.recomputed_tokens == alone.stats.recomputed_tokens
    assert not torch.equal(runs.recomputed, alone.recomputed) and runs.logits.isfinite().all()
    ends = engine.prompts.sentence_end_ids
    assert engine.prompts.tokenize(".")[0] in ends and engine.prompts.tokenize("ferry")[0] not in ends
    # the budget goes by sentence: the share of each sentence recomputed varies far more than
    # single tokens' (tiny random attention reads every sentence about alike, so few are whole)
    ids = runs.token_ids
    reused = torch.zeros(len(ids), dtype=torch.bool)
    for span in runs.layout.chunk_spans:
        reused[span.start:span.end] = True
    sentences, current = [], []
    for i in reused.nonzero().squeeze(1).tolist():
        if current and (i != current[-1] + 1 or ids[current[-1]] in ends):
            sentences.append(current)
            current = []
        current.append(i)
    sentences.append(current)

    def spread(chosen):   # the standard deviation of the sentences' recomputed shares
        return torch.tensor([chosen[s].float().mean() for s in sentences]).std()
    assert len(sentences) > 3 and spread(runs.recomputed) > 2 * spread(alone.recomputed)
    # an engine whose own strategy asks for sentences makes the ids when built, not in a TTFT
    built = make_tiny_engine("llama", tokenizer, strategy=QueryAware(0.25, sentence_runs=True))
    assert "sentence_end_ids" in vars(built.prompts)
    assert "sentence_end_ids" not in vars(make_tiny_engine("llama", tokenizer).prompts)


def test_sentence_end_ids_are_the_same_from_a_tokenizer_without_a_rust_backend(tokenizer):
    class PythonOnly:   # a slow tokenizer: batch_decode and no backend_tokenizer
        def __len__(self):
            return len(tokenizer)

        def batch_decode(self, ids):
            return tokenizer.batch_decode(ids)

    fast, slow = PromptBuilder(tokenizer), PromptBuilder(tokenizer)
    slow.tokenizer = PythonOnly()
    assert slow.sentence_end_ids == fast.sentence_end_ids and len(fast.sentence_end_ids) > 3


def test_runs_of_neighbours_spend_the_same_budget_end_to_end(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    segments = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]
    alone = engine.prefill(segments, strategy=QueryAware(0.25))
    runs = engine.prefill(segments, strategy=QueryAware(0.25, neighbour_window=0.25))
    assert runs.stats.recomputed_tokens == alone.stats.recomputed_tokens
    assert not torch.equal(runs.recomputed, alone.recomputed) and runs.logits.isfinite().all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_query_aware_counts_and_compute(arch, tokenizer):
    engine = make_tiny_engine(arch, tokenizer)
    engine.precompute(CHUNKS)
    segments = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]
    pre = engine.prefill(segments, strategy=QueryAware(0.25, per_chunk=0))
    reused = sum(len(engine.prompts.tokenize(c)) for c in CHUNKS[:3])
    fresh = pre.stats.prompt_tokens - reused
    assert pre.stats.recomputed_tokens == fresh + math.ceil(0.25 * reused - 1e-9)
    # as shipped, at 0.1 the floor for each of the three short chunks is in force (a quarter of them)
    floored = engine.prefill(segments, strategy=QueryAware(0.1)).stats.recomputed_tokens
    assert floored == fresh + QueryAware(0.1).selection().budget(reused, 3) == fresh + math.ceil(0.25 * reused - 1e-9)
    layers = engine.adapter.shape.num_layers
    # The question pass (fresh tokens at every layer) plus the second pass (fresh + chosen tokens).
    expected = layers * fresh + layers * pre.stats.recomputed_tokens
    assert pre.stats.compute_fraction == pytest.approx(expected / (layers * pre.stats.prompt_tokens))
    full = engine.prefill(segments, strategy=FullRecompute())
    assert (engine.prefill(segments, strategy=QueryAware(1.0)).logits - full.logits).abs().max() <= 1e-4


def test_the_question_decides_what_is_recomputed(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    chosen = [engine.prefill([Chunk(c) for c in CHUNKS] + [question], strategy=QueryAware(0.2)).recomputed
              for question in ("Question: who ran the ferry?", "Which bridge was replaced, and by whom?")]
    assert not torch.equal(chosen[0][:60], chosen[1][:60])


@pytest.mark.parametrize("name", ["legolink", "full_reuse", "full_recompute"])
def test_a_ratio_for_a_strategy_without_one_is_an_error(name):
    with pytest.raises(RagblendError, match=f"{name}' takes no ratio"):
        strategy_from_name(name, 0.3)
    assert strategy_from_name(name) is not None


def test_auto_ratio_is_cacheblends_only():
    from ragblend import CacheBlend

    assert strategy_from_name("cacheblend", "auto") == CacheBlend(ratio="auto")
    for name in ("default", "query_aware"):
        with pytest.raises(RagblendError, match="use strategy 'cacheblend'"):
            strategy_from_name(name, "auto")
    for name in ("legolink", "full_recompute"):   # no advice to give them a number
        with pytest.raises(RagblendError, match="takes no ratio"):
            strategy_from_name(name, "auto")


def test_a_call_naming_another_strategy_leaves_the_fields_ratio_behind(tokenizer):
    from ragblend.integrations.llamaindex_llm import BlendLLM

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    llm = BlendLLM(engine=engine, strategy="query_aware", ratio=0.3, max_new_tokens=2)
    llm.complete("Say hi.", strategy="full_recompute")   # the 0.3 is query_aware's, not full_recompute's
    assert engine.last_stats.strategy == "full_recompute"
    with pytest.raises(RagblendError, match="takes no ratio"):
        llm.complete("Say hi.", strategy="full_recompute", ratio=0.3)


def test_the_per_chunk_floor_counts_retrieved_chunks_not_history_pieces():
    # one 100-token chunk, then eight parts of a conversation's pieces (split around control tokens)
    spans = [ReusedSpan(1, 100), *[ReusedSpan(102 + 10 * i, 9, piece=True) for i in range(8)]]
    prompt = FusionPrompt.build(190, spans, "cpu")
    assert prompt.num_reused == 172 and prompt.num_chunks == 1
    selection = QueryAware(0.1).selection()
    selected = selection.first(prompt, lambda: torch.rand(2, prompt.num_reused))
    # max(ratio's 18, floor of 24 for the one chunk); counting the parts it was a quarter, 43
    assert int(selected[prompt.reused].sum()) == 24 == selection.budget(172, 1)


def test_query_aware_at_ratio_one_is_a_full_prefill_bit_for_bit(tokenizer):
    # Called directly (the runner would not fuse at ratio 1): nothing of the question pass is kept.
    from ragblend.core.fusion.pipeline import SequentialSource
    from ragblend.core.fusion.prefill import fused_prefill

    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute(CHUNKS)
    layout = engine.prompts.build([Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"])
    spans = [ReusedSpan(s.start, s.end - s.start) for s in layout.chunk_spans]
    source = SequentialSource([engine.store.open(engine.ingestion.key_for(s.token_ids)) for s in layout.chunk_spans])
    fused = fused_prefill(engine.adapter, layout.token_ids, spans, source, QueryAware(1.0))
    full = fused_prefill(engine.adapter, layout.token_ids, [], None, FullRecompute())
    assert torch.equal(fused.logits, full.logits)
    assert all(torch.equal(a, b) for a, b in zip(fused.keys, full.keys))
    assert all(len(p) == len(layout.token_ids) for p in fused.layer_positions)
