"""Decoding many requests together: one pass over the weights per step for every active sequence.

Decoding one token reads every weight of the model (~540 MB a token for SmolLM2 in float32,
~1/8 of that on 4-bit weights) to do very little arithmetic with them, so on a CPU a step over
8 sequences costs about what a step over one does. :class:`BatchDecoder` keeps several
:class:`~ragblend.core.decode.generate.Decoding` objects (each made by its own fused prefill, each with
its own KV buffers, sampling settings and stop strings) and advances them all at once:

* the projections, the MLP and the LM head run on one ``[sequences, hidden]`` matrix
  (:func:`batch_extend`), so their weights are read once per step for the whole batch;
* attention runs per sequence, over that sequence's own keys (their lengths differ). Padding
  every sequence's keys to the longest and masking would copy all of them in every layer of
  every step; the per-sequence calls cost a small share of a step (measured in the benchmark);
* sequences join and leave between steps (continuous batching).

A lone sequence keeps its single-sequence step, prompt-lookup drafts included; in a batch every
sequence takes plain one-token steps (drafts would make the batch's rows uneven). A fused answer
that starts to loop falls back to the exact path (.repeats) in a full prefill of its own, between steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import InvalidInputError
from ..model.adapter import RopeTables
from ..model.layer_step import LayerPass, run_layers
from ..model.masks import visible_keys
from .generate import Decoding, KVDecoder


def kv_bytes_per_position(decoder: KVDecoder) -> int:
    """Bytes of K and V one position holds over all layers of ``decoder``'s model."""
    return kv_bytes_for(decoder.adapter, 1, decoder.dtype)   # a lazy decoder's buffers need not be made yet


def kv_bytes_for(adapter, positions: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of the KV buffers a decoder over ``adapter``'s model holds for ``positions`` positions
    with K and V in ``dtype`` (default: the model's; an engine's answers use ``engine.answers.kv_dtype``)."""
    shape = adapter.shape
    itemsize = (dtype or adapter.dtype).itemsize
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize * positions


@torch.inference_mode()
def batch_extend(decoders: list[KVDecoder], tokens: list[int]) -> torch.Tensor:
    """Append ``tokens[i]`` to ``decoders[i]`` for every i in one pass over the weights; return the
    logits after each, ``[len(decoders), vocab]``. Row i equals ``decoders[i].step(tokens[i])``
    to float rounding (the matmuls run over more rows, which can pick another kernel)."""
    if not decoders or len(decoders) != len(tokens):
        raise InvalidInputError("batch_extend takes one token per decoder, and at least one decoder.")
    adapter = decoders[0].adapter
    if any(d.adapter is not adapter for d in decoders):
        raise InvalidInputError("Decoders batched together must run on one model (the same adapter).")
    for d in decoders:
        if d.length >= d.capacity:
            raise InvalidInputError(f"A decoder's buffers hold {d.capacity} positions, all used: no room for a token.")
    starts = [d.length for d in decoders]
    # Each sequence sits at its own position: its own row of RoPE angles.
    rope = RopeTables.stack([d.rope.rows(p) for d, p in zip(decoders, starts)])
    hidden = run_layers(adapter, torch.tensor(tokens, device=adapter.device), rope, BatchLayers(adapter, decoders, starts))
    logits = adapter.logits(hidden)
    # Only a pass that completed counts its position: a failed one (anywhere, the LM head
    # included) leaves every decoder as it found it, so it can be run again.
    for d, p in zip(decoders, starts):
        d.length = p + 1
    return logits


class BatchLayers(LayerPass):
    """One token of each of ``decoders`` (at ``starts``) in one pass: Q/K/V and everything after
    attention over one ``[sequences, hidden]`` matrix, each token's K/V written into its own
    decoder's buffers, attention per sequence over that sequence's own keys. One token a
    sequence: no cancellation check."""

    cancellable = False

    def __init__(self, adapter, decoders: list[KVDecoder], starts: list[int]):
        super().__init__(adapter)
        self.decoders, self.starts = decoders, starts
        self.spans = {}   # per sliding window (layers may differ): each sequence's visible keys and bias mask

    def process_qkv(self, layer, x, cos, sin):
        q, k, v = self.adapter.qkv(layer, x)   # k, v: [kv_heads, sequences, head_dim]
        k = self.adapter.rope(k, cos, sin)
        for d, p, k_i, v_i in zip(self.decoders, self.starts, k.unbind(1), v.unbind(1)):
            d.keys[layer][:, p] = k_i
            d.values[layer][:, p] = v_i
        return self.adapter.rope(q, cos, sin)

    def attend(self, layer, q):
        window = self.adapter.window(layer)
        if window not in self.spans:
            self.spans[window] = [visible_keys(p, window, d.key_bias, d.dtype) for d, p in zip(self.decoders, self.starts)]
        # Each sequence's queries go to its own K/V dtype (a float32 one beside a float16 one).
        outs = [self.adapter.attend_one_token(q_i[:, None], d.keys[layer][:, keys], d.values[layer][:, keys], bias)
                for d, (keys, bias), q_i in zip(self.decoders, self.spans[window], q.unbind(1))]
        return torch.cat(outs).to(self.adapter.dtype)


@dataclass(eq=False)
class Member:
    """One sequence of a :class:`BatchDecoder`: its decoding, and whatever its owner tags it with."""

    decoding: Decoding
    tag: object = None
    joined: float = field(default_factory=time.perf_counter)

    @property
    def kv_bytes(self) -> int:
        """The KV memory its decoder holds (prompt and answer, allocated at the start)."""
        return self.decoding.decoder.capacity * kv_bytes_per_position(self.decoding.decoder)


@dataclass
class Event:
    """What a step did for one member: the text it released, and whether it finished (then
    ``member.decoding.finish_reason`` says why, and the member has left the batch). A member
    whose own work failed (its sampling, its detokenizing, its row of a pass) finishes with
    that ``error``; the others carry on."""

    member: Member
    delta: str
    finished: bool
    error: BaseException | None = None


class BatchDecoder:
    """Steps every member's decoding together. Not thread-safe: one thread adds, removes and steps.

    ``max_batch`` bounds the members and ``max_kv_bytes`` (None: no bound) their KV memory;
    :meth:`fits` says whether another decoding of a given size may join. Each model pass holds
    the decodings' lock (their engine's, so that other calls on the engine wait for it).
    """

    def __init__(self, max_batch: int = 8, max_kv_bytes: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidInputError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
        if max_kv_bytes is not None and (isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int)
                                         or max_kv_bytes < 1):
            raise InvalidInputError(f"max_kv_bytes must be a positive integer or None, got {max_kv_bytes!r}.")
        self.max_batch, self.max_kv_bytes = max_batch, max_kv_bytes
        self.members: list[Member] = []
        self.passes = 0          # model passes that advanced sequences (a batched one counts once)
        self.batched_rows = 0    # sequences those passes advanced
        self.most_rows = 0       # the most sequences one pass advanced

    def __len__(self) -> int:
        return len(self.members)

    @property
    def kv_bytes(self) -> int:
        return sum(m.kv_bytes for m in self.members)

    def fits(self, kv_bytes: int = 0) -> bool:
        """Whether a decoding holding ``kv_bytes`` may join now. An empty batch takes any one
        (a request larger than the whole budget is served alone rather than never)."""
        if not self.members:
            return True
        if len(self.members) >= self.max_batch:
            return False
        return self.max_kv_bytes is None or self.kv_bytes + kv_bytes <= self.max_kv_bytes

    def add(self, decoding: Decoding, tag: object = None) -> Member:
        """Let ``decoding`` (fresh from its prefill, not iterated) join at the next step."""
        if decoding.finish_reason is not None or decoding.token_ids:
            raise InvalidInputError("Only a decoding that has not started can join a batch.")
        if self.members and decoding.decoder.adapter is not self.members[0].decoding.decoder.adapter:
            raise InvalidInputError("Every decoding in a batch must run on one model (the same engine).")
        member = Member(decoding, tag)
        self.members.append(member)
        return member

    def remove(self, member: Member) -> None:
        """Drop ``member`` (its client left); the others carry on at the next step."""
        if member in self.members:
            self.members.remove(member)

    @torch.inference_mode()
    def step(self, deliver: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """Every member takes its next token (from logits computed before); those that finish
        leave; then one model pass computes the next logits of every member that needs them.
        ``deliver``: called with the tokens' events before that pass (which are then not
        returned), so that a server sends each token while the next is computed: an answer's
        first token (from its prefill's logits) waits for no pass.

        One member's failure is its own: it leaves with an Event carrying the error. A pass
        that fails over the whole batch is run again for each member alone, so that only the
        members whose own pass fails leave. Running it again is safe: a failed pass counts no
        new position (:func:`batch_extend` advances the decoders only once it has their logits),
        and the K/V it wrote lie past every decoder's length, where the pass run again writes
        them anew. The counters count only passes that advanced something."""
        events = []
        for member in list(self.members):
            decoding = member.decoding
            try:
                # no logits pending only where a failed fallback ended the answer (generate.Decoding.fall_back)
                delta = decoding.take(decoding.pending.popleft()) if decoding.pending else ""
                finished = decoding.finish_reason is not None
                if finished:
                    delta += decoding.rest()
            except Exception as err:   # e.g. sampling from a distribution that came out empty
                self._fail(member, err, events)
                continue
            if finished:
                decoding.decode_s = time.perf_counter() - member.joined
                self.members.remove(member)
            events.append(Event(member, delta, finished))
        if deliver is not None:
            deliver(events)
            events = []
        stepping = [m for m in self.members if m.decoding.needs_step]
        if stepping:
            with stepping[0].decoding.lock or contextlib.nullcontext():
                stepping = self._fall_back([m for m in stepping if m.decoding.falls_back], stepping, events)
                if len(stepping) == 1:   # alone: the single-sequence step, with its drafts
                    try:
                        stepping[0].decoding.advance()
                        self._count_pass(1)
                    except Exception as err:
                        self._fail(stepping[0], err, events)
                elif stepping:
                    self._batched_pass(stepping, events)
        return events

    def _fall_back(self, looping: list[Member], stepping: list[Member], events: list[Event]) -> list[Member]:
        """Run the fallback of each member whose fused answer started to loop (a full prefill of its
        prompt and kept answer, alone: .repeats); the members left to step."""
        for member in looping:
            try:
                member.decoding.advance()
                if member.decoding.fallback_tokens:   # a failed fallback ran no pass
                    self._count_pass(1)
            except Exception as err:
                self._fail(member, err, events)
        return [m for m in stepping if m not in looping]

    def _batched_pass(self, stepping: list[Member], events: list[Event]) -> None:
        decodings = [m.decoding for m in stepping]
        try:
            logits = batch_extend([d.decoder for d in decodings], [d.token_ids[-1] for d in decodings])
            self._count_pass(len(decodings))
        except Exception:   # whose row failed? each member's pass again, alone
            logits = None
        for i, (member, d) in enumerate(zip(stepping, decodings)):
            try:
                if logits is None:
                    row = batch_extend([d.decoder], [d.token_ids[-1]])[0]
                    self._count_pass(1)
                else:
                    row = logits[i]
                d.steps += 1
                d.pending.append(d.rechecked(row))
            except Exception as err:
                self._fail(member, err, events)

    def _count_pass(self, rows: int) -> None:
        """A model pass advanced ``rows`` sequences."""
        self.passes += 1
        self.batched_rows += rows
        self.most_rows = max(self.most_rows, rows)

    def _fail(self, member: Member, err: BaseException, events: list[Event]) -> None:
        self.remove(member)
        events.append(Event(member, "", True, err))
