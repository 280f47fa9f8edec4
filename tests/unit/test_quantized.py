"""Models loaded from a GGUF file in their quantized form (ragblend.core.model.quantized): the weights
are the file's (as transformers dequantizes them), the prefill on them stays within float
rounding of the float32 model's, and a bad file is refused before anything heavy loads."""

import numpy as np
import pytest
import torch

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.errors import InvalidInputError, ModelFileError, UnsupportedModelError
from ragblend.core.model.gguf_file import read_gguf
from ragblend.core.model.linear import weight_samples
from ragblend.core.model.quantized import QuantLinear, build_quantized_model, quantized_bytes

from ..conftest import PASSAGES

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 64, 128, 4, 2, 1024
# Per tensor kind, the GGUF type written: Q4_0/Q4_1 where the rows come in 64s (held as 4-bit),
# Q4_1 for K/V's 32 rows (too few for the 4-bit kernel's blocks: held as 8-bit), 5- and 8-bit types.
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q5_1"}


def write_tiny_gguf(path, architecture="llama", types=TYPES, truncate=0):
    """A tiny random Llama-shaped model as a GGUF file, quantized by the gguf package."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}

    def add(name, kind, shape):
        weights = rng.normal(0, 0.15, shape).astype(np.float32)
        type_name = types.get(kind, "F32")
        quant = gguf.GGMLQuantizationType[type_name]
        data = weights if type_name == "F32" else gguf.quants.quantize(weights, quant)
        writer.add_tensor(name, data, raw_dtype=None if type_name == "F32" else quant)

    add("token_embd.weight", "token_embd", (VOCAB, HIDDEN))
    for i in range(LAYERS):
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", kind, shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add("output.weight", "output", (VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def models(tiny_gguf):
    """(quantized, float32) models of the tiny file: ours, and transformers' dequantized one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(tiny_gguf.parent), tiny_gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    quantized = build_quantized_model(read_gguf(tiny_gguf), config)
    exact = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return quantized, exact


def test_weights_stay_in_their_quantized_form_and_are_the_files(models):
    quantized, exact = models
    kinds = {}
    exact_modules = dict(exact.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear) and name in exact_modules:
            kinds[name.split(".")[-1]] = module.kind
            weight = exact_modules[name].weight
            # 4-bit: the file's codes, scales and zeros rounded to bfloat16 (the kernel's); 8-bit: one scale a row
            assert (module.dequantize() - weight).abs().max() <= 0.01 * weight.abs().max(), name
    assert kinds == {"q_proj": "int4", "k_proj": "int8", "v_proj": "int8", "o_proj": "int8", "gate_proj": "int4",
                     "up_proj": "int4", "down_proj": "int8", "lm_head": "int8"} or kinds["q_proj"] == "int4"
    assert kinds["q_proj"] == kinds["up_proj"] == kinds["gate_proj"] == "int4"
    assert kinds["k_proj"] == kinds["down_proj"] == "int8"
    float32_bytes = sum(p.numel() * 4 for p in exact.parameters())
    assert quantized_bytes(quantized) < 0.45 * float32_bytes


def test_fingerprint_samples_are_the_float32_models(models):
    """The quantized model is known by the float32 weights its file holds (its calibration applies)."""
    quantized, exact = models
    ours, theirs = list(weight_samples(quantized)), list(weight_samples(exact))
    assert [(n, s) for n, s, _ in ours] == [(n, tuple(s)) for n, s, _ in theirs]
    for (name, _, a), (_, _, b) in zip(ours, theirs):
        assert np.array_equal(a, b), name


def test_dequantized_weights_are_ggufs_reference_bit_for_bit(tiny_gguf):
    """The PyTorch dequantizer of Q4_0/Q4_1/Q8_0 (start-up's hot path) gives gguf's own floats."""
    from gguf import GGMLQuantizationType, dequantize

    from ragblend.core.model.quantized import dequantized_rows

    gguf = read_gguf(tiny_gguf)
    seen = set()
    for info in gguf.tensors.values():
        raw = np.array(gguf.blocks(info))
        reference = dequantize(raw, GGMLQuantizationType(info.type_id)).reshape(raw.shape[0], -1)
        order = np.arange(raw.shape[0])[::-1].copy()
        for rows, expected in ((slice(None), reference), (order, reference[order])):
            assert np.array_equal(dequantized_rows(gguf, info, rows).view(np.uint32), expected.view(np.uint32)), info.name
        seen.add(info.type_name)
    assert {"Q4_0", "Q4_1", "Q8_0"} <= seen


def test_float32_on_request_is_transformers_float32_model(tiny_gguf, models):
    """dtype=torch.float32 dequantizes the file as transformers does (no float32 copy on disk either)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    exact = build_quantized_model(read_gguf(tiny_gguf), config, exact=True)
    ids = torch.arange(40)[None] * 7 % VOCAB
    with torch.no_grad():
        assert (exact(ids).logits - models[1](ids).logits).abs().max() <= 1e-4
    quantized = models[0]
    with torch.inference_mode():   # the scratch buffer, made in inference mode, serves passes outside it too
        inside = quantized(ids).logits
    with torch.no_grad():
        assert torch.equal(quantized(ids).logits, inside)
    assert BlendEngine(exact, _tokenizer()).weights_form == "float32"


def _tokenizer():
    from transformers import AutoTokenizer

    from ..conftest import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_prefill_on_quantized_weights_is_within_rounding_of_float32(models, tokenizer):
    quantized, exact = models
    engines = [BlendEngine(model, tokenizer) for model in (quantized, exact)]
    assert engines[0].weights_form == "quantized" and engines[1].weights_form == "float32"
    assert engines[0].calibration_id == engines[1].calibration_id   # the same model
    assert engines[0].fingerprint != engines[1].fingerprint        # its KV entries its own
    segments = [Chunk(p) for p in PASSAGES] + ["Question: when was the lighthouse first lit?"]
    full = [e.prefill(segments, strategy=FullRecompute()).logits for e in engines]
    noise = first_token_kl(full[1], engines[1].prefill([Chunk(p) for p in PASSAGES[::-1]] + segments[-1:],
                                                       strategy=FullRecompute()).logits)
    assert first_token_kl(full[1], full[0]) < 0.05 * noise
    for engine in engines:
        engine.precompute(PASSAGES)
    fused = [e.prefill(segments).logits for e in engines]
    assert first_token_kl(fused[1], fused[0]) < 0.05 * noise
    # decoding steps run the low-bit kernels; the prefill (and a near tie's recheck) the float32 path
    counts = engines[0].decode_weights.layer_counts()
    assert counts["4-bit"] == 3 * LAYERS and counts["8-bit"] == 4 * LAYERS + 1
    assert engines[0].decoding_adapter() is not engines[0].adapter
    out = engines[0].generate(segments, max_new_tokens=6)
    assert len(out.token_ids) >= 1


def test_a_truncated_gguf_is_refused_with_its_sizes(tmp_path):
    path = write_tiny_gguf(tmp_path / "cut.gguf", truncate=1000)
    with pytest.raises(ModelFileError, match=r"truncated: its header describes [\d,]+ bytes, the file has [\d,]+"):
        read_gguf(path)


def test_an_unsupported_architecture_or_type_is_refused_naming_what_works(tmp_path):
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'.*it runs llama"):
        read_gguf(write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2"))
    (tmp_path / "text.gguf").write_text("not a model at all, but long enough to have a header")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_gguf(tmp_path / "text.gguf")


def test_an_unsupported_quantization_type_is_refused_naming_the_types_that_load(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block = np.zeros((4, 84), dtype=np.uint8)   # four Q2_K blocks (84 bytes per 256 weights)
    writer.add_tensor("blk.0.attn_q.weight", block, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"Q2_K, which ragblend cannot load; it loads .*Q4_0.*Q8_0"):
        read_gguf(path)


def test_a_model_too_large_for_memory_is_refused_with_the_estimate(tiny_gguf, monkeypatch):
    from ragblend.core.model import loading as model_module

    monkeypatch.setattr(model_module, "available_memory", lambda: 1000)
    with pytest.raises(InvalidInputError, match=r"needs about [\d.]+ GiB of memory at the load's peak \([\d.]+ GiB of weights held.*0.0 GiB is available"):
        model_module.load_model(tiny_gguf)


def test_a_bfloat16_prefill_twin_stays_near_float32_and_rechecks_in_float32(models, tokenizer, monkeypatch):
    """The prefill twin may multiply in bfloat16 (where measured faster); a near tie is still
    checked again on the float32 twin, and the answer stays within rounding of float32's."""
    monkeypatch.setenv("RAGBLEND_QUANTIZED_PREFILL", "bfloat16")
    quantized, exact = models
    fast = BlendEngine(quantized, tokenizer)
    layers = [m for m in fast.adapter.hf_model.modules() if isinstance(m, QuantLinear)]
    assert {m.long_pass_dtype for m in layers} == {torch.bfloat16} and {m.kernel_rows for m in layers} == {64}
    recheck = [m for m in fast.decode_weights.exact_adapter().hf_model.modules() if isinstance(m, QuantLinear)]
    assert {m.long_pass_dtype for m in recheck} == {torch.float32} and {m.kernel_rows for m in recheck} == {0}
    reference = BlendEngine(exact, tokenizer)
    segments = [Chunk(p) for p in PASSAGES] + ["Question: when was the lighthouse first lit?"]
    ref = reference.prefill(segments, strategy=FullRecompute()).logits
    noise = first_token_kl(ref, reference.prefill([Chunk(p) for p in PASSAGES[::-1]] + segments[-1:],
                                                  strategy=FullRecompute()).logits)
    assert first_token_kl(ref, fast.prefill(segments, strategy=FullRecompute()).logits) < 0.05 * noise


def test_float32_decoding_of_a_fast_plan_engine_runs_on_the_float32_twin(models, tokenizer, monkeypatch):
    """decode_dtype="float32" decodes in float32 whatever the prefill plan: not on the fast prefill
    twin, whose decoding-sized passes run the low-bit kernels (bfloat16 scales and activations)."""
    monkeypatch.setenv("RAGBLEND_QUANTIZED_PREFILL", "bfloat16")
    engine = BlendEngine(models[0], tokenizer, decode_dtype="float32")
    decoding = engine.decoding_adapter()
    assert decoding is engine.decode_weights.exact_adapter() and decoding is not engine.adapter
    layers = [m for m in decoding.hf_model.modules() if isinstance(m, QuantLinear)]
    assert {m.long_pass_dtype for m in layers} == {torch.float32} and {m.kernel_rows for m in layers} == {0}
    out = engine.generate([Chunk(p) for p in PASSAGES] + ["Question: when was the lighthouse first lit?"],
                          strategy=FullRecompute(), max_new_tokens=4)
    assert len(out.token_ids) >= 1


def test_the_long_pass_plan_is_measured_once_per_host(models, tmp_path, monkeypatch):
    from ragblend.core.model.quantized import KERNEL_ROW_BUCKETS, long_pass_plan

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL", raising=False)
    monkeypatch.delattr(models[0], "ragblend_long_pass", raising=False)   # measured by an earlier engine
    plan = long_pass_plan(models[0])
    assert plan["dtype"] in ("float32", "bfloat16") and plan["kernel_rows"] in (8, *KERNEL_ROW_BUCKETS)
    from ragblend.core.model.quantized import _scratch

    assert not getattr(_scratch, "buffers", {})   # the measurement's scratch is not kept with the engine
    records = list((tmp_path / "host").glob("quantized-long-pass-*.json"))
    if records:   # a busy host's two measurements may disagree: then nothing is kept, the float32 path serves
        monkeypatch.delattr(models[0], "ragblend_long_pass")
        assert long_pass_plan(models[0]) == plan   # read back from the host's record
    else:
        assert plan == {"dtype": "float32", "kernel_rows": 8}
    monkeypatch.setenv("RAGBLEND_QUANTIZED_PREFILL", "float32")
    assert long_pass_plan(models[0]) == {"dtype": "float32", "kernel_rows": 8}


def test_the_question_pass_runs_on_the_low_bit_kernels_and_the_prefill_in_float32(models, tokenizer, monkeypatch):
    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL", raising=False)
    engine = BlendEngine(models[0], tokenizer)
    plan = models[0].ragblend_long_pass
    prefill = [m for m in engine.adapter.hf_model.modules() if isinstance(m, QuantLinear)]
    scoring = [m for m in engine.adapter.scoring.hf_model.modules() if isinstance(m, QuantLinear)]
    assert {(m.kernel_rows, m.long_pass_dtype) for m in prefill} == {(0, torch.float32)}
    assert {(m.kernel_rows, m.long_pass_dtype) for m in scoring} == {(plan["kernel_rows"], torch.float32)}
    assert [b.data_ptr() for b in prefill[0].buffers()] == [b.data_ptr() for b in scoring[0].buffers()]  # shared


def test_a_bfloat16_dequantization_is_the_float32_one_rounded_in_one_reused_buffer(models, monkeypatch):
    """The fast plan's weights: bit for bit the float32 dequantization rounded once to bfloat16,
    built a cache-sized slice at a time into the thread's one bfloat16 buffer."""
    from ragblend.core.model import quantized

    monkeypatch.setattr(quantized, "SLICE_WEIGHTS", 64 * 64)   # several slices even in a tiny layer
    layers = [m for m in models[0].modules() if isinstance(m, QuantLinear) and m.kind in ("int4", "int8")]
    assert {m.kind for m in layers} == {"int4", "int8"}
    for layer in layers:
        exact = layer.dequantize().clone()
        rounded = layer.dequantize(dtype=torch.bfloat16)
        assert torch.equal(rounded, exact.bfloat16())
        again = layer.dequantize(dtype=torch.bfloat16)
        assert again.data_ptr() == rounded.data_ptr() == quantized.scratch(1, torch.bfloat16).data_ptr()
    widest = max(layers, key=lambda m: m.out_features * m.in_features)
    x = torch.randn(300, widest.in_features)
    widest.long_pass_dtype, widest.kernel_rows = torch.bfloat16, 0
    try:
        fast = widest.rows(x)
    finally:
        widest.long_pass_dtype, widest.kernel_rows = torch.float32, quantized.DRAFT_ROWS
    exact = torch.nn.functional.linear(x, widest.dequantize()) + (0 if widest.bias is None else widest.bias)
    # bfloat16 inputs and output (8-bit mantissas), float32 sums: ~2^-8 of the output's scale
    assert fast.dtype == torch.float32
    assert (fast - exact).abs().max() < 2 ** -6 * exact.abs().max()


@pytest.mark.parametrize("faster", [True, False])
def test_the_plan_takes_bfloat16_only_where_it_measured_clearly_faster(models, tmp_path, monkeypatch, faster):
    from ragblend.core.model import quantized

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL", raising=False)
    monkeypatch.delattr(models[0], "ragblend_long_pass", raising=False)
    monkeypatch.setattr(quantized, "_bfloat16_native", lambda: True)
    bfloat16_speed = 2.0 if faster else 1.2   # CLEARLY_FASTER is 1.3

    def timed(workloads, rounds):
        return {"float32": 1.0, "bfloat16": 1.0 / bfloat16_speed} if "float32" in workloads else \
            {"kernel": 2.0, "long": 1.0}   # the low-bit kernel never wins here
    monkeypatch.setattr(quantized, "fastest_rounds", timed)
    plan = quantized.long_pass_plan(models[0])
    assert plan == {"dtype": "bfloat16" if faster else "float32", "kernel_rows": 8}
    monkeypatch.delattr(models[0], "ragblend_long_pass")


def test_the_fast_plan_is_the_default_only_where_its_architecture_met_the_rule(models, monkeypatch):
    from ragblend.core.model.loading import PrefillFidelity
    from ragblend.core.model.quantized import describe, fast_prefill, prefill_twin

    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL", raising=False)
    model = models[0]
    monkeypatch.setattr(model, "ragblend_long_pass", {"dtype": "bfloat16", "kernel_rows": 32}, raising=False)

    def twin_forms():
        return {(m.kernel_rows, m.long_pass_dtype) for m in prefill_twin(model).modules() if isinstance(m, QuantLinear)}
    monkeypatch.setattr(model, "ragblend_fast_prefill_fidelity", None, raising=False)
    assert twin_forms() == {(0, torch.float32)} and "not measured" in fast_prefill(model)[1]
    monkeypatch.setattr(model, "ragblend_fast_prefill_fidelity", PrefillFidelity("Tiny", 0.2, 5, 10))
    assert twin_forms() == {(0, torch.float32)} and "MISSED" in " ".join(describe(model))
    assert "near ties" in fast_prefill(model)[1]   # says what misses
    monkeypatch.setattr(model, "ragblend_fast_prefill_fidelity", PrefillFidelity("Tiny", 0.01, 20, 20))
    assert twin_forms() == {(32, torch.bfloat16)} and "because it met the fidelity rule" in " ".join(describe(model))
    # its K/V are not the float32 prefill's: stored under another fingerprint (engine.fingerprint takes the form)
    assert prefill_twin(model).ragblend_weights_form == "quantized-fast-bfloat16-32"
    monkeypatch.setenv("RAGBLEND_QUANTIZED_PREFILL", "float32")
    assert twin_forms() == {(0, torch.float32)}
    assert prefill_twin(model).ragblend_weights_form == "quantized"
    # a verdict measured with the down projection in float32 keeps it so (and says so)
    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL")
    monkeypatch.setattr(model, "ragblend_fast_prefill_fidelity", PrefillFidelity("Tiny", 0.01, 20, 20, ("down_proj",)))
    twin = prefill_twin(model)
    forms = {name.split(".")[-1]: m.long_pass_dtype for name, m in twin.named_modules() if isinstance(m, QuantLinear)}
    assert forms["down_proj"] == torch.float32 and forms["up_proj"] == forms["q_proj"] == torch.bfloat16
    assert twin.ragblend_weights_form == "quantized-fast-bfloat16-32-down_proj-float32"
    assert "down_proj in float32" in " ".join(describe(model))


def test_bfloat16_is_timed_where_the_cpu_multiplies_it_natively():
    """The plan times bfloat16 only on such a CPU; a check that always said no (torch 2.13 has no
    torch._C._cpu names for it) kept every host on float32 without ever timing it."""
    import pathlib

    from ragblend.core.model.quantized import _bfloat16_native

    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(cpuinfo.read_text().split())
    assert _bfloat16_native() == bool({"avx512_bf16", "amx_bf16"} & flags)


def _four_bit_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Blocks ``[rows, blocks, bytes]`` of a random tensor in ``type_name``: Q4_0/Q4_1 quantized by
    the gguf package, Q4_K (which it cannot quantize) random codes, sub-scales and float16 d, dmin."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    if type_name != "Q4_K":
        weights = rng.normal(0, 0.15, (rows, cols)).astype(np.float32)
        raw = quants.quantize(weights, GGMLQuantizationType[type_name])
        return raw.reshape(rows, cols // 32, -1)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    halves = rng.uniform(1e-4, 2e-3, (rows, cols // 256, 2)).astype(np.float16)
    raw[..., 0:4] = halves.view(np.uint8).reshape(rows, cols // 256, 4)
    return raw


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_long_pass_dequantizes_4_bit_weights_to_the_files_values(type_name):
    """The prefill's weights are the file's (gguf's reference dequantizer) to float32 rounding, not
    the decoding kernel's bfloat16-rounded scales; held in a byte a group (Q4_0), float16 pairs (Q4_1)
    or the file's 16 bytes a block (Q4_K)."""
    from gguf import GGMLQuantizationType, dequantize

    from ragblend.core.model.quantized import four_bit_groups, unpack_int4

    rows, cols = 128, 512
    raw = _four_bit_blocks(type_name, rows, cols)
    reference = torch.from_numpy(dequantize(raw.reshape(rows, -1), GGMLQuantizationType[type_name]).reshape(rows, cols))
    heads = raw[..., :16] if type_name == "Q4_K" else None   # as the loader passes them
    layer = QuantLinear.int4(*four_bit_groups(raw, type_name), source_type=type_name, q4_k_heads=heads)
    ours = layer.dequantize().clone()
    ulp = 2 ** -23 * reference.abs().max()
    assert (ours - reference).abs().max() <= 4 * ulp
    assert torch.equal(ours[64:].clone(), layer.dequantize(64, 128))   # a slice of rows reads the same values
    # what the decoding kernel's bfloat16 scales give: far coarser (the held form that missed the rule)
    sz = layer.scales_and_zeros.float()
    codes = unpack_int4(layer.packed, rows, cols, 0, rows).float()
    kernel_form = codes * sz[..., 0].T.repeat_interleave(32, 1) + (sz[..., 1] - 8 * sz[..., 0]).T.repeat_interleave(32, 1)
    assert (kernel_form - reference).abs().max() > 1000 * ulp
    held = {name: b.dtype for name, b in layer.named_buffers() if name not in ("packed", "scales_and_zeros")}
    assert held == {"Q4_0": {"scale_residual_nibbles": torch.uint8}, "Q4_1": {"exact_scales": torch.float16},
                    "Q4_K": {"q4_k_heads": torch.uint8}}[type_name]
    _, scales, low = four_bit_groups(raw, type_name)   # the file's own scales and minimums, bit for bit
    groups = codes.reshape(rows, -1, 32)
    assert torch.equal(ours, torch.addcmul(low[..., None], groups, scales[..., None]).reshape(rows, cols))
    x = torch.randn(80, cols)   # a long pass (more rows than the kernel's) multiplies the file's weights
    torch.testing.assert_close(layer(x), x @ reference.T, rtol=1e-5, atol=1e-5)


def test_a_q4_0_scale_is_held_as_a_byte_beside_the_kernels_and_read_back_bit_for_bit():
    """Every finite float16 scale (subnormals, negatives, zero, the largest) comes back exactly
    from its bfloat16 rounding and a residual of -4..4: what lets Q4_0 drop its stored copy."""
    from ragblend.core.model.quantized import exact_from_residuals, pack_nibbles, scale_residuals, unpack_nibbles

    halves = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    scales = halves[torch.isfinite(halves)].float().reshape(-1, 32)
    kernel = scales.to(torch.bfloat16)
    residuals = scale_residuals(scales, kernel)
    assert residuals.dtype == torch.int8 and residuals.abs().max() == 4
    assert torch.equal(exact_from_residuals(kernel, residuals).view(torch.int32), scales.view(torch.int32))
    assert torch.equal(exact_from_residuals(kernel.T, residuals.T).view(torch.int32), scales.T.view(torch.int32))
    for groups in (32, 31):   # half a byte a group, an odd count of groups too
        nibbles = pack_nibbles(residuals[:, :groups])
        assert nibbles.dtype == torch.uint8 and nibbles.shape[1] == (groups + 1) // 2
        assert torch.equal(unpack_nibbles(nibbles, groups), residuals[:, :groups])


def test_a_long_pass_and_a_lookup_read_q5_0_and_q8_0_weights_exactly_from_the_file(models):
    """8-bit-a-row codes (the decoding kernel's) round a Q5_0/Q8_0 file's weights again; a long
    pass, an embedding lookup and the head's exact top logits read the file's own blocks."""
    quantized, exact = models
    exact_modules = dict(exact.named_modules())
    checked = set()
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear) and module.source_type in ("Q5_0", "Q8_0") and name in exact_modules:
            weight = exact_modules[name].weight
            assert module.file_rows is not None and torch.equal(module.dequantize(), weight), name
            rounded = module.codes.float() * module.scales[:, None]   # what the kernel multiplies
            assert not torch.equal(rounded, weight)
            checked.add(module.source_type)
    assert checked == {"Q5_0", "Q8_0"}
    ids = torch.tensor([[5, 900, 5, 64, 1023]])
    assert torch.equal(quantized.model.embed_tokens(ids), exact.model.embed_tokens(ids))


def test_int4_packing_is_this_torchs_layout_and_unpacks_back():
    """PyTorch packs 4-bit weights in blocks of 64 rows where its kernel was built for AVX-512 and
    32 for AVX2: ragblend's own packing and unpacking follow the block this host's op uses (on an
    AVX2 host they assumed 64, and every long pass over a 4-bit GGUF weight read permuted rows)."""
    from ragblend.core.model.quantized import int4_block_rows, pack_int4, unpack_int4

    codes = np.random.default_rng(1).integers(0, 16, (192, 96), dtype=np.uint8)
    assert int4_block_rows() in (64, 32)
    packed = pack_int4(codes)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes).int(), 2))
    assert torch.equal(unpack_int4(packed, 192, 96, 64, 192), torch.from_numpy(codes[64:192]))
