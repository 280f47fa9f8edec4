"""Gemma 3 (text) and the plain prompt layout of models without a chat template.

Gemma 3 interleaves sliding-window layers (RoPE base 10k) with global ones (base 1M): every
layer must be rotated, and every cached chunk key re-rotated, with its own kind's tables. The
exactness tests at 100% recompute and against a dense reference run on a tiny Gemma 3 in
tests/unit/test_engine.py and tests/unit/test_reference.py (``gemma3`` in ``TINY_ARCHS``); this file
checks the per-layer tables themselves and what the adapter refuses; the real 270M model is in
tests/integration/test_gemma3.py.

Gemma 3 270M is a base model with no chat template: :class:`PromptBuilder` then lays out
system text, passages, question and an answer cue (its "plain layout").
"""

import copy

import pytest
import torch

from ragblend import BlendEngine, Chunk, FullRecompute, QueryAware
from ragblend.core.errors import UnsupportedModelError
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.prompt import PromptBuilder

from ..conftest import PASSAGES, TOKENIZER_DIR, tiny_config, tiny_model

SYSTEM = "Answer briefly."
QUESTION = "Question: who ran the ferry?"


@pytest.fixture(scope="module")
def plain_tokenizer():
    """The tests' small tokenizer with its chat template removed, as a base model ships."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.chat_template = None
    return tok


# ---------------------------------------------------------------------------- the adapter


def test_each_layer_gets_its_own_kinds_rope_tables():
    model = tiny_model("gemma3")
    adapter = ModelAdapter(model)
    rope = adapter.rope_tables(100)
    probe = torch.empty(0)
    for layer, kind in enumerate(model.config.layer_types):
        cos, sin = model.model.rotary_emb(probe, torch.arange(100)[None], kind)
        assert torch.equal(rope.layer(layer)[0], cos[0]) and torch.equal(rope.layer(layer)[1], sin[0])
    local, global_ = rope.layer(0)[0], rope.layer(1)[0]   # sliding_attention, full_attention
    assert not torch.allclose(local, global_)
    assert rope.layer(2)[0] is local   # one table per kind, shared by its layers
    # Rows taken and stacked per kind, as decoding does one position per sequence.
    rows = type(rope).stack([rope.rows(7), rope.rows(42)])
    for layer in range(4):
        assert torch.equal(rows.layer(layer)[0], rope.layer(layer)[0][[7, 42]])
    assert adapter.scaling == pytest.approx(24 ** -0.5)   # query_pre_attn_scalar, not head_dim


def test_a_single_rope_model_shares_one_table_across_layers():
    rope = ModelAdapter(tiny_model("llama")).rope_tables(10)
    assert all(rope.layer(i)[0] is rope.layer(0)[0] for i in range(4))


def test_attention_soft_capping_is_refused_clearly():
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(tiny_config("gemma3"))
    config.attn_logit_softcapping = 50.0   # Gemma 2's: attention ragblend's SDPA does not compute
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        ModelAdapter(model)


# ---------------------------------------------------------------------------- the plain layout


def test_plain_layout_is_system_passages_question_and_an_answer_cue(plain_tokenizer):
    builder = PromptBuilder(plain_tokenizer)
    assert not builder.use_chat_template
    layout = builder.build([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), QUESTION], system=SYSTEM)
    text = plain_tokenizer.decode(layout.token_ids[1:])
    assert layout.token_ids[0] == plain_tokenizer.bos_token_id
    assert text == f"{SYSTEM}\n\n{PASSAGES[0]}\n\n{PASSAGES[1]}\n\n{QUESTION}\n\nAnswer:"
    sep = builder.tokenize("\n\n")
    expected = ([plain_tokenizer.bos_token_id] + builder.tokenize(SYSTEM) + sep + builder.tokenize(PASSAGES[0]) + sep
                + builder.tokenize(PASSAGES[1]) + sep + builder.tokenize(QUESTION) + sep + builder.tokenize("Answer:"))
    assert layout.token_ids == expected
    for span, passage in zip(layout.chunk_spans, PASSAGES):   # the chunks keep their own ids
        assert layout.token_ids[span.start:span.end] == builder.tokenize(passage)
    # No system prompt (or an empty one): the passages follow the BOS token.
    assert builder.build([QUESTION]).token_ids == [plain_tokenizer.bos_token_id] + builder.tokenize(QUESTION) + sep \
        + builder.tokenize("Answer:")
    assert builder.build([QUESTION], system="").token_ids == builder.build([QUESTION]).token_ids


def test_plain_layout_of_a_conversation_and_of_chat_messages_agree(plain_tokenizer):
    builder = PromptBuilder(plain_tokenizer)
    history = [("user", "Who kept the lighthouse?"), ("assistant", "Nobody is named.")]
    layout = builder.build([QUESTION], system=SYSTEM, history=history)
    assert plain_tokenizer.decode(layout.token_ids[1:]) == (
        f"{SYSTEM}\n\nWho kept the lighthouse?\n\nAnswer: Nobody is named.\n\n{QUESTION}\n\nAnswer:")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who kept the lighthouse?"},
                {"role": "assistant", "content": "Nobody is named."}, {"role": "user", "content": QUESTION}]
    assert builder.chat_ids(messages) == layout.token_ids
    assert builder.chat_ids(messages, add_generation_prompt=False) == layout.token_ids[:-len(builder._plain_cue())]
    assert builder.chat_ids(messages[:3]) == builder.chat_ids(messages[:3], add_generation_prompt=False)  # ends answered


def test_the_answer_cue_can_be_changed_or_left_out(plain_tokenizer):
    bare = PromptBuilder(plain_tokenizer, answer_cue="").build([QUESTION], system=SYSTEM)
    assert plain_tokenizer.decode(bare.token_ids[1:]) == f"{SYSTEM}\n\n{QUESTION}"
    other = PromptBuilder(plain_tokenizer, answer_cue="A:").build([QUESTION], history=[("assistant", "Hi.")])
    assert plain_tokenizer.decode(other.token_ids[1:]) == f"A: Hi.\n\n{QUESTION}\n\nA:"


def test_a_template_less_engine_reuses_chunks_and_matches_the_model_forward(plain_tokenizer):
    engine = BlendEngine(tiny_model("gemma3"), plain_tokenizer, kv_dtype="float32")
    segments = [Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[2]), QUESTION]
    full = engine.prefill(segments, system=SYSTEM, strategy=FullRecompute())
    assert plain_tokenizer.decode(full.token_ids).endswith(f"{QUESTION}\n\nAnswer:")
    with torch.no_grad():
        ref = engine.hf_model(torch.tensor([full.token_ids])).logits[0, -1]
    assert (full.logits - ref).abs().max() < 1e-4
    engine.precompute(PASSAGES[:3])
    blended = engine.prefill(segments, system=SYSTEM, strategy=QueryAware(0.3))
    assert blended.token_ids == full.token_ids and blended.stats.reused_tokens > 0
