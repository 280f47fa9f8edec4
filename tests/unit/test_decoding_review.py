"""Findings of a review of the decoding changes (fused low-bit matmuls, folded masks, batched
steps attending with SDPA): each test failed on the code it was written against."""

import torch

from ragblend.core.batching import batch_extend
from ragblend.core.generate import KVDecoder

from ..conftest import make_tiny_engine
from .test_engine import segments


def test_a_batch_of_decoders_with_different_kv_dtypes_gives_each_its_own_step(tokenizer):
    """Decoders on one adapter may keep K/V in different dtypes (an engine's answers keep theirs
    in its ``decode_kv_dtype``; engines over one model share its decoding twin). Each batched row
    must still be the row its decoder's own step gives: the batch once rounded every sequence's
    queries to the first decoder's dtype, so a float32 sequence behind a 16-bit one got
    float16-rounded queries (logits off by ~1e-3, by ~1e-2 behind a bfloat16 one)."""
    engine = make_tiny_engine("qwen2", tokenizer)
    pre = engine.prefill(segments())

    def decoder(dtype):
        return KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 2, pre.key_bias,
                         dtype=dtype)

    for low in (torch.float16, torch.bfloat16):
        rows = batch_extend([decoder(low), decoder(torch.float32)], [7, 8])
        assert (rows[1] - decoder(torch.float32).step(8)).abs().max() < 1e-4
        assert (rows[0] - decoder(low).step(7)).abs().max() < 1e-4
