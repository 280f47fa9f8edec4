"""BlendLLM: a LlamaIndex LLM that answers with ragblend's fusion engine.

Drop it into any query engine; chunks whose KV was precomputed at ingestion
(:class:`ragblend.KVPrecompute`) are found inside the prompt the synthesizer builds and
their KV reused::

    from llama_index.core import VectorStoreIndex
    from ragblend import BlendLLM

    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=embed_model)
    query_engine = index.as_query_engine(llm=BlendLLM(engine=engine))
    response = query_engine.query("When was the lighthouse first lit?")
    print(response, engine.last_stats.reused_tokens)
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import astream_chat_response_to_tokens, stream_chat_response_to_tokens
from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, SelectorPromptTemplate

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError
from ragblend.core.prompt import PromptLayout, Segment

from .common import (
    SAMPLING,
    EngineFields,
    iterate_in_thread,
    lazy_engine,
    refuse_media,
    refuse_tool_calls,
    refuse_tool_results,
    split_conversation,
    template_role,
    token_usage,
)


@dataclass
class CallRecord:
    """One call of the LLM: the prompt text it was given, the exact prompt token ids
    (None when it was given as segments), what the fusion reused, and the engine's stats."""

    prompt: str
    layout: Any
    stats: Stats


# Blocks a text-only model cannot read (LlamaIndex's ImageBlock, AudioBlock, VideoBlock, DocumentBlock).
MEDIA_BLOCKS = frozenset({"image", "audio", "video", "document"})


def _media_blocks(messages: Sequence[ChatMessage]):
    """``(index, 'kind (BlockClass)')`` of each media block (``content`` holds only the text ones)."""
    for i, message in enumerate(messages):
        for block in getattr(message, "blocks", ()):
            kind = getattr(block, "block_type", None)
            if kind in MEDIA_BLOCKS:
                yield i, f"{kind} ({type(block).__name__})"


def _tool_calls(messages: Sequence[ChatMessage]):
    """``(index, tool name)`` of each message that calls a tool: a ToolCallBlock, or OpenAI's
    ``tool_calls``/``function_call`` kept in ``additional_kwargs`` (LlamaIndex's OpenAI LLM)."""
    for i, message in enumerate(messages):
        blocks = [b for b in getattr(message, "blocks", ()) if getattr(b, "block_type", None) == "tool_call"]
        extra = message.additional_kwargs or {}
        calls = [*(extra.get("tool_calls") or ()), *([extra["function_call"]] if extra.get("function_call") else [])]
        if blocks:
            yield i, blocks[0].tool_name
        elif calls:
            call = calls[0] if isinstance(calls[0], dict) else getattr(calls[0], "model_dump", dict)()
            yield i, call.get("name") or (call.get("function") or {}).get("name") or "?"


class BlendLLM(EngineFields, CustomLLM):
    """LlamaIndex LLM running a local model through ragblend's KV-fusion engine.

    Pass ``engine=`` to share a :class:`~ragblend.BlendEngine` (then ``engine.last_stats``
    shows what the last call reused), or let BlendLLM build one from the fields below (on first
    use, shared with every BlendLLM and BlendChatModel of the same model and options:
    :mod:`.shared_engines`).
    The system prompt goes into the model's chat template, not in front of the text.

    Chat is implemented once (:meth:`stream_answer` under ``_stream_chat``); chat without
    streaming and both completion paths derive from it, so every path returns the same
    payload: ``raw={"usage": ..., "ragblend": stats as a dict}`` and
    ``additional_kwargs={"ragblend_stats": Stats}``.

    To LlamaIndex it is a completion model (``is_chat_model=False``), so query engines use their
    plain-text prompts; but a prompt that is a conversation (a chat engine's system message,
    history and question, as a ``ChatPromptTemplate``) keeps its turns: :meth:`predict` and
    :meth:`stream` give it to the chat template, where LlamaIndex would flatten it into
    ``"user: ..."``/``"assistant: "`` lines of one user message, which a small model continues in
    kind (an answer beginning ``"user: "``).
    """

    max_new_tokens: int = Field(default=SAMPLING.max_new_tokens, description="Most tokens to generate per call.")
    context_window: Optional[int] = Field(default=None, description="Report a smaller window than the model's to synthesizers (None = the model's).")

    _engine: BlendEngine = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _calls: deque = PrivateAttr(default_factory=lambda: deque(maxlen=64))

    def __init__(self, engine: BlendEngine | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.check_strategy()
        window = self.context_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            # a synthesizer would pack its prompts for a window of nothing (or take 0 as "the model's")
            raise InvalidInputError(f"context_window must be an integer >= 1, or None for the model's; got {window!r}.")
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "BlendLLM"

    @property
    def engine(self) -> BlendEngine:
        """The fusion engine (loaded on first use when not given)."""
        return lazy_engine(self)

    @property
    def last_stats(self) -> Stats | None:
        """Stats of this LLM's most recent call (``engine.last_stats`` is the engine's, across users)."""
        return self._calls[-1].stats if self._calls else None

    @property
    def calls(self) -> list[CallRecord]:
        """The most recent calls (up to 64), oldest first; a refine query makes several."""
        return list(self._calls)

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        window = min(self.context_window or engine.context_window, engine.context_window)
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=engine.name, system_role=MessageRole.SYSTEM)

    def _extend_prompt(self, formatted_prompt: str) -> str:
        # The system prompt is given to the chat template, not glued onto the text.
        if self.query_wrapper_prompt:
            return self.query_wrapper_prompt.format(query_str=formatted_prompt)
        return formatted_prompt

    # ------------------------------------------------------------------ the one generation path

    def stream_answer(self, prompt: PromptLayout | Sequence[Segment], *, system: str | None = None,
                      label: str = "", **kwargs: Any):
        """Decode an answer to ``prompt``, yielding ``(delta, stats)``; the last item has
        ``delta == ""`` and the complete stats. ``prompt`` is a layout (from
        ``engine.find_chunks``) or segments with :class:`~ragblend.Chunk` s (as
        :class:`BlendSynthesizer` passes nodes). ``kwargs`` override the fields for this
        call. The call is recorded under ``label`` in :attr:`calls`."""
        max_new_tokens = kwargs.pop("max_new_tokens", kwargs.pop("max_tokens", self.max_new_tokens))
        options = self.generation_options(kwargs, max_new_tokens)
        if not isinstance(prompt, PromptLayout):
            options["system"] = system if system is not None else self.system_prompt or None
        stream = self.engine.stream(prompt, **options)
        for delta in stream:
            yield delta, stream.stats
        self._calls.append(CallRecord(label, prompt if isinstance(prompt, PromptLayout) else None, stream.stats))
        yield "", stream.stats

    def _chat_layout(self, messages: Sequence[ChatMessage], chat: bool) -> PromptLayout:
        refuse_media(_media_blocks(messages), "BlendLLM.chat")
        refuse_tool_calls(_tool_calls(messages), "BlendLLM.chat")
        # LlamaIndex's roles are strings too (MessageRole is a str enum); tool and function are tool turns.
        turns = [(template_role(m.role), m.content or "") for m in messages]
        system, history, text = split_conversation(turns, "BlendLLM.chat")
        refuse_tool_results(turns, self.engine, "BlendLLM.chat")
        if self.system_prompt:   # the field's prompt leads the chat's own, in one system message (see _extend_messages)
            system = f"{self.system_prompt}\n\n{system}" if system else self.system_prompt
        layout = self.engine.find_chunks(text, system=system, history=history)
        return self.as_chat(layout) if chat else layout   # a completion (a query engine's prompt) keeps none

    def _stream_chat(self, messages: Sequence[ChatMessage], chat: bool = True, **kwargs: Any) -> ChatResponseGen:
        layout = self._chat_layout(messages, chat)
        text = ""
        for delta, stats in self.stream_answer(layout, label=messages[-1].content or "", **kwargs):
            text += delta
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                               raw={"usage": token_usage(stats), "ragblend": dict(stats.__dict__)},
                               additional_kwargs={"ragblend_stats": stats})

    def _chat(self, messages: Sequence[ChatMessage], chat: bool = True, **kwargs: Any) -> ChatResponse:
        *_, last = self._stream_chat(messages, chat, **kwargs)
        return last.model_copy(update={"delta": None})

    def _extend_messages(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        # LlamaIndex puts the LLM's system_prompt before the messages as a system message of its own:
        # before a chat engine's (its context), that is a second system message, which templates such
        # as Gemma 3's refuse. _chat_layout joins it to the chat's first system message instead.
        return list(messages)

    def _as_messages(self, prompt: str) -> list[ChatMessage]:
        return [ChatMessage(role=MessageRole.USER, content=prompt)]   # the system prompt is added in _chat_layout

    @staticmethod
    def _as_completion(response: ChatResponse) -> CompletionResponse:
        return CompletionResponse(text=response.message.content or "", delta=response.delta, raw=response.raw,
                                  additional_kwargs=response.additional_kwargs)

    def _complete(self, prompt: str, **kwargs: Any) -> CompletionResponse:
        return self._as_completion(self._chat(self._as_messages(prompt), False, **kwargs))

    def _stream_complete(self, prompt: str, **kwargs: Any) -> CompletionResponseGen:
        for response in self._stream_chat(self._as_messages(prompt), False, **kwargs):
            yield self._as_completion(response)

    # ------------------------------------------------------------------ conversations keep their turns

    def _conversation(self, prompt: BasePromptTemplate, prompt_args: dict) -> list[ChatMessage] | None:
        """The messages of ``prompt`` if it is a conversation (a ChatPromptTemplate, or a selector
        that picks one for this LLM), else None (a plain prompt: LlamaIndex's own path)."""
        if isinstance(prompt, SelectorPromptTemplate):
            prompt = prompt.select(llm=self)
        if not isinstance(prompt, ChatPromptTemplate):
            return None
        return self._get_messages(prompt, **prompt_args)

    def predict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        messages = self._conversation(prompt, prompt_args)
        if messages is None:
            return super().predict(prompt, **prompt_args)
        return self._parse_output(self.chat(messages).message.content or "")

    def stream(self, prompt: BasePromptTemplate, **prompt_args: Any):
        messages = self._conversation(prompt, prompt_args)
        if messages is None:
            return super().stream(prompt, **prompt_args)
        if prompt.output_parser is not None or self.output_parser is not None:
            raise NotImplementedError("Output parser is not supported for streaming.")   # as LLM.stream
        return stream_chat_response_to_tokens(self.stream_chat(messages))

    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        messages = self._conversation(prompt, prompt_args)
        if messages is None:
            return await super().apredict(prompt, **prompt_args)
        return self._parse_output((await self.achat(messages)).message.content or "")

    async def astream(self, prompt: BasePromptTemplate, **prompt_args: Any):
        messages = self._conversation(prompt, prompt_args)
        if messages is None:
            return await super().astream(prompt, **prompt_args)
        if prompt.output_parser is not None or self.output_parser is not None:
            raise NotImplementedError("Output parser is not supported for streaming.")
        return await astream_chat_response_to_tokens(await self.astream_chat(messages))

    # ------------------------------------------------------------------ the public methods
    # The decorated methods fire LlamaIndex's callbacks; the async ones call the undecorated
    # helpers in a worker thread, so each call is reported once.

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return iterate_in_thread(lambda: self._stream_complete(prompt, **kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, **kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, **kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return iterate_in_thread(lambda: self._stream_chat(messages, **kwargs))
