"""The prefix tier (ragblend.core.decode.prefix_cache): exact repeats and conversations reuse the K/V
computed before, exactly; the tier is bounded, namespaced and keyed by what makes K/V differ."""

import copy
import dataclasses

import pytest
import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute
from ragblend.core.decode.prefix_cache import PrefixCache, PrefixScope
from ragblend.core.prompt import PromptLayout

from ..conftest import PASSAGES, TINY_ARCHS, make_tiny_engine, tiny_model

TIER = 64 << 20   # the tests' engines have no prefix tier unless given one (tests/conftest.py)
SEGMENTS = [Chunk(p) for p in PASSAGES[:3]] + ["Question: who ran the ferry?"]
SCOPE = PrefixScope("model", "torch.float32", True)


@pytest.fixture(params=TINY_ARCHS)
def tiny_engine(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer, prefix_cache_bytes=TIER)


def forward_logits(engine, token_ids):
    with torch.no_grad():
        return engine.hf_model(torch.tensor([token_ids])).logits[0, -1]


def text_ids(engine, n: int, seed: int = 0) -> list[int]:
    """``n`` ids of plain text (no chunk in them) after the template's opening."""
    ids = engine.build_prompt([" ".join(PASSAGES)]).token_ids
    g = torch.Generator().manual_seed(seed)
    return ids[:8] + torch.randint(10, 1000, (n - 8,), generator=g).tolist()


def kv(tokens: int, layers: int = 2, fill: float = 0.0):
    keys = [torch.full((2, tokens, 4), fill) for _ in range(layers)]
    return keys, [k.clone() for k in keys]


def test_an_exact_repeat_computes_nothing_and_answers_as_the_first_time(tiny_engine):
    tiny_engine.precompute(PASSAGES[:3])
    first = tiny_engine.prefill(SEGMENTS)          # fused: the engine's own strategy
    repeat = tiny_engine.prefill(SEGMENTS)
    n = len(first.token_ids)
    assert first.stats.prefix_tokens == 0 and first.stats.chunks_reused == 3
    assert repeat.stats.prefix_tokens == n and repeat.stats.recomputed_tokens == 0
    assert repeat.stats.cache_hit_tokens == repeat.stats.reused_tokens == n   # a server's cached_tokens
    assert torch.equal(repeat.logits, first.logits)   # the first computation's own logits, kept
    repeat.logits.add_(1.0)   # a caller writing to its logits changes no later repeat's
    assert torch.equal(tiny_engine.prefill(SEGMENTS).logits, first.logits)
    for layer in range(tiny_engine.adapter.shape.num_layers):
        assert torch.allclose(repeat.keys[layer], first.keys[layer], atol=1e-4)
        assert torch.allclose(repeat.values[layer], first.values[layer], atol=1e-4)
    assert tiny_engine.prefix_info()["hits"] == 2


def test_a_stored_prefix_and_a_new_suffix_equal_the_full_prefill_of_the_whole(tiny_engine):
    ids = text_ids(tiny_engine, 120)   # past the tiny Mistral's and Gemma's 48-token windows
    first = tiny_engine.prefill(PromptLayout(ids[:80], []))
    assert first.stats.prefix_tokens == 0
    longer = tiny_engine.prefill(PromptLayout(ids, []))
    assert longer.stats.prefix_tokens == 80 and longer.stats.recomputed_tokens == 40
    full = tiny_engine.prefill(PromptLayout(ids, []), strategy=FullRecompute())   # a named strategy: no tier
    assert full.stats.prefix_tokens == 0
    assert (longer.logits - full.logits).abs().max() <= 1e-4
    assert (longer.logits - forward_logits(tiny_engine, ids)).abs().max() <= 1e-4
    for layer in range(tiny_engine.adapter.shape.num_layers):
        assert torch.allclose(longer.keys[layer], full.keys[layer], atol=1e-4)
        assert torch.allclose(longer.values[layer], full.values[layer], atol=1e-4)


def test_the_next_turn_reuses_the_answer_the_engine_generated(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    ids = text_ids(engine, 60)
    answer = engine.generate(PromptLayout(ids, []), max_new_tokens=6, stop=None)
    assert len(answer.token_ids) == 6
    # The next turn: the prompt, the answer, then new text; the last answer token's K/V were never computed.
    turn = ids + answer.token_ids + text_ids(engine, 30, seed=1)[8:]
    nxt = engine.prefill(PromptLayout(turn, []))
    assert nxt.stats.prefix_tokens == len(ids) + 5
    assert (nxt.logits - forward_logits(engine, turn)).abs().max() <= 1e-4


def test_the_tier_is_bounded_in_bytes_least_recently_used_out_first():
    one = sum(t.numel() * t.element_size() for t in sum(kv(32), []))
    cache = PrefixCache(2 * one + one // 2)
    prompts = [[i] * 32 for i in range(3)]
    assert cache.store(SCOPE, prompts[0], *kv(32))
    assert cache.store(SCOPE, prompts[1], *kv(32))
    assert cache.lookup([SCOPE], prompts[0]).num_tokens == 32   # touched: prompts[1] is now the oldest
    assert cache.store(SCOPE, prompts[2], *kv(32))
    assert cache.lookup([SCOPE], prompts[1]) is None
    assert cache.lookup([SCOPE], prompts[0]) is not None and cache.lookup([SCOPE], prompts[2]) is not None
    info = cache.info()
    assert info["bytes"] <= info["max_bytes"] and info["evictions"] == 1 and info["entries"] == 2
    assert not cache.store(SCOPE, [5] * 96, *kv(96))   # over the whole budget: not kept, and no error
    assert len(cache) == 2


def test_an_engine_over_its_prefix_budget_answers_every_prompt(tiny_engine):
    per_token = 2 * 4 * tiny_engine.adapter.shape.num_kv_heads * tiny_engine.adapter.shape.head_dim * 4
    budget = tiny_engine.prefix.max_bytes = 150 * per_token   # one prompt's K/V, not two
    for seed in range(4):
        ids = text_ids(tiny_engine, 100 + 10 * seed, seed=seed)
        pre = tiny_engine.prefill(PromptLayout(ids, []))
        assert (pre.logits - forward_logits(tiny_engine, ids)).abs().max() <= 1e-4
        assert 0 < tiny_engine.prefix.nbytes <= budget
    tiny_engine.prefill(PromptLayout(text_ids(tiny_engine, 200, seed=9), []))   # more than the whole budget
    assert tiny_engine.prefix_info()["evictions"] == 3 and len(tiny_engine.prefix) == 1


def test_a_longer_entry_replaces_its_prefix_and_lookups_stop_at_the_first_difference():
    cache = PrefixCache(1 << 20)
    assert cache.store(SCOPE, list(range(40)), *kv(40))
    assert cache.store(SCOPE, list(range(70)), *kv(70))
    assert len(cache) == 1                                   # the 40-token entry served nothing more
    assert not cache.store(SCOPE, list(range(50)), *kv(50))   # held already by the longer one
    hit = cache.lookup([SCOPE], list(range(45)) + [999] * 10)
    assert hit.num_tokens == 45 and hit.keys[0].shape[1] == 45   # past the last whole block, token by token
    assert cache.lookup([SCOPE], [999] + list(range(1, 70))) is None
    assert cache.lookup([SCOPE], list(range(70)), limit=69).num_tokens == 69


def test_namespaces_never_share_a_prefix(tiny_engine):
    ids = text_ids(tiny_engine, 90)
    tiny_engine.prefill(PromptLayout(ids, [], namespace="tenant-a"))
    other = tiny_engine.prefill(PromptLayout(ids, [], namespace="tenant-b"))
    shared = tiny_engine.prefill(PromptLayout(ids, []))
    again = tiny_engine.prefill(PromptLayout(ids, [], namespace="tenant-a"))
    assert other.stats.prefix_tokens == 0 and other.stats.cache_hit_tokens == 0
    assert shared.stats.prefix_tokens == 0
    assert again.stats.prefix_tokens == len(ids)   # an exact repeat: all of it, with its logits
    # find_chunks / build_prompt lay a prompt out in the namespace they were given
    assert tiny_engine.find_chunks("Hello there", namespace="tenant-a").namespace == "tenant-a"


def test_k_v_of_another_model_or_dtype_are_never_reused(tokenizer):
    llama = make_tiny_engine("llama", tokenizer, prefix_cache_bytes=TIER)
    qwen = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    half = BlendEngine(copy.deepcopy(tiny_model("llama")).to(torch.bfloat16), tokenizer, min_fusion_speedup=0)
    assert half.prefix.max_bytes == 512 << 20   # on by default
    for other in (qwen, half):
        other.prefix = other.runner.prefix = llama.prefix   # one tier for all three
    ids = text_ids(llama, 70)
    llama.prefill(PromptLayout(ids, []))
    for other in (qwen, half):
        pre = other.prefill(PromptLayout(ids, []))
        assert pre.stats.prefix_tokens == 0
    assert llama.prefill(PromptLayout(ids, [])).stats.prefix_tokens == len(ids)
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, list(range(32)), *kv(32))
    for scope in (PrefixScope("model", "torch.float16", True), PrefixScope("other", "torch.float32", True)):
        assert cache.lookup([scope], list(range(32))) is None


def test_a_corrupt_entry_is_a_miss_and_is_dropped(tiny_engine):
    ids = text_ids(tiny_engine, 70)
    tiny_engine.prefill(PromptLayout(ids, []))
    (entry,) = tiny_engine.prefix._entries.values()
    entry.keys[1] = entry.keys[1][:, :-3]   # K/V that do not hold the entry's tokens
    pre = tiny_engine.prefill(PromptLayout(ids, []))
    assert pre.stats.prefix_tokens == 0
    assert (pre.logits - forward_logits(tiny_engine, ids)).abs().max() <= 1e-4
    cache = PrefixCache(1 << 20)
    cache.store(SCOPE, list(range(32)), *kv(32))
    (entry,) = cache._entries.values()
    entry.token_ids = (7,) * 32   # ids that are not what its blocks were hashed from
    assert cache.lookup([SCOPE], list(range(32))) is None and len(cache) == 0


def test_a_named_strategy_runs_as_asked_and_the_tier_can_be_off(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, prefix_cache_bytes=TIER)
    engine.precompute(PASSAGES[:3])
    engine.prefill(SEGMENTS)
    named = engine.prefill(SEGMENTS, strategy=CacheBlend(ratio=0.3))
    assert named.stats.prefix_tokens == 0 and named.stats.chunks_reused == 3
    off = make_tiny_engine("llama", tokenizer, prefix_cache_bytes=0)
    assert off.prefix is None and off.prefix_info() == {}
    off.prefill(SEGMENTS)
    assert off.prefill(SEGMENTS).stats.prefix_tokens == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G"])
def test_prefix_cache_bytes_must_be_a_byte_count(tokenizer, bad):
    from ragblend.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="prefix_cache_bytes"):
        make_tiny_engine("llama", tokenizer, prefix_cache_bytes=bad)


def test_a_repeat_after_an_answer_gives_the_same_answer(tiny_engine):
    # Chunks computed in the call (none precomputed): QueryAware fuses, its score bias on the cached
    # tokens is kept with the answer's K/V, so that the repeat's last token sees what the first saw.
    first = tiny_engine.generate(SEGMENTS, max_new_tokens=12)
    repeat = tiny_engine.generate(SEGMENTS, max_new_tokens=12)
    assert repeat.stats.prefix_tokens == len(first.prompt_token_ids)
    assert (repeat.logits - first.logits).abs().max() <= 1e-4
    assert repeat.token_ids == first.token_ids


def test_clients_at_once_on_overlapping_prompts_get_the_answers_each_gets_alone(tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    engine = make_tiny_engine("qwen3", tokenizer, prefix_cache_bytes=TIER)
    alone = make_tiny_engine("qwen3", tokenizer, prefix_cache_bytes=0)
    front = text_ids(engine, 64)
    prompts = [front + text_ids(engine, 20 + i, seed=i)[8:] for i in range(8)] * 2   # each asked twice

    def answer(on, ids):
        return on.generate(PromptLayout(ids, []), max_new_tokens=5).token_ids

    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda ids: answer(engine, ids), prompts))
    assert together == [answer(alone, ids) for ids in prompts]
    assert engine.prefix_info()["hits"] >= 8


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_a_comparison_times_fusion_not_the_prefix_tier(tiny_engine):
    """``ask --compare``, the demo and the app warm up on the prompt they then time: under
    :func:`fusion_only` the timed answer is fused again, not served from the tier."""
    from ragblend.integrations.compare import fusion_only

    tiny_engine.precompute(PASSAGES[:3])
    with fusion_only():
        tiny_engine.prefill(SEGMENTS)   # the warm-up
        timed = tiny_engine.prefill(SEGMENTS)
    assert timed.stats.prefix_tokens == 0 and timed.stats.chunks_reused == 3
    tiny_engine.prefill(SEGMENTS)   # the tier is back afterwards: kept, then served
    assert tiny_engine.prefill(SEGMENTS).stats.prefix_tokens > 0


@pytest.mark.parametrize("tiny_engine", ["llama"], indirect=True)
def test_a_new_question_over_the_same_chunks_is_fused_anew_not_served_anothers_fusion(tiny_engine):
    """QueryAware chose the recomputed tokens by the first question's attention: a second question
    over the same chunks shares their K/V's front, but is fused for itself."""
    tiny_engine.precompute(PASSAGES[:3])
    tiny_engine.prefill(SEGMENTS)
    other = tiny_engine.prefill(SEGMENTS[:-1] + ["Question: when was the lighthouse first lit?"])
    assert other.stats.prefix_tokens == 0 and other.stats.chunks_reused == 3
    assert tiny_engine.prefill(SEGMENTS).stats.prefix_tokens > 0   # its own repeat still is served


def test_a_whole_prompt_is_served_with_its_kept_logits_also_once_its_answer_is_stored():
    cache, logits = PrefixCache(1 << 20), torch.randn(50)
    cache.store(SCOPE, list(range(32)), *kv(32), logits=logits)
    assert torch.equal(cache.lookup([SCOPE], list(range(32))).logits, logits)
    assert cache.lookup([SCOPE], list(range(33))).logits is None     # a longer prompt computes its rest
    cache.store(SCOPE, list(range(48)), *kv(48))                     # the answer's K/V replace the prompt's entry
    assert len(cache) == 1 and torch.equal(cache.lookup([SCOPE], list(range(32))).logits, logits)
    assert cache.lookup([SCOPE], list(range(40))).logits is None
    cache.store(SCOPE, list(range(40)), *kv(40), logits=logits + 1)   # held by the longer entry: only its logits kept
    assert len(cache) == 1 and torch.equal(cache.lookup([SCOPE], list(range(40))).logits, logits + 1)
    assert cache.nbytes == sum(entry.nbytes for entry in cache._entries.values())


def test_the_next_turn_of_a_chat_computes_only_its_question(tokenizer):
    """Once a chat's answer is out, the tokens its next turn starts with (the answer's last token,
    the template's closing of it and opening of the user turn) are computed over it in the
    background: the next turn finds all of them in the tier, exactly as a prefill computes them.
    A completion (no chat) leaves its answer as it was."""
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    system = "Context:\n\n" + PASSAGES[0]
    first = dataclasses.replace(engine.find_chunks("Who ran the ferry?", system=system), chat=True)
    answer = engine.generate(first, max_new_tokens=6, stop=None)
    assert engine.prompts.tokenize(answer.text) == answer.token_ids   # its text is what it generated
    engine.flush()   # the opening is computed in the background
    history = [("user", "Who ran the ferry?"), ("assistant", answer.text)]
    second = engine.find_chunks("And when did it stop?", system=system, history=history)
    nxt = engine.prefill(second)
    opening = engine.prompts.next_turn_opening()
    assert nxt.stats.prefix_tokens == len(first.token_ids) + len(answer.token_ids) + len(opening)
    assert second.token_ids[:nxt.stats.prefix_tokens][-len(opening):] == opening   # up to the question
    assert (nxt.logits - forward_logits(engine, second.token_ids)).abs().max() <= 1e-4

    ids = text_ids(engine, 60)
    done = engine.generate(PromptLayout(ids, []), max_new_tokens=6, stop=None)
    engine.flush()
    after = ids + done.token_ids + engine.prompts.next_turn_opening() + text_ids(engine, 30, seed=1)[8:]
    assert engine.prefill(PromptLayout(after, [])).stats.prefix_tokens == len(ids) + 5


def test_a_few_tokens_over_decoded_k_v_run_on_the_decoding_weights(tokenizer):
    """A next turn's question over an answer decoded on low-bit weights (K/V that are not exact
    anyway) runs as decoding runs tokens: on those weights, a few rows a pass; its first token
    stays that of a full prefill. A longer rest, or exact K/V, run on the prefill's weights."""
    from ragblend.core.calibration.metrics import first_token_kl

    engine = BlendEngine(copy.deepcopy(tiny_model("qwen2")), tokenizer, decode_dtype="int8",
                         prefix_cache_bytes=TIER, min_fusion_speedup=0, history_pieces=False)
    ids = text_ids(engine, 60)
    for namespace, new_tokens in (("short", 12), ("long", 40)):
        answer = engine.generate(PromptLayout(ids, [], namespace=namespace), max_new_tokens=6, stop=None)
        turn = ids + answer.token_ids + text_ids(engine, 8 + new_tokens, seed=1)[8:]
        nxt = engine.prefill(PromptLayout(turn, [], namespace=namespace))
        assert nxt.stats.prefix_tokens == len(ids) + 5   # the answer's K/V, decoded on 8-bit weights
        on_twin = "on the decoding weights" in nxt.stats.strategy_reason
        assert on_twin == (namespace == "short")   # 13 rows in one 8-bit pass; 41 in one float32 pass
        assert first_token_kl(forward_logits(engine, turn), nxt.logits) < 1e-2
        assert nxt.logits.argmax() == forward_logits(engine, turn).argmax()
    exact = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    answer = exact.generate(PromptLayout(ids, []), max_new_tokens=6, stop=None)
    nxt = exact.prefill(PromptLayout(ids + answer.token_ids + [11, 12, 13], []))
    assert nxt.stats.prefix_tokens == len(ids) + 5 and "decoding weights" not in nxt.stats.strategy_reason


@pytest.mark.parametrize("biased", [False, True])
def test_an_answer_whose_draft_ran_past_its_end_is_kept_too(tokenizer, biased):
    """A draft verified past an answer's end (an end-of-sequence token accepted in it) leaves the
    decoder one position longer than the answer: the answer's own K/V are kept all the same, also
    with the score bias of a fused prompt (QueryAware's cached-attention scale), one per kept key."""
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    layout = PromptLayout(text_ids(engine, 60), [])
    decoding = engine.begin(layout, max_new_tokens=6, stop=None)
    "".join(decoding)
    assert decoding.decoder.length == len(layout.token_ids) + 5   # the last token's K/V are not computed
    # As where a verified draft ended in EOS: the decoder holds K/V past the tokens the answer keeps.
    del decoding.token_ids[-2:]
    if biased:   # as a fused prompt's: a bias on each of the prompt's keys
        kept = decoding.prefill.prefix_kept
        decoding.prefill.prefix_kept = dataclasses.replace(kept, key_bias=torch.zeros(len(layout.token_ids)))
    engine.finish(decoding)
    assert engine.prefix_held(layout.token_ids + decoding.token_ids) == len(layout.token_ids) + 4


def test_an_answer_the_tier_cannot_keep_is_served_logged_and_counted(tokenizer, monkeypatch, caplog):
    """Keeping an answer's K/V fails (here: the tier refuses every store): the answer is served
    all the same, the failure is logged and counted (``prefix_info()["faults"]``, /metrics)."""
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    layout = PromptLayout(text_ids(engine, 60), [])
    expected = engine.generate(layout, max_new_tokens=6, stop=None, strategy=FullRecompute()).text
    engine.prefix.clear()

    def refuse(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(engine.prefix, "store", refuse)
    with caplog.at_level("WARNING", logger="ragblend"):
        answer = engine.generate(layout, max_new_tokens=6, stop=None)
    assert answer.text == expected
    assert engine.prefix_info()["faults"] >= 1 and "could not keep" in caplog.text


def test_a_next_question_goes_into_the_room_after_the_opening_once(tokenizer):
    """The K/V of a chat's next question are written into the free positions kept after its
    opening (no copy of the conversation's K/V); only one prompt ever takes that room: a second
    question over the same turn copies, and leaves the first one's K/V as they were."""
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    system = "Context:\n\n" + PASSAGES[0]
    first = dataclasses.replace(engine.find_chunks("Who ran the ferry?", system=system), chat=True)
    answer = engine.generate(first, max_new_tokens=6, stop=None)
    engine.flush()   # the opening, and the room after it, are kept in the background
    (entry,) = engine.prefix._entries.values()
    assert entry.room is not None and entry.room.capacity == len(entry.token_ids) + engine.runner.prefixes.QUESTION_ROOM
    history = [("user", "Who ran the ferry?"), ("assistant", answer.text)]
    prompts = [engine.find_chunks(q, system=system, history=history) for q in ("And when did it stop?", "Why?")]
    taken = engine.prefill(prompts[0])
    assert taken.keys[0].untyped_storage().data_ptr() == entry.keys[0].untyped_storage().data_ptr()   # in the room
    kept = [k.clone() for k in taken.keys]
    copied = engine.prefill(prompts[1])
    assert copied.keys[0].untyped_storage().data_ptr() != entry.keys[0].untyped_storage().data_ptr()
    assert all(torch.equal(k, before) for k, before in zip(taken.keys, kept))   # the first question's K/V stand
    for prompt, result in zip(prompts, (taken, copied)):
        assert result.stats.prefix_tokens == len(entry.token_ids)
        assert (result.logits - forward_logits(engine, prompt.token_ids)).abs().max() <= 1e-4


def test_a_next_turn_opening_never_brings_back_what_the_tier_let_go(tokenizer):
    """The opening is computed on the background thread after the answer: where the tier was cleared
    meanwhile (calibration), evicted the answer or was switched off, nothing comes back."""
    import threading

    system = "Context:\n\n" + PASSAGES[0]
    for change in ("clear", "evict", "off"):
        engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
        tier, gate = engine.prefix, threading.Event()
        engine.runner.background.submit(gate.wait)   # the background thread busy: the opening waits
        first = dataclasses.replace(engine.find_chunks("Who ran the ferry?", system=system, namespace="a"), chat=True)
        engine.generate(first, max_new_tokens=6, stop=None)
        if change == "clear":
            tier.clear()
        elif change == "evict":   # room for one conversation; another namespace's prompt takes it
            tier.max_bytes = int(next(iter(tier._entries.values())).nbytes * 1.5)
            engine.generate(engine.find_chunks("Who ran the ferry?", system=system, namespace="b"), max_new_tokens=6,
                            stop=None)
        else:
            engine.runner.prefix = None
        held = [(e.scope.namespace, len(e.token_ids)) for e in tier._entries.values()]
        gate.set()
        engine.flush()
        assert [(e.scope.namespace, len(e.token_ids)) for e in tier._entries.values()] == held, change


def test_a_near_tie_after_a_rest_on_the_decoding_weights_is_picked_in_float32(tokenizer):
    """As decoding re-picks a near tie on the float32 weights, a rest on the decoding weights whose
    top two logits are within NEAR_TIE is computed again on the prefill's weights."""
    from ragblend.core.decode.generate import NEAR_TIE

    engine = BlendEngine(copy.deepcopy(tiny_model("qwen2")), tokenizer, decode_dtype="int8",
                         prefix_cache_bytes=TIER, min_fusion_speedup=0, history_pieces=False)
    ids, weights = text_ids(engine, 60), engine.runner.prefixes.decode_weights

    def next_turn(rest: list[int], namespace: str, on_twin: bool):
        """A 6-token answer (decoded on 8-bit weights), then a next turn of ``rest`` over it."""
        engine.runner.prefixes.decode_weights = weights if on_twin else None   # None: every rest in float32
        answer = engine.generate(PromptLayout(ids, [], namespace=namespace), max_new_tokens=6, stop=None)
        return engine.prefill(PromptLayout(ids + answer.token_ids + rest, [], namespace=namespace))

    for seed in range(2, 200):   # a rest whose float32 logits are near-tied
        rest = text_ids(engine, 20, seed=seed)[8:]
        exact = next_turn(rest, f"f{seed}", on_twin=False)
        top = exact.logits.topk(2).values
        if top[0] - top[1] < NEAR_TIE / 4:
            break
    assert top[0] - top[1] < NEAR_TIE / 4
    nxt = next_turn(rest, f"t{seed}", on_twin=True)
    assert nxt.stats.prefix_tokens == len(ids) + 5 and "decoding weights" not in nxt.stats.strategy_reason
    assert (nxt.logits - exact.logits).abs().max() <= 1e-5


def test_a_conversations_branches_share_its_earlier_turns():
    """K/V fused for a prompt serve only prompts holding all of it (``usable_from``); a turn computed
    over them serves what they did, so it never drops them for a prompt it cannot serve, and a
    second branch of the conversation still finds the turns the branches share."""
    cache = PrefixCache(1 << 20)
    fused = dataclasses.replace(SCOPE, exact=False)
    assert cache.store(fused, list(range(40)), *kv(40), usable_from=39)     # a fused first turn
    assert cache.store(fused, list(range(70)), *kv(70), usable_from=39)     # a turn over it (branch A)
    assert len(cache) == 1                                                 # it serves all the first did
    branch_b = list(range(60)) + [999] * 10
    assert cache.lookup([fused], branch_b).num_tokens == 60                # the shared turns, past the first
    assert cache.lookup([fused], list(range(30)) + [999] * 10) is None      # less than the fused prompt: none
    # A new prompt fused over the same front serves only itself: the shorter entry stays, and serves.
    assert cache.store(fused, list(range(50)) + [7] * 30, *kv(80), usable_from=79)
    assert len(cache) == 2
    assert cache.lookup([fused], list(range(50)) + [8] * 10).num_tokens == 50
    assert cache.lookup([fused], list(range(50)) + [7] * 30).num_tokens == 80
    # a shorter entry held by a longer one that does not serve it is kept, not refused
    cache = PrefixCache(1 << 20)
    assert cache.store(fused, list(range(70)), *kv(70), usable_from=69)
    assert cache.store(fused, list(range(40)), *kv(40), usable_from=39)
    assert cache.lookup([fused], list(range(45)) + [999]).num_tokens == 40   # the shorter one serves it


def test_a_second_branch_of_a_fused_conversation_reuses_the_turns_it_shares(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer, prefix_cache_bytes=TIER)
    engine.precompute(PASSAGES[:3])
    system = "Context:\n\n" + "\n\n".join(PASSAGES[:3])
    history = []
    for question in ("Who ran the ferry?", "And when did it stop?"):
        layout = engine.find_chunks(question, system=system, history=history)
        answer = engine.generate(dataclasses.replace(layout, chat=True), max_new_tokens=6, stop=None)
        engine.flush()
        history += [("user", question), ("assistant", answer.text)]
    turn_2 = len(layout.token_ids)
    shared = []
    for question in ("Who built the lighthouse?", "What did the bakery sell?"):   # two branches of turn 3
        layout = engine.find_chunks(question, system=system, history=history)
        engine.generate(layout, max_new_tokens=4, stop=None)
        engine.flush()
        shared.append(engine.last_stats.prefix_tokens)
    assert shared[0] > len(engine.find_chunks("x", system=system).token_ids)   # past the first turn
    assert shared[1] >= shared[0] >= turn_2 - 1   # both past the turns they share
    # a new first question over the same context shares less than the fused first turn: fused for itself
    engine.generate(engine.find_chunks("Where did the ferry go?", system=system), max_new_tokens=2, stop=None)
    assert engine.last_stats.prefix_tokens == 0


def test_a_repeat_is_served_the_entry_that_kept_its_logits_among_equally_long_ones():
    cache, logits = PrefixCache(1 << 20), torch.randn(50)
    fused = dataclasses.replace(SCOPE, exact=False)
    assert cache.store(fused, list(range(40)), *kv(40), usable_from=20, logits=logits)
    assert cache.store(fused, list(range(70)), *kv(70), usable_from=39)   # serves less: both kept
    hit = cache.lookup([fused], list(range(40)))
    assert hit.num_tokens == 40 and torch.equal(hit.logits, logits)      # the repeat computes nothing
    assert cache.lookup([fused], list(range(50))).num_tokens == 50


def test_a_long_conversations_entry_keeps_the_logits_of_its_latest_prompts_only():
    from ragblend.core.decode.prefix_cache import MAX_KEPT_LOGITS

    cache = PrefixCache(1 << 20)
    turns = [32 + 16 * t for t in range(MAX_KEPT_LOGITS + 3)]   # each turn's prompt, then its answer stored
    for t, length in enumerate(turns):
        cache.store(SCOPE, list(range(length)), *kv(length), logits=torch.full((50,), float(t)))
        cache.store(SCOPE, list(range(length + 8)), *kv(length + 8))
    (entry,) = cache._entries.values()
    assert sorted(entry.logits) == turns[-MAX_KEPT_LOGITS:]
    assert cache.lookup([SCOPE], list(range(turns[-1]))).logits[0] == len(turns) - 1   # the latest repeat: computes nothing
    assert cache.lookup([SCOPE], list(range(turns[0]))).logits is None                # the first: its last token computed
    assert cache.nbytes == sum(entry.nbytes for entry in cache._entries.values())
