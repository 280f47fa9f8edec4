"""core.model.decode_weights: the weights decoding runs on. float32 decodes on the engine's own
adapter; float16, 4-bit and 8-bit twins of the model answer like it, are built once per model
and kind, leave the model alone, and fall back to float32 (saying why) where they cannot run.
(The low-bit layers themselves: test_kernels.py.)"""

import logging
import threading

import pytest
import torch

from ragblend.core.decode.generate import KVDecoder
from ragblend.core.decode.prefix_cache import PrefixHit, PrefixScope
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.model.decode_weights import DecodeWeights
from ragblend.core.model.linear import INT4_GROUP, CpuLinear, Int4Linear, quantize_int4

from ..conftest import tiny_model
from .test_engine import segments


def test_float16_decoding_is_close_and_leaves_the_model_alone(tokenizer):
    from ragblend.core.calibration.metrics import first_token_kl
    from ragblend.core.model.linear import HalfLinear

    from ..conftest import make_tiny_engine

    exact = make_tiny_engine("qwen2", tokenizer)              # biased projections
    half = make_tiny_engine("qwen2", tokenizer, decode_dtype="float16")
    a = exact.generate(segments(), max_new_tokens=12, temperature=0)
    b = half.generate(segments(), max_new_tokens=12, temperature=0)
    assert a.logits.equal(b.logits)                           # the prefill is untouched
    twin = half.decoding_adapter().hf_model
    assert isinstance(twin.model.layers[0].self_attn.q_proj, HalfLinear)
    assert twin.model.layers[0].self_attn.q_proj.bias.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in half.hf_model.parameters())   # the original keeps float32
    assert twin.model.embed_tokens.weight is half.hf_model.model.embed_tokens.weight   # shared, not copied
    pre = exact.prefill(segments())
    steps = a.token_ids[:6]
    ref = KVDecoder(exact.adapter, pre.keys, pre.values, len(pre.token_ids) + 6, pre.key_bias)
    low = KVDecoder(half.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 6, pre.key_bias)
    assert max(first_token_kl(ref.step(t), low.step(t)) for t in steps) < 1e-3


def snapped_to_int4(model):
    """A copy of ``model`` whose linear weights lie on the 4-bit grid, as a Q4_1 GGUF's do
    once dequantized: 4-bit decoding then differs from float32 only by its bfloat16 activations."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                codes, scales, low = quantize_int4(module.weight)
                grid = scales[..., None] * codes.reshape(*scales.shape, INT4_GROUP).float() + low[..., None]
                module.weight.copy_(grid.reshape(module.weight.shape))
    return model


def test_int4_decoding_answers_like_float32_and_drafts_change_nothing(tokenizer):
    from ragblend import BlendEngine
    from ragblend.core.calibration.metrics import first_token_kl
    from ragblend.core.decode.generate import KVDecoder

    from ..conftest import tiny_model

    model = snapped_to_int4(tiny_model("qwen2"))                # biased projections
    exact = BlendEngine(model, tokenizer)
    four = BlendEngine(model, tokenizer, decode_dtype="int4")
    twin = four.decoding_adapter().hf_model
    assert isinstance(twin.model.layers[0].mlp.down_proj, Int4Linear)
    assert twin.model.layers[0].mlp.down_proj.quantization_error < 1e-6   # the grid's own blocks
    assert type(twin.lm_head) is CpuLinear                   # logits stay float32
    assert all(p.dtype == torch.float32 for p in four.hf_model.parameters())
    pre = exact.prefill(segments())
    answer = exact.generate(segments(), max_new_tokens=8, temperature=0).token_ids
    ref = KVDecoder(exact.adapter, pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    low = KVDecoder(four.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    assert max(first_token_kl(ref.step(t), low.step(t)) for t in answer[:6]) < 1e-2
    # A drafted pass verifies several tokens at once; it must give each the logits it gets alone,
    # or drafting would change greedy answers. The 4-bit kernel runs on bfloat16 activations, so a
    # float32 difference of one ulp before a layer (attention over 4 queries instead of 1) can move
    # a rounding: on an AMD EPYC with AVX-512 the logits differed by up to 0.8% of their scale
    # (0.028), where a row mix-up moves them by their whole scale.
    one = KVDecoder(four.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    many = KVDecoder(four.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    singly = torch.stack([one.step(t) for t in answer[:4]])
    together = many.extend(answer[:4])
    assert (together - singly).abs().max() < 2 ** -5 * singly.abs().max()
    assert torch.equal(together.argmax(-1), singly.argmax(-1))
    four.prompt_lookup_num_tokens = 0
    plain = four.generate(segments(), max_new_tokens=12, temperature=0)
    four.prompt_lookup_num_tokens = 3
    drafted = four.generate(segments(), max_new_tokens=12, temperature=0)
    assert drafted.token_ids == plain.token_ids


def test_int4_on_weights_that_are_not_4_bit_says_it_quantized_them(tokenizer, caplog):
    import copy

    from ragblend import BlendEngine

    from ..conftest import tiny_model

    with caplog.at_level(logging.WARNING, logger="ragblend"):   # a copy: no other engine built its twin before
        four = BlendEngine(copy.deepcopy(tiny_model("mistral")), tokenizer, decode_dtype="int4")
    assert isinstance(four.decoding_adapter().hf_model.model.layers[0].mlp.down_proj, Int4Linear)
    assert "quantized at load" in caplog.text


def test_int4_where_it_cannot_run_says_why_and_decodes_in_float32(tokenizer, monkeypatch, caplog):
    from ragblend import BlendEngine
    from ragblend.core.model import decode_weights as engine_module

    from ..conftest import tiny_model

    monkeypatch.setattr(engine_module, "int4_available", lambda: "this torch has no int4 kernel")
    model = snapped_to_int4(tiny_model("llama"))   # its own copy: no other engine built its twin before
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        four = BlendEngine(model, tokenizer, decode_dtype="int4")
        out = four.generate(segments(), max_new_tokens=4, temperature=0)
    assert four.decoding_adapter() is four.adapter and out.token_ids
    assert "no int4 kernel" in caplog.text and "float32" in caplog.text


def test_int4_leaves_layers_it_cannot_pack_in_float32(caplog):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ragblend import BlendEngine

    from ..conftest import TOKENIZER_DIR
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(0)
    odd = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       vocab_size=1024)).eval()
    engine = BlendEngine(odd, tokenizer, decode_dtype="int4")
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        engine.generate(segments(), max_new_tokens=3, temperature=0)
    mlp = engine.decoding_adapter().hf_model.model.layers[0].mlp
    assert type(mlp.down_proj) is CpuLinear and isinstance(mlp.fused_gate_up.low_bit, Int4Linear)   # 80 inputs: not 32s
    assert "cannot hold 4-bit weights" in caplog.text and "groups of 32" in caplog.text


def low_bit_measures(monkeypatch, faster: bool):
    """Make the decoding-format measurement say low-bit weights are (or are not) faster here."""
    from ragblend.core.model import decode_weights as engine_module

    seen = []

    def fake(workloads, rounds=5):
        seen.append(sorted(workloads))
        return {"float32": 1.0, "low-bit": 0.5 if faster else 1.0}

    monkeypatch.setattr(engine_module, "fastest_rounds", fake)
    # measured now, not a verdict an earlier process stored for this host (core.model.host_cache)
    monkeypatch.setattr(engine_module, "remembered", lambda name, key, measure, valid: measure()[0])
    return seen


def test_auto_decodes_on_4_bit_weights_only_where_they_already_are(tokenizer, monkeypatch):
    from ragblend import BlendEngine

    from ..conftest import tiny_model

    low_bit_measures(monkeypatch, faster=True)
    snapped = BlendEngine(snapped_to_int4(tiny_model("llama")), tokenizer)   # as from a Q4_1 GGUF
    plain = BlendEngine(tiny_model("llama"), tokenizer)   # float weights, not from a GGUF: low bits would lose
    assert snapped.decode_dtype == plain.decode_dtype == "auto"
    layers = snapped.decoding_adapter().hf_model.model.layers
    assert all(isinstance(layer.mlp.down_proj, Int4Linear) for layer in layers)
    assert plain.decoding_adapter() is plain.adapter
    assert plain.generate(segments(), max_new_tokens=3, temperature=0).token_ids


def test_short_passes_run_on_the_kernel_only_where_that_many_rows_measure_faster(tokenizer, monkeypatch):
    """A low-bit kind kept for decoding runs passes of up to SHORT_PASS_ROWS rows (a conversation's
    next question) on its kernel only where that many rows measure faster than float32 on this
    host, else only a decoding pass's DRAFT_ROWS; the prefix tier's short rests follow."""
    from ragblend import BlendEngine
    from ragblend.core.model import decode_weights as weights_module
    from ragblend.core.model.kernels import DRAFT_ROWS, SHORT_PASS_ROWS

    monkeypatch.setattr(weights_module, "remembered", lambda name, key, measure, valid: measure()[0])
    for faster_at, rows in (({1}, DRAFT_ROWS), ({1, SHORT_PASS_ROWS}, SHORT_PASS_ROWS)):
        monkeypatch.setattr(weights_module, "_low_bit_faster", lambda kind, group, n, at=faster_at: n in at)
        engine = BlendEngine(snapped_to_int4(tiny_model("llama")), tokenizer)
        assert engine.decode_weights.short_pass_rows() == rows
        # a 12-token rest over K/V that are not exact runs on the decoding weights, in passes of that many rows
        hit = PrefixHit(40, [], [], None, PrefixScope("model", "torch.float32", exact=False))
        assert engine.runner.prefixes.rest_adapter(hit, 12) == (engine.decoding_adapter(), rows)
        down = engine.decoding_adapter().hf_model.model.layers[0].mlp.down_proj
        x = torch.randn(12, down.weight.shape[1])
        assert down.rows(x).equal(down.kernel(x)) == (rows == SHORT_PASS_ROWS)   # else float32
    # One pass of 16 rows is the same math as two of 8 (the kernel works row by row).
    x = torch.randn(SHORT_PASS_ROWS, down.weight.shape[1])
    torch.testing.assert_close(down.kernel(x), torch.cat([down.kernel(x[:8]), down.kernel(x[8:])]))


def test_int8_decoding_answers_like_float32_with_every_layer_8_bit(tokenizer):
    import copy

    from ragblend import BlendEngine
    from ragblend.core.calibration.metrics import first_token_kl
    from ragblend.core.decode.generate import KVDecoder
    from ragblend.core.model.linear import Int8Head, Int8Linear

    from ..conftest import tiny_model

    model = copy.deepcopy(tiny_model("qwen2"))   # its own copy: its twin is built here
    exact = BlendEngine(model, tokenizer, decode_dtype="float32")
    eight = BlendEngine(model, tokenizer, decode_dtype="int8")
    twin = eight.decoding_adapter().hf_model
    assert isinstance(twin.model.layers[0].self_attn.fused_qkv.low_bit, Int8Linear)   # q, k and v in one matmul
    assert isinstance(twin.model.layers[0].self_attn.o_proj, Int8Linear)
    assert type(twin.lm_head) is Int8Head                        # the LM head too, its top logits rescored
    assert eight.decode_weights.layer_counts() == {"8-bit": sum(type(m) is torch.nn.Linear for m in model.modules())}
    pre = exact.prefill(segments())
    answer = exact.generate(segments(), max_new_tokens=8, temperature=0).token_ids
    ref = KVDecoder(exact.adapter, pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    low = KVDecoder(eight.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias)
    assert max(first_token_kl(ref.step(t), low.step(t)) for t in answer[:6]) < 1e-2   # wrong scales: > 1
    eight.prompt_lookup_num_tokens = 0
    plain = eight.generate(segments(), max_new_tokens=12, temperature=0)
    eight.prompt_lookup_num_tokens = 3
    assert eight.generate(segments(), max_new_tokens=12, temperature=0).token_ids == plain.token_ids


def test_auto_uses_8_bit_weights_for_a_gguf_model_only_where_they_measure_faster(tokenizer, monkeypatch):
    import copy

    from ragblend import BlendEngine
    from ragblend.core.model import loading as model_module
    from ragblend.core.model.linear import Int8Linear

    from ..conftest import tiny_model

    seen = low_bit_measures(monkeypatch, faster=True)
    gguf = snapped_to_int4(tiny_model("llama"))
    gguf.lm_head.weight = torch.nn.Parameter(torch.randn_like(gguf.lm_head.weight))   # a Q8_0-like head
    model_module._FROM_GGUF.add(gguf)                        # as load_model marks a model read from a GGUF file
    engine = BlendEngine(gguf, tokenizer)
    assert engine.decode_weights.layer_counts() == {"4-bit": 4 * gguf.config.num_hidden_layers + 3 * gguf.config.num_hidden_layers,
                                        "8-bit": 1}
    assert isinstance(engine.decoding_adapter().hf_model.lm_head, Int8Linear)
    # 4-bit and 8-bit layers each measured twice at 1 row, the 4-bit ones twice at SHORT_PASS_ROWS too
    assert seen == [["float32", "low-bit"]] * 6

    low_bit_measures(monkeypatch, faster=False)               # a host where the low-bit kernels lose
    slower = copy.deepcopy(gguf)
    model_module._FROM_GGUF.add(slower)
    engine = BlendEngine(slower, tokenizer)
    assert engine.decoding_adapter() is engine.adapter and engine.decode_weights.layer_counts() == {
        "float32": 7 * gguf.config.num_hidden_layers + 1}


def test_int8_where_it_cannot_run_says_why_and_decodes_in_float32(tokenizer, monkeypatch, caplog):
    import copy

    from ragblend import BlendEngine
    from ragblend.core.model import decode_weights as engine_module

    from ..conftest import tiny_model

    monkeypatch.setattr(engine_module, "int8_available", lambda: "this torch has no int8 kernel")
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        eight = BlendEngine(copy.deepcopy(tiny_model("llama")), tokenizer, decode_dtype="int8")
        out = eight.generate(segments(), max_new_tokens=3, temperature=0)
    assert eight.decoding_adapter() is eight.adapter and out.token_ids
    assert "no int8 kernel" in caplog.text and "float32" in caplog.text


def test_float32_decodes_on_the_engines_own_adapter_and_counts_its_layers():
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    weights = DecodeWeights(model, adapter, None, "float32", threading.RLock())
    assert weights.decoding_adapter() is adapter
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert linears == 7 * model.config.num_hidden_layers + 1          # q k v o, gate up down, and the LM head
    assert weights.layer_counts() == {"float32": linears}


def test_a_float16_twin_is_built_once_per_model_and_counted_as_float16():
    model = tiny_model("mistral")
    first = DecodeWeights(model, ModelAdapter(model), None, "float16", threading.RLock())
    second = DecodeWeights(model, ModelAdapter(model), None, "float16", threading.RLock())
    twin = first.decoding_adapter()
    assert twin is second.decoding_adapter() and twin is not first.adapter          # shared by the model's engines
    assert first.layer_counts() == {"float16": 7 * model.config.num_hidden_layers + 1}
    assert all(p.dtype == torch.float32 for p in model.parameters())                # the model keeps float32


def test_fused_projections_compute_what_their_parts_compute():
    """Q, K and V run as one low-bit matmul over their stacked weights: each part's output is
    the one its own low-bit layer gives, biases included, whatever the rows and leading dimensions."""
    from ragblend.core.model.decode_weights import FusedRows
    from ragblend.core.model.linear import Int8Linear

    model = snapped_to_int4(tiny_model("qwen2"))                  # biased q, k and v
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    for kind in (Int4Linear, Int8Linear):
        fused = FusedRows(kind, parts, None)
        assert fused.low_bit.weight is None                       # no stacked float32 copy kept
        with torch.inference_mode():
            x = torch.randn(3, model.config.hidden_size)
            for part, out in zip(parts, fused(x)):
                assert torch.allclose(out, kind(part).rows(x), atol=1e-5, rtol=0)
            long = torch.randn(3, 6, model.config.hidden_size)    # 18 rows: past a short pass
            for part, out in zip(parts, fused(long)):
                assert out.shape == (3, 6, part.out_features)
                assert torch.allclose(out, part(long), atol=1e-5, rtol=0)   # the parts' float32 weights


@pytest.mark.parametrize("sizes", [(128, 64, 64), (192, 64, 96), (64, 32, 32)])   # the last: 4-bit packs again
def test_fused_rows_from_their_parts_hold_the_bytes_of_the_stacked_weight(sizes):
    """Stacking the parts' own low-bit tensors (no second quantization) gives the bytes packing
    the stacked weight gives, where 4-bit packing's 64-row blocks allow it."""
    from ragblend.core.model.decode_weights import FusedRows
    from ragblend.core.model.linear import Int8Linear

    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, size) for size in sizes]
    for kind in (Int4Linear, Int8Linear):
        packed = FusedRows(kind, linears, None)
        stacked = FusedRows(kind, linears, None, [kind(linear) for linear in linears])
        for name, tensor in packed.low_bit.parts().items():
            if name != "error":
                assert torch.equal(stacked.low_bit.parts()[name], tensor), (kind.__name__, name)
        assert torch.equal(stacked.low_bit.bias, packed.low_bit.bias)
        x = torch.randn(2, 64)
        assert all(torch.equal(a, b) for a, b in zip(stacked(x), packed(x)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])   # biases; q/k norms; sandwich norms, windows
def test_a_fused_twin_decodes_like_an_unfused_one(arch, tokenizer, monkeypatch):
    import copy

    from ragblend import BlendEngine
    from ragblend.core.decode.batching import batch_extend
    from ragblend.core.model import decode_weights as module
    from ragblend.core.model.decode_weights import FusedRows

    model = snapped_to_int4(tiny_model(arch))
    fused_engine = BlendEngine(copy.deepcopy(model), tokenizer, decode_dtype="int4")
    monkeypatch.setattr(module, "fused_groups", lambda *args: [])
    separate_engine = BlendEngine(copy.deepcopy(model), tokenizer, decode_dtype="int4")
    twin = fused_engine.decoding_adapter().hf_model.model.layers[0]
    assert isinstance(twin.self_attn.fused_qkv, FusedRows) and isinstance(twin.mlp.fused_gate_up, FusedRows)
    assert type(twin.self_attn.q_proj) is CpuLinear               # its float32 weight, for long passes
    assert not hasattr(separate_engine.decoding_adapter().hf_model.model.layers[0].self_attn, "fused_qkv")
    layers = model.config.num_hidden_layers
    assert fused_engine.decode_weights.layer_counts() == {"4-bit": 7 * layers, "float32": 1}   # parts counted each
    pre = fused_engine.prefill(segments())

    def decoder(engine):
        return KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 40, pre.key_bias)

    fused, separate = decoder(fused_engine), decoder(separate_engine)
    # a drafted pass, a short pass past DRAFT_ROWS, one past SHORT_PASS_ROWS (float32 weights)
    for tokens in ([5, 9, 11], list(range(20, 32)), list(range(40, 60))):
        assert torch.allclose(fused.extend(tokens), separate.extend(tokens), atol=1e-4, rtol=0)
    others = [decoder(fused_engine), decoder(separate_engine)]
    assert torch.allclose(batch_extend([fused, others[0]], [7, 8]), batch_extend([separate, others[1]], [7, 8]),
                          atol=1e-4, rtol=0)


def test_a_group_whose_parts_decode_in_different_formats_stays_unfused():
    from ragblend.core.model.decode_weights import fused_groups
    from ragblend.core.model.linear import Int8Linear

    model = snapped_to_int4(tiny_model("llama"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    def four_bit():
        return {id(m.weight): Int4Linear(m) for m in (attn.q_proj, attn.k_proj, mlp.gate_proj, mlp.up_proj)}

    low_bit = four_bit()
    assert [(owner, name) for owner, name, _ in fused_groups(model, low_bit, None)] == [
        ("model.layers.0.mlp", "fused_gate_up")]                   # v stays float32: q/k/v unfused
    assert set(low_bit) == {id(attn.q_proj.weight), id(attn.k_proj.weight)}   # fused parts' own layers let go
    low_bit = {**four_bit(), id(attn.v_proj.weight): Int8Linear(attn.v_proj)}   # 4-bit q and k beside 8-bit v
    assert [name for _, name, _ in fused_groups(model, low_bit, None)] == ["fused_gate_up"]


def test_a_gguf_models_decoding_weights_are_built_once_per_host(tokenizer, monkeypatch, tmp_path, caplog):
    """The 4-bit/8-bit decoding weights of a model read from a file are cached on disk: a later
    process (here: another copy of the model) reads them instead of packing them again, and
    decodes the same tokens; an unreadable cache file is a miss, built again."""
    import copy

    from ragblend import BlendEngine
    from ragblend.core.model import loading as model_module
    from ragblend.core.model.linear import Int8Linear

    from ..conftest import tiny_model

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    low_bit_measures(monkeypatch, faster=True)
    gguf = snapped_to_int4(tiny_model("llama"))
    gguf.lm_head.weight = torch.nn.Parameter(torch.randn_like(gguf.lm_head.weight))   # a Q8_0-like head
    gguf.ragblend_source = {"path": str(tmp_path / "model.gguf"), "size": 1, "mtime_ns": 1}   # as load_model sets

    def copy_of_the_model():
        model = copy.deepcopy(gguf)
        model_module._FROM_GGUF.add(model)   # as load_model marks a model read from a GGUF file
        return model

    first = BlendEngine(copy_of_the_model(), tokenizer)
    counts = first.decode_weights.layer_counts()
    expected = first.generate(segments(), max_new_tokens=10, temperature=0).token_ids
    cached = list((tmp_path / "decoding").glob("*.safetensors"))
    assert len(cached) == 1 and counts == {"4-bit": 7 * gguf.config.num_hidden_layers, "8-bit": 1}
    from ragblend.core.model import low_bit_cache

    # in PyTorch's aligned memory: the 8-bit kernel crashed (SIGSEGV) on tensors read in place from the file
    assert all(t.data_ptr() % 64 == 0 for t in low_bit_cache.read(cached[0]).values() if t.numel())

    packed = []
    with monkeypatch.context() as patched:
        for kind in (Int4Linear, Int8Linear):
            def counting(self, *args, _init=kind.__init__, **kwargs):
                packed.append(type(self))
                _init(self, *args, **kwargs)
            patched.setattr(kind, "__init__", counting)
        second = BlendEngine(copy_of_the_model(), tokenizer)
        assert second.decode_weights.layer_counts() == counts
        assert second.generate(segments(), max_new_tokens=10, temperature=0).token_ids == expected
    # Nothing is quantized again, but for fused groups whose 4-bit parts do not stack (the tiny
    # model's 32-row projections; a real model's come in 64s)
    from ragblend.core.model.decode_weights import FusedRows, _stackable

    groups = [m for m in second.decoding_adapter().hf_model.modules() if isinstance(m, FusedRows)]
    assert groups and len(packed) == sum(not _stackable(type(g.low_bit), g.sizes) for g in groups)

    # Damaged weights behind a sound header (a disk fault, a partial copy) fail the file's checksum:
    # a miss, built again, never weights to decode on. Then a file that is not safetensors at all.
    whole = bytearray(cached[0].read_bytes())
    whole[-64:] = bytes(0x7F for _ in range(64))
    for damaged, why in ((bytes(whole), "checksum"), (b"not a safetensors file", "")):
        cached[0].write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ragblend"):
            third = BlendEngine(copy_of_the_model(), tokenizer)
            assert third.decode_weights.layer_counts() == counts
        assert "could not read the cached decoding weights" in caplog.text and why in caplog.text
        assert third.generate(segments(), max_new_tokens=10, temperature=0).token_ids == expected


def test_the_decoding_weights_cache_is_keyed_by_cpu_and_file(tmp_path, monkeypatch):
    """PyTorch packs 4-bit weights differently per CPU capability, and a file copied over another
    may keep its size and mtime: either is another cache entry, never a wrong hit."""
    import os

    from ragblend.core.model import kernels, low_bit_cache
    from ragblend.core.model.loading import source_stamp

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"x" * 64)
    model = torch.nn.Module()
    model.ragblend_source = source_stamp(weights)
    here = low_bit_cache.cache_path(model, "auto")
    assert here is not None and here.parent == tmp_path / "decoding"
    other = "AVX512" if kernels._torch_capability() == "AVX2" else "AVX2"   # whichever this host is not
    monkeypatch.setattr(kernels, "_torch_capability", lambda: other)
    assert low_bit_cache.cache_path(model, "auto") != here
    monkeypatch.undo()
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    stat = weights.stat()
    replacement = tmp_path / "other.gguf"
    replacement.write_bytes(b"y" * 64)
    os.replace(replacement, weights)   # same path and size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))   # and mtime kept, as cp -p does
    model.ragblend_source = source_stamp(weights)
    assert low_bit_cache.cache_path(model, "auto") != here


def test_the_decoding_folder_keeps_under_its_budget_dropping_the_least_recently_used(tmp_path, monkeypatch):
    """Old keys' files (another torch, changed code) do not pile up: a write evicts the files read
    least recently beyond the budget, never the one it wrote, and a read marks its file used."""
    import os

    from ragblend.core.model import low_bit_cache

    tensors = {"w|packed": torch.zeros(1 << 18, dtype=torch.uint8)}   # 256 KiB a file
    old, used, other = (tmp_path / f"{name}.safetensors" for name in ("old", "used", "other"))
    for age, path in enumerate((old, used, other)):
        low_bit_cache.write(path, tensors)
        os.utime(path, (1000 + age, 1000 + age))
    (tmp_path / "notes.txt").write_text("not ours")
    assert low_bit_cache.read(used) is not None   # used now: the most recent
    monkeypatch.setattr(low_bit_cache, "MAX_FOLDER_BYTES", 3 * (1 << 18) + (1 << 16))
    new = tmp_path / "new.safetensors"
    low_bit_cache.write(new, tensors)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["new.safetensors", "notes.txt", "other.safetensors", "used.safetensors"]
    monkeypatch.setattr(low_bit_cache, "MAX_FOLDER_BYTES", 0)   # smaller than one file: room for two such
    os.utime(other, (2000, 2000))   # older than "used", read above
    low_bit_cache.write(new, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.safetensors", "notes.txt", "used.safetensors"]


def test_a_decoding_folder_that_cannot_be_tidied_is_a_logged_miss(tmp_path, monkeypatch, caplog):
    from ragblend.core.model import low_bit_cache

    def unlistable(_):
        raise PermissionError("no listing here")

    monkeypatch.setattr(low_bit_cache.os, "scandir", unlistable)
    path = tmp_path / "new.safetensors"
    low_bit_cache.write(path, {"w|packed": torch.zeros(8, dtype=torch.uint8)})   # does not raise
    assert low_bit_cache.read(path) is not None
    assert "could not tidy the decoding weights folder" in caplog.text
