"""What the engine's calls return: :class:`Stats`, :class:`Prefill`, :class:`PromptTrace`,
:class:`Generation` and :class:`TextStream`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from .prompt import PromptLayout


@dataclass
class Stats:
    """What one prefill (and the decode after it, if any) cost and reused."""

    ttft_s: float = 0.0            # from the call to the first token's logits (a server's: from the request's arrival)
    queued_s: float = 0.0          # a server's: from the request's arrival to its prefill (counted in ttft_s)
    prompt_tokens: int = 0
    reused_tokens: int = 0         # prompt tokens whose KV came from the store (and was kept)
    cache_hit_tokens: int = 0      # prompt tokens found in the store: the reused ones plus those the fusion recomputed
    recomputed_tokens: int = 0     # prompt tokens computed through every layer
    compute_fraction: float = 0.0  # token-layers computed, as a share of a full prefill's
    load_s: float = 0.0            # reading cached KV (in the background when pipelined)
    load_wait_s: float = 0.0       # of which the fusion had to wait for
    compute_s: float = 0.0         # running layers
    strategy: str = ""
    ratio: float | None = None     # the recompute ratio (CacheBlend's "auto" resolved)
    cached_attention_scale: float | None = None   # QueryAware's factor on attention to the reused tokens left cached
    chunks_reused: int = 0         # distinct chunks whose KV came from the store (however many spans)
    chunks_missing: int = 0        # distinct chunks with no (usable) stored KV
    chunks_computed: int = 0       # of those, computed in isolation now and written back
    isolate_s: float = 0.0         # time spent computing those
    tiers: dict = field(default_factory=dict)   # chunks served per tier, e.g. {"memory": 5, "disk": 1}
    generated_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0          # model passes after the prefill: one per token after the first, fewer when drafts were kept
    decode_rechecks: int = 0       # of them, low-bit passes made again on float32 weights at a near tie
    finish_reason: str | None = None
    strategy_reason: str = ""      # why this strategy and ratio (caller's choice, calibration, default)
    fusion_skipped: bool = False   # the exact full prefill ran instead of the fusion: see skip_reason
    skip_reason: str = ""          # why, e.g. "predicted 1.1x: prompt 380 tokens, 60% recomputed"
    predicted_speedup: float | None = None   # the fusion's predicted speed-up over a full prefill, where predicted
    fusion_fallback: str = ""      # why the fused answer fell back to the exact path mid-answer (a loop began), or ""
    fallback_tokens: int = 0       # tokens that fallback's full prefill computed (the prompt and the answer kept)
    store_faults: int = 0          # KV store failures during this prefill, each served as a miss
    prefix_tokens: int = 0         # prompt tokens whose K/V came from the prefix tier (counted in reused_tokens too)
    history_tokens: int = 0        # prompt tokens found as stored pieces of earlier turns (core.store.pieces; in cache_hit_tokens too)

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_hidden_fraction(self) -> float:
        """Share of the KV load time that overlapped compute (1.0 = fully hidden)."""
        # The wait also holds thread hand-off latency, so it can exceed a tiny load.
        return min(1.0, max(0.0, 1.0 - self.load_wait_s / self.load_s)) if self.load_s > 0 else 1.0


@dataclass
class Prefill:
    """Result of :meth:`BlendEngine.prefill`."""

    token_ids: list[int]          # exact prompt ids after chat templating
    logits: torch.Tensor          # [vocab] next-token logits after the prompt (float32)
    stats: Stats
    keys: list[torch.Tensor] = field(repr=False)     # per layer [kv_heads, N, head_dim], after RoPE
    values: list[torch.Tensor] = field(repr=False)
    recomputed: torch.Tensor = field(repr=False)     # bool [N]: tokens recomputed at the last layer
    layout: PromptLayout = field(repr=False)
    # float [N] added to every attention score on each key (QueryAware's cached_attention_scale),
    # or None; decoding from keys/values must add it too, as generate() does
    key_bias: torch.Tensor | None = field(default=None, repr=False)
    # how its K/V were kept in the prefix tier (core.decode.prefix_cache.KeptPrefix), its answer's to follow; None: not kept
    prefix_kept: object = field(default=None, repr=False)
    keeps_pieces: bool = field(default=False, repr=False)   # whether its turns are kept as pieces once answered
    # whether its K/V and logits are a full prefill's (every token through every layer, here or when the prefix
    # tier kept them): its answer is on the exact path; a fused one may fall back to it (.decode.repeats)
    exact: bool = field(default=False, repr=False)


@dataclass
class PromptTrace:
    """The last prompt an engine prefilled, for display: its ids, which tokens were
    recomputed, and where the reused chunks sit."""

    token_ids: list[int]
    recomputed: torch.Tensor          # bool [N]
    chunk_spans: list                 # ChunkSpan, in prompt order


@dataclass
class Generation:
    """Result of :meth:`BlendEngine.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_token_ids: list[int] = field(repr=False)
    logits: torch.Tensor = field(default=None, repr=False)   # [vocab] logits after the prompt (first token)


class TextStream:
    """Text deltas of one :meth:`BlendEngine.stream` call, with that call's ``stats``
    (set once the prefill is done, complete when the stream ends)."""

    def __init__(self):
        self.stats: Stats | None = None
        self._deltas: Iterator[str] = iter(())

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()
