"""core.fusion.prefill: the fused prefill on a model adapter alone. With nothing reused it is the
model's own forward; KV cached in the very context it sits in, reused as it is, gives the same;
after the check layer only the kept tokens run. (Against a dense reference: test_reference.py.)"""

import pytest
import torch

from ragblend import CacheBlend, FullReuse
from ragblend.core.fusion.ingest import isolated_kv
from ragblend.core.fusion.pipeline import SequentialSource
from ragblend.core.fusion.prefill import fused_prefill
from ragblend.core.fusion.selection import ReusedSpan
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.store.kv import ChunkKV
from ragblend.core.store.tiers import MemoryReader

from ..conftest import PASSAGES, TINY_ARCHS, tiny_model
from .test_engine import segments


def model_forward(model, token_ids):
    """The HF model's own next-token logits and (rotated) per-layer K/V for ``token_ids``."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
    cache = out.past_key_values
    return out.logits[0, -1], [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_compute_scales_with_selected_tokens(tiny_engine):
    """After the check layer, only the kept tokens run through the layer."""
    from ragblend.core.fusion.pipeline import SequentialSource
    from ragblend.core.fusion.prefill import fused_prefill
    from ragblend.core.fusion.selection import ReusedSpan

    engine = tiny_engine
    engine.precompute(PASSAGES[:3])
    layout = engine.prompts.build(segments())
    spans = [ReusedSpan(s.start, s.end - s.start) for s in layout.chunk_spans]
    chunks = [engine.store.open(engine.ingestion.key_for(s.token_ids)) for s in layout.chunk_spans]
    n = len(layout.token_ids)
    reused = sum(s.num_tokens for s in spans)
    fused = fused_prefill(engine.adapter, layout.token_ids, spans,
                          SequentialSource(chunks), CacheBlend(0.25, check_layer=1))
    kept = n - reused + -(-reused // 4)
    assert fused.layer_selected[0] == n and fused.layer_selected[1] == n
    assert fused.layer_selected[2:] == [kept] * (engine.adapter.shape.num_layers - 2)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_with_nothing_reused_it_is_the_models_forward(arch, tokenizer):
    model = tiny_model(arch)
    token_ids = tokenizer(" ".join(PASSAGES))["input_ids"]
    fused = fused_prefill(ModelAdapter(model), token_ids, [], None, FullReuse())
    logits, cache = model_forward(model, token_ids)
    assert (fused.logits - logits).abs().max() <= 1e-4
    assert fused.recomputed.all() and fused.layer_selected == [len(token_ids)] * len(cache)
    for (k, v), key, value in zip(cache, fused.keys, fused.values):
        n = k.shape[1]   # a sliding-window layer's cache keeps only its window
        assert torch.allclose(key[:, -n:], k, atol=1e-4) and torch.allclose(value[:, -n:], v, atol=1e-4)


def test_kv_reused_in_its_own_context_gives_the_forward_and_only_fresh_tokens_run(tokenizer):
    model = tiny_model("qwen2")
    adapter = ModelAdapter(model)
    before, chunk, after = (tokenizer(text)["input_ids"] for text in (PASSAGES[0], " " + PASSAGES[1], " Who?"))
    token_ids = before + chunk + after
    keys, values = isolated_kv(adapter, before, chunk)    # the chunk's KV after exactly what precedes it here
    reader = MemoryReader(ChunkKV("0" * 64, chunk, keys, values))
    fused = fused_prefill(adapter, token_ids, [ReusedSpan(len(before), len(chunk))], SequentialSource([reader]),
                          FullReuse())
    logits, _ = model_forward(model, token_ids)
    assert (fused.logits - logits).abs().max() <= 1e-4
    reused = torch.zeros(len(token_ids), dtype=torch.bool)
    reused[len(before):len(before) + len(chunk)] = True
    assert torch.equal(fused.recomputed, ~reused)
    assert fused.layer_selected == [len(before) + len(after)] * adapter.shape.num_layers
    assert fused.key_bias is None             # no scale on the cached keys unless a strategy asks for one
