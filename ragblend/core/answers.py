"""Answers after a fused prefill: where the decoding part of :class:`~ragblend.core.engine.BlendEngine`
starts. It moves the prompt's K/V into the decoder's buffers, on the weights
:class:`~ragblend.core.decode_weights.DecodeWeights` chose, and sets the answer's limits (end
tokens, the context window) and prompt lookup. The decoding loop itself is
:class:`~ragblend.core.generate.Decoding`."""

from __future__ import annotations

import torch

from .decode_weights import DecodeWeights
from .generate import Decoding, KVDecoder, PromptLookup, SamplingParams


def eos_ids_of(hf_model, tokenizer) -> frozenset[int]:
    """The tokens that end an answer: the generation config's end ids and the tokenizer's."""
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return frozenset(eos)


class Answers:
    """Starts the decoding of answers for one engine: on ``weights``' adapter, ending at
    ``eos_ids`` or the ``context_window``; model passes hold ``lock``."""

    def __init__(self, weights: DecodeWeights, tokenizer, eos_ids: frozenset[int], context_window: int, lock):
        self.weights, self.tokenizer, self.eos_ids = weights, tokenizer, eos_ids
        self.context_window, self.lock = context_window, lock

    def start(self, pre, params: SamplingParams, *, draft_tokens: int) -> Decoding:
        """The decoding of an answer after the prefill ``pre`` (a :class:`~ragblend.core.results.Prefill`),
        not yet stepped; ``pre.keys``/``values`` become views of the decoder's buffers. Greedy
        float32 decoding drafts up to ``draft_tokens`` a pass from the prompt (0: none)."""
        adapter = self.weights.decoding_adapter()
        n = len(pre.token_ids)
        decoder = KVDecoder(adapter, pre.keys, pre.values, min(n + params.max_new_tokens, self.context_window),
                            pre.key_bias)
        # The prompt's K/V now live in the decoder's buffers; keep views, not a second copy.
        pre.keys, pre.values = [k[:, :n] for k in decoder.keys], [v[:, :n] for v in decoder.values]
        lookup = None
        # Drafts are verified in a pass over several tokens, which in float32 gives each token's
        # logits to ~1e-5; in bfloat16 a trial saw 0.69 and a changed answer, so only float32 drafts.
        if draft_tokens and params.temperature == 0 and self.weights.adapter.dtype == torch.float32:
            lookup = PromptLookup(pre.token_ids)
        return Decoding(decoder, self.tokenizer, pre.logits.to(adapter.device), n, params, self.eos_ids,
                        self.context_window, lock=self.lock, lookup=lookup, draft_tokens=draft_tokens,
                        stats=pre.stats, prefill=pre)
