"""BlendChatModel: a LangChain chat model that answers with ragblend's fusion engine.

Chunks whose KV is stored are reused three ways:

* text content blocks marked with ``cache_control`` (the convention of Anthropic prompt
  caching, top-level or under ``extras``) are fused as chunks;
* ``kv_chunks=[...]`` at call time marks those texts inside the last user message;
* otherwise stored chunks are found inside the plain prompt text, as in ``BlendLLM``.

Example::

    from langchain_core.messages import HumanMessage, SystemMessage
    from ragblend import BlendChatModel

    chat = BlendChatModel(max_tokens=64)          # the model loads on first use
    doc = ("The Sanderling is the passenger ferry that crosses from the north pier of Lowenmark to the "
           "island of Hallow Holm. It sails four times a day in summer and twice a day in winter, and the "
           "crossing takes about thirty minutes.")   # a chunk must outweigh the template to be fused
    reply = chat.invoke([
        SystemMessage("Answer from the context."),
        HumanMessage(content=[{"type": "text", "text": doc, "cache_control": {"type": "ephemeral"}},
                              {"type": "text", "text": "Which ferry goes to Hallow Holm?"}]),
    ])
    print(reply.content, reply.usage_metadata["input_token_details"]["cache_read"])
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage, SystemMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field, PrivateAttr, SecretStr

from ragblend.core.chat_template import RESULT_AS_TEXT
from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError
from ragblend.core.prompt import Chunk
from ragblend.serving.protocol import is_marked, segments_of, text_of

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

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_TOKENS = SAMPLING.max_new_tokens   # what max_tokens=None generates at most


def _role(message: BaseMessage) -> str:
    """The chat-template role of a LangChain message (a tool message keeps its own type)."""
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, ChatMessage):
        return template_role(message.role)   # the generic message carries its role as a string
    return template_role(message.type)   # ToolMessage's "tool", FunctionMessage's "function": a tool turn


# Content blocks a text-only model cannot read: LangChain's standard kinds, OpenAI's chat and
# Responses kinds, Anthropic's document and Google's media blocks.
MEDIA_BLOCKS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "video", "file",
                          "input_file", "document", "media"})


def _media_blocks(messages: Sequence[BaseMessage]):
    """``(index, 'kind')`` of each media block in LangChain messages' content lists."""
    for i, message in enumerate(messages):
        for block in message.content if isinstance(message.content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in MEDIA_BLOCKS:
                yield i, repr(kind)


def _tool_calls(messages: Sequence[BaseMessage]):
    """``(index, tool name)`` of each message that calls a tool (an AIMessage's ``tool_calls``, or
    OpenAI's ``tool_calls``/``function_call`` kept in ``additional_kwargs``)."""
    for i, message in enumerate(messages):
        extra = message.additional_kwargs or {}
        calls = [*(getattr(message, "tool_calls", None) or ()), *(getattr(message, "invalid_tool_calls", None) or ()),
                 *(extra.get("tool_calls") or ()), *([extra["function_call"]] if extra.get("function_call") else [])]
        if calls:
            call = calls[0] if isinstance(calls[0], dict) else {}
            yield i, call.get("name") or (call.get("function") or {}).get("name") or "?"


def _check_max_tokens(max_tokens):
    """``max_tokens`` if it is None (then 256 at most) or an integer >= 1; anything else is an error,
    never a silent default."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidInputError(f"max_tokens must be an integer >= 1 (or None for {DEFAULT_MAX_TOKENS}), "
                                f"got {max_tokens!r}.")
    return max_tokens


def usage_metadata(stats: Stats) -> UsageMetadata:
    usage = token_usage(stats)
    return UsageMetadata(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"],
                         input_token_details={"cache_read": usage["cached_prompt_tokens"]})


class BlendChatModel(EngineFields, BaseChatModel):
    """LangChain chat model running a local model through ragblend's KV-fusion engine.

    Pass ``engine=`` to share a :class:`~ragblend.BlendEngine`; otherwise one is loaded
    from ``model_path``/``kv_dir`` on first use (so constructing the class is cheap), shared with
    every BlendLLM and BlendChatModel of the same model and options (:mod:`.shared_engines`).
    """

    max_tokens: Optional[int] = Field(default=SAMPLING.max_new_tokens, description="Most tokens to generate (None = 256).")
    stop: Optional[list[str]] = Field(default=None, description="Stop strings.")
    streaming: bool = Field(default=False, description="Stream by default in invoke (LangChain convention).")
    # Standard LangChain parameters with no meaning for a local model; accepted so generic
    # code that passes them keeps working.
    timeout: Optional[float] = Field(default=None, description="Accepted for compatibility; unused locally.")
    max_retries: int = Field(default=2, description="Accepted for compatibility; unused locally.")
    api_key: Optional[SecretStr] = Field(default=None, description="Bearer key for base_url (None = $RAGBLEND_API_KEY, if set); unused locally.")

    _engine: Optional[BlendEngine] = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, engine: BlendEngine | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.check_strategy()   # validate early, load nothing
        _check_max_tokens(self.max_tokens)
        self._engine = engine

    # ------------------------------------------------------------------ identity

    @property
    def _llm_type(self) -> str:
        return "ragblend"

    @property
    def model_name(self) -> str:
        if self._engine is not None:
            return self._engine.name
        return os.path.basename(self.model_path.rstrip("/")) if self.model_path else DEFAULT_NAME

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "strategy": self.strategy, "ratio": self.ratio,
                "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="ragblend", ls_model_name=kwargs.get("model", self.model_name),
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature))
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    @property
    def engine(self) -> BlendEngine:
        """The fusion engine (loaded on first use when not given)."""
        return lazy_engine(self)

    def get_token_ids(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    # ------------------------------------------------------------------ prompt

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any):
        """Refused with what to do instead: ragblend does not implement tool calling (LangChain's
        base class raises a bare NotImplementedError)."""
        raise InvalidInputError("BlendChatModel does not implement tool calling (bind_tools): call the tool in your "
                                f"own code and {RESULT_AS_TEXT}, or use a chat model that calls tools.")

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, **kwargs: Any):
        """Refused with what to do instead: LangChain's base class builds structured output on
        :meth:`bind_tools`, whose refusal would name tool calling, not what was asked."""
        raise InvalidInputError("BlendChatModel does not implement structured output (with_structured_output): ask "
                                "for JSON in the prompt and parse the answer, e.g. with LangChain's "
                                "PydanticOutputParser or JsonOutputParser (whose get_format_instructions() says "
                                "what to put in the prompt), or use a chat model that calls tools.")

    def _layout(self, messages: Sequence[BaseMessage], kv_chunks: Sequence[str] | None):
        return self.as_chat(self._laid_out(messages, kv_chunks))   # a long stuffed first message keeps none

    def _laid_out(self, messages: Sequence[BaseMessage], kv_chunks: Sequence[str] | None):
        refuse_media(_media_blocks(messages), "BlendChatModel")
        refuse_tool_calls(_tool_calls(messages), "BlendChatModel")
        engine = self.engine
        turns = [(_role(m), text_of(m.content)) for m in messages]
        system, history, _ = split_conversation(turns, "BlendChatModel")
        refuse_tool_results(turns, engine, "BlendChatModel")
        content = messages[-1].content
        if isinstance(content, list) and any(is_marked(b) for b in content):
            return engine.build_prompt(segments_of(content), system=system, history=history)
        text = text_of(content)
        if kv_chunks:
            return engine.build_prompt(_split_on(text, kv_chunks), system=system, history=history, separator="")
        return engine.find_chunks(text, system=system, history=history)

    def _options(self, stop: Optional[list[str]], kwargs: dict) -> dict:
        kwargs.pop("model", None)  # one local model: a per-call override only names it
        max_tokens = _check_max_tokens(kwargs.pop("max_tokens", self.max_tokens))
        options = self.generation_options(kwargs, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        options["stop"] = stop or options["stop"] or self.stop
        return options

    def _metadata(self, stats: Stats) -> dict:
        return {"model_name": self.model_name, "finish_reason": stats.finish_reason,
                "model_provider": "ragblend", "ragblend": dict(stats.__dict__)}

    # ------------------------------------------------------------------ generation

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        kv_chunks = kwargs.pop("kv_chunks", None)
        options = self._options(stop, kwargs)
        out = self.engine.generate(self._layout(messages, kv_chunks), **options)
        message = AIMessage(content=out.text, usage_metadata=usage_metadata(out.stats),
                            response_metadata=self._metadata(out.stats))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        kv_chunks = kwargs.pop("kv_chunks", None)
        options = self._options(stop, kwargs)
        stream = self.engine.stream(self._layout(messages, kv_chunks), **options)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        stats = stream.stats
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage_metadata(stats), response_metadata=self._metadata(stats),
            chunk_position="last"))

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager and chunk.message.content:
                await run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
            yield chunk


def _split_on(text: str, chunks: Sequence[str]) -> list:
    """``text`` as segments with every occurrence of the given chunk texts marked as Chunk."""
    for chunk in chunks:
        if not isinstance(chunk, str) or not chunk or chunk not in text:
            raise InvalidInputError("Every kv_chunks text must occur verbatim in the last user message; "
                                    f"{str(chunk)[:60]!r} does not.")
    segments: list = [text]
    for chunk in sorted(set(chunks), key=len, reverse=True):
        out = []
        for seg in segments:
            if isinstance(seg, Chunk):
                out.append(seg)
                continue
            parts = seg.split(chunk)
            for i, part in enumerate(parts):
                if i:
                    out.append(Chunk(chunk))
                if part:
                    out.append(part)
        segments = out
    return segments
