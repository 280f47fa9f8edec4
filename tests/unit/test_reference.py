"""The fused prefill at any ratio equals a plain dense computation with the same selection.

For the tokens the engine selected at each layer, a dense reference built from the model's
own modules (every token computed at every layer, then the K/V of the tokens *not* selected
at that layer replaced by their cached K/V) must give the fused logits and the fused K/V of
the selected tokens. This rules out the classic bug of selection indices computed on one
slice and applied to another, which shows up only between ratio 0 and 1.

With ``cached_attention_scale`` (APE's scaling) the reference adds ``log(scale)`` to every
score on a reused token left out from layer 0, in the prefill and in a decoding step after it.
"""

import inspect
import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ragblend import CacheBlend, QueryAware
from ragblend.core.decode.generate import KVDecoder
from ragblend.core.fusion.pipeline import SequentialSource
from ragblend.core.fusion.prefill import fused_prefill
from ragblend.core.fusion.selection import ReusedSpan

from ..conftest import PASSAGES, make_tiny_engine

STRATEGIES = [CacheBlend(0.05), CacheBlend(0.3), CacheBlend(0.7), CacheBlend(0.3, gradual=((3, 0.1),)),
              QueryAware(0.05), QueryAware(0.3), QueryAware(0.7), QueryAware(0.3, cached_attention_scale=1.0)]


def flat_prompt(passages):
    """Chunks out of order, one of them twice, and the second half of another (a partial chunk)."""
    words = passages[3].split()
    return "\n\n".join([passages[2], passages[0], passages[2], " ".join(words[len(words) // 2:]),
                        "Question: who ran the ferry?"])


def dense_reference(hf_model, token_ids, layer_positions, cached_k, cached_v, key_bias, dtype=torch.float32):
    """Logits and per-layer K (after RoPE) / V of a dense pass in which, at each layer, only
    the tokens in ``layer_positions[layer]`` keep their fresh K/V; every other token's K/V
    is its cached one (``cached_k``/``cached_v``: per layer ``[kv_heads, N, dim]``, K before RoPE).
    ``key_bias [N]`` is added to every score on each key.

    Gemma 3's details as its modeling file has them: RoPE tables per layer type (the rotary
    module takes the type), sliding windows per layer, norms after attention and around the
    MLP, and the final logit soft-capping."""
    base, n, config = hf_model.model, len(token_ids), hf_model.config
    ids = torch.tensor([token_ids])
    hidden = base.embed_tokens(ids)
    layer_types = getattr(config, "layer_types", None)
    # ragblend's own modules (a GGUF's) say whether the family has tables per layer type
    per_type = getattr(base.rotary_emb, "per_layer_type",
                       "layer_type" in inspect.signature(base.rotary_emb.forward).parameters)
    tables = ({t: base.rotary_emb(hidden, torch.arange(n)[None], t) for t in set(layer_types)} if per_type
              else {None: base.rotary_emb(hidden, torch.arange(n)[None])})
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    keys, values = [], []
    for layer_index, layer in enumerate(base.layers):
        attn = layer.self_attn
        cos, sin = tables[layer_types[layer_index] if per_type else None]
        # Gemma 3's window is its sliding layers' only (transformers' attention holds it per layer;
        # ragblend's own modules, a GGUF's, do not: the layer's type says)
        window = getattr(config, "sliding_window", None) if layer_types is None or \
            layer_types[layer_index] == "sliding_attention" else None
        window = getattr(attn, "sliding_window", window)
        causal = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
        x = layer.input_layernorm(hidden)
        shape = (1, n, -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        stale = torch.ones(n, dtype=torch.bool)
        stale[layer_positions[layer_index]] = False
        k[0][:, stale] = cached_k[layer_index][:, stale].to(dtype)
        v[0][:, stale] = cached_v[layer_index][:, stale].to(dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k[0].clone())
        values.append(v[0].clone())
        group = q.shape[1] // k.shape[1]
        k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k_all.transpose(-1, -2)) * attn.scaling + key_bias
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = (weights @ v_all).transpose(1, 2).reshape(1, n, -1)
        if hasattr(layer, "pre_feedforward_layernorm"):   # Gemma 3
            hidden = hidden + layer.post_attention_layernorm(attn.o_proj(out))
            hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        else:
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    logits = hf_model.lm_head(base.norm(hidden[:, -1]))[0]
    if getattr(config, "final_logit_softcapping", None) is not None:
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits, keys, values


def expected_key_bias(n, spans, fused, strategy):
    """``log(scale)`` on the reused tokens not computed from layer 0, else 0."""
    left_out = torch.zeros(n, dtype=torch.bool)
    for span in spans:
        left_out[span.start:span.start + span.num_tokens] = True
    left_out[fused.layer_positions[0]] = False
    return left_out.float() * math.log(getattr(strategy, "cached_attention_scale", 1.0))


REFERENCE_RTOL = 1e-4   # on the fused K/V against the dense reference, beside the absolute atol


def check_against_reference(engine, prompt_text, strategy, atol=1e-4, answer_token=None):
    layout = engine.find_chunks(prompt_text, system="Answer briefly.")
    assert any(s.offset > 0 or s.end - s.start < len(s.token_ids) for s in layout.chunk_spans), "no partial chunk"
    assert len({s.token_ids for s in layout.chunk_spans}) < len(layout.chunk_spans), "no repeated chunk"
    entries = [engine.store.get(engine.ingestion.key_for(s.token_ids)) for s in layout.chunk_spans]
    spans = [ReusedSpan(s.start, s.end - s.start, s.offset) for s in layout.chunk_spans]
    windows = [slice(s.offset, s.offset + s.end - s.start) for s in layout.chunk_spans]
    readers = [engine.store.open(e.key) for e in entries]
    fused = fused_prefill(engine.adapter, layout.token_ids, spans, SequentialSource(readers, windows=windows), strategy)

    n, layers = len(layout.token_ids), engine.adapter.shape.num_layers
    shape = engine.adapter.shape
    cached_k = [torch.zeros(shape.num_kv_heads, n, shape.head_dim) for _ in range(layers)]
    cached_v = [torch.zeros(shape.num_kv_heads, n, shape.head_dim) for _ in range(layers)]
    for span, window, entry in zip(spans, windows, entries):
        where = slice(span.start, span.start + span.num_tokens)
        for layer in range(layers):
            cached_k[layer][:, where] = entry.keys[layer][:, window].float()
            cached_v[layer][:, where] = entry.values[layer][:, window].float()
    key_bias = expected_key_bias(n, spans, fused, strategy)
    with torch.inference_mode():
        # The engine's own twin of the model (its linear kernels), so only the fusion differs.
        logits, keys, values = dense_reference(engine.adapter.hf_model, layout.token_ids, fused.layer_positions,
                                               cached_k, cached_v, key_bias)
    selected_somewhere = 0
    for layer, positions in enumerate(fused.layer_positions):
        # float32 rounding grows with the value and differs by host and pass size (another matmul
        # kernel per row bucket): ~1e-4 on K of magnitude ~10 on an AMD EPYC; a fusion bug is ~0.1-1.
        for got, want in ((fused.keys[layer], keys[layer]), (fused.values[layer], values[layer])):
            want = want[:, positions]
            assert ((got[:, positions] - want).abs() <= atol + REFERENCE_RTOL * want.abs()).all()
        selected_somewhere += positions.numel()
    assert (fused.logits - logits.float()).abs().max() <= atol
    # The selection really is partial: neither every token nor only the uncached ones.
    reused = sum(sp.num_tokens for sp in spans)
    assert (n - reused) * layers < selected_somewhere < n * layers
    if answer_token is not None:
        # A decoding step after the fused prefill: the new token is computed at every layer,
        # and it too pays the scaled attention to the tokens left out.
        decoder = KVDecoder(engine.adapter, fused.keys, fused.values, n + 1, fused.key_bias)
        step_logits = decoder.step(answer_token)
        grow = lambda t: torch.cat([t, torch.zeros(t.shape[0], 1, t.shape[2])], dim=1)  # noqa: E731
        with torch.inference_mode():
            expected, _, _ = dense_reference(
                engine.adapter.hf_model, layout.token_ids + [answer_token],
                [torch.cat([p, torch.tensor([n])]) for p in fused.layer_positions],
                [grow(k) for k in cached_k], [grow(v) for v in cached_v], torch.cat([key_bias, torch.zeros(1)]))
        assert (step_logits - expected.float()).abs().max() <= atol
    return fused


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_fused_prefill_matches_dense_reference_tiny(arch, strategy, tokenizer):
    engine = make_tiny_engine(arch, tokenizer, kv_dtype="float32")
    chunks = [f"{a} {b}" for a, b in zip(PASSAGES, PASSAGES[1:] + PASSAGES[:1])]  # long enough to match in part
    engine.precompute(chunks)
    check_against_reference(engine, flat_prompt(chunks), strategy)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_decoding_after_a_fused_prefill_matches_dense_reference(arch, scale, tokenizer):
    engine = make_tiny_engine(arch, tokenizer, kv_dtype="float32")
    chunks = [f"{a} {b}" for a, b in zip(PASSAGES, PASSAGES[1:] + PASSAGES[:1])]
    engine.precompute(chunks)
    fused = check_against_reference(engine, flat_prompt(chunks), QueryAware(0.3, cached_attention_scale=scale),
                                    answer_token=int(tokenizer.encode(" ferry")[0]))
    assert (fused.key_bias is None) == (scale == 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_the_adapters_resolved_norms_compute_the_models_own(arch):
    """ModelAdapter calls each RMSNorm as one ``F.rms_norm`` (Gemma 3's with ``1 + weight``), not
    through the module: same values as the module, on norm weights that are not all 0 or 1."""
    from transformers import AutoModelForCausalLM

    from ragblend.core.model.adapter import ModelAdapter

    from ..conftest import tiny_config

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    adapter = ModelAdapter(model)
    x = torch.randn(5, model.config.hidden_size)
    for block, steps in zip(adapter.layers, adapter._steps):
        pairs = [(steps.input_norm, block.input_layernorm), (steps.post_attention_norm, block.post_attention_layernorm)]
        if arch != "llama":
            heads = torch.randn(5, 2, adapter.shape.head_dim)
            for resolved, module in ((steps.q_norm, block.self_attn.q_norm), (steps.k_norm, block.self_attn.k_norm)):
                assert not isinstance(resolved, torch.nn.Module)
                torch.testing.assert_close(resolved(heads), module(heads), rtol=1e-5, atol=1e-6)
        for resolved, module in pairs:
            assert not isinstance(resolved, torch.nn.Module)   # the fused call, not the module
            torch.testing.assert_close(resolved(x), module(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adapter._final_norm(x), model.model.norm(x), rtol=1e-5, atol=1e-6)
    half = ModelAdapter(model.to(torch.bfloat16))   # other dtypes keep the modules (their rounding is theirs)
    assert isinstance(half._steps[0].input_norm, torch.nn.Module)
