"""How a model's weights are held in memory (``dtype`` / ``--dtype``): an HF directory stored in
bfloat16 or float16 stays 16-bit and computes the float32 load's numbers; ``quantized`` needs a
GGUF file; ``ragblend info`` prints the form, its bytes and why."""

import json
from pathlib import Path

import pytest
import torch

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.cli import build_parser, main
from ragblend.core import options as engine_options
from ragblend.core.errors import InvalidInputError
from ragblend.core.model.loading import load_model
from ragblend.core.model.quantized import QuantLinear, quantized_bytes

from ..conftest import tiny_model

SEGMENTS = [Chunk("The lighthouse on the north cape was first lit in 1871 by its keeper, Ada Moss."),
            Chunk("Ships from the northern ports sailed past it every winter, in fog and in storm."),
            "Question: when was the lighthouse first lit?"]


def save_tiny(folder, tokenizer, arch="llama", dtype=torch.bfloat16):
    """A tiny random model of ``arch`` saved as an HF directory whose safetensors are ``dtype``."""
    import copy

    copy.deepcopy(tiny_model(arch)).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("gemma3", torch.bfloat16),
                                        ("qwen2", torch.float16)])
def test_a_16_bit_hf_dir_stays_16_bit_and_computes_the_float32_loads_numbers(tmp_path, tokenizer, arch, dtype):
    folder = save_tiny(tmp_path / "model", tokenizer, arch, dtype)
    held = BlendEngine.from_pretrained(folder, kv_dir=False)
    exact = BlendEngine.from_pretrained(folder, dtype="float32", kv_dir=False)
    name = str(dtype).split(".")[-1]
    assert held.weights_form == name and exact.weights_form == "float32"
    matrices = [m for m in held.hf_model.modules() if isinstance(m, QuantLinear)]
    assert matrices and all(m.weight.dtype == dtype for m in matrices)
    float32_bytes = sum(p.numel() * p.element_size() for p in exact.hf_model.parameters())
    assert quantized_bytes(held.hf_model) < 0.52 * float32_bytes   # ~2 bytes a weight (norms stay float32)
    # the same model to ragblend (calibration and KV entries shared), and the same numbers
    assert held.fingerprint == exact.fingerprint
    for strategy in (FullRecompute(), None):
        if strategy is None:
            for engine in (held, exact):
                engine.precompute([s.text for s in SEGMENTS[:2]])
        logits = [e.prefill(SEGMENTS, strategy=strategy).logits for e in (held, exact)]
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0), (logits[0] - logits[1]).abs().max()
    answers = [e.generate(SEGMENTS, max_new_tokens=8).token_ids for e in (held, exact)]
    assert answers[0] == answers[1] and len(answers[0]) == 8


def test_a_float32_hf_dir_stays_float32_and_16_bit_is_held_on_request(tmp_path, tokenizer):
    folder = save_tiny(tmp_path / "model", tokenizer, dtype=torch.float32)
    model, _ = load_model(folder)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.ragblend_weights_reason == "float32, as stored in the checkpoint"
    model, _ = load_model(folder, dtype="bfloat16")
    assert model.ragblend_weights_form == "bfloat16"
    # Said truthfully: rounded at load, not "as stored ... from BF16" (the checkpoint holds float32)
    # ... and its numbers are the rounded ones, not dtype='float32''s (review 45)
    assert model.ragblend_weights_reason == ("bfloat16 rounded at load from the checkpoint's float32, asked for "
                                             "(dtype='bfloat16'); computed in float32 one matrix at a time (the "
                                             "rounded values; dtype='float32' keeps the checkpoint's own, in twice "
                                             "the memory)")
    from ragblend.core.model.quantized import describe

    lines = describe(model)
    assert lines[0].endswith("matrices bfloat16, rounded at load from the checkpoint's float32")
    assert not [line for line in lines if "as stored" in line or "BF16" in line]
    # A config without its dtype: the safetensors headers tell (review 45)
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config))
    model, _ = load_model(folder, dtype="bfloat16")
    assert "rounded at load from the checkpoint's float32" in model.ragblend_weights_reason


def test_quantized_on_an_hf_dir_is_refused_saying_it_needs_a_gguf(tmp_path, tokenizer, capsys):
    folder = save_tiny(tmp_path / "model", tokenizer)
    with pytest.raises(InvalidInputError, match=r"dtype=\"quantized\" \(--dtype quantized\) needs a GGUF file.*"
                                                r"convert it to a GGUF"):
        load_model(folder, dtype="quantized")
    assert main(["info", "--model", folder, "--dtype", "quantized"]) == 2
    assert "needs a GGUF file" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="is not a floating-point torch dtype; use \"auto\""):
        load_model(folder, dtype="int3")


@pytest.mark.parametrize("command", [["serve"], ["info"], ["ask", "a question?"], ["calibrate"], ["cache", "stats"]])
def test_the_dtype_flag_reaches_the_engine_options_of_every_command_that_loads_a_model(command):
    parser = build_parser()
    for value in ("auto", "float32", "bfloat16", "float16", "quantized"):
        args = parser.parse_args([*command, "--dtype", value])
        assert engine_options.from_args(args).dtype == value
    assert engine_options.from_args(parser.parse_args(command)).dtype is None   # the default: auto
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--dtype", "int4"])   # argparse names the choices


def test_ragblend_info_prints_the_weights_form_its_bytes_and_why(tmp_path, tokenizer, capsys):
    folder = save_tiny(tmp_path / "model", tokenizer)
    assert main(["info", "--model", folder]) == 0
    out = capsys.readouterr().out
    assert "Weights: held bfloat16, because: bfloat16, as stored in the checkpoint;\n    computed in float32" in out
    assert "matrices as stored (16/32-bit), from BF16" in out and "MiB of weights in memory" in out
    assert "rounded" not in out
    assert main(["info", "--model", folder, "--dtype", "bfloat16"]) == 0   # asked for what it is stored in
    assert "matrices as stored (16/32-bit), from BF16" in capsys.readouterr().out
    assert "each 16-bit matrix copied into one reused float32 buffer" in out
    assert main(["info", "--model", folder, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Weights: held float32, because: float32, asked for (dtype='float32')" in out
    assert "matrices float32" in out


def test_a_gguf_files_form_is_described_with_its_reason(tmp_path, monkeypatch, capsys):
    from transformers import AutoConfig

    from ragblend.core.model import loading as model_module
    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.quantized import build_quantized_model, describe

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")   # (no tokenizer in it: the model is built, not loaded)
    gguf = read_gguf(path)
    reason = model_module.gguf_weights_reason
    assert reason(gguf, None, torch.float32, "cpu").startswith("float32, the default for a small model")
    assert reason(gguf, "quantized", None, "cpu").startswith("the file's quantized form, asked for (dtype='quantized')")
    assert reason(gguf, torch.float32, torch.float32, "cpu") == "float32, asked for (dtype='float32')"
    # 16-bit on request: rounded at load from the file's types, and said so (not "as stored ... from BF16")
    from ragblend.core.model.sixteen_bit import hold_in_16_bit

    types = sorted({t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2})
    rounded = model_module.rounded_from(gguf, tmp_path, torch.bfloat16)
    assert rounded == f"the file's {', '.join(types)}" and "BF16" not in types
    assert reason(gguf, "bfloat16", torch.bfloat16, "cpu", rounded) == \
        f"bfloat16 rounded at load from {rounded}, asked for (dtype='bfloat16')"
    held = hold_in_16_bit(build_quantized_model(gguf, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name),
                                                exact=True, dtype=torch.bfloat16), rounded)
    lines = describe(held)
    assert lines[0].endswith(f"matrices bfloat16, rounded at load from {rounded}")
    assert not [line for line in lines if "as stored" in line]
    assert model_module.rounded_from(gguf, tmp_path, torch.float32) is None   # float32: dequantized, not rounded
    monkeypatch.setattr(model_module, "FLOAT32_GGUF_BYTES", 0)
    monkeypatch.setattr(model_module, "QUANTIZED_PREFILL_FIDELITY", {})   # an architecture not measured
    assert model_module._weights_form(path, "auto", "cpu")[1] is None   # too large for float32: quantized
    assert reason(gguf, "auto", None, "cpu").startswith("the file's quantized form, the default for a large model")
    lines = describe(build_quantized_model(gguf, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)))
    assert any("4-bit (groups of 32" in line for line in lines) and any("8-bit (a scale per row)" in line
                                                                        for line in lines)
    assert any("int4/int8 CPU kernels" in line for line in lines)
    assert any(line.endswith("MiB of weights in memory") for line in lines)
    # Issue 55: `ragblend info` said why and how in one line of ~900 characters; now a subject a line, wrapped.
    monkeypatch.setattr(model_module, "QUANTIZED_PREFILL_FIDELITY", {"llama": model_module.PrefillFidelity(
        "Gemma 3 270M Q4_K_M", 0.1384, 5, 11)})   # a verdict that missed: the longest reason
    from ragblend.cli.info import WIDTH, print_weights
    from ragblend.core.model.quantized import FAST_PLAN_MISSES

    model = build_quantized_model(gguf, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name))
    model.ragblend_fast_prefill_fidelity = model_module.PrefillFidelity("Gemma 3 270M Q4_K_M", 0.1, 5, 11)
    monkeypatch.delenv("RAGBLEND_QUANTIZED_PREFILL", raising=False)
    lines = describe(model)
    assert any(FAST_PLAN_MISSES in line for line in lines)
    print_weights("quantized", reason(gguf, "auto", None, "cpu"), lines)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Weights: held quantized, because: the file's quantized form")
    assert len(out) >= 10 and max(len(line) for line in out) <= WIDTH
    said = " ".join(out)
    assert "MISSED the fidelity rule" in said and "nearest exact path" in said and "is not taken, because it" in said


def test_blend_chat_model_passes_its_dtype_to_the_engine(tmp_path, tokenizer):
    from ragblend.integrations.langchain_chat import BlendChatModel

    folder = save_tiny(tmp_path / "model", tokenizer)
    assert BlendChatModel(model_path=folder).engine_options().dtype is None   # auto
    chat = BlendChatModel(model_path=folder, dtype="float32", kv_dir=str(tmp_path / "kv"), max_tokens=2)
    assert chat.invoke("Hi").content is not None
    assert chat._engine.weights_form == "float32"
    with pytest.raises(ValueError, match="dtype"):
        BlendChatModel(dtype="int4")


def test_an_architecture_that_missed_the_fidelity_rule_is_held_quantized_when_large_saying_why(tmp_path, monkeypatch):
    from ragblend.core.model import loading as model_module
    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.loading import PrefillFidelity

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf = read_gguf(path)
    monkeypatch.setattr(model_module, "FLOAT32_GGUF_BYTES", 0)   # large enough to be held quantized by default
    monkeypatch.setattr(model_module, "QUANTIZED_PREFILL_FIDELITY", {"llama": PrefillFidelity("Tiny", 0.02, 20, 20)})
    assert model_module._weights_form(path, None, "cpu")[1] is None
    assert "the prefill on quantized weights met the fidelity rule on Tiny: first-token KL 2.0% of the order " \
           "noise, greedy answers identical on 20 of 20" in model_module.gguf_weights_reason(gguf, None, None, "cpu")
    missed = PrefillFidelity("Tiny", 0.02, 18, 20)   # 90% of the answers: misses
    monkeypatch.setattr(model_module, "QUANTIZED_PREFILL_FIDELITY", {"llama": missed})
    # a large model stays quantized (float32 would not fit at 1-8B); the reason says it missed
    assert not missed.meets and model_module._weights_form(path, None, "cpu")[1] is None
    reason = model_module.gguf_weights_reason(gguf, None, None, "cpu")
    assert "MISSED the fidelity rule on Tiny" in reason and "dtype=torch.float32 holds the nearest exact path" in reason
    assert model_module._weights_form(path, "quantized", "cpu")[1] is None   # asked for: held quantized, saying so
    assert "MISSED the fidelity rule" in model_module.gguf_weights_reason(gguf, "quantized", None, "cpu")
    monkeypatch.setattr(model_module, "QUANTIZED_PREFILL_FIDELITY", {})
    assert "not measured for the llama architecture" in model_module.gguf_weights_reason(gguf, None, None, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_gguf_held_16_bit_is_read_by_ragblend_as_transformers_dequantizer_reads_it(tmp_path, dtype):
    # Issue 55: --dtype bfloat16 on a GGUF went through transformers' GGUF dequantizer (a float32
    # model first, then a 16-bit one); ragblend's reader rounds each tensor as it dequantizes it.
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.quantized import build_quantized_model
    from ragblend.core.model.sixteen_bit import hold_in_16_bit

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = hold_in_16_bit(build_quantized_model(read_gguf(path), config, exact=True, dtype=dtype))
    theirs = hold_in_16_bit(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=dtype))
    mine = {name: m for name, m in ours.named_modules() if isinstance(m, QuantLinear)}
    other = {name: m for name, m in theirs.named_modules() if isinstance(m, QuantLinear)}
    assert mine.keys() == other.keys() and len(mine) > 10
    for name, layer in mine.items():
        assert layer.weight.dtype == dtype and torch.equal(layer.weight, other[name].weight), name
    # The same 16-bit matrices; the norms stay the file's float32 (transformers rounds them to 16 bits too).
    exact = build_quantized_model(read_gguf(path), config, exact=True).eval()
    norms = {name: t for name, t in exact.state_dict().items() if "norm" in name}
    assert norms and all(torch.equal(ours.state_dict()[name], t) for name, t in norms.items())
    ids = torch.arange(40)[None] * 7 % 200
    with torch.no_grad():
        reference = exact(ids).logits
        for model in (ours, theirs):   # both a 16-bit rounding of the float32 model's weights
            assert (model.eval()(ids).logits - reference).abs().max() < 0.25
    assert ours.ragblend_weights_form == _name(dtype)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_load_model_holds_a_gguf_16_bit_without_transformers_gguf_loader(monkeypatch):
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' GGUF loader was used")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    model, _ = load_model(None, dtype="bfloat16")   # the embedded SmolLM2's GGUF
    assert model.ragblend_weights_form == "bfloat16" and model.config.dtype == torch.float32
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(layer.weight.dtype == torch.bfloat16 for layer in layers)
    assert model.ragblend_weights_reason.startswith("bfloat16 rounded at load from the file's ")
    assert "asked for (dtype='bfloat16')" in model.ragblend_weights_reason
