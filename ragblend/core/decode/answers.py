"""Answers after a fused prefill: where the decoding part of :class:`~ragblend.core.engine.BlendEngine`
starts. It moves the prompt's K/V into the decoder's buffers (in the dtype
:func:`decode_kv_dtype` chose), on the weights :class:`~ragblend.core.model.decode_weights.DecodeWeights`
chose, and sets the answer's limits (end tokens, the context window) and prompt lookup, its
drafts priced by what a row of a pass costs here (:func:`draft_row_cost`). The decoding loop
itself is :class:`~ragblend.core.decode.generate.Decoding`."""

from __future__ import annotations

import logging

import torch

from ..model.decode_weights import DecodeWeights
from ..model.host_cache import measured_twice, remembered
from ..model.kernels import MIN_GAIN, fastest_rounds, host_key
from .generate import Decoding, DraftPolicy, KVDecoder, PromptLookup, SamplingParams
from .repeats import RepeatGuard, RepeatRule

log = logging.getLogger("ragblend")
MEASURED_KEYS = 2048   # keys per layer of the attention timed: over all layers, more than a CPU's caches hold
_MEASURED: dict[tuple, torch.dtype] = {}   # (model shape, threads) -> decode_kv_dtype("auto")'s choice


def eos_ids_of(hf_model, tokenizer) -> frozenset[int]:
    """The tokens that end an answer: the generation config's end ids and the tokenizer's."""
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return frozenset(eos)


def decode_kv_dtype(weights: DecodeWeights, wanted: str, measure=None) -> torch.dtype:
    """The dtype of an answer's K/V buffers for ``wanted`` (an ``EngineOptions.decode_kv_dtype``).

    Over a long prompt a decoding step spends about half its time in attention, reading every
    prompt token's K and V (~46 KB a token for SmolLM2 in float32); 16-bit halves the bytes.
    ``"auto"`` takes float16 only where the decoding matmuls already round activations to
    bfloat16 (4-bit or 8-bit weights), so that float32 decoding stays exact, and only if a
    decoding step's attention (all layers, ``MEASURED_KEYS`` keys, timed by ``measure``, by
    default :func:`~ragblend.core.model.kernels.fastest_rounds`; a test's timer is not kept) is
    faster so than in float32 on this host beyond the noise. Not bfloat16, though often a
    little faster: its 8-bit mantissa changed greedy answers that float16's 11 bits kept
    (docs/benchmarks.md#decoding)."""
    adapter = weights.adapter
    if adapter.dtype != torch.float32 or adapter.device.type != "cpu":
        return adapter.dtype   # a model loaded in 16 bits already decodes in them
    if wanted != "auto":
        return getattr(torch, wanted)
    if not {"4-bit", "8-bit"} & set(weights.layer_counts()):
        return torch.float32
    # Engines over models of one shape, in one process, share the measurement (~0.5 s); later
    # processes on this host read it (.host_cache), so that they decode alike.
    key = (adapter.shape, torch.get_num_threads())
    if measure is None and key in _MEASURED:
        return _MEASURED[key]

    def measured() -> str:
        with torch.inference_mode():
            seconds = (measure or fastest_rounds)({str(dtype): _attention_step(adapter, dtype)
                                                   for dtype in (torch.float32, torch.float16)})
        chosen = "float16" if seconds["torch.float16"] * MIN_GAIN < seconds["torch.float32"] else "float32"
        log.info("ragblend: a decoding step's attention over %d keys: %s; decoding K/V in %s", MEASURED_KEYS,
                 ", ".join(f"{name.split('.')[-1]} {s * 1e3:.2f} ms" for name, s in seconds.items()), chosen)
        return chosen

    if measure is not None:   # a test's timer: nothing kept
        return getattr(torch, measured())
    chosen = getattr(torch, remembered("decode-kv-dtype", host_key([]) | {"model": repr(adapter.shape)},
                                       lambda: measured_twice(measured, "float32"), lambda value: value in ("float16", "float32")))
    _MEASURED[key] = chosen
    return chosen


def _attention_step(adapter, dtype: torch.dtype):
    """A decoding step's attention in ``dtype``: one query over ``MEASURED_KEYS`` keys, every layer."""
    shape = adapter.shape
    keys = [torch.zeros(shape.num_kv_heads, MEASURED_KEYS, shape.head_dim, dtype=dtype)
            for _ in range(2 * shape.num_layers)]
    query = torch.zeros(shape.num_heads, 1, shape.head_dim, dtype=dtype)
    mask = torch.zeros(1, MEASURED_KEYS, dtype=dtype)
    return lambda: [adapter.attention(query, keys[2 * layer], keys[2 * layer + 1], mask)
                    for layer in range(shape.num_layers)]


MAX_ROW_COST = 0.5   # half a pass: no host measured near it, so a timing past it was disturbed
_ROW_COSTS: dict[tuple, float] = {}   # (shape, K/V dtype, threads, weight formats) -> draft_row_cost's


def draft_row_cost(weights: DecodeWeights, kv_dtype: torch.dtype, measure=None) -> float:
    """What one more row adds to a decoding pass, as a share of a one-token pass: a four-token
    pass over ``MEASURED_KEYS`` keys against a one-token pass, timed by ``measure`` (by default
    :func:`~ragblend.core.model.kernels.fastest_rounds`; a test's timer is not kept) at engine
    start (~0.3 s for SmolLM2; engines over models of one shape in one process share it). It
    prices a drafted token for :class:`~ragblend.core.decode.generate.DraftPolicy`. Measured once, not
    from an answer's own passes, so that how an answer drafts does not depend on the clock
    mid-answer: the same prompt drafts alike, and gets the same passes and the same answer."""
    adapter = weights.decoding_adapter()
    if adapter.device.type != "cpu" or adapter.dtype != torch.float32:
        return 0.0   # only float32 drafts (Answers.start); a GPU reads the weights once for a few rows alike
    key = (adapter.shape, kv_dtype, torch.get_num_threads(), tuple(weights.layer_counts().items()))
    if measure is None and key in _ROW_COSTS:
        return _ROW_COSTS[key]

    def measured() -> tuple[float, bool]:
        shape = adapter.shape
        prompt = [torch.zeros(shape.num_kv_heads, MEASURED_KEYS, shape.head_dim, dtype=kv_dtype)
                  for _ in range(shape.num_layers)]
        decoder = KVDecoder(adapter, prompt, prompt, MEASURED_KEYS + 4, dtype=kv_dtype)

        def one_pass(rows: int):
            def run():
                decoder.extend([0] * rows)
                decoder.truncate(MEASURED_KEYS)
            return run

        with torch.inference_mode():
            seconds = (measure or fastest_rounds)({"1": one_pass(1), "4": one_pass(4)})
        row_cost = (seconds["4"] / seconds["1"] - 1) / 3
        log.info("ragblend: a decoding pass over %d keys: %.1f ms for one token, %.1f ms for four; a drafted "
                 "token costs %.0f%% of a pass", MEASURED_KEYS, seconds["1"] * 1e3, seconds["4"] * 1e3, row_cost * 100)
        # past MAX_ROW_COST, or below 0, the timing was disturbed: the conservative price (drafts
        # dear, so few are drafted), kept as unsettled and measured again at a quiet start (.host_cache)
        if not 0.0 <= row_cost < MAX_ROW_COST:
            return MAX_ROW_COST, False
        return row_cost, True

    if measure is not None:   # a test's timer: nothing kept
        return measured()[0]
    # Later processes on this host read it (.host_cache): a price that differs drafts differently,
    # which rounds an answer differently, and at a near-tie changes its words.
    row_cost = remembered("draft-row-cost", host_key([]) | {"model": repr(adapter.shape), "kv_dtype": str(kv_dtype),
                                                            "weights": weights.layer_counts()},
                          measured, lambda value: isinstance(value, float) and 0.0 <= value <= MAX_ROW_COST)
    _ROW_COSTS[key] = row_cost
    return row_cost


class Answers:
    """Starts the decoding of answers for one engine: on ``weights``' adapter, over K/V in
    ``kv_dtype`` (see :func:`decode_kv_dtype`), ending at ``eos_ids`` or the ``context_window``;
    model passes hold ``lock``. A fused answer that starts to loop falls back to the exact path
    where ``repeat_rule`` says (:mod:`.repeats`; None: never)."""

    def __init__(self, weights: DecodeWeights, tokenizer, eos_ids: frozenset[int], context_window: int, lock,
                 kv_dtype: torch.dtype = torch.float32):
        self.weights, self.tokenizer, self.eos_ids = weights, tokenizer, eos_ids
        self.context_window, self.lock, self.kv_dtype = context_window, lock, kv_dtype
        self.draft_row_cost = draft_row_cost(weights, kv_dtype)   # prices a drafted token (DraftPolicy)
        self.repeat_rule: RepeatRule | None = RepeatRule()

    @property
    def can_draft(self) -> bool:
        """Whether greedy answers draft by prompt lookup at all. Drafts are verified in a pass over
        several tokens, which in float32 gives each token's logits to ~1e-5; in bfloat16 a trial saw
        0.69 and a changed answer, so only a float32 model drafts."""
        return self.weights.adapter.dtype == torch.float32

    QUESTION_TOKENS = 1024   # the most prompt tokens after its last chunk read as its question

    def _question_text(self, pre) -> str:
        """The prompt's text after its last chunk (its question, in a RAG prompt), for the repeat guard."""
        spans = getattr(getattr(pre, "layout", None), "chunk_spans", None) or []
        start = max([0, *(span.end for span in spans)], default=0)
        tail = list(pre.token_ids[max(start, len(pre.token_ids) - self.QUESTION_TOKENS):])
        return self.tokenizer.decode(tail, skip_special_tokens=True)

    def start(self, pre, params: SamplingParams, *, draft_tokens: int, exact_prefill=None) -> Decoding:
        """The decoding of an answer after the prefill ``pre`` (a :class:`~ragblend.core.results.Prefill`),
        not yet stepped; ``pre.keys``/``values`` become views of the decoder's buffers. Greedy
        float32 decoding drafts up to ``draft_tokens`` a pass from the prompt (0: none).
        ``exact_prefill`` (token ids -> the full prefill's K/V and logits): what a fused answer
        that starts to loop falls back to; None, or a prefill that ran on the exact path, has none."""
        adapter = self.weights.decoding_adapter()
        n = len(pre.token_ids)
        # The buffers are made at the first decoding pass: the first token, from the prefill's
        # logits, is sent before the prompt's K/V are copied (and converted to kv_dtype).
        decoder = KVDecoder(adapter, pre.keys, pre.values, min(n + params.max_new_tokens, self.context_window),
                            pre.key_bias, dtype=self.kv_dtype, lazy=True)

        def filled(made: KVDecoder):   # the prompt's K/V then live in its buffers: keep views, not a second copy
            pre.keys, pre.values = [k[:, :n] for k in made.keys], [v[:, :n] for v in made.values]

        decoder.filled = filled
        lookup = None
        policy = None
        if draft_tokens and params.temperature == 0 and self.can_draft:
            lookup = PromptLookup(pre.token_ids)
            policy = DraftPolicy(self.draft_row_cost)
        # Low-bit decoding re-runs a near-tied greedy pick on the float32 weights (generate.NEAR_TIE).
        exact = self.weights.exact_adapter() if adapter is not self.weights.adapter else None
        exact = None if exact is adapter else exact   # decoding already runs on the float32 twin
        guard = None
        if exact_prefill is not None and self.repeat_rule is not None and not pre.exact:
            guard = RepeatGuard(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), self.repeat_rule,
                                asked=lambda: self._question_text(pre))
        return Decoding(decoder, self.tokenizer, pre.logits.to(adapter.device), n, params, self.eos_ids,
                        self.context_window, lock=self.lock, lookup=lookup, draft_tokens=draft_tokens,
                        draft_policy=policy, exact_adapter=exact, repeat_guard=guard,
                        exact_prefill=exact_prefill if guard is not None else None, stats=pre.stats, prefill=pre)
