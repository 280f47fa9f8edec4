"""ragblend's own decoder modules (ragblend.core.model.decoder), what a GGUF model is built of:
the same parameters, in the same order, and the same logits as transformers' model of the same
weights, for every family ragblend runs; a GGUF file of each loads (float32 and held quantized)
without importing transformers' modeling code; and the engine's passes on them match."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.model.decoder import CausalLM, plain_decoder
from ragblend.core.model.gguf_file import read_gguf
from ragblend.core.model.linear import weight_samples
from ragblend.core.model.quantized import build_quantized_model

from ..conftest import PASSAGES, TINY_ARCHS, tiny_config

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 64, 128, 4, 2, 16, 1024
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
# (no "mistral": the gguf package names no such architecture; llama.cpp writes Mistral models as "llama")


def _skeleton(model) -> list:
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_plain_decoder_is_transformers_model_of_the_same_weights(arch):
    """Every tiny config of conftest (a RoPE scaling variant, a sliding window, Gemma 3's two RoPE
    bases and soft-capping): the same state dict, and the same logits on the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch)
    theirs = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    ours = plain_decoder(config)
    assert isinstance(ours, CausalLM)
    assert _skeleton(ours) == _skeleton(theirs)
    ours.load_state_dict(theirs.state_dict())
    ids = torch.arange(80)[None] * 7 % config.vocab_size   # longer than the sliding windows (48)
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() <= 1e-5


def write_arch_gguf(path, arch: str):
    """A tiny random model of GGUF architecture ``arch`` (Q4_0 / Q8_0 / F32 tensors), named as
    llama.cpp names them (gguf's own name table over the model's parameters)."""
    import gguf

    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS if arch != "gemma3" else 6)   # Gemma 3: 5 sliding layers, then a global one
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(_head_dim(arch))
    writer.add_value_length(_head_dim(arch))
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    if arch == "gemma3":
        writer.add_sliding_window(16)
    layers = LAYERS if arch != "gemma3" else 6
    config = _config_for(arch, layers)
    with torch.device("meta"):
        names = [name for name, _ in plain_decoder(config).named_parameters()]
    table = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    for name in names:
        base, _, suffix = name.rpartition(".")
        if name == "lm_head.weight" and arch == "gemma3":
            continue   # tied
        shape = _shape(name, config)
        file_name = f"{table.get_name(base)}.{suffix}"
        if len(shape) == 1:
            values = (rng.normal(0, 0.1, shape) + (1 if name.endswith("norm.weight") else 0)).astype(np.float32)
            writer.add_tensor(file_name, values)
        else:
            quant = gguf.GGMLQuantizationType.Q4_0 if shape[0] % 64 == 0 else gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(file_name, gguf.quants.quantize(rng.normal(0, 0.15, shape).astype(np.float32), quant),
                              raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _head_dim(arch: str) -> int:
    return 128 if arch == "qwen3" else HEAD_DIM   # transformers reads no head size from a Qwen3 GGUF: its default


def _config_for(arch: str, layers: int):
    config = tiny_config(arch)
    config.num_hidden_layers, config.tie_word_embeddings = layers, arch == "gemma3"
    config.head_dim = _head_dim(arch)
    if arch == "gemma3":
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return config


def _shape(name: str, config) -> tuple:
    with torch.device("meta"):
        return tuple(dict(plain_decoder(config).named_parameters())[name].shape)


@pytest.fixture(scope="module", params=list(GGUF_ARCHS))
def arch_gguf(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = write_arch_gguf(folder / f"{request.param}.gguf", GGUF_ARCHS[request.param])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), gguf_file=path.name)
    (folder / "config").mkdir()
    config.save_pretrained(folder / "config")   # what the child process reads, as load_model does
    return path, config


def test_a_gguf_of_each_family_builds_without_modeling_code_and_gives_transformers_logits(arch_gguf):
    from transformers import AutoModelForCausalLM

    path, config = arch_gguf
    child = f"""
import json, sys, torch
from transformers import AutoConfig
from ragblend.core.model.gguf_file import read_gguf
from ragblend.core.model.quantized import build_quantized_model
config = AutoConfig.from_pretrained({str(path.parent / "config")!r})
ids = torch.arange(40)[None] * 7 % {VOCAB}
out = {{}}
for exact in (True, False):
    model = build_quantized_model(read_gguf({str(path)!r}), config, exact=exact)
    with torch.no_grad():
        out[str(exact)] = model(ids).logits.tolist()
heavy = [m for m in ("transformers.modeling_utils", "sympy", "torch._dynamo", "accelerate") if m in sys.modules]
print(json.dumps({{"heavy": heavy, "type": type(model).__name__, "logits": out}}))
"""
    result = json.loads(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                       check=True).stdout.splitlines()[-1])
    # transformers' LlamaConfig module itself imports transformers.activations, which pulls in sympy
    # and accelerate (the other families' configs do not); no family imports modeling_utils
    assert result["heavy"] == ([] if path.stem != "llama" else ["sympy", "accelerate"])
    assert result["type"] == "CausalLM"
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.arange(40)[None] * 7 % VOCAB
    with torch.no_grad():
        reference = theirs(ids).logits
    exact, quantized = (torch.tensor(result["logits"][key]) for key in ("True", "False"))
    assert (exact - reference).abs().max() <= 1e-5
    # held quantized: the same numbers as the same quantized model on transformers' modules
    old = _on_transformers_modules(path, config)
    with torch.no_grad():
        assert (quantized - old(ids).logits).abs().max() <= 1e-5


def _on_transformers_modules(path, config, exact: bool = False):
    """``path``'s model built as before ragblend had its own modules: transformers' skeleton."""
    model = build_quantized_model(read_gguf(path), config, exact=exact, transformers_modules=True)
    assert not isinstance(model, CausalLM)
    return model


@pytest.mark.parametrize("exact", [True, False])
def test_the_engine_on_the_plain_modules_is_the_engine_on_transformers(arch_gguf, tokenizer, exact):
    """Same fingerprint (KV entries and calibrations stay valid) and the same prefill logits."""
    path, config = arch_gguf
    ours = build_quantized_model(read_gguf(path), config, exact=exact)
    old = _on_transformers_modules(path, config, exact)
    assert _skeleton(ours) == _skeleton(old)
    assert [(n, s) for n, s, _ in weight_samples(ours)] == [(n, s) for n, s, _ in weight_samples(old)]
    engines = [BlendEngine(model, tokenizer) for model in (ours, old)]
    assert engines[0].fingerprint == engines[1].fingerprint
    segments = [Chunk(p) for p in PASSAGES[:2]] + ["Question: when was the lighthouse first lit?"]
    full = [e.prefill(segments, strategy=FullRecompute()) for e in engines]
    assert (full[0].logits - full[1].logits).abs().max() <= 1e-4
    with torch.no_grad():
        forward = ours(torch.tensor([full[0].token_ids])).logits[0, -1]
    assert (forward - full[0].logits).abs().max() <= 1e-3
