"""A fused answer that starts to loop falls back to the exact path (core.decode.repeats): the detector on
token lists, the fallback's continuation against a full prefill of prompt + kept answer, the answer
that ends where the exact path writes the dropped copy twice more, streams that never show a dropped copy,
and the batched decoding's fallback. Tiny random models; the rule is loosened (units of 1-2 tokens)
where a tiny model's answers loop only in short units."""

import dataclasses

import pytest

from ragblend import Chunk, FullRecompute, QueryAware
from ragblend.core.decode.batching import BatchDecoder
from ragblend.core.decode.generate import SamplingParams
from ragblend.core.decode.repeats import Repeat, RepeatGuard, RepeatRule

from ..conftest import PASSAGES, make_tiny_engine

WORDS = ["The", " ferry", " left", " at", " nine", ".", " It", " was", " late", "1", ",", "000", " |", " 0", "0"]


def words(ids):
    return "".join(WORDS[i] for i in ids)


def observed(tokens, rule=RepeatRule()):
    """Feed ``tokens`` to a guard: the first loop found (with the index of the token that completed it), and the guard."""
    guard = RepeatGuard(words, rule)
    for i, token in enumerate(tokens):
        repeat = guard.observe(token)
        if repeat is not None:
            return (i, repeat), guard
    return None, guard


def test_two_copies_of_a_sentence_back_to_back_are_a_loop():
    sentence = [0, 1, 2, 3, 4, 5]   # "The ferry left at nine."
    found, _ = observed(sentence + sentence + sentence)
    assert found == (11, Repeat(unit=6, start=6))
    # seen from any rotation: an answer that begins mid-unit loops all the same
    found, _ = observed([7, 8] + sentence + sentence)
    assert found == (13, Repeat(unit=6, start=8))
    # a unit of under 4 tokens three times: " left at nine left at nine left at nine"
    found, _ = observed([2, 3, 4] * 4)
    assert found == (8, Repeat(unit=3, start=3, copies=3))


@pytest.mark.parametrize("tokens", [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 0, 1, 2, 3, 4, 5],   # a sentence again, but not back to back
    [2, 3, 4, 2, 3, 4],                                 # a unit of 3 tokens twice ("New York, New York")
    [9] + [10, 14, 14, 14] * 4,                         # "1,000,000,000,000": a unit of under 8 characters
    [12, 13] * 12,                                      # "| 0 | 0 | 0": a run of a 2-token unit
    [3, 4, 3, 4, 3, 4, 3, 4, 3, 4],                     # " at nine" x5: runs of 4 are runs of 2 again
])
def test_what_legitimate_answers_hold_is_no_loop(tokens):
    found, _ = observed(tokens)
    assert found is None


def test_a_copy_in_progress_is_held_back_until_it_breaks():
    guard = RepeatGuard(words)
    for token in [0, 1, 2, 3, 4, 5, 0, 1, 2]:
        guard.observe(token)
    assert guard.held == 3   # "The ferry left" may be the second copy starting
    guard.observe(8)         # " late": it is not
    assert guard.held == 0


def test_real_text_without_loops_is_not_flagged(tokenizer):
    text = ("The ferry left at nine. The ferry came back at ten, and the ferry left again at noon. "
            "Steps: 1. Open the valve. 2. Open the valve cover. 3. Close it.")
    guard = RepeatGuard(tokenizer.decode)
    assert all(guard.observe(t) is None for t in tokenizer.encode(text))
    loop = tokenizer.encode("The ferry left at nine. The ferry left at nine. The ferry")
    guard = RepeatGuard(tokenizer.decode)
    assert any(guard.observe(t) is not None for t in loop)


def loosened_engine(arch, tokenizer, rule):
    engine = make_tiny_engine(arch, tokenizer)
    engine.precompute(PASSAGES)
    # a tiny random model's tokens need not be words
    engine.answers.repeat_rule = None if rule is None else dataclasses.replace(rule, needs_letter=False)
    return engine


def prompt(order):
    return [Chunk(PASSAGES[i]) for i in order] + ["Question: who ran the ferry?"]


def test_the_fallback_continues_as_a_full_prefill_of_prompt_and_kept_answer(tokenizer):
    """Qwen2, chunks reversed: the fused answer repeats a token at its 5th; the rest is what a full
    prefill of the prompt and the 4 tokens kept decodes, and the stats say so."""
    engine = loosened_engine("qwen2", tokenizer, RepeatRule(1, 1))
    fused = engine.generate(prompt((2, 1, 0)), strategy=QueryAware(0.3), max_new_tokens=48)
    stats = fused.stats
    kept = stats.fallback_tokens - stats.prompt_tokens
    assert stats.fusion_fallback.startswith("repeating answer") and 0 < kept < len(fused.token_ids)
    layout = engine.find_chunks_in_ids(fused.prompt_token_ids + fused.token_ids[:kept])
    exact = engine.generate(layout, strategy=FullRecompute(), max_new_tokens=48 - kept)
    assert exact.token_ids == fused.token_ids[kept:]
    assert fused.finish_reason == exact.finish_reason == "length"
    stream = engine.stream(prompt((2, 1, 0)), strategy=QueryAware(0.3), max_new_tokens=48)
    assert "".join(stream) == fused.text   # the dropped token was held back, never sent


def test_the_exact_path_may_write_the_dropped_copy_once_again(tokenizer):
    """Mistral: the fused answer's 2-token unit twice makes it fall back; the exact path writes that
    copy once more and goes its own way: the copy is shown (legitimate repeated text survives a
    false alarm), and only twice more would end the answer (DroppedCopy)."""
    engine = loosened_engine("mistral", tokenizer, RepeatRule(2, 2))
    unguarded = loosened_engine("mistral", tokenizer, None)
    params = SamplingParams(max_new_tokens=64)
    looping = unguarded.generate(prompt((0, 1, 2)), strategy=QueryAware(0.3), params=params)
    watched = engine.generate(prompt((0, 1, 2)), strategy=QueryAware(0.3), params=params)
    kept = watched.stats.fallback_tokens - watched.stats.prompt_tokens
    assert watched.stats.fusion_fallback.startswith("repeating answer") and watched.finish_reason == "length"
    assert watched.token_ids[:kept + 2] == looping.token_ids[:kept + 2]   # the copy, written again
    assert watched.token_ids[kept + 2:] != looping.token_ids[kept + 2:]
    assert engine.fusion_fallbacks == 1 and unguarded.fusion_fallbacks == 0
    # a stream shows exactly that answer: nothing of a dropped copy was sent twice
    stream = engine.stream(prompt((0, 1, 2)), strategy=QueryAware(0.3), params=params)
    assert "".join(stream) == watched.text and stream.stats.fusion_fallback == watched.stats.fusion_fallback


def test_a_full_prefills_answer_is_never_checked(tokenizer):
    engine = loosened_engine("mistral", tokenizer, RepeatRule(1, 1))
    unguarded = loosened_engine("mistral", tokenizer, None)
    exact = engine.generate(prompt((0, 1, 2)), strategy=FullRecompute(), max_new_tokens=48)
    assert exact.stats.fusion_fallback == "" and exact.stats.fallback_tokens == 0
    assert exact.token_ids == unguarded.generate(prompt((0, 1, 2)), strategy=FullRecompute(),
                                                 max_new_tokens=48).token_ids


def test_a_batched_answer_falls_back_between_steps(tokenizer):
    """In a BatchDecoder the looping member falls back alone; every member answers as it does alone."""
    engine = loosened_engine("qwen2", tokenizer, RepeatRule(1, 1))
    params, strategy = SamplingParams(max_new_tokens=24), QueryAware(0.3)
    prompts = [prompt((2, 1, 0)), prompt((0, 1, 2)), prompt((1, 3))]
    alone = [engine.generate(p, strategy=strategy, params=params) for p in prompts]
    assert alone[0].stats.fusion_fallback
    batch, texts = BatchDecoder(), {}
    decodings = [engine.begin(p, strategy=strategy, params=params) for p in prompts]
    for d in decodings:
        batch.add(d)
    while len(batch):
        for event in batch.step():
            assert event.error is None
            texts[id(event.member.decoding)] = texts.get(id(event.member.decoding), "") + event.delta
    for solo, together in zip(alone, decodings):
        assert together.token_ids == solo.token_ids and texts[id(together)] == solo.text
        assert engine.finish(together).fusion_fallback == solo.stats.fusion_fallback


def test_fallbacks_reach_the_servers_metrics_and_the_cli(capsys):
    from ragblend.cli.ask import print_answer
    from ragblend.core.results import Stats
    from ragblend.serving.app import Metrics

    metrics, looped = Metrics(), Stats(fusion_fallback="repeating answer: ...", fallback_tokens=695)
    metrics.answer(looped)
    metrics.answer(Stats())
    assert "ragblend_fusion_fallbacks_total 1\n" in metrics.text(0, None)

    class Answer:
        text, stats = "The team reviewed the matter.", looped

    print_answer("fused", Answer())
    assert "began to loop" in capsys.readouterr().out


@pytest.mark.parametrize("text", [
    "The zero matrix of shape 3x4 is:\n\n[[0, 0, 0, 0],\n [0, 0, 0, 0],\n [0, 0, 0, 0]]",
    "| Plan | Basic | Pro |\n|----------|----------|----------|\n| Support | Not included | Not included |",
    "rows = [\n    {\"qty\": 1}, {\"qty\": 1}, {\"qty\": 1},\n]",
])
def test_structured_text_is_no_loop_or_survives_the_fallback(tokenizer, text):
    """Rows of digits and punctuation never count; a unit with words that repeats once (two equal
    table cells) may make a fused answer fall back, but the answer goes on: only where the exact path
    writes the copy twice more does it end (DroppedCopy)."""
    from ragblend.core.decode.repeats import DroppedCopy

    guard = RepeatGuard(tokenizer.decode)
    found = [r for r in (guard.observe(t) for t in tokenizer.encode(text)) if r is not None]
    assert all(any(c.isalpha() for c in tokenizer.decode(tokenizer.encode(text)[r.start:r.start + r.unit]))
               for r in found)
    copy = tokenizer.encode(" Not included |")
    watch = DroppedCopy(copy)
    assert all(watch.observe(t) for t in copy) and not watch.complete   # written once again: shown
    assert all(watch.observe(t) for t in copy) and watch.complete       # twice more: the exact path loops


def test_a_fallback_that_fails_keeps_the_answer_so_far(tokenizer, caplog):
    """Out of memory in the fallback's full prefill: the answer ends at its kept text, in generate,
    stream and the batched decoder alike, and the stats say why."""
    engine = loosened_engine("qwen2", tokenizer, RepeatRule(1, 1))

    def no_memory(token_ids):
        raise MemoryError("no room for the exact K/V")

    engine.runner.exact_prefill = no_memory
    params, strategy = SamplingParams(max_new_tokens=48), QueryAware(0.3)
    kept = engine.generate(prompt((2, 1, 0)), strategy=strategy, params=params)
    assert kept.finish_reason == "stop" and kept.token_ids
    assert "the fallback failed (MemoryError)" in kept.stats.fusion_fallback
    assert "".join(engine.stream(prompt((2, 1, 0)), strategy=strategy, params=params)) == kept.text
    batch = BatchDecoder()
    member = batch.add(engine.begin(prompt((2, 1, 0)), strategy=strategy, params=params))
    events = []
    while batch.members:
        events += batch.step()
    assert all(e.error is None for e in events if e.member is member)
    assert "".join(e.delta for e in events if e.member is member) == kept.text


def test_a_stream_does_not_hold_back_runs_that_can_never_count(tokenizer):
    """A long zero matrix is runs of a short unit without words: no copy of it is held back."""
    text = "[[" + ",\n ".join("[" + ", ".join(["0"] * 8) + "]" for _ in range(12)) + "]]"
    guard = RepeatGuard(tokenizer.decode)
    most = 0
    for token in tokenizer.encode(text):
        assert guard.observe(token) is None
        most = max(most, guard.held)
    assert most == 0


def test_repetition_the_question_asked_for_is_left_to_the_exact_path(tokenizer):
    """A loop whose unit (any turn of it: a chorus's second half first) is text of the question is
    repetition asked for: after the fallback the exact path writes it as often as it does (no
    DroppedCopy watch, which would end the answer after one copy). Other loops are watched."""
    from ragblend.core.decode.repeats import RepeatGuard

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)   # noqa: E731
    guard = RepeatGuard(decode, asked="Write a poem whose chorus 'Oh Aberfinn, my home by the sea' follows each verse.")
    chorus = ids(" my home by the sea,\nOh Aberfinn,")   # found where two copies met: a turn of the chorus
    assert guard.asked_for(chorus) and guard.asked_for(ids("Oh Aberfinn, my home by the sea\n"))
    assert not guard.asked_for(ids(" It was a great product."))
    assert not RepeatGuard(decode).asked_for(chorus)   # no question, nothing asked for
    engine = make_tiny_engine("qwen2", tokenizer)
    engine.precompute(PASSAGES)
    decoding = engine.begin(prompt((0, 1, 2)), strategy=QueryAware(0.3), max_new_tokens=4)
    assert decoding.repeat_guard.asked.startswith("question: who ran the ferry")   # the text after the last chunk
    engine.finish(decoding)
