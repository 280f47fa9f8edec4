"""Decoding from a fused KV cache: greedy or sampled, with stop strings, EOS and streaming.

The fused prefill leaves the post-RoPE K/V of every prompt token; they become an ordinary
transformers ``DynamicCache`` and the model's own forward pass decodes from there, one
token at a time. So with a full prefill, greedy decoding is exactly transformers'
``generate``.
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


def build_cache(hf_model, keys: list[torch.Tensor], values: list[torch.Tensor]):
    """A transformers ``DynamicCache`` holding the given per-layer ``[kv_heads, N, dim]`` K/V."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[None], v[None], layer)
    return cache


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

    hf_model: object
    tokenizer: object
    cache: object
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
                    out = self.hf_model(
                        input_ids=torch.tensor([[token]], device=logits.device),
                        position_ids=torch.tensor([[position]], device=logits.device),
                        past_key_values=self.cache, use_cache=True,
                    )
                logits = out.logits[0, -1]
        self.decode_s = time.perf_counter() - t0
        if len(self.text) > emitted:
            yield self.text[emitted:]
