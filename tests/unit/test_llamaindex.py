"""LlamaIndex: BlendLLM with unusual but legal arguments, on a tiny model."""

import asyncio
import threading

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.llms import ChatMessage  # noqa: E402

from ragblend import BlendLLM  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402


def test_a_context_window_below_one_is_refused_at_construction(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    for window in (0, -5):
        with pytest.raises(ValueError, match="context_window"):
            BlendLLM(engine=engine, context_window=window)
    assert BlendLLM(engine=engine, context_window=100).metadata.context_window == 100


def test_developer_and_model_roles_are_system_and_assistant_turns(tokenizer):
    """OpenAI's developer role is a system turn; Gemini's model and Cohere's chatbot roles are the
    assistant's, not the user's."""
    engine = make_tiny_engine("llama", tokenizer)
    llm = BlendLLM(engine=engine, max_new_tokens=2)

    def prompt_ids(roles):
        llm.chat([ChatMessage(role=role, content=text) for role, text in
                  zip(roles, ["Be brief.", "Hi", "Hello", "Bye"])])
        return engine.last_prompt.token_ids

    standard = prompt_ids(["system", "user", "assistant", "user"])
    assert prompt_ids(["developer", "user", "model", "user"]) == standard
    assert prompt_ids(["system", "user", "chatbot", "user"]) == standard


def test_an_abandoned_astream_stops_decoding(tokenizer):
    """Leaving astream_complete after two deltas stops the worker thread's decoding: the call is
    never finished (nor recorded), instead of running to max_new_tokens in the background."""
    engine = make_tiny_engine("llama", tokenizer)
    llm = BlendLLM(engine=engine, max_new_tokens=400)

    async def take_two_then_wait():
        deltas = 0
        async for _ in await llm.astream_complete("Tell me a long story."):
            deltas += 1
            if deltas == 2:
                break
        for worker in [t for t in threading.enumerate() if t.name == "ragblend-stream"]:
            await asyncio.to_thread(worker.join, 60)
            assert not worker.is_alive()

    asyncio.run(take_two_then_wait())
    assert llm.calls == [] and engine.last_stats.generated_tokens == 0

def test_an_image_block_is_refused_not_dropped(tokenizer):
    """ChatMessage.content holds only the text blocks: a text-only model would answer as if it had
    seen the image. Refused, as the server does."""
    from llama_index.core.base.llms.types import ImageBlock, TextBlock

    from ragblend.core.errors import InvalidInputError

    engine = make_tiny_engine("llama", tokenizer)
    llm = BlendLLM(engine=engine, max_new_tokens=2)
    image = ImageBlock(image=b"\x89PNG\r\n\x1a\n", image_mimetype="image/png")
    with pytest.raises(InvalidInputError, match=r"messages\[0\] has image \(ImageBlock\) content"):
        llm.chat([ChatMessage(role="user", blocks=[TextBlock(text="What is in this?"), image])])
    assert engine.last_stats is None
    assert llm.chat([ChatMessage(role="user", blocks=[TextBlock(text="Hi")])]).message.content is not None
