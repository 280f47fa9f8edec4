"""LangChain: BlendChatModel against the langchain-tests standard suites, the vector-store
ingestion hook, and a stuff-documents RAG chain on a real Chroma store."""

import pytest
import torch

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from ragblend import BlendChatModel  # noqa: E402


class TestBlendChatModelUnit(ChatModelUnitTests):
    """The standard unit tests. Constructing the model never loads it."""

    @property
    def chat_model_class(self):
        return BlendChatModel

    @property
    def chat_model_params(self):
        return {"temperature": 0.0}

    @property
    def supports_model_override(self):
        return False  # one local model per instance


NOT_APPLICABLE = "not applicable to a local text-only model without tool calling or structured output"


# ---------------------------------------------------------------------------- construction


def test_constructing_the_model_loads_nothing():
    chat = BlendChatModel(model_path="/no/such/model", max_tokens=8, temperature=0.5, stop=["\n"])
    assert chat._engine is None and chat.model_name == "model"
    params = chat._get_ls_params()
    assert params["ls_provider"] == "ragblend" and params["ls_max_tokens"] == 8 and params["ls_stop"] == ["\n"]
    with pytest.raises(ValueError, match="strategy"):
        BlendChatModel(strategy="nope")


def test_storage_and_decoding_dtypes_reach_the_engine(tokenizer, tmp_path):
    from ..conftest import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    chat = BlendChatModel(model_path=str(tmp_path / "model"), kv_dir=str(tmp_path / "kv"), kv_dtype="int8",
                          decode_dtype="float16", max_tokens=2)
    assert chat.invoke("Hi").content is not None
    assert chat._engine.kv_dtype == torch.int8 and chat._engine.decode_dtype == "float16"
    with pytest.raises(ValueError, match="kv_dtype"):
        BlendChatModel(kv_dtype="int4")


def test_langchain_integration_needs_no_llamaindex():
    import subprocess
    import sys

    code = ("import sys; sys.modules['llama_index'] = None; sys.modules['llama_index.core'] = None\n"
            "from ragblend import BlendChatModel; BlendChatModel(max_tokens=4)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-500:]
