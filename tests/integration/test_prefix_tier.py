"""The prefix tier on the real default model: an exact repeat of a RAG prompt is answered from it
(the same logits within float noise, the same answer, far sooner), and a conversation's next turn
reuses the previous turn, the answer the engine generated included."""

import pytest
import torch

from ragblend import BlendEngine, Chunk

from ..conftest import PASSAGES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    engine = BlendEngine.from_pretrained(kv_dir=False)   # the tier on, as by default
    engine.precompute(PASSAGES)
    return engine


def test_an_exact_repeat_is_answered_from_the_tier(engine, bench_prompt):
    chunks, question = bench_prompt   # ~3.1k tokens
    engine.precompute(chunks)
    engine.generate([Chunk(chunks[0]), "What is this about?"], max_new_tokens=2)   # warm, not timed
    segments = [Chunk(c) for c in chunks] + [question]
    first = engine.generate(segments, max_new_tokens=16)
    repeat = engine.generate(segments, max_new_tokens=16)
    n = len(first.prompt_token_ids)
    assert first.stats.prefix_tokens == 0 and first.stats.chunks_reused == len(chunks)
    assert repeat.stats.prefix_tokens == n and repeat.stats.recomputed_tokens == 0   # its logits kept too
    assert torch.equal(repeat.logits, first.logits)
    assert repeat.token_ids == first.token_ids
    assert repeat.stats.ttft_s < 0.5 * first.stats.ttft_s   # nothing computed against a fused prompt, in one run


def test_the_next_turn_reuses_the_last_one_and_its_answer(engine):
    system = "Answer from the passages.\n\n" + "\n\n".join(PASSAGES)
    question = "Who ran the ferry?"
    turn_one = engine.generate([question], system=system, max_new_tokens=24)
    history = [("user", question), ("assistant", turn_one.text)]
    turn_two = engine.generate(engine.build_prompt(["For how long?"], system=system, history=history),
                               max_new_tokens=8)
    # All of turn one's prompt, and of its answer as far as the history's template repeats its ids.
    assert turn_two.stats.prefix_tokens > len(turn_one.prompt_token_ids)
    assert turn_two.stats.prefix_tokens >= len(turn_one.prompt_token_ids) + len(turn_one.token_ids) - 2
