"""Decoding (ragblend.core.decode.generate): KVDecoder's steps against the model's own forward, prompt-lookup
drafts that change nothing but the number of passes, token picking (greedy, temperature, top-p,
seeds), stop strings and EOS. Tiny random models and a scripted stand-in for the model."""

import pytest
import torch

from ragblend import FullRecompute
from ragblend.core.decode.answers import MAX_ROW_COST, draft_row_cost
from ragblend.core.decode.generate import Decoding, DraftPolicy, KVDecoder, PromptLookup, SamplingParams, pick_token
from ragblend.core.errors import InvalidInputError

from ..conftest import PASSAGES
from .test_engine import forward_logits, segments


def test_decoding_steps_equal_the_model_forward(tiny_engine):
    """Each decoding step (buffers written in place, the sliding window on Mistral) gives the
    logits of the model's own forward over the whole sequence so far."""
    pre = tiny_engine.prefill(segments(), strategy=FullRecompute())
    answer = [5, 77, 300, 12, 900, 41]
    decoder = KVDecoder(tiny_engine.adapter, pre.keys, pre.values, len(pre.token_ids) + len(answer))
    for i, token in enumerate(answer):
        logits = decoder.step(token)
        ref, _ = forward_logits(tiny_engine, pre.token_ids + answer[:i + 1])
        assert (logits - ref).abs().max() <= 1e-4


def test_a_lazy_decoder_whose_fill_failed_part_way_fills_whole_on_retry(tiny_engine, monkeypatch):
    """Answer buffers made at the first pass (lazy): an allocation failing part way through them
    (out of memory) leaves the decoder unfilled, so the retry's layers are each its own."""
    pre = tiny_engine.prefill(segments(), strategy=FullRecompute())
    capacity = len(pre.token_ids) + 2
    decoder = KVDecoder(tiny_engine.adapter, pre.keys, pre.values, capacity, lazy=True)
    calls, real = [0], torch.Tensor.new_empty

    def failing_third(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("no room")
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "new_empty", failing_third)
        with pytest.raises(MemoryError):
            decoder.keys
    assert len(decoder.keys) == len(pre.keys)
    for layer, k in enumerate(pre.keys):
        assert torch.equal(decoder.keys[layer][:, :k.shape[1]], k.to(decoder.dtype))
    eager = KVDecoder(tiny_engine.adapter, pre.keys, pre.values, capacity)
    assert torch.equal(decoder.step(5), eager.step(5))


def test_one_pass_over_several_tokens_equals_a_pass_each(tiny_engine):
    """KVDecoder.extend (how drafted tokens are verified) gives each token the logits that
    one pass per token gives, on the decoding twin, with the fused prefill's key bias and
    (Mistral) the sliding window; truncated positions are written again correctly."""
    from ragblend import QueryAware

    tiny_engine.precompute(PASSAGES[:3])
    pre = tiny_engine.prefill(segments(), strategy=QueryAware(0.3, scale_in_decoding=True))
    assert pre.key_bias is not None
    answer = [5, 77, 300, 12]
    adapter, capacity = tiny_engine.decoding_adapter(), len(pre.token_ids) + len(answer)
    one = KVDecoder(adapter, pre.keys, pre.values, capacity, pre.key_bias)
    each = torch.stack([one.step(t) for t in answer])
    many = KVDecoder(adapter, pre.keys, pre.values, capacity, pre.key_bias)
    assert (many.extend(answer) - each).abs().max() <= 1e-4
    many.truncate(many.length - 3)
    assert (many.extend([77, 300, 12]) - each[1:]).abs().max() <= 1e-4
    with pytest.raises(InvalidInputError, match="no room"):
        many.extend([1])


def test_prompt_lookup_drafts_what_followed_the_latest_match():

    lookup = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 6])
    lookup.append(2)
    lookup.append(3)   # the tail (2, 3) last stood at positions 5-6, followed by 5, 6, 2
    assert lookup.draft(3) == (2, [5, 6, 2]) and lookup.draft(1) == (2, [5])
    lookup.append(9)   # only the one-token tail (9) occurred before, followed by 2, 3, 5
    assert lookup.draft(3) == (1, [2, 3, 5])
    lookup.append(7)   # never seen: nothing to draft
    assert lookup.draft(3) == (0, [])


class ScriptedDecoder:
    """Stands in for KVDecoder: a 'model' whose greedy choice after token t is ``successor[t]``."""

    def __init__(self, successor: dict[int, int], length: int, capacity: int, vocab: int):
        self.successor, self.length, self.capacity, self.vocab, self.passes = successor, length, capacity, vocab, 0

    def logits_after(self, token: int) -> torch.Tensor:
        logits = torch.zeros(self.vocab)
        logits[self.successor.get(token, 0)] = 1.0
        return logits

    def extend(self, tokens):
        assert self.length + len(tokens) <= self.capacity
        self.length, self.passes = self.length + len(tokens), self.passes + 1
        return torch.stack([self.logits_after(t) for t in tokens])

    def truncate(self, length):
        self.length = length


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9, 30])
@pytest.mark.parametrize("stop", [(), ("ferry",)])
@pytest.mark.parametrize("room", [10_000, 6])
def test_drafted_decoding_emits_what_one_pass_a_token_emits(tokenizer, max_new_tokens, stop, room):
    """Greedy decoding with prompt-lookup drafts gives the same tokens, text and finish reason
    as one pass per token, in fewer passes, whatever ends it (length, EOS, a stop string, the
    context window)."""

    chain = tokenizer.encode(" the ferry crossed to the north pier at dawn", add_special_tokens=False)
    eos = 0
    successor = dict(zip(chain, chain[1:] + [eos]))   # the model recites the chain, then ends
    prompt = [5, 6, *chain, 7]                           # the prompt holds the chain too
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
    runs = {}
    for drafts in (0, 3):
        decoder = ScriptedDecoder({6: chain[0], **successor}, len(prompt), len(prompt) + max_new_tokens,
                                  len(tokenizer))
        decoding = Decoding(decoder, tokenizer, decoder.logits_after(6), len(prompt), params, frozenset({eos}),
                            context_window=len(prompt) + room, lookup=PromptLookup(prompt) if drafts else None,
                            draft_tokens=drafts)
        pieces = list(decoding)
        assert "".join(pieces) == decoding.text and decoding.steps == decoder.passes
        runs[drafts] = decoding
    plain, drafted = runs[0], runs[3]
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    assert drafted.finish_reason == plain.finish_reason
    if len(plain.token_ids) > 4:
        assert drafted.steps < plain.steps


def test_drafting_leaves_greedy_answers_unchanged(tiny_engine):
    tiny_engine.prompt_lookup_num_tokens = 0
    plain = tiny_engine.generate(segments(), max_new_tokens=24)
    plain_steps = tiny_engine.last_stats.decode_steps
    tiny_engine.prompt_lookup_num_tokens = 3
    drafted = tiny_engine.generate(segments(), max_new_tokens=24)
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    assert tiny_engine.last_stats.decode_steps <= plain_steps
    sampled = tiny_engine.generate(segments(), max_new_tokens=8, temperature=0.7, seed=1)   # never drafts
    assert tiny_engine.last_stats.decode_steps in (len(sampled.token_ids) - 1, len(sampled.token_ids))


def test_the_draft_policy_stops_drafting_what_is_never_kept_and_drafts_all_of_what_always_is():
    policy = DraftPolicy(row_cost=0.15)
    assert policy.length(1, 3) >= 1 and policy.length(3, 3) >= 1   # untried: worth a try
    for _ in range(40):
        policy.record(1, policy.length(1, 3), 0)   # one-token matches: never kept
        policy.record(3, 3, 3)                     # three-token matches: always kept
    assert policy.length(1, 3) == 0 and policy.length(3, 3) == 3
    assert policy.length(3, 1) == 1 and policy.length(3, 0) == 0 and policy.length(0, 0) == 0
    # Passes that found a one-token match but drafted nothing: its counts decay back to a try.
    tried_again = 0
    for _ in range(20):
        tried_again += policy.length(1, 3) > 0
        policy.record(1, 0, 0)
    assert tried_again >= 1


def test_a_dear_row_drafts_less_than_a_cheap_one():
    cheap, dear = DraftPolicy(row_cost=0.05), DraftPolicy(row_cost=0.30)
    for policy in (cheap, dear):   # the same record: 1 in 10 first drafted tokens kept
        policy.tries, policy.kept = {(2, 1): 10.0, (2, 2): 1.0}, {(2, 1): 1.0, (2, 2): 1.0}
    assert cheap.length(2, 3) >= 1 and dear.length(2, 3) == 0


def test_the_row_cost_is_measured_once_and_a_disturbed_timing_is_capped(tiny_engine):
    weights, kv = tiny_engine.decode_weights, tiny_engine.answers.kv_dtype
    assert draft_row_cost(weights, kv, measure=lambda work: {"1": 0.010, "4": 0.0145}) == pytest.approx(0.15)
    assert draft_row_cost(weights, kv, measure=lambda work: {"1": 0.010, "4": 0.090}) == MAX_ROW_COST
    # four rows faster than one: disturbed too, so the conservative price (few drafts), not "free"
    assert draft_row_cost(weights, kv, measure=lambda work: {"1": 0.010, "4": 0.009}) == MAX_ROW_COST
    timed = []

    def measure(work):
        timed.extend(work)
        for run in work.values():
            run()   # the passes run over the engine's own decoding weights
        return {"1": 0.01, "4": 0.012}
    assert draft_row_cost(weights, kv, measure=measure) == pytest.approx(0.2 / 3) and timed == ["1", "4"]
    assert 0 <= tiny_engine.answers.draft_row_cost <= MAX_ROW_COST   # the engine measured its own at start


def test_drafting_stops_on_an_answer_that_never_follows_the_prompt(tokenizer):
    """A 'model' whose answer never continues as the prompt did: after a few rejected drafts the
    passes mostly run the token alone (a drafted row costs time and keeps nothing), trying a
    one-token draft now and then."""
    prompt = list(range(10, 60)) * 2                                 # the prompt goes t -> t+1 ...
    successor = {t: 10 + (t - 10 + 7) % 50 for t in range(10, 60)}   # ... the model t -> t+7
    rows = []

    class Counting(ScriptedDecoder):
        def extend(self, tokens):
            rows.append(len(tokens))
            return super().extend(tokens)

    decoder = Counting(successor, len(prompt), len(prompt) + 45, len(tokenizer))
    decoding = Decoding(decoder, tokenizer, decoder.logits_after(prompt[-1]), len(prompt),
                        SamplingParams(max_new_tokens=45), frozenset(), context_window=10_000,
                        lookup=PromptLookup(prompt), draft_tokens=3, draft_policy=DraftPolicy(row_cost=0.15))
    list(decoding)
    assert len(decoding.token_ids) == 45 and rows[0] > 1       # it tried drafting at first ...
    drafted_rows = sum(r - 1 for r in rows[-30:])
    assert drafted_rows <= 8                                   # ... and mostly stopped (always: 90)


# ---------------------------------------------------------------------------- picking a token


def test_greedy_and_a_tiny_temperature_pick_the_best_token():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0]) * 1e4   # large logits: a naive softmax / T overflows
    assert pick_token(logits, SamplingParams(temperature=0), None) == 1
    generator = torch.Generator().manual_seed(0)
    assert {pick_token(logits, SamplingParams(temperature=1e-6), generator) for _ in range(20)} == {1}


def test_top_p_keeps_the_smallest_head_that_reaches_it():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def picks(top_p, n=400):
        generator = torch.Generator().manual_seed(1)
        return {pick_token(logits, SamplingParams(temperature=1.0, top_p=top_p), generator) for _ in range(n)}

    assert picks(0.5) == {0}            # the first token alone reaches 0.5
    assert picks(0.6) == {0, 1}         # 0.5 + 0.3 reaches it; the tail never comes
    assert picks(0.9) == {0, 1, 2}
    assert picks(1.0) == {0, 1, 2, 3}


def test_a_seed_repeats_a_sampled_answer(tiny_engine):
    a = tiny_engine.generate(segments(), max_new_tokens=10, temperature=0.9, seed=7)
    b = tiny_engine.generate(segments(), max_new_tokens=10, temperature=0.9, seed=7)
    assert a.token_ids == b.token_ids and a.text == b.text


# ---------------------------------------------------------------------------- how an answer ends


SENTENCE = " the ferry crossed to a north pier at dawn"   # no token twice: each one has one successor


def recital(tokenizer, params, room=10_000):
    """A Decoding of a 'model' that recites SENTENCE, then emits EOS (token 0)."""
    chain = tokenizer.encode(SENTENCE, add_special_tokens=False)
    successor = dict(zip(chain, chain[1:] + [0]))
    prompt = [5, 6, *chain, 7]
    decoder = ScriptedDecoder({6: chain[0], **successor}, len(prompt), len(prompt) + params.max_new_tokens,
                              len(tokenizer))
    decoding = Decoding(decoder, tokenizer, decoder.logits_after(6), len(prompt), params, frozenset({0}),
                        context_window=len(prompt) + room)
    return decoding, chain


def test_eos_ends_the_answer_and_is_not_part_of_it(tokenizer):
    decoding, chain = recital(tokenizer, SamplingParams(max_new_tokens=50))
    deltas = list(decoding)
    assert decoding.finish_reason == "stop" and decoding.token_ids == chain and 0 not in decoding.token_ids
    assert "".join(deltas) == decoding.text == tokenizer.decode(chain)


@pytest.mark.parametrize("stop", ["north", "a nor", " dawn"])
def test_a_stop_string_ends_the_answer_before_it_and_is_never_streamed(tokenizer, stop):
    decoding, _ = recital(tokenizer, SamplingParams(max_new_tokens=50, stop=(stop,)))
    deltas = list(decoding)
    assert decoding.finish_reason == "stop" and decoding.text == SENTENCE[:SENTENCE.index(stop)]
    assert "".join(deltas) == decoding.text   # nothing of the stop string was handed out early


def test_the_length_limit_and_the_context_window_end_the_answer(tokenizer):
    decoding, chain = recital(tokenizer, SamplingParams(max_new_tokens=3))
    list(decoding)
    assert decoding.finish_reason == "length" and decoding.token_ids == chain[:3]
    decoding, chain = recital(tokenizer, SamplingParams(max_new_tokens=50), room=2)
    list(decoding)
    assert decoding.finish_reason == "length" and decoding.token_ids == chain[:2]


def test_sampling_params_are_checked():
    for bad in ({"max_new_tokens": 0}, {"temperature": -0.1}, {"top_p": 0}, {"seed": -1}, {"stop": [""]}):
        with pytest.raises(InvalidInputError):
            SamplingParams(**bad)
    assert SamplingParams(stop="END").stop == ("END",)   # one string is one stop string


def test_a_stream_left_half_read_leaves_inference_mode_as_it_found_it(tiny_engine):
    """An abandoned stream's generator is closed later by the garbage collector, perhaps in the
    middle of the next answer: it must hold no inference mode across its yields (a BlendChatModel
    turn after a stopped stream failed with 'Inplace update to inference tensor')."""
    stream = iter(tiny_engine.stream(segments(), max_new_tokens=8))
    next(stream)
    assert not torch.is_inference_mode_enabled()
    answer = tiny_engine.generate(segments(), max_new_tokens=4)   # the next turn, the first stream still open
    assert answer.text is not None
    stream.close()
    assert not torch.is_inference_mode_enabled()


def test_an_answer_cut_inside_a_character_ends_before_it(tokenizer):
    """max_new_tokens reached after the first bytes of an emoji: those bytes would decode to U+FFFD
    and never complete, so the answer ends before them, streamed or not."""
    ids = tokenizer.encode("Ship \U0001F6A2", add_special_tokens=False)   # the emoji is several byte tokens
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("\ufffd")) + 2
    logits = [torch.nn.functional.one_hot(torch.tensor(t), len(tokenizer)).float() * 10 for t in ids[:cut]]
    decoding = Decoding(None, tokenizer, logits[0], 4, SamplingParams(max_new_tokens=cut), frozenset(), 1 << 16)
    streamed = "".join(decoding.take(row) for row in logits) + decoding.rest()
    assert decoding.finish_reason == "length"
    assert decoding.text == streamed == "Ship "
