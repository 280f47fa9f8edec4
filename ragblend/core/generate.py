"""Decoding from a fused KV cache: greedy or sampled, with stop strings, EOS and streaming.

The fused prefill leaves the post-RoPE K/V of every prompt token. :class:`KVDecoder` copies
them into buffers sized for the whole answer and runs one token at a time through the
model's own modules (the adapter's per-layer steps), writing each new token's K/V in place:
the same operations as transformers' decoding, without its per-step cache and mask
bookkeeping. With a full prefill, greedy decoding gives transformers' ``generate`` tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature=0`` is greedy; ``seed`` makes sampling repeatable."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}.")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise InvalidInputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}.")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p)
                or not 0 < self.top_p <= 1):
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidInputError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}.")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidInputError(f"stop must be a list of non-empty strings, got {self.stop!r}.")
        object.__setattr__(self, "stop", stop)


class KVDecoder:
    """Decodes one token at a time over preallocated per-layer K/V buffers.

    ``keys``/``values``: the prompt's per-layer ``[kv_heads, N, head_dim]`` K (after RoPE)
    and V; ``capacity``: the most positions the buffers will hold (prompt + answer);
    ``key_bias``: the fused prefill's score bias on the prompt's keys (``[N]``, see
    :attr:`~ragblend.core.fusion.FusedPrefill.key_bias`), kept for every answer token.
    """

    def __init__(self, adapter, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int,
                 key_bias: torch.Tensor | None = None):
        shape, n = adapter.shape, keys[0].shape[1]
        self.adapter, self.length = adapter, n
        self.key_bias = None
        if key_bias is not None:
            self.key_bias = key_bias.new_zeros(capacity)
            self.key_bias[:n] = key_bias
        self.keys, self.values = [], []
        for k, v in zip(keys, values):
            key_buffer = k.new_empty(shape.num_kv_heads, capacity, shape.head_dim)
            value_buffer = v.new_empty(shape.num_kv_heads, capacity, shape.head_dim)
            key_buffer[:, :n], value_buffer[:, :n] = k, v
            self.keys.append(key_buffer)
            self.values.append(value_buffer)
        self.cos, self.sin = adapter.rope_tables(capacity)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Append ``token`` at the next position; return the logits ``[vocab]`` after it."""
        adapter, position = self.adapter, self.length
        if position >= self.keys[0].shape[1]:
            raise InvalidInputError(f"The decoder's buffers hold {position} positions; no room for another token.")
        cos, sin = self.cos[position:position + 1], self.sin[position:position + 1]
        hidden = adapter.embed(torch.tensor([token], device=self.cos.device))
        for layer in range(adapter.shape.num_layers):
            x = adapter.attn_input(layer, hidden)
            k, v = adapter.kv(layer, x)
            self.keys[layer][:, position] = adapter.rope(k, cos, sin)[:, 0]
            self.values[layer][:, position] = v[:, 0]
            q = adapter.rope(adapter.q(layer, x), cos, sin)
            window = adapter.window(layer)
            first = 0 if window is None else max(0, position + 1 - window)
            bias = None if self.key_bias is None else self.key_bias[first:position + 1]
            attn = adapter.attention_to_all(q, self.keys[layer][:, first:position + 1],
                                            self.values[layer][:, first:position + 1], bias)
            hidden = adapter.finish(layer, hidden, attn)
        self.length = position + 1
        return adapter.logits(hidden)[0]


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # Shift by the maximum first: with a tiny temperature, logits / temperature would overflow
    # to inf (and the probabilities to NaN); shifted, the best token scores 0 and the rest -inf.
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest head of the distribution whose mass reaches top_p
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


@dataclass
class Decoding:
    """An in-progress decode. Iterate it for text deltas; afterwards read the totals."""

    decoder: KVDecoder
    tokenizer: object
    first_logits: torch.Tensor
    prompt_len: int
    params: SamplingParams
    eos_ids: frozenset[int]
    context_window: int
    lock: object = None   # held around each model step (never across a yield)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    decode_s: float = 0.0

    def __iter__(self) -> Iterator[str]:
        params = self.params
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=self.first_logits.device)
            generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        logits, emitted = self.first_logits, 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            while True:
                token = pick_token(logits, params, generator)
                if token in self.eos_ids:
                    self.finish_reason = "stop"
                    break
                self.token_ids.append(token)
                full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
                cut = min((i for i in (full.find(s) for s in params.stop) if i >= 0), default=-1)
                if cut >= 0:
                    self.text, self.finish_reason = full[:cut], "stop"
                    break
                self.text = full
                safe = len(full) - _stop_holdback(full, params.stop)
                while safe > emitted and full[safe - 1] == "\ufffd":  # half a UTF-8 character
                    safe -= 1
                if safe > emitted:
                    yield full[emitted:safe]
                    emitted = safe
                position = self.prompt_len + len(self.token_ids) - 1
                if len(self.token_ids) >= params.max_new_tokens or position + 1 >= self.context_window:
                    self.finish_reason = "length"
                    break
                with self.lock or contextlib.nullcontext():
                    logits = self.decoder.step(token)
        self.decode_s = time.perf_counter() - t0
        if len(self.text) > emitted:
            yield self.text[emitted:]
