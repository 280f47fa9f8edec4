"""Correctness of the fused prefill on tiny random models of every supported family."""

import math

import pytest
import torch

from ragblend import CacheBlend, Chunk, FullRecompute, FullReuse, LegoLink
from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion.ingest import isolated_kv
from ragblend.core.store.kv import ChunkKV

from ..conftest import PASSAGES


def forward_logits(engine, token_ids):
    with torch.no_grad():
        out = engine.hf_model(torch.tensor([token_ids]), use_cache=True)
    return out.logits[0, -1], out.past_key_values


def segments(order=(0, 1, 2)):
    return [Chunk(PASSAGES[i]) for i in order] + ["Question: who ran the ferry?"]


def test_full_recompute_equals_model_forward(tiny_engine):
    pre = tiny_engine.prefill(segments(), system="Answer briefly.", strategy=FullRecompute())
    ref, _ = forward_logits(tiny_engine, pre.token_ids)
    assert (pre.logits - ref).abs().max() <= 1e-4
    assert pre.stats.recomputed_tokens == pre.stats.prompt_tokens == len(pre.token_ids)


def test_long_prompt_crosses_sliding_window(tiny_engine):
    # Longer than the tiny Mistral's 48-token window, so the window mask really matters there.
    segs = [Chunk(p) for p in PASSAGES] + ["Question: which bridge was replaced?"]
    pre = tiny_engine.prefill(segs, strategy=FullRecompute())
    assert len(pre.token_ids) > 2 * 48
    ref, _ = forward_logits(tiny_engine, pre.token_ids)
    assert (pre.logits - ref).abs().max() <= 1e-4


def test_cacheblend_ratio_one_equals_full_prefill_and_its_cache(tiny_engine):
    tiny_engine.precompute(PASSAGES[:3])
    pre = tiny_engine.prefill(segments(), strategy=CacheBlend(ratio=1.0))
    assert pre.stats.chunks_reused == 3
    ref, cache = forward_logits(tiny_engine, pre.token_ids)
    assert (pre.logits - ref).abs().max() <= 1e-4
    for layer in range(tiny_engine.adapter.shape.num_layers):
        k_ref, v_ref = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        n = k_ref.shape[1]  # a sliding-window layer keeps only its window
        assert torch.allclose(pre.keys[layer][:, -n:], k_ref, atol=1e-4), f"K differs at layer {layer}"
        assert torch.allclose(pre.values[layer][:, -n:], v_ref, atol=1e-4), f"V differs at layer {layer}"


def test_full_reuse_of_kv_computed_in_context_equals_full_prefill(tiny_engine):
    """Chunks precomputed in exactly the context they appear in: FullReuse must be exact.

    This proves the stored pre-RoPE K is rotated to the right positions and that fresh
    tokens attend through an exact causal mask (they never see later keys).
    """
    engine = tiny_engine   # a fresh engine: its store holds only what this test puts there
    layout = engine.prompts.build(segments(), system=None)
    lead_spans = engine.runner.lead_spans(layout)   # the first chunk reads its lead entry
    for j, span in enumerate(layout.chunk_spans):
        keys, values = isolated_kv(engine.adapter, layout.token_ids[:span.start], list(span.token_ids))
        engine.store.put(ChunkKV(engine.ingestion.key_for(span.token_ids, lead=j in lead_spans), list(span.token_ids),
                                 keys, values))
    pre = engine.prefill(segments(), strategy=FullReuse())
    assert pre.token_ids == layout.token_ids
    assert pre.stats.reused_tokens == sum(s.end - s.start for s in layout.chunk_spans)
    ref, _ = forward_logits(engine, pre.token_ids)
    assert (pre.logits - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("strategy", [FullReuse(), LegoLink(4), CacheBlend(0.3), CacheBlend(0.3, gradual=((2, 0.2),)),
                                      CacheBlend(0.3, deviation="key"), CacheBlend(0.3, deviation="key_value")])
def test_reuse_strategies_run_and_recompute_only_what_they_should(tiny_engine, strategy):
    tiny_engine.precompute(PASSAGES[:3])
    pre = tiny_engine.prefill(segments(), strategy=strategy)
    n = len(pre.token_ids)
    chunk_tokens = sum(s.end - s.start for s in pre.layout.chunk_spans)
    fresh = n - chunk_tokens
    assert pre.stats.prompt_tokens == n
    assert pre.stats.reused_tokens + pre.stats.recomputed_tokens == n
    assert pre.recomputed[-1]  # the last token always runs (it gives the logits)
    if isinstance(strategy, FullReuse):
        assert pre.stats.recomputed_tokens == fresh
    elif isinstance(strategy, LegoLink):
        assert pre.stats.recomputed_tokens == fresh + 2 * 4  # every chunk but the first
    else:
        kept = pre.stats.recomputed_tokens - fresh
        final_ratio = strategy.gradual[-1][1] if strategy.gradual else strategy.ratio
        assert kept == math.ceil(final_ratio * chunk_tokens - 1e-9)
    assert torch.isfinite(pre.logits).all()
    assert len(pre.keys) == tiny_engine.adapter.shape.num_layers
    assert all(k.shape[1] == n for k in pre.keys)


def test_compute_fraction_counts_token_layers(tiny_engine):
    tiny_engine.precompute(PASSAGES[:3])
    full = tiny_engine.prefill(segments(), strategy=FullRecompute())
    blend = tiny_engine.prefill(segments(), strategy=CacheBlend(0.25))
    layers = tiny_engine.adapter.shape.num_layers
    assert full.stats.compute_fraction == 1.0
    n, kept = blend.stats.prompt_tokens, blend.stats.recomputed_tokens
    assert blend.stats.compute_fraction == pytest.approx((2 * n + (layers - 2) * kept) / (layers * n))


@pytest.mark.parametrize("kind", ["key", "value", "key_value"])
def test_cacheblend_keeps_the_tokens_that_deviate_most(tiny_engine, kind):
    """The kept tokens are exactly the top scorers of the chosen deviation at the check layer,
    and the three scores disagree on this prompt (so the choice matters)."""
    from ragblend.core.fusion.pipeline import SequentialSource
    from ragblend.core.fusion.selection import kv_deviation

    engine = tiny_engine
    engine.precompute(PASSAGES[:3])
    layout = engine.prompts.build(segments())
    # Layers 0 and 1 run over every token, so the fresh K/V at the check layer are a plain prefill's.
    hidden = _hidden_before(engine, layout.token_ids, 1)
    with torch.inference_mode():
        fresh_k, fresh_v = engine.adapter.kv(1, engine.adapter.attn_input(1, hidden))
    reused_pos = torch.cat([torch.arange(s.start, s.end) for s in layout.chunk_spans])
    lead = engine.runner.lead_spans(layout)   # the first chunk is read from its lead entry
    source = SequentialSource([engine.store.open(engine.ingestion.key_for(s.token_ids, lead=j in lead))
                               for j, s in enumerate(layout.chunk_spans)])
    source.prepare([1])
    cached = source.layer(1)
    scores = {k: kv_deviation(k, fresh_k[:, reused_pos], fresh_v[:, reused_pos], cached,
                              torch.arange(reused_pos.numel())) for k in ("key", "value", "key_value")}
    keep = math.ceil(0.2 * reused_pos.numel() - 1e-9)
    top = {k: set(reused_pos[s.topk(keep).indices].tolist()) for k, s in scores.items()}
    assert top["key"] != top["value"]
    blend = engine.prefill(segments(), strategy=CacheBlend(0.2, deviation=kind))
    kept = set(blend.recomputed.nonzero().squeeze(1).tolist()) & set(reused_pos.tolist())
    assert kept == top[kind]


def _hidden_before(engine, token_ids, layer):
    """Hidden states entering ``layer`` in a plain prefill (from the HF model)."""
    with torch.inference_mode():
        out = engine.hf_model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states[layer][0].to(engine.adapter.dtype)


def test_later_text_never_changes_earlier_tokens(tiny_engine):
    """Exact causal mask: recomputed tokens see only keys at or before their position."""
    tiny_engine.precompute(PASSAGES[:3])
    a = tiny_engine.prefill([Chunk(PASSAGES[0]), "Some fresh text here.", Chunk(PASSAGES[1]), "Question A?"],
                            strategy=FullReuse())
    b = tiny_engine.prefill([Chunk(PASSAGES[0]), "Some fresh text here.", Chunk(PASSAGES[1]),
                             "A quite different and longer final question B?"], strategy=FullReuse())
    start = a.layout.chunk_spans[1].end  # everything before the final question is shared
    assert a.token_ids[:start] == b.token_ids[:start]
    for ka, kb, va, vb in zip(a.keys, b.keys, a.values, b.values):
        assert torch.equal(ka[:, :start], kb[:, :start])
        assert torch.equal(va[:, :start], vb[:, :start])


def test_from_pretrained_keeps_the_store_it_is_given_even_an_empty_one(tokenizer, tmp_path):
    from ragblend import BlendEngine
    from ragblend.core.store.tiers import MemoryStore

    from ..conftest import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    empty = MemoryStore(1 << 20)
    assert len(empty) == 0    # falsy: `store or default` would have replaced it
    engine = BlendEngine.from_pretrained(tmp_path / "model", store=empty, kv_dir=tmp_path / "unused")
    assert engine.store is empty and not (tmp_path / "unused").exists()
    engine.precompute([PASSAGES[0]])
    assert len(empty) == 2    # the chunk's own entry and its lead entry


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 9, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_linear_computes_the_linear_layer(rows, bias):
    from ragblend.core.model.linear import CpuLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    with torch.inference_mode():   # how the engine runs it (oneDNN's op has no backward)
        out = CpuLinear(linear)(x)
        batched = CpuLinear(linear)(x[None])   # leading dimensions are flattened and restored
    assert out.shape == (rows, 96) and out.is_contiguous() and out.dtype == torch.float32
    assert (out - linear(x)).abs().max() <= 1e-5 if rows else True
    assert batched.shape == (1, rows, 96) and (batched[0] - out).abs().max() <= 1e-5 if rows else True


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 8])
def test_prompt_lookup_num_tokens_must_be_a_count(tokenizer, bad):
    from ..conftest import make_tiny_engine

    with pytest.raises(InvalidInputError, match="prompt_lookup_num_tokens"):
        make_tiny_engine("llama", tokenizer, prompt_lookup_num_tokens=bad)


def test_decode_dtype_must_be_known(tokenizer):
    from ..conftest import make_tiny_engine

    with pytest.raises(InvalidInputError, match="decode_dtype"):
        make_tiny_engine("llama", tokenizer, decode_dtype="int3")


def test_a_prompt_that_reuses_too_little_runs_as_a_full_prefill(tiny_engine):
    """QueryAware runs the uncached tokens twice (question pass, fused pass): where that would
    compute more than a full prefill, the engine runs the full prefill (exact, and cheaper),
    and its stats say so."""
    from ragblend import QueryAware

    small = "The ferry ran at dawn."
    tiny_engine.precompute([small])
    question = " ".join(["Question: who ran the ferry, and when did the lighthouse keeper light the lamp?"] * 6)
    segments = [Chunk(small), question]
    out = tiny_engine.prefill(segments, strategy=QueryAware(0.3))
    assert out.stats.strategy == "full_recompute" and "would compute more than a full prefill" in out.stats.strategy_reason
    assert out.stats.compute_fraction == 1.0 and out.stats.reused_tokens == 0 and out.stats.cache_hit_tokens == 0
    assert out.stats.chunks_reused == 0 and out.stats.tiers == {} and "chosen by the caller" in out.stats.strategy_reason
    assert out.stats.ratio is None and out.stats.cached_attention_scale is None   # what ran: no fusion
    assert out.stats.fusion_skipped and tiny_engine.last_prompt.chunk_spans == []   # no token counts as a chunk's
    # Decided before the store is read: a chunk not stored yet is not computed (nor stored) for nothing.
    fresh = "The gulls nested on the pier."
    missed = tiny_engine.prefill([Chunk(fresh), question], strategy=QueryAware(0.3))
    assert missed.stats.strategy == "full_recompute" and missed.stats.isolate_s == 0
    assert missed.stats.chunks_computed == 0 and tiny_engine.key_of(fresh) not in tiny_engine.store
    assert torch.allclose(out.logits, tiny_engine.prefill(segments, strategy=FullRecompute()).logits, atol=1e-5)
    assert tiny_engine.generate(segments, strategy=QueryAware(0.3), max_new_tokens=8).token_ids == \
        tiny_engine.generate(segments, strategy=FullRecompute(), max_new_tokens=8).token_ids
    # With write-back off, a missing chunk is plain text: decided again once the lookup found less.
    stored, missing = "The ferry ran at dawn.", " ".join(PASSAGES[3:6])
    tiny_engine.write_back = False
    try:
        late = tiny_engine.prefill([Chunk(stored), Chunk(missing), "Question: who ran it?"], strategy=QueryAware(0.3))
    finally:
        tiny_engine.write_back = True
    assert late.stats.fusion_skipped and late.stats.reused_tokens == 0 and late.stats.chunks_missing == 0
    assert tiny_engine.key_of(missing) not in tiny_engine.store
    tiny_engine.precompute(PASSAGES[:3])
    fused = tiny_engine.prefill([Chunk(p) for p in PASSAGES[:3]] + ["Question: who ran the ferry?"],
                                strategy=QueryAware(0.3))
    assert fused.stats.strategy == "query_aware" and fused.stats.compute_fraction < 1.0
    assert not fused.stats.fusion_skipped and tiny_engine.last_prompt.chunk_spans


def test_describe_reports_the_engine_in_plain_values(tokenizer):
    from ragblend.core.description import EngineDescription
    from ragblend.core.store.kv_budget import KVShape, bytes_per_token

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer, kv_dtype="int8", prompt_lookup_num_tokens=3,
                              min_fusion_speedup=1.3)
    about = engine.describe()
    assert isinstance(about, EngineDescription)
    assert (about.arch, about.num_layers, about.dtype, about.device) == ("llama", 4, "torch.float32", "cpu")
    assert about.weights_form == "float32" and about.weights_reason and not about.quantized
    assert about.kernels is not None and about.kernels.state and about.kernels.buckets   # float32 on the CPU
    assert set(about.low_bit_decoding) == {"int4", "int8"} and sum(about.decode_layers.values()) > 0
    assert about.stored_kv.dtype == "int8"
    assert about.stored_kv.bytes_per_token == bytes_per_token(KVShape(4, 2, 16), "int8")
    assert about.stored_kv.chunk_bytes > 0 and about.stored_kv.entries_per_chunk in (1, 2)
    assert about.fusion.min_speedup == 1.3 and not about.fusion.always
    assert about.fusion.constants_source in ("unmeasured", "measured", "defaults")
    assert about.drafts.max_tokens == 3 and 0 < about.drafts.row_cost
    engine.min_fusion_speedup = 0
    assert engine.describe().fusion.always   # read at each call: the engine's settings now
