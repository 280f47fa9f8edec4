"""Attention masks: exact causal masks over any subset of query positions, grouped so that
each group only attends to the keys it can see. Shared by the fused prefill, isolated KV and
decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from .adapter import ModelAdapter


def causal_mask(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Exact causal mask ``[queries, keys]``: key position <= query position (and in the window)."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def visible_keys(position: int, window: int | None, key_bias: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[slice, torch.Tensor | None]:
    """The keys a token at ``position`` sees (a sliding window sees its last ``window`` keys only)
    and the additive bias ``[1, keys]`` of ``key_bias`` over them in ``dtype`` (None: no bias)."""
    keys = slice(0 if window is None else max(0, position - window + 1), position + 1)
    return keys, None if key_bias is None else key_bias[keys].to(dtype)[None]


@dataclass
class QueryGroup:
    rows: slice                  # rows of the selected queries
    keys: slice                  # keys this group can see at all
    mask: torch.Tensor | None    # additive mask [rows, keys], or None for plain causal


# Query rows per masked attention call, by device. A CPU gains from small groups (each skips the
# keys after its last row); a GPU needs large calls to fill it: on an H100, an 8B-shaped model's
# fused prefill of 16K tokens with its KV already on the GPU took 0.60 s in groups of 64 rows,
# 0.27 s in groups of 1,024 (at 4K 256 rows was fastest, 1,024 as fast as 64; docs/benchmarks.md,
# "Scaling with the prompt").
ROWS_PER_GROUP = {"cpu": 64, "cuda": 1024}


def attention_plan(query_pos: torch.Tensor, num_keys: int, window: int | None,
                   dtype: torch.dtype, rows_per_group: int | None = None,
                   key_bias: torch.Tensor | None = None) -> list[QueryGroup]:
    """Split the selected queries (sorted by position) into groups that each attend only to
    the keys up to the group's last position.

    A masked SDPA computes every query-key pair, so one big masked call costs about twice
    the causal work; groups recover most of the causal saving. Masks are additive floats,
    built once per selection rather than converted from booleans in every layer.
    ``key_bias`` (float ``[num_keys]``) is added to every query's score on each key.
    ``rows_per_group``: None takes the device's (:data:`ROWS_PER_GROUP`).
    """
    n = query_pos.numel()
    if rows_per_group is None:
        rows_per_group = ROWS_PER_GROUP.get(query_pos.device.type, ROWS_PER_GROUP["cpu"])
    if rows_per_group < 1:
        raise InvalidInputError(f"rows_per_group must be at least 1, got {rows_per_group}.")
    if n == num_keys and (window is None or n <= window) and key_bias is None:
        return [QueryGroup(slice(0, n), slice(0, n), None)]
    groups = []
    for start in range(0, n, rows_per_group):
        rows = slice(start, min(n, start + rows_per_group))
        pos = query_pos[rows]
        first = 0 if window is None else max(0, int(pos[0]) - window + 1)
        keys = slice(first, int(pos[-1]) + 1)
        allowed = causal_mask(pos, num_keys, window)[:, keys]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
        if key_bias is not None:
            mask += key_bias[keys].to(dtype)
        mask.masked_fill_(~allowed, float("-inf"))
        groups.append(QueryGroup(rows, keys, mask))
    return groups


def attend(adapter: ModelAdapter, q, k, v, plan: list[QueryGroup]) -> torch.Tensor:
    if len(plan) == 1 and plan[0].mask is None:
        return adapter.attention(q, k, v, None)
    return torch.cat([adapter.attention(q[:, g.rows], k[:, g.keys], v[:, g.keys], g.mask) for g in plan])


def attention_weights(adapter: ModelAdapter, q: torch.Tensor, keys: torch.Tensor, query_pos: torch.Tensor,
                      window: int | None) -> torch.Tensor:
    """Softmax attention ``[heads, queries, keys]`` of (rotated) ``q`` over (rotated) ``keys``."""
    heads, n, dim = q.shape
    kv_heads = keys.shape[0]
    # The query heads that share a K/V head go through one matmul (no repeated keys).
    grouped = q.reshape(kv_heads, heads // kv_heads * n, dim)
    scores = (grouped @ keys.to(q.dtype).transpose(1, 2)).float().view(heads, n, -1) * adapter.scaling
    scores.masked_fill_(~causal_mask(query_pos, keys.shape[1], window), float("-inf"))
    return torch.softmax(scores, dim=-1)


def offset_causal_mask(n: int, offset: int, device, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[n, offset + n]``: query i (at ``offset + i``) may see keys ``0 .. offset + i``."""
    allowed = torch.arange(offset + n, device=device)[None, :] <= torch.arange(offset, offset + n, device=device)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
