"""EngineOptions (ragblend.core.options): the engine's options, declared once and read by the
engine, the CLI flags and the integrations' fields."""

import argparse

import pytest
import torch

from ragblend.core.errors import InvalidInputError, InvalidTypeError
from ragblend.core.options import EngineOptions, add_arguments, field_help, from_args
from tests.conftest import make_tiny_engine


def test_options_check_once_with_the_engines_errors():
    with pytest.raises(InvalidInputError, match="kv_dtype must be one of"):
        EngineOptions(kv_dtype="int4")
    with pytest.raises(InvalidInputError, match="decode_dtype must be"):
        EngineOptions(decode_dtype="int2")
    with pytest.raises(InvalidInputError, match="prompt_lookup_num_tokens must be"):
        EngineOptions(prompt_lookup_num_tokens=-1)
    assert EngineOptions(kv_dtype=torch.int8).storage_dtype == torch.int8


def test_engine_takes_options_and_keywords_over_them(tokenizer):
    options = EngineOptions(kv_dtype="int8", precompute_batch_tokens=0, prefetch=False)
    engine = make_tiny_engine("llama", tokenizer, options=options, precompute_batch_tokens=64)
    assert engine.kv_dtype == torch.int8 and engine.prefetch is False
    assert engine.precompute_batch_tokens == 64 and engine.options.precompute_batch_tokens == 64
    with pytest.raises(InvalidTypeError, match="kv_dir"):   # a loading option: from_pretrained's
        make_tiny_engine("llama", tokenizer, kv_dir="/tmp/x")
    with pytest.raises(InvalidTypeError, match="unexpected keyword argument 'kv_dtypes'"):
        make_tiny_engine("llama", tokenizer, kv_dtypes="int8")


def test_cli_flags_come_from_the_declarations():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ["model", "kv_dtype", "decode_dtype"])
    options = from_args(parser.parse_args(["--kv-dtype", "int8", "--model", "m.gguf"]))
    assert (options.kv_dtype, options.model, options.decode_dtype) == ("int8", "m.gguf", "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-dtype", "int2"])
    assert "--kv-dtype {float32,float16,bfloat16,int8,uint4}" in parser.format_help()


def test_integration_fields_describe_the_options():
    pytest.importorskip("pydantic")
    from ragblend.integrations.common import EngineFields

    fields = EngineFields.model_fields
    for field, option in [("model_path", "model"), ("dtype", "dtype"), ("kv_dir", "kv_dir"), ("kv_dtype", "kv_dtype"),
                          ("decode_dtype", "decode_dtype")]:
        assert fields[field].description == field_help(option)
    assert (fields["kv_dtype"].default, fields["decode_dtype"].default) == ("float16", "auto")


def test_integration_fields_give_the_engine_options_they_name():
    from ragblend.integrations.common import EngineFields

    fields = EngineFields(model_path="/models/m.gguf", kv_dir="/tmp/kv", kv_dtype="int8", decode_dtype="float32")
    assert fields.engine_options() == EngineOptions(model="/models/m.gguf", kv_dir="/tmp/kv", kv_dtype="int8",
                                                    decode_dtype="float32")
    # Their defaults are the options' own: one declaration.
    assert EngineFields().engine_options() == EngineOptions()
