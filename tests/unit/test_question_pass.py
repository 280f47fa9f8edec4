"""QueryAware's question pass over a conversation's history pieces: the parts of one piece (split around
the template's control tokens) are read as one span there, the control tokens' K/V taken from the piece;
the fused pass still computes them."""

import torch

from ragblend.core.fusion.pipeline import PrefetchSource, SequentialSource
from ragblend.core.fusion.prefill import _joined_pieces, _question_pass_prompt
from ragblend.core.fusion.selection import FusionPrompt, ReusedSpan
from ragblend.core.prompt import PromptLayout
from ragblend.core.store.pieces import is_piece
from ragblend.core.store.tiers import MemoryReader

from ..conftest import synthetic_entry
from .test_pieces import chat, pieces_engine


def test_a_pieces_parts_are_joined_with_the_pieces_own_tokens_between_them():
    piece, other = MemoryReader(synthetic_entry(0)), MemoryReader(synthetic_entry(1))
    # one piece in two parts (its token 5 a control token, computed), then another entry's part
    spans = [ReusedSpan(10, 5, 0, piece=True), ReusedSpan(16, 4, 6, piece=True), ReusedSpan(21, 4, 0, piece=True)]
    source = SequentialSource([piece, piece, other], windows=[slice(0, 5), slice(6, 10), slice(0, 4)])
    ids = [0] * 30
    ids[10:20], ids[21:25] = piece.token_ids[0:10], other.token_ids[0:4]
    assert _joined_pieces(spans, source, ids) == [[0, 1], [2]]
    prompt = FusionPrompt.build(30, spans, "cpu")
    joined, layers = _question_pass_prompt(prompt, source, ids)
    assert [(s.start, s.num_tokens, s.offset) for s in joined.spans] == [(10, 10, 0), (21, 4, 0)]
    assert joined.num_reused == prompt.num_reused + 1
    (k, v), (k2, _) = layers.layer(1)
    entry = piece.entry
    assert torch.equal(k, entry.keys[1][:, 0:10]) and torch.equal(v, entry.values[1][:, 0:10])
    assert torch.equal(k2, other.entry.keys[1][:, 0:4])


def test_only_a_pieces_parts_in_memory_with_exactly_its_tokens_between_are_joined():
    piece = MemoryReader(synthetic_entry(0))
    windows = [slice(0, 5), slice(6, 10)]
    shifted = [ReusedSpan(10, 5, 0, piece=True), ReusedSpan(17, 4, 6, piece=True)]   # 2 tokens between, 1 in the piece
    chunks = [ReusedSpan(10, 5, 0), ReusedSpan(16, 4, 6)]                              # a document chunk's parts
    source = SequentialSource([piece, piece], windows=windows)
    ids = [0] * 30
    ids[10:20] = piece.token_ids[0:10]
    assert _joined_pieces(shifted, source, ids) == [[0], [1]]
    assert _joined_pieces(chunks, source, ids) == [[0], [1]]
    parts = [ReusedSpan(10, 5, 0, piece=True), ReusedSpan(16, 4, 6, piece=True)]
    other_between = list(ids)
    other_between[15] = piece.token_ids[5] + 1   # the right count of tokens between, not the piece's own (review 45)
    assert _joined_pieces(parts, source, other_between) == [[0], [1]]
    ahead = PrefetchSource([piece, piece], windows=windows)   # a read-ahead source joins memory entries too
    try:
        assert _joined_pieces(parts, ahead, ids) == [[0, 1]]
    finally:
        ahead.close()


def test_the_fused_pass_still_computes_the_control_tokens_between_a_pieces_parts(tokenizer):
    engine = pieces_engine(tokenizer)
    chat(engine, 3)
    trace = engine.last_prompt
    layout = PromptLayout(trace.token_ids, trace.chunk_spans)
    spans = [s for s in layout.chunk_spans if is_piece(s)]
    between = [i for a, b in zip(spans, spans[1:]) if a.token_ids == b.token_ids
               and b.start - a.end == b.offset - (a.offset + a.end - a.start) > 0 for i in range(a.end, b.start)]
    assert between   # the history's pieces were split around control tokens
    if engine.prefix is not None:   # fused again, not served from the prefix tier
        engine.prefix.clear()
    pre = engine.prefill(layout)
    assert pre.stats.history_tokens > 0 and all(bool(pre.recomputed[i]) for i in between)
