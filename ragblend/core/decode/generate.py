"""Decoding from a fused KV cache: greedy or sampled, with stop strings, EOS and streaming.

The fused prefill leaves the post-RoPE K/V of every prompt token. :class:`KVDecoder` copies
them into buffers sized for the whole answer and runs new tokens through the model's own
modules (the adapter's per-layer steps), writing their K/V in place: the same operations as
transformers' decoding, without its per-step cache and mask bookkeeping. Greedy decoding
drafts tokens by :class:`PromptLookup` and verifies them in the same pass, keeping only those
it would have chosen anyway. With a full prefill, greedy decoding gives transformers'
``generate`` tokens.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import struct
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch

from ..cancel import Cancelled, check_cancelled
from ..errors import InvalidInputError
from ..model.layer_step import LayerPass, run_layers
from ..model.masks import attention_plan, visible_keys
from ..model.omp import release_thread_pool
from .repeats import DroppedCopy, Repeat, RepeatGuard

log = logging.getLogger("ragblend")

# A greedy pick on low-bit weights (4-bit or 8-bit, bfloat16 activations) whose top two logits
# lie closer than this is made again on the float32 weights. Fed the same answers (SmolLM2, 54
# prompts, 1,147 steps on an AVX2-only EPYC), the low-bit margin between a step's top two tokens
# was off the float32 one by 0.02 (median), 0.12-0.15 (99th percentile); of the 9 picks that
# differed, 8 had a margin under 0.03 (1.9% of steps do) and one 0.055. Wider costs more than it
# saves: a pick made again runs a float32 pass (on that host ~110 ms, plus ~5 ms a row, where a
# low-bit pass takes ~50). docs/notes/near-ties.md.
NEAR_TIE = 0.03

def near_tie(logits: torch.Tensor) -> bool:
    """Whether a greedy pick from ``logits`` (``[vocab]``, or ``[rows, vocab]``: any row) has its top
    two logits within :data:`NEAR_TIE`: where low-bit rounding may have made the pick."""
    top = logits.topk(2, dim=-1).values
    return bool((top[..., 0] - top[..., 1] < NEAR_TIE).any())


# Sampling computes in float32, where a positive temperature or top_p below ~7e-46 is zero: a
# temperature of 1e-300 divides by zero (the probabilities turn to NaN), a top_p of 1e-300 keeps
# no token at all, and the draw fails. Such values are refused. Subnormal ones (below float32's
# smallest normal number, ~1.2e-38) still work here, but not where denormals are flushed to
# zero, so the server refuses them too (serving.requests.CompletionOptions).
MIN_SAMPLING_VALUE = float(torch.finfo(torch.float32).tiny)


def rounds_to_zero_in_float32(value: float) -> bool:
    return 0 < abs(value) < MIN_SAMPLING_VALUE and struct.unpack("f", struct.pack("f", value))[0] == 0


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
        if rounds_to_zero_in_float32(self.temperature):
            raise InvalidInputError(f"temperature {self.temperature!r} rounds to zero in float32, where sampling "
                                    f"computes; use 0 for greedy decoding or at least {MIN_SAMPLING_VALUE:.3g}.")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p)
                or not 0 < self.top_p <= 1):
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if rounds_to_zero_in_float32(self.top_p):
            raise InvalidInputError(f"top_p {self.top_p!r} rounds to zero in float32, where sampling computes, and "
                                    f"would keep no token; use at least {MIN_SAMPLING_VALUE:.3g}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidInputError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}.")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidInputError(f"stop must be a list of non-empty strings, got {self.stop!r}.")
        object.__setattr__(self, "stop", stop)


class KVDecoder:
    """Runs new tokens, one or a few per pass, over preallocated per-layer K/V buffers.

    ``keys``/``values``: the prompt's per-layer ``[kv_heads, N, head_dim]`` K (after RoPE)
    and V; ``capacity``: the most positions the buffers will hold (prompt + answer);
    ``key_bias``: the fused prefill's score bias on the prompt's keys (``[N]``, see
    :attr:`~ragblend.core.fusion.prefill.FusedPrefill.key_bias`), kept for every answer token;
    ``dtype``: the buffers' (default: the prompt K/V's). Attention runs in it; the rest of a
    step in the model's dtype. ``lazy``: the buffers are made (the prompt's K/V copied in) when
    first used, not now: an answer's first token, which its prefill's logits give, is sent
    without waiting for the copy (tens of MB over a long prompt); ``filled(decoder)`` is then called.
    """

    def __init__(self, adapter, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int,
                 key_bias: torch.Tensor | None = None, dtype: torch.dtype | None = None, *, lazy: bool = False):
        n = keys[0].shape[1]
        self.adapter, self.length, self.capacity = adapter, n, capacity   # capacity: the most positions held
        self.dtype = dtype or keys[0].dtype
        self.key_bias = None
        if key_bias is not None:
            self.key_bias = key_bias.new_zeros(capacity)
            self.key_bias[:n] = key_bias
        self._prompt: tuple | None = (keys, values)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.filled: Callable[[KVDecoder], None] | None = None
        if not lazy:
            self._fill()
        self.rope = adapter.rope_tables(capacity)   # per layer: Gemma 3's local and global layers differ

    @classmethod
    def over(cls, adapter, keys: list[torch.Tensor], values: list[torch.Tensor], length: int,
             key_bias: torch.Tensor | None = None) -> KVDecoder:
        """A decoder whose buffers are ``keys`` and ``values`` themselves (per layer ``[kv_heads,
        capacity, head_dim]``, their first ``length`` positions held), not copies: it writes the
        positions after ``length`` (a :class:`~ragblend.core.decode.prefix_cache.Room`)."""
        decoder = cls(adapter, [k[:, :0] for k in keys], [v[:, :0] for v in values], keys[0].shape[1],
                      None if key_bias is None else key_bias[:0], lazy=True)
        decoder._keys, decoder._values, decoder._prompt, decoder.length = list(keys), list(values), None, length
        if key_bias is not None:
            decoder.key_bias[:length] = key_bias
        return decoder

    def _fill(self) -> None:
        """Make the buffers and copy the prompt's K/V into them."""
        keys, values = self._prompt
        shape, n, capacity = self.adapter.shape, keys[0].shape[1], self.capacity
        # Built aside and kept only whole: a fill that fails part way (out of memory) leaves the
        # decoder unfilled, so a retry starts again from the first layer.
        key_buffers, value_buffers = [], []
        for k, v in zip(keys, values):
            key_buffer = k.new_empty(shape.num_kv_heads, capacity, shape.head_dim, dtype=self.dtype)
            value_buffer = v.new_empty(shape.num_kv_heads, capacity, shape.head_dim, dtype=self.dtype)
            key_buffer[:, :n], value_buffer[:, :n] = k, v
            key_buffers.append(key_buffer)
            value_buffers.append(value_buffer)
        self._keys, self._values, self._prompt = key_buffers, value_buffers, None
        filled, self.filled = self.filled, None
        if filled is not None:
            filled(self)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer the K buffer ``[kv_heads, capacity, head_dim]`` (the first ``length`` positions held)."""
        if self._prompt is not None:
            self._fill()
        return self._keys

    @property
    def values(self) -> list[torch.Tensor]:
        if self._prompt is not None:
            self._fill()
        return self._values

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Append ``token`` at the next position; return the logits ``[vocab]`` after it."""
        return self.extend([token])[0]

    @torch.inference_mode()
    def extend(self, tokens: list[int], adapter=None, *, last_only: bool = False,
               with_logits: bool = True) -> torch.Tensor | None:
        """Append ``tokens`` at the next positions in one pass; return the logits after each
        ``[len(tokens), vocab]`` (``last_only``: after the last, ``[1, vocab]``: a prompt's rest;
        ``with_logits=False``: none, only their K/V are wanted). One pass reads every weight once,
        whatever the number of tokens, which is what makes verifying drafted tokens
        (:class:`PromptLookup`) cheap. ``adapter``: another adapter of the same model to run this
        pass on (the float32 one that re-runs a low-bit pass, see :attr:`Decoding.exact_adapter`)."""
        adapter, start, n = adapter or self.adapter, self.length, len(tokens)
        end = start + n
        if n == 0 or end > self.capacity:
            raise InvalidInputError(f"The decoder's buffers hold {self.capacity} positions; "
                                    f"{start} are used, no room for {n} more.")
        hidden = run_layers(adapter, torch.tensor(tokens, device=adapter.device), self.rope.rows(slice(start, end)),
                            DecoderLayers(self, adapter, start, end))
        logits = None if not with_logits else adapter.logits(hidden[-1:] if last_only else hidden)
        self.length = end   # only once the pass completed: a failed one leaves the decoder as it was
        return logits

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (drafted tokens that were not accepted)."""
        if not 0 <= length <= self.length:
            raise InvalidInputError(f"Cannot truncate a decoder holding {self.length} positions to {length}.")
        self.length = length


class DecoderLayers(LayerPass):
    """A :class:`KVDecoder`'s pass over the new tokens at ``start:end``: Q, K and V in one matmul
    (a decoding twin's fused low-bit rows, :meth:`ModelAdapter.qkv`), K/V written into the
    decoder's buffers, attention of each token over the keys it sees."""

    def __init__(self, decoder: KVDecoder, adapter, start: int, end: int):
        super().__init__(adapter)
        self.decoder, self.start, self.end = decoder, start, end
        # A prompt's rest (core.decode.prefix_cache) may be long: it may be cancelled (a failed pass changes
        # nothing). A one-token step pays no check.
        self.cancellable = end - start > 1
        self.plans = {}   # per sliding window (layers may differ): the keys the new tokens see, and their masks

    def process_qkv(self, layer, x, cos, sin):
        q, k, v = self.adapter.qkv(layer, x)
        self.decoder.keys[layer][:, self.start:self.end] = self.adapter.rope(k, cos, sin)
        self.decoder.values[layer][:, self.start:self.end] = v
        return self.adapter.rope(q, cos, sin)

    def attend(self, layer, q):
        adapter, decoder, n = self.adapter, self.decoder, self.end - self.start
        window = adapter.window(layer)
        if window not in self.plans:   # once, not in every layer: the keys seen, and the masks
            self.plans[window] = self._plan(window)
        seen, masks = self.plans[window]
        keys, values = decoder.keys[layer][:, seen], decoder.values[layer][:, seen]
        if n == 1:
            attn = adapter.attend_one_token(q, keys, values, *masks)
        else:
            attn = adapter.attention(q.to(decoder.dtype), keys, values, *masks)
        return attn.to(adapter.dtype)   # attention ran in the buffers' dtype; the rest in the model's

    def _plan(self, window: int | None):
        decoder, start, end = self.decoder, self.start, self.end
        if end - start == 1:   # one token sees all its keys: no causal mask, only the bias if any
            seen, bias = visible_keys(start, window, decoder.key_bias, decoder.dtype)
            return seen, (bias,)
        key_bias = None if decoder.key_bias is None else decoder.key_bias[:end]
        positions = torch.arange(start, end, device=self.adapter.device)
        plan = attention_plan(positions, end, window, decoder.dtype, rows_per_group=end - start, key_bias=key_bias)[0]
        return plan.keys, (plan.mask, self.adapter.fold_mask(plan.mask))


class PromptLookup:
    """Drafts the next tokens by prompt lookup: find the latest earlier place where the
    sequence's last 1-3 tokens occurred, and propose the tokens that followed there.

    RAG answers copy names, dates and phrases from the passages, so drafts taken from the
    prompt are often right. The decoder checks a draft in one pass (:meth:`KVDecoder.extend`)
    and keeps only the tokens greedy decoding would have produced anyway.
    """

    MAX_NGRAM = 3
    MIN_NGRAM = 1

    def __init__(self, token_ids: list[int]):
        self.tokens: list[int] = list(token_ids)
        self.follower: dict[tuple[int, ...], int] = {}   # n-gram -> where its latest follower is
        # What append() would have filed for each token, built by the dict itself (a 3k-token
        # prompt: ~1 ms instead of ~6, which every answer's first token waited for): each n-gram
        # that ends before the last token, the latest place after it winning.
        head = self.tokens[:-1]
        for n in range(1, self.MAX_NGRAM + 1):
            self.follower.update(zip(zip(*(head[k:] for k in range(n))), range(n, len(self.tokens))))

    def append(self, token: int) -> None:
        tokens = self.tokens
        for n in range(1, self.MAX_NGRAM + 1):
            if len(tokens) >= n:
                self.follower[tuple(tokens[-n:])] = len(tokens)
        tokens.append(token)

    def draft(self, max_tokens: int) -> tuple[int, list[int]]:
        """``(n, tokens)``: up to ``max_tokens`` tokens that followed the longest recurring tail,
        and that tail's length n (1-3); ``(0, [])`` when the last token never occurred before."""
        for n in range(self.MAX_NGRAM, self.MIN_NGRAM - 1, -1):
            start = self.follower.get(tuple(self.tokens[-n:])) if len(self.tokens) >= n else None
            if start is not None:
                return n, self.tokens[start:start + max_tokens]
        return 0, []


class DraftPolicy:
    """How many drafted tokens a pass verifies: as many as are likely to pay, learned over the answer.

    A drafted token costs a row of the pass whether it is kept or not (``row_cost``, as a share
    of a one-token pass: ~15% on a 2-core CPU over a 3k-token prompt, measured per engine by
    :func:`~ragblend.core.decode.answers.draft_row_cost`), and it is kept only where greedy decoding
    would have chosen it. How often that happens depends on the answer and on the match: a
    sentence copied from a passage keeps whole drafts, free text almost none, and a draft found
    by a 3-token match is kept far more often than one found by a single token. Drafting 3 on
    every pass made a 256-token answer of free text slower than no drafting at all.

    So the policy counts, per match length and draft position j, how often the j-th drafted
    token was kept when the ones before it were, and drafts the length k with the most expected
    tokens per unit of time, ``(1 + P_1 + ... + P_k) / (1 + k * row_cost)``, where P_j is the
    chance the first j drafted tokens are all kept. The counts decay on every pass that found a
    match, drafted or not, so a length it stopped drafting drifts back to the prior and is
    tried again. One policy per answer, and no clock in it: the same prompt drafts the same
    way, so it gets the same passes and the same answer."""

    DECAY = 0.97                # each pass with a match shrinks that match length's counts: ~the last 30 passes
    PRIOR_TRIES, PRIOR_KEPT = 2.0, 1.0   # an untried (or long unused) position counts as kept half the time

    def __init__(self, row_cost: float):
        self.row_cost = row_cost
        self.tries: dict[tuple[int, int], float] = {}   # (match length, position) -> decayed count
        self.kept: dict[tuple[int, int], float] = {}

    def kept_chance(self, match: int, position: int) -> float:
        """The chance the ``position``-th drafted token (from 1) is kept, given the ones before it were."""
        key = (match, position)
        return (self.kept.get(key, 0.0) + self.PRIOR_KEPT) / (self.tries.get(key, 0.0) + self.PRIOR_TRIES)

    def length(self, match: int, available: int) -> int:
        """How many of ``available`` drafted tokens (found by a ``match``-token tail) to verify."""
        best, best_rate, all_kept, expected_tokens = 0, 1.0, 1.0, 1.0
        for position in range(1, available + 1):
            all_kept *= self.kept_chance(match, position)
            expected_tokens += all_kept
            rate = expected_tokens / (1 + position * self.row_cost)
            if rate > best_rate:
                best, best_rate = position, rate
        return best

    def record(self, match: int, drafted: int, accepted: int) -> None:
        """What a pass did with a ``match``-token tail's draft: ``drafted`` tokens verified,
        the first ``accepted`` of them kept."""
        if not match:
            return
        for key in [key for key in self.tries if key[0] == match]:
            self.tries[key] *= self.DECAY
            self.kept[key] *= self.DECAY
        # Position j was tried when the j-1 tokens before it were kept.
        for position in range(1, min(drafted, accepted + 1) + 1):
            key = (match, position)
            self.tries[key] = self.tries.get(key, 0.0) + 1.0
            self.kept[key] = self.kept.get(key, 0.0) + (1.0 if position <= accepted else 0.0)


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
    lookup: PromptLookup | None = None   # drafts tokens to verify in each step (greedy only)
    draft_tokens: int = 0                # the most tokens drafted per step
    draft_policy: DraftPolicy | None = None   # how many of them a pass verifies (None: all it finds)
    exact_adapter: object = None         # float32 weights that re-run a low-bit pass at a near tie (greedy only)
    # A fused answer's watch for a loop (.repeats), and the exact full prefill it falls back to
    # (token ids -> FusedPrefill; the prompt's ids are prefill's); None for an answer on the exact path (a
    # full prefill's, or after a fallback).
    repeat_guard: RepeatGuard | None = None
    exact_prefill: Callable[[list[int]], object] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    decode_s: float = 0.0
    steps: int = 0                       # decoder passes, fewer than tokens when drafts are accepted
    rechecks: int = 0                    # of them, passes made again on exact_adapter at a near tie
    fallback: str = ""                   # why the answer fell back to the exact path ("": it did not)
    fallback_tokens: int = 0             # tokens the fallback's full prefill computed (prompt + kept answer)
    stats: object = None                 # the engine's Stats of this request, when it made the decoding
    prefill: object = None               # and its Prefill (results.Prefill)

    def finish_stats(self, stats):
        """``stats`` (a :class:`~ragblend.core.results.Stats`) completed with this decoding's answer."""
        stats.generated_tokens = len(self.token_ids)
        stats.decode_s, stats.decode_steps, stats.finish_reason = self.decode_s, self.steps, self.finish_reason
        stats.decode_rechecks = self.rechecks
        stats.fusion_fallback, stats.fallback_tokens = self.fallback, self.fallback_tokens
        release_thread_pool()   # the answer is done: see .omp
        return stats

    def __post_init__(self):
        if self.params.temperature > 0:
            self.lookup = None   # a draft is checked against the greedy choice: sampling never drafts
            self.exact_adapter = None   # a near tie matters to a greedy pick; sampling draws either token
        self.generator = None
        if self.params.temperature > 0:
            self.generator = torch.Generator(device=self.first_logits.device)
            self.generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())
        # Logits already computed for the next tokens: the prompt's at first, one after a plain
        # step, more when a step accepted drafted tokens (whose K/V are then in the cache already).
        self.pending = collections.deque([self.first_logits])
        self.exact_until = self.prompt_len   # K/V before it are what float32 decoding writes (see _again_in_float32)
        self.emitted = 0   # characters of text handed out as deltas
        self.repeat: Repeat | None = None   # a loop just found, the fallback not yet run (see needs_step)
        self.dropped: DroppedCopy | None = None   # after the fallback: the copy it dropped, if written again

    def __iter__(self) -> Iterator[str]:
        t0 = time.perf_counter()
        # Inference mode is entered per step, never held across a yield: a caller that abandons the
        # stream leaves this generator to the garbage collector, whose closing it later (in the middle
        # of another answer's pass, on this thread) would otherwise switch inference mode off there.
        while True:
            with torch.inference_mode():
                delta = self.take(self.pending.popleft())
            if delta:
                yield delta
            if self.finish_reason is not None:
                break
            if not self.pending:   # the token is not in the cache yet
                check_cancelled()   # a caller's fusion.cancellable() may stop us between steps
                with torch.inference_mode(), self.lock or contextlib.nullcontext():
                    self.advance()
                if self.finish_reason is not None:   # a fallback that failed ends the answer
                    break
        self.decode_s = time.perf_counter() - t0
        rest = self.rest()
        if rest:
            yield rest

    # -- one token at a time, for a loop that steps many decodings together (core.decode.batching)

    @property
    def falls_back(self) -> bool:
        """Whether the next :meth:`advance` is the fallback (a full prefill, not a batchable step)."""
        return self.repeat is not None

    @property
    def needs_step(self) -> bool:
        """Whether the next token's logits must be computed (:meth:`advance`: a model pass over the
        last token, or the fallback to the exact path after a loop)."""
        return self.finish_reason is None and not self.pending

    def advance(self) -> None:
        """Compute the next token's logits (call when :attr:`needs_step`, holding the lock): a model
        pass over the last token, or, after a loop was found, the fallback to the exact path."""
        if self.repeat is not None:
            self.fall_back()
        else:
            self.pending.extend(self._step(self.token_ids[-1]))

    def take(self, logits: torch.Tensor) -> str:
        """Pick the next token from ``logits``; return the text it releases (often "", when a
        stop string may be starting or a character is half decoded). Sets ``finish_reason``
        at EOS, a stop string or the length limit. A fused answer's token that completes a loop
        (.repeats) is not kept: the answer rolls back and falls back at the next :meth:`advance`."""
        params = self.params
        token = pick_token(logits, params, self.generator)
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return ""
        if self._repeats(token):
            return ""
        self.token_ids.append(token)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish_reason = full[:cut], "stop"
            return ""
        self.text = full
        delta = ""
        safe = len(full) - _stop_holdback(full, params.stop)
        held = self.repeat_guard.held if self.repeat_guard is not None else self.dropped.held if self.dropped else 0
        if held:   # a second copy may be in progress: shown only once it breaks off
            before = self.tokenizer.decode(self.token_ids[:-held], skip_special_tokens=True)
            safe = min(safe, len(before.rstrip("\ufffd")))   # a character the held tokens complete is held too
        while safe > self.emitted and full[safe - 1] == "\ufffd":  # half a UTF-8 character
            safe -= 1
        if safe > self.emitted:
            delta, self.emitted = full[self.emitted:safe], safe
        position = self.prompt_len + len(self.token_ids) - 1
        if len(self.token_ids) >= params.max_new_tokens or position + 1 >= self.context_window:
            self.finish_reason = "length"
            # the limit fell inside a character: its first bytes decode to U+FFFD and never complete
            self.text = self.text[:max(self.emitted, len(self.text.rstrip("\ufffd")))]
        elif self.lookup is not None:
            self.lookup.append(token)
        return delta

    def _repeats(self, token: int) -> bool:
        """Whether ``token`` completes a loop, and is dropped with the copy it completes: a fused
        answer's first loop (then the answer falls back at the next :meth:`advance`), or the exact
        path's writing that dropped copy twice more (then the answer ends before them: see .repeats)."""
        if self.repeat_guard is not None:
            self.repeat = self.repeat_guard.observe(token)
            if self.repeat is None:
                return False
            start = self.repeat.start
            copy = (self.token_ids[start:] + [token])[-self.repeat.unit:]
            # Repetition the question asked for is the exact path's to write as often as it does: not watched.
            self.dropped = None if self.repeat_guard.asked_for(copy) else DroppedCopy(copy)
            self.pending.clear()   # logits computed after the dropped tokens
        elif self.dropped is not None and self.dropped.observe(token):
            if not self.dropped.complete:
                return False
            start = len(self.token_ids) + 1 - self.dropped.held
            self.finish_reason, self.dropped = "stop", None
            self.fallback += "; the exact path wrote it twice more, so the answer ends before them"
        else:
            self.dropped = None   # the exact path went its own way
            return False
        del self.token_ids[start:]
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return True

    def fall_back(self) -> None:
        """Go on from the kept answer as a full prefill would: the exact K/V of prompt + kept
        answer (:attr:`exact_prefill`, a full prefill of those tokens) in a new decoder, the logits
        after them pending. The answer is on the exact path from then on, never checked again."""
        repeat, old, exact_prefill = self.repeat, self.decoder, self.exact_prefill
        self.repeat = self.repeat_guard = self.exact_prefill = None   # checked once: never again, whatever follows
        ids = list(self.prefill.token_ids) + self.token_ids
        try:
            exact = exact_prefill(ids)
        except Cancelled:
            raise
        except Exception as err:   # e.g. out of memory: the answer so far stands, ended where it was kept
            log.warning("a looping answer's fallback to the exact path failed (%s: %s); it ends at the kept text",
                        type(err).__name__, err)
            self.fallback = f"{repeat.describe()}; the fallback failed ({type(err).__name__}), so the answer ends there"
            self.finish_reason, self.dropped = "stop", None
            return
        self.decoder = KVDecoder(old.adapter, exact.keys, exact.values, old.capacity, dtype=old.dtype)
        self.exact_until = self.decoder.length
        if self.lookup is not None:   # drafts from the kept tokens only
            self.lookup = PromptLookup(ids)
        self.pending.append(exact.logits.to(old.adapter.device))
        self.steps += 1
        self.fallback, self.fallback_tokens = repeat.describe(), len(ids)
        if self.prefill is not None:   # its K/V are the fused prompt's, not those the answer now follows
            self.prefill.prefix_kept = None
            self.prefill.keys = self.prefill.values = None   # views of the old buffers: let them go

    def rest(self) -> str:
        """Once finished: the text not yet handed out (held back for a stop string that did not come)."""
        rest, self.emitted = self.text[self.emitted:], max(self.emitted, len(self.text))
        return rest

    def _step(self, token: int) -> list[torch.Tensor]:
        """Run ``token`` and a draft through the model; the logits for the next tokens, one
        for the token and one per draft token greedy decoding accepts."""
        decoder = self.decoder
        room = min(self.draft_tokens, decoder.capacity - decoder.length - 1,
                   self.params.max_new_tokens - len(self.token_ids) - 1)
        match, draft = self.lookup.draft(room) if self.lookup is not None and room > 0 else (0, [])
        if self.draft_policy is not None:
            draft = draft[:self.draft_policy.length(match, len(draft))]
        logits = decoder.extend([token, *draft])
        self.steps += 1
        accepted = _accepted_drafts(logits, draft)
        if self._near_tie(logits[:accepted + 1]):   # the low-bit rounding may have made the pick
            logits = self._again_in_float32(draft)
            accepted = _accepted_drafts(logits, draft)
        decoder.truncate(decoder.length - len(draft) + accepted)
        self.exact_until = min(self.exact_until, decoder.length)
        if self.draft_policy is not None:
            self.draft_policy.record(match, len(draft), accepted)
        return list(logits[:accepted + 1])

    def rechecked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``), computed after this decoding's last token by a batched pass
        (:func:`~ragblend.core.decode.batching.batch_extend`), or at a near tie made again on the
        float32 weights (as :meth:`_step` does)."""
        return self._again_in_float32([])[0] if self._near_tie(logits[None]) else logits

    def _near_tie(self, logits: torch.Tensor) -> bool:
        """Whether a greedy pick from a row of ``logits`` (``[rows, vocab]``) has its top two
        logits within :data:`NEAR_TIE`. False when decoding runs on float32 weights already."""
        return self.exact_adapter is not None and near_tie(logits)

    def _again_in_float32(self, draft: list[int]) -> torch.Tensor:
        """The pass that just ran the last answer token and ``draft``, run again on the float32
        weights from the first position a low-bit pass wrote: the K/V of earlier answer tokens
        can tip a near tie too, and this way the pick sees what float32 decoding would (K/V in
        the answer's K/V dtype). Each position runs in float32 at most once (``exact_until``
        moves past it), so an answer re-runs at most its own length in rows. Returns the logits
        after the token and each draft."""
        decoder = self.decoder
        decoder.truncate(self.exact_until)
        logits = decoder.extend(self.token_ids[self.exact_until - self.prompt_len:] + draft, adapter=self.exact_adapter)
        self.exact_until = decoder.length
        self.rechecks += 1
        return logits[-1 - len(draft):]


def _accepted_drafts(logits: torch.Tensor, draft: list[int]) -> int:
    """How many of ``draft`` greedy decoding keeps: those its picks from ``logits`` (row i
    after draft token i-1) agree with, up to the first that does not."""
    accepted = 0
    while accepted < len(draft) and int(torch.argmax(logits[accepted])) == draft[accepted]:
        accepted += 1
    return accepted


SAMPLING_OPTIONS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(params: SamplingParams | None = None, **options) -> SamplingParams:
    """``params``, or ``options`` (any of :class:`SamplingParams`' fields, as keywords) as one
    (not both): how :meth:`BlendEngine.generate` and its kin take their sampling settings."""
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        raise InvalidInputError(f"{unknown[0]!r} is not a sampling option; SamplingParams takes "
                                f"{', '.join(SAMPLING_OPTIONS)}.")
    if params is None:
        return SamplingParams(**options)
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"params must be a ragblend SamplingParams, got {type(params).__name__}.")
    if SamplingParams(**options) != SamplingParams():
        raise InvalidInputError("Pass sampling options either as params=SamplingParams(...) or as keywords, not both.")
    return params

