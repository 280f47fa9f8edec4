"""core.decode.answers: starting an answer after a fused prefill. The decoder's buffers hold the
prompt and the answer but never more than the context window; the answer ends at an end token
or the window; greedy float32 answers draft from the prompt, others do not. The answer's K/V
dtype (decode_kv_dtype): float16 only on low-bit weights and where it measures faster (a fake
timer drives the choice), close to float32's in every step."""

import json
import threading

import pytest
import torch

import ragblend.core.decode.generate as generate
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.decode.answers import Answers, decode_kv_dtype, eos_ids_of
from ragblend.core.decode.batching import batch_extend, kv_bytes_for, kv_bytes_per_position
from ragblend.core.decode.generate import KVDecoder, SamplingParams
from ragblend.core.errors import InvalidInputError
from ragblend.core.model.decode_weights import DecodeWeights

from ..conftest import PASSAGES, make_tiny_engine
from .test_batching import run_batch
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
    # made at the first pass, so that the first token (the prefill's logits) waits for no copy
    assert decoding.decoder._prompt is not None
    assert kv_bytes_per_position(decoding.decoder) * (n + 7) == kv_bytes_for(engine.adapter, n + 7)
    assert decoding.decoder._prompt is not None
    buffers = decoding.decoder.keys
    assert pre.keys[0].data_ptr() == buffers[0].data_ptr() and pre.keys[0].shape[1] == n
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


# -- the dtype of an answer's K/V (decode_kv_dtype)

def _fake_times(float32, float16):
    """A stand-in for kernels.fastest_rounds that reports these milliseconds, not a measurement."""
    def measure(workloads):
        assert set(workloads) == {"torch.float32", "torch.float16"}   # bfloat16 is never a candidate
        return {"torch.float32": float32 / 1e3, "torch.float16": float16 / 1e3}
    return measure


def test_auto_kv_dtype_is_float16_only_on_low_bit_weights_and_when_it_measures_faster(tokenizer):
    four = make_tiny_engine("llama", tokenizer, decode_dtype="int4", decode_kv_dtype="float32")
    weights = four.decode_weights
    assert decode_kv_dtype(weights, "auto", measure=_fake_times(10.0, 7.0)) == torch.float16
    # Within the noise (MIN_GAIN) of float32, or slower: float32.
    assert decode_kv_dtype(weights, "auto", measure=_fake_times(10.0, 9.9)) == torch.float32
    assert decode_kv_dtype(weights, "auto", measure=_fake_times(10.0, 12.0)) == torch.float32
    # Float32 weights decode exactly: their K/V stay float32, whatever a timer would say.
    exact = make_tiny_engine("llama", tokenizer, decode_dtype="float32")
    assert decode_kv_dtype(exact.decode_weights, "auto", measure=_fake_times(10.0, 1.0)) == torch.float32
    assert exact.answers.kv_dtype == torch.float32
    # Asked for by name: as named.
    assert decode_kv_dtype(exact.decode_weights, "bfloat16") == torch.bfloat16
    with pytest.raises(InvalidInputError, match="decode_kv_dtype must be one of"):
        make_tiny_engine("llama", tokenizer, decode_kv_dtype="int8")


def test_a_kv_dtype_two_timings_disagree_on_serves_the_process_and_is_kept_unsettled(tokenizer, tmp_path, monkeypatch):
    import ragblend.core.decode.answers as answers

    weights = make_tiny_engine("llama", tokenizer, decode_dtype="int4", decode_kv_dtype="float32").decode_weights
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(answers, "_MEASURED", {})
    timings = iter([_fake_times(10.0, 7.0), _fake_times(10.0, 12.0)] + [_fake_times(10.0, 7.0)] * 2)
    monkeypatch.setattr(answers, "fastest_rounds", lambda work: next(timings)(work))
    assert decode_kv_dtype(weights, "auto") == torch.float32   # a near tie or a busy machine: float32
    # issue 59: kept, marked unsettled (measured again at a quiet start), not measured by every process
    (path,) = (tmp_path / "host").glob("decode-kv-dtype-*.json")
    assert json.loads(path.read_text())["settled"] is False
    monkeypatch.setattr(answers, "_MEASURED", {})   # a later process on a quiet host: measures again, both agree
    import ragblend.core.model.host_cache as host_cache

    monkeypatch.setattr(host_cache, "host_is_quiet", lambda: True)
    assert decode_kv_dtype(weights, "auto") == torch.float16
    [path] = (tmp_path / "host").glob("decode-kv-dtype-*.json")
    assert json.loads(path.read_text())["value"] == "float16"


def test_auto_kv_dtype_is_measured_once_per_model_shape_and_threads(tokenizer, monkeypatch):
    import ragblend.core.decode.answers as answers

    monkeypatch.setattr(answers, "_MEASURED", {})
    four = make_tiny_engine("llama", tokenizer, decode_dtype="int4")   # measures with the real timer
    key = (four.adapter.shape, torch.get_num_threads())
    assert answers._MEASURED == {key: four.answers.kv_dtype}
    answers._MEASURED[key] = torch.bfloat16   # a marker no measurement gives: a second engine reads it
    assert make_tiny_engine("llama", tokenizer, decode_dtype="int4").answers.kv_dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_16_bit_kv_answers_close_to_float32_and_batched_steps_agree(tokenizer, arch):
    """K/V buffers in bfloat16: each step's distribution stays close to the float32 buffers'
    (with the fused prefill's key bias and Gemma 3's sliding window), and a batched step gives
    each sequence the logits of its own step."""
    from ragblend import QueryAware

    engine = make_tiny_engine(arch, tokenizer, decode_dtype="float32", decode_kv_dtype="bfloat16")
    assert engine.answers.kv_dtype == torch.bfloat16
    engine.precompute(PASSAGES[:3])
    pre = engine.prefill(segments(), strategy=QueryAware(0.3))
    answer = [5, 77, 300, 12, 900, 41]
    capacity = len(pre.token_ids) + len(answer)
    exact = KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias)
    half = KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias, dtype=torch.bfloat16)
    assert half.keys[0].dtype == torch.bfloat16 and exact.keys[0].dtype == torch.float32
    kls = [first_token_kl(exact.step(t), half.step(t)) for t in answer]
    assert max(kls) < 1e-3
    # A drafted pass verifies several tokens at once: each gets the logits it gets alone, to the
    # rounding of 16-bit attention (exactly on Llama; Gemma 3's windowed layers mask more keys).
    one, many = (KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias, dtype=torch.bfloat16)
                 for _ in range(2))
    singly, together = torch.stack([one.step(t) for t in answer[:4]]), many.extend(answer[:4])
    assert max(first_token_kl(a, b) for a, b in zip(singly, together)) < 1e-5
    alone = KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias, dtype=torch.bfloat16)
    other = KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias, dtype=torch.bfloat16)
    batched = batch_extend([alone, other], [5, 77])
    single = KVDecoder(engine.adapter, pre.keys, pre.values, capacity, pre.key_bias, dtype=torch.bfloat16).step(5)
    assert first_token_kl(single, batched[0]) < 1e-3   # the batch's softmax runs in float32, SDPA's in bfloat16
    # The engine's own answers run on them: generate and stream agree, and the KV budget counts 2 bytes.
    out = engine.generate(segments(), max_new_tokens=6)
    assert "".join(engine.stream(segments(), max_new_tokens=6)) == out.text
    assert kv_bytes_for(engine.adapter, 10, torch.bfloat16) * 2 == kv_bytes_for(engine.adapter, 10)


# -- a near-tied greedy pick on low-bit weights is made again on the float32 weights

def low_bit_and_float32(tokenizer):
    """Engines over one tiny model decoding on 4-bit and on float32 weights, one token a pass."""
    options = dict(decode_kv_dtype="float32", prompt_lookup_num_tokens=0)
    return (make_tiny_engine("llama", tokenizer, decode_dtype="int4", **options),
            make_tiny_engine("llama", tokenizer, decode_dtype="float32", **options))


def test_with_every_pick_a_near_tie_low_bit_decoding_gives_float32_decodings_answer(tokenizer, monkeypatch):
    four, exact = low_bit_and_float32(tokenizer)
    params = SamplingParams(max_new_tokens=16)
    want = exact.generate(segments(), params=params)
    monkeypatch.setattr(generate, "NEAR_TIE", 0.0)   # none made again: the weights quantized at load change it
    assert four.generate(segments(), params=params).token_ids != want.token_ids
    monkeypatch.setattr(generate, "NEAR_TIE", float("inf"))   # every pick a near tie
    got = four.generate(segments(), params=params)
    assert got.token_ids == want.token_ids
    assert four.last_stats.decode_rechecks == four.last_stats.decode_steps == len(got.token_ids) - 1
    fours = [four.begin(p, params=params) for p in (segments(), segments(), [segments()[-1]])]
    run_batch(four, fours)   # batched passes make them again alike
    assert fours[0].token_ids == fours[1].token_ids == want.token_ids
    assert all(d.rechecks == d.steps for d in fours)


def test_a_near_tie_makes_the_whole_answers_kv_float32_decodings(tokenizer, monkeypatch):
    """Six low-bit passes, then near ties: the first one runs every answer token since the
    prompt again in float32 (their low-bit K/V could tip it), each later one only the tokens
    since the last; the answer's K/V are then those float32 gives its tokens."""
    four, exact = low_bit_and_float32(tokenizer)

    def decode(near_tie_after_six):
        monkeypatch.setattr(generate, "NEAR_TIE", 0.0)
        decoding = four.begin(segments(), max_new_tokens=12)
        deltas = iter(decoding)
        while decoding.steps < 6:
            next(deltas)
        monkeypatch.setattr(generate, "NEAR_TIE", near_tie_after_six)
        list(deltas)
        return decoding

    def distance_from_float32_kv(decoding):
        n, end = decoding.prompt_len, decoding.decoder.length
        pre = decoding.prefill
        ref = KVDecoder(exact.adapter, pre.keys, pre.values, end, pre.key_bias)
        ref.extend(decoding.token_ids[:end - n])
        return max(float((a[:, n:end] - b[:, n:end]).abs().max())
                   for a, b in zip(decoding.decoder.keys + decoding.decoder.values, ref.keys + ref.values))

    low_bit, made_again = decode(0.0), decode(float("inf"))
    assert low_bit.rechecks == 0 and made_again.rechecks > 0
    assert made_again.exact_until == made_again.decoder.length
    assert distance_from_float32_kv(made_again) < 1e-5 < 1e-3 < distance_from_float32_kv(low_bit)


def test_without_near_ties_and_when_sampling_nothing_is_re_run(tokenizer, monkeypatch):
    four, exact = low_bit_and_float32(tokenizer)
    monkeypatch.setattr(generate, "NEAR_TIE", 0.0)   # no gap is under 0
    four.generate(segments(), max_new_tokens=8)
    assert four.last_stats.decode_steps == 7 and four.last_stats.decode_rechecks == 0
    monkeypatch.setattr(generate, "NEAR_TIE", float("inf"))
    four.generate(segments(), max_new_tokens=8, temperature=0.8, seed=1)   # sampling draws either token
    assert four.last_stats.decode_rechecks == 0
    exact.generate(segments(), max_new_tokens=8)   # float32 weights decide exactly already
    assert exact.last_stats.decode_rechecks == 0
