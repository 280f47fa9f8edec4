"""Batched decoding across requests (core.decode.batching): sequences decoded together answer as each
decoded alone, join and leave between steps, and keep their own sampling and stop strings.

The rule for "the same": greedy token ids identical, and each batched step's logits within
1e-4 of the single-sequence step's (float32; a pass over several rows may use another matmul
kernel, which changes the logits by float rounding, ~1e-5)."""

import pytest
import torch

from ragblend.core.decode.batching import BatchDecoder, batch_extend
from ragblend.core.decode.generate import KVDecoder, SamplingParams
from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion.strategies import QueryAware
from ragblend.core.prompt import Chunk

from ..conftest import PASSAGES, TINY_ARCHS, make_tiny_engine

QUESTIONS = ["Question: who ran the ferry?", "Question: when was the lighthouse lit, and what did it burn?",
             "Q: bridge?", "Question: how are the loaves proofed in the village bakery, and for how long?"]


def prompts():
    """Prompts of different lengths, some longer than the mistral model's 48-token window."""
    return [[Chunk(PASSAGES[i % 4]), Chunk(PASSAGES[(i + 1) % 4]), q] if i % 2 == 0 else [q]
            for i, q in enumerate(QUESTIONS)]


def run_batch(engine, decodings, join_after=()):
    """Decode ``decodings`` in one BatchDecoder; ``join_after[i]`` steps pass before the i-th
    joins (all at once by default). Returns the text each received as deltas."""
    batch = BatchDecoder(max_batch=8)
    waiting = list(zip(join_after or [0] * len(decodings), decodings))
    texts, step = {id(d): "" for d in decodings}, 0
    while waiting or len(batch):
        for entry in [w for w in waiting if w[0] <= step]:
            batch.add(entry[1])
            waiting.remove(entry)
        for event in batch.step():
            texts[id(event.member.decoding)] += event.delta
        step += 1
    return [texts[id(d)] for d in decodings]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_sequences_decoded_together_equal_each_decoded_alone(arch, tokenizer):
    engine = make_tiny_engine(arch, tokenizer)
    params = SamplingParams(max_new_tokens=12)
    alone = [engine.generate(p, params=params) for p in prompts()]
    decodings = [engine.begin(p, params=params) for p in prompts()]
    texts = run_batch(engine, decodings, join_after=[0, 0, 3, 5])
    for solo, together, text in zip(alone, decodings, texts):
        assert together.token_ids == solo.token_ids
        assert together.finish_reason == solo.finish_reason
        assert together.text == solo.text == text
    stats = engine.finish(decodings[0])
    assert stats.generated_tokens == len(decodings[0].token_ids) and stats.decode_steps >= 1


@pytest.mark.parametrize("arch, kv_dtype", [("mistral", torch.float32), ("qwen3", torch.float32),
                                             ("qwen3", torch.float16)], ids=["mistral", "qwen3", "qwen3-float16-kv"])
def test_a_batched_step_gives_each_sequence_its_own_step_logits(arch, kv_dtype, tokenizer):
    """Rows of one batched pass against single-sequence steps, over prompts of different lengths
    (mistral: past its sliding window) and a fusion that biases attention on reused keys; with
    float16 K/V too (what an engine's answers keep on 4-bit weights), where the matmuls' float
    rounding over more rows can round a stored key to the next float16 value (~1e-3 of it):
    logits within 2e-3."""
    engine = make_tiny_engine(arch, tokenizer, strategy=QueryAware(ratio=0.5, scale_in_decoding=True))
    pres = [engine.prefill(p) for p in prompts()]

    def decoders():
        return [KVDecoder(engine.adapter, p.keys, p.values, len(p.token_ids) + 6, p.key_bias, dtype=kv_dtype)
                for p in pres]

    assert any(p.key_bias is not None for p in pres)
    single, batched = decoders(), decoders()
    tokens = [5, 17, 300, 1000]
    for _ in range(5):
        expected = torch.stack([d.step(t) for d, t in zip(single, tokens)])
        got = batch_extend(batched, tokens)
        assert torch.allclose(got, expected, atol=1e-4 if kv_dtype == torch.float32 else 2e-3, rtol=0)
        tokens = [int(t) for t in got.argmax(-1)]
    for s, b in zip(single, batched):
        assert s.length == b.length
        n = s.length
        # float16 keys: one ulp of a key near 2 is ~2e-3 (the rounding the docstring describes)
        assert torch.allclose(s.keys[0][:, :n], b.keys[0][:, :n], atol=1e-5 if kv_dtype == torch.float32 else 4e-3)


def test_a_batch_of_decoders_with_different_kv_dtypes_gives_each_its_own_step(tokenizer):
    """Decoders on one adapter may keep K/V in different dtypes (an engine's answers keep theirs
    in its ``decode_kv_dtype``; engines over one model share its decoding twin). Each batched row
    must still be the row its decoder's own step gives: the batch once rounded every sequence's
    queries to the first decoder's dtype, so a float32 sequence behind a 16-bit one got
    float16-rounded queries (logits off by ~1e-3, by ~1e-2 behind a bfloat16 one)."""
    engine = make_tiny_engine("qwen2", tokenizer)
    pre = engine.prefill(prompts()[0])

    def decoder(dtype):
        return KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 2, pre.key_bias,
                         dtype=dtype)

    for low in (torch.float16, torch.bfloat16):
        rows = batch_extend([decoder(low), decoder(torch.float32)], [7, 8])
        assert (rows[1] - decoder(torch.float32).step(8)).abs().max() < 1e-4
        # the 16-bit row's own K/V round alike either way; batched or alone its attention sums
        # in another order (1.0e-4 apart on logits ~1.6 once on an AMD EPYC)
        assert (rows[0] - decoder(low).step(7)).abs().max() < 5e-4


def test_sampling_and_stop_strings_stay_per_request(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer)
    prompt = prompts()[1]
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    alone = engine.generate(prompt, params=sampled)
    greedy = engine.generate(prompt, params=SamplingParams(max_new_tokens=10))
    stop = greedy.text[len(greedy.text) // 2:][:2]
    assert stop.strip(), greedy.text
    decodings = [engine.begin(prompt, params=sampled),
                 engine.begin(prompt, params=SamplingParams(max_new_tokens=10, stop=(stop,))),
                 engine.begin(prompts()[0], params=SamplingParams(max_new_tokens=10))]
    texts = run_batch(engine, decodings)
    assert decodings[0].token_ids == alone.token_ids and texts[0] == alone.text
    assert decodings[1].finish_reason == "stop" and texts[1] == greedy.text[:greedy.text.find(stop)]
    assert stop not in texts[1]


def test_a_member_removed_mid_batch_leaves_the_others_unchanged(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    params = SamplingParams(max_new_tokens=10)
    alone = [engine.generate(p, params=params) for p in prompts()[:3]]
    decodings = [engine.begin(p, params=params) for p in prompts()[:3]]
    batch = BatchDecoder()
    members = [batch.add(d) for d in decodings]
    for _ in range(3):
        batch.step()
    batch.remove(members[1])   # its client left
    assert len(batch) == 2
    while len(batch):
        batch.step()
    assert decodings[0].token_ids == alone[0].token_ids and decodings[2].token_ids == alone[2].token_ids
    assert len(decodings[1].token_ids) == 3 and decodings[1].finish_reason is None


def test_batch_bounds(tokenizer):
    engine = make_tiny_engine("qwen3", tokenizer)
    params = SamplingParams(max_new_tokens=4)
    first, second = (engine.begin(p, params=params) for p in prompts()[:2])
    batch = BatchDecoder(max_batch=2, max_kv_bytes=1)
    assert batch.fits(10**12)   # an empty batch takes any request: served alone rather than never
    member = batch.add(first)
    assert member.kv_bytes > 0 and not batch.fits(1)   # over the KV budget: wait
    roomy = BatchDecoder(max_batch=1)
    roomy.add(second)
    assert not roomy.fits(0)   # the batch is full
    batch.step()
    with pytest.raises(InvalidInputError, match="not started"):
        batch.add(first)   # a decoding joins once, before its first token
    with pytest.raises(InvalidInputError, match="max_batch"):
        BatchDecoder(max_batch=0)
    with pytest.raises(InvalidInputError, match="one model"):
        other = make_tiny_engine("llama", tokenizer).begin(prompts()[1], params=params)
        roomy.add(other)



class FailOnce:
    """Replaces ``adapter.<name>`` so that its ``call``-th call raises (a pass over the batch
    running out of memory, say); every other call runs the real method."""

    def __init__(self, monkeypatch, adapter, name: str, call: int):
        self.real, self.call, self.calls = getattr(adapter, name), call, 0
        monkeypatch.setattr(adapter, name, self)

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.call:
            raise MemoryError("simulated: no memory for the batch's pass")
        return self.real(*args)


def decode_in_one_batch(decodings) -> tuple[BatchDecoder, list]:
    batch, events = BatchDecoder(max_batch=8), []
    for d in decodings:
        batch.add(d)
    while len(batch):
        events += batch.step()
    return batch, events


@pytest.mark.parametrize("where", ["logits", "attention", "embed"])
def test_a_failed_batched_pass_run_again_per_member_gives_the_unfailed_answers(where, tokenizer, monkeypatch):
    """A pass over the whole batch that fails is run again for each member alone. The failed
    pass must leave every decoder as it found it: it once counted the new position before the
    LM head ran, so a failure there appended each member's token twice and every answer went on
    silently wrong. Failing in the second batched pass's LM head (every layer's K/V written),
    in its second row's attention halfway through the layers, or before any layer: each answer
    is the unfailed one, token for token, and the batch counts the passes that really ran."""
    engine = make_tiny_engine("qwen2", tokenizer)
    params = SamplingParams(max_new_tokens=8)
    alone = [engine.generate(p, params=params) for p in prompts()[:3]]
    assert min(len(a.token_ids) for a in alone) >= 3   # all three are in the first two batched passes
    control, _ = decode_in_one_batch([engine.begin(p, params=params) for p in prompts()[:3]])
    decodings = [engine.begin(p, params=params) for p in prompts()[:3]]
    adapter = decodings[0].decoder.adapter
    layers = adapter.shape.num_layers
    # attend_one_token runs once per row per layer: pass 1 makes 3 * layers calls
    call = {"logits": 2, "embed": 2, "attention": 3 * layers + 3 * (layers // 2) + 2}[where]
    fail = FailOnce(monkeypatch, adapter, "attend_one_token" if where == "attention" else where, call)
    batch, events = decode_in_one_batch(decodings)
    assert fail.calls > call   # it failed, and decoding went on
    assert [e.error for e in events if e.error is not None] == []
    for solo, together in zip(alone, decodings):
        assert together.token_ids == solo.token_ids
        assert together.text == solo.text and together.finish_reason == solo.finish_reason
    # the failed pass advanced nobody; the three passes run instead advanced one each
    assert batch.batched_rows == control.batched_rows == sum(d.steps for d in decodings)
    assert batch.passes == control.passes + 2 and batch.most_rows == control.most_rows


def test_a_pass_that_fails_in_the_lm_head_counts_no_position(tokenizer, monkeypatch):
    """batch_extend and KVDecoder.extend leave a decoder's length as they found it when the
    pass fails after writing every layer's K/V; the pass run again gives the unfailed logits."""
    engine = make_tiny_engine("qwen2", tokenizer)
    pre = engine.prefill(prompts()[0])

    def decoder():
        return KVDecoder(engine.adapter, pre.keys, pre.values, len(pre.token_ids) + 4, pre.key_bias)

    expected = decoder().extend([7, 8])
    for run in (lambda d: batch_extend([d, decoder()], [7, 8])[0], lambda d: d.extend([7, 8])[0]):
        failing = decoder()
        FailOnce(monkeypatch, engine.adapter, "logits", 1)
        with pytest.raises(MemoryError):
            run(failing)
        assert failing.length == len(pre.token_ids)
        monkeypatch.undo()
        assert torch.allclose(run(failing), expected[0], atol=1e-4, rtol=0)


def test_each_token_is_delivered_before_the_pass_that_computes_the_next(tokenizer):
    """A server sends a token while the next is computed: an answer's first token (from its
    prefill's logits) waits for no model pass, and the text is the same as stepping without."""
    engine = make_tiny_engine("llama", tokenizer)
    params = SamplingParams(max_new_tokens=6, stop=[])
    alone = engine.generate(prompts()[0], params=params)
    batch, delivered = BatchDecoder(), []
    batch.add(engine.begin(prompts()[0], params=params))
    while len(batch):
        returned = batch.step(deliver=lambda events: delivered.extend((batch.passes, e) for e in events))
        assert returned == []   # every event was delivered, none held for after the pass
    passes = [passes for passes, _ in delivered]   # a pass that accepts drafted tokens gives several
    assert passes[0] == 0 and passes == sorted(passes) and passes[-1] == batch.passes
    assert "".join(e.delta for _, e in delivered) == alone.text and delivered[-1][1].finished
