"""LangChain: BlendChatModel against the langchain-tests standard suites, the vector-store
ingestion hook, and a stuff-documents RAG chain on a real Chroma store."""

import pytest
import torch

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from ragblend import BlendChatModel  # noqa: E402


class NoToolCalling:
    """What BlendChatModel lacks, for both langchain-tests suites: its bind_tools is overridden
    only to refuse with what to do, which the suites would read as support."""

    @property
    def has_tool_calling(self):
        return False

    @property
    def has_structured_output(self):
        return False


class TestBlendChatModelUnit(NoToolCalling, ChatModelUnitTests):
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


# ---------------------------------------------------------------------------- unusual but legal calls


def test_an_abandoned_astream_stops_decoding(tokenizer):
    """A consumer that leaves an async stream after two chunks stops the answer's decoding in the
    worker thread, instead of letting it run to max_tokens in the background."""
    import asyncio
    import threading

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    chat = BlendChatModel(engine=engine, max_tokens=400)

    async def take_two_then_wait():
        chunks = 0
        async for _ in chat.astream("Tell me a long story."):
            chunks += 1
            if chunks == 2:
                break
        # The event loop stays up meanwhile, so the worker can go on handing chunks to nobody.
        for worker in [t for t in threading.enumerate() if t.name == "ragblend-stream"]:
            await asyncio.to_thread(worker.join, 60)
            assert not worker.is_alive()

    asyncio.run(take_two_then_wait())
    assert engine.last_stats.generated_tokens == 0   # the answer was stopped, never finished


def test_max_tokens_zero_is_refused_not_256(tokenizer):
    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    with pytest.raises(ValueError, match="max_tokens"):
        BlendChatModel(engine=engine, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        BlendChatModel(engine=engine, max_tokens=4).invoke("Hi", max_tokens=0)
    assert BlendChatModel(engine=engine, max_tokens=None).invoke("Hi").usage_metadata["output_tokens"] <= 256


def test_generic_chat_messages_keep_their_role(tokenizer):
    """LangChain's ChatMessage(role=...) is a user, assistant or system turn by its role."""
    from langchain_core.messages import ChatMessage, HumanMessage, SystemMessage

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    chat = BlendChatModel(engine=engine, max_tokens=2)
    chat.invoke([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")])
    generic = engine.last_prompt.token_ids
    chat.invoke([SystemMessage("Be brief."), HumanMessage("Hi")])
    assert generic == engine.last_prompt.token_ids


@pytest.mark.parametrize("block", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "image", "source_type": "base64", "data": "iVBORw0KGgo=", "mime_type": "image/png"},
    {"type": "file", "source_type": "base64", "data": "JVBERi0=", "mime_type": "application/pdf"},
    {"type": "media", "data": "iVBORw0KGgo=", "mime_type": "image/png"},
])
def test_a_media_block_is_refused_not_dropped(tokenizer, block):
    """A text-only model would answer as if it had seen the image: refused, as the server does."""
    from langchain_core.messages import HumanMessage

    from ragblend.core.errors import InvalidInputError

    from ..conftest import make_tiny_engine

    engine = make_tiny_engine("llama", tokenizer)
    chat = BlendChatModel(engine=engine, max_tokens=2)
    with pytest.raises(InvalidInputError, match=f"messages\\[0\\] has '{block['type']}' content"):
        chat.invoke([HumanMessage(content=[{"type": "text", "text": "What is in this?"}, block])])
    assert engine.last_stats is None
    assert chat.invoke([HumanMessage(content=[{"type": "text", "text": "Hi"}])]).content is not None


def test_structured_output_is_refused_in_its_own_words():
    # A trial (session 45): LangChain's base builds it on bind_tools, whose refusal named tool calling.
    from pydantic import BaseModel

    from ragblend import InvalidInputError

    class Person(BaseModel):
        name: str

    chat = BlendChatModel(max_tokens=4)   # never loaded: refused before any model call
    for schema in (Person, {"title": "Person", "type": "object", "properties": {"name": {"type": "string"}}}):
        with pytest.raises(InvalidInputError, match=r"does not implement structured output \(with_structured_output"
                                                    r"\): ask for JSON in the prompt.*PydanticOutputParser") as info:
            chat.with_structured_output(schema)
        assert "bind_tools" not in str(info.value)
