"""core.model.masks: exact causal masks for any subset of query positions. The grouped plan attends
as one dense masked attention would (sliding window and key bias included), each group reading
only the keys it can see; the offset mask of a decoding pass is the dense causal mask's rows."""

import pytest
import torch

from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.model.masks import (
    ROWS_PER_GROUP,
    attend,
    attention_plan,
    attention_weights,
    causal_mask,
    offset_causal_mask,
)

from ..conftest import tiny_model


def dense_causal(num_tokens: int) -> torch.Tensor:
    """Additive causal mask ``[N, N]``: 0 on and below the diagonal, -inf above."""
    return torch.full((num_tokens, num_tokens), float("-inf")).triu(1)


@pytest.mark.parametrize("n, offset", [(1, 0), (1, 7), (3, 5), (4, 0)])
def test_the_offset_mask_is_the_last_rows_of_the_dense_causal_mask(n, offset):
    mask = offset_causal_mask(n, offset, "cpu", torch.float32)
    assert mask.shape == (n, offset + n)
    assert torch.equal(mask, dense_causal(offset + n)[offset:])


def test_causal_mask_keeps_keys_up_to_the_query_and_within_the_window():
    pos = torch.tensor([0, 4, 9])
    assert causal_mask(pos, 10, None).sum(1).tolist() == [1, 5, 10]
    windowed = causal_mask(pos, 10, 3)
    assert windowed.sum(1).tolist() == [1, 3, 3] and windowed[2].nonzero().squeeze(1).tolist() == [7, 8, 9]


def dense_attention(adapter, q, k, v, query_pos, window, key_bias):
    """One softmax over every key, the mask applied to the full score matrix: the reference."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) * adapter.scaling + key_bias
    scores = scores.masked_fill(~causal_mask(query_pos, k.shape[1], window), float("-inf"))
    out = torch.softmax(scores, -1) @ v                  # [heads, n, dim]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_attention_equals_one_dense_masked_attention(window, with_bias):
    adapter = ModelAdapter(tiny_model("mistral"))
    heads, kv_heads, dim, num_keys = 4, 2, 16, 150
    g = torch.Generator().manual_seed(0)
    query_pos = torch.randperm(num_keys, generator=g)[:70].sort().values   # a selection, as CacheBlend keeps
    q = torch.randn(heads, query_pos.numel(), dim, generator=g)
    k, v = torch.randn(kv_heads, num_keys, dim, generator=g), torch.randn(kv_heads, num_keys, dim, generator=g)
    key_bias = torch.randn(num_keys, generator=g) if with_bias else None
    plan = attention_plan(query_pos, num_keys, window, torch.float32, rows_per_group=16, key_bias=key_bias)
    assert len(plan) == 5
    for group in plan:   # each group reads only up to its last query (and from its window's start)
        pos = query_pos[group.rows]
        assert group.keys.stop == int(pos[-1]) + 1
        assert group.keys.start == (0 if window is None else max(0, int(pos[0]) - window + 1))
    with torch.no_grad():
        out = attend(adapter, q, k, v, plan)
    reference = dense_attention(adapter, q, k, v, query_pos, window, 0 if key_bias is None else key_bias)
    assert (out - reference).abs().max() < 1e-5


def test_a_selection_is_grouped_by_its_devices_rows_per_group(monkeypatch):
    query_pos = torch.arange(0, 600, 2)   # 300 selected queries over 600 keys
    monkeypatch.setitem(ROWS_PER_GROUP, "cpu", 100)   # the device's count is the one used
    assert [g.rows for g in attention_plan(query_pos, 600, None, torch.float32)] == [
        slice(0, 100), slice(100, 200), slice(200, 300)]
    assert len(attention_plan(query_pos, 600, None, torch.float32, rows_per_group=64)) == 5
    with pytest.raises(ValueError):
        attention_plan(query_pos, 600, None, torch.float32, rows_per_group=0)


def test_every_query_of_a_plain_prefill_is_one_unmasked_causal_group():
    plan = attention_plan(torch.arange(40), 40, None, torch.float32)
    assert len(plan) == 1 and plan[0].mask is None and plan[0].keys == slice(0, 40)


def test_attention_weights_are_a_distribution_over_the_visible_keys_only():
    adapter = ModelAdapter(tiny_model("llama"))
    g = torch.Generator().manual_seed(1)
    query_pos = torch.tensor([2, 10, 29])
    q, keys = torch.randn(4, 3, 16, generator=g), torch.randn(2, 30, 16, generator=g)
    weights = attention_weights(adapter, q, keys, query_pos, window=8)
    assert weights.shape == (4, 3, 30)
    assert torch.allclose(weights.sum(-1), torch.ones(4, 3))
    assert torch.all(weights[:, ~causal_mask(query_pos, 30, 8)] == 0)
