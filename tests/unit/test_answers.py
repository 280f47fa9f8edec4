"""core.answers: starting an answer after a fused prefill. The decoder's buffers hold the
prompt and the answer but never more than the context window; the answer ends at an end token
or the window; greedy float32 answers draft from the prompt, others do not."""

import threading

import pytest

from ragblend.core.answers import Answers, eos_ids_of
from ragblend.core.decode_weights import DecodeWeights
from ragblend.core.generate import SamplingParams

from ..conftest import make_tiny_engine
from .test_engine import segments


@pytest.fixture
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


def answers_for(engine, eos_ids=frozenset(), context_window=2048):
    """Answers wired by hand on the engine's own float32 adapter."""
    weights = DecodeWeights(engine.hf_model, engine.adapter, None, "float32", threading.RLock())
    return Answers(weights, engine.tokenizer, eos_ids, context_window, threading.RLock())


def test_the_buffers_hold_prompt_and_answer_and_the_prompt_kv_is_not_copied(engine):
    pre = engine.prefill(segments())
    n = len(pre.token_ids)
    decoding = answers_for(engine).start(pre, SamplingParams(max_new_tokens=7), draft_tokens=0)
    assert decoding.decoder.capacity == n + 7
    assert pre.keys[0].data_ptr() == decoding.decoder.keys[0].data_ptr() and pre.keys[0].shape[1] == n
    list(decoding)
    assert len(decoding.token_ids) == 7 and decoding.finish_reason == "length"


def test_the_capacity_is_capped_at_the_context_window_which_ends_the_answer(engine):
    pre = engine.prefill(segments())
    n = len(pre.token_ids)
    decoding = answers_for(engine, context_window=n + 5).start(pre, SamplingParams(max_new_tokens=100), draft_tokens=0)
    assert decoding.decoder.capacity == n + 5
    list(decoding)
    assert len(decoding.token_ids) == 5 and decoding.finish_reason == "length"


def test_an_end_token_ends_the_answer_and_is_not_part_of_it(engine):
    greedy = answers_for(engine).start(engine.prefill(segments()), SamplingParams(max_new_tokens=8), draft_tokens=0)
    list(greedy)
    answer = greedy.token_ids
    cut = next(i for i in range(1, len(answer)) if answer[i] not in answer[:i])   # its first appearance
    ended = answers_for(engine, eos_ids=frozenset({answer[cut]})).start(
        engine.prefill(segments()), SamplingParams(max_new_tokens=8), draft_tokens=0)
    list(ended)
    assert ended.token_ids == answer[:cut] and ended.finish_reason == "stop"


def test_only_greedy_answers_draft_from_the_prompt(engine):
    def lookup(temperature, draft_tokens):
        params = SamplingParams(max_new_tokens=4, temperature=temperature, seed=0)
        return answers_for(engine).start(engine.prefill(segments()), params, draft_tokens=draft_tokens).lookup

    assert lookup(0.0, 3) is not None
    assert lookup(0.7, 3) is None and lookup(0.0, 0) is None


def test_the_end_tokens_are_the_generation_configs_and_the_tokenizers(engine, tokenizer):
    model = engine.hf_model
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [5, 6]
        assert eos_ids_of(model, tokenizer) == {5, 6, tokenizer.eos_token_id}
        model.generation_config.eos_token_id = None
        assert eos_ids_of(model, tokenizer) == {tokenizer.eos_token_id}
    finally:
        model.generation_config.eos_token_id = saved
