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

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError

from .common import STRATEGY_NAMES, iterate_in_thread, lazy_engine, make_strategy


def usage_of(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "cached_prompt_tokens": stats.reused_tokens}


@dataclass
class CallRecord:
    """One call of the LLM: the prompt text it was given, the exact prompt token ids, what
    the fusion reused, and the engine's stats."""

    prompt: str
    layout: Any
    stats: Stats


class BlendLLM(CustomLLM):
    """LlamaIndex LLM running a local model through ragblend's KV-fusion engine.

    Pass ``engine=`` to share a :class:`~ragblend.BlendEngine` (then ``engine.last_stats``
    shows what the last call reused), or let BlendLLM build one from the fields below.
    The system prompt goes into the model's chat template, not in front of the text.
    """

    model_path: Optional[str] = Field(default=None, description="Local HF model dir or .gguf file; None = embedded SmolLM2-135M-Instruct.")
    kv_dir: Optional[str] = Field(default=None, description="Disk tier of the KV store; None = <user cache>/ragblend/kv.")
    strategy: str = Field(default="default", description=f"Fusion strategy: one of {', '.join(STRATEGY_NAMES)} (default: the engine's calibrated choice).")
    ratio: Optional[float | str] = Field(default=None, description="Recompute ratio in (0, 1] (CacheBlend also 'auto'); None = the strategy's default.")
    legolink_k: int = Field(default=16, description="LegoLink: tokens recomputed at the start of each chunk.")
    max_new_tokens: int = Field(default=256, description="Most tokens to generate per call.")
    temperature: float = Field(default=0.0, description="0 = greedy decoding.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass (with temperature > 0).")
    seed: Optional[int] = Field(default=None, description="Seed for sampling.")
    context_window: Optional[int] = Field(default=None, description="Report a smaller window than the model's to synthesizers (None = the model's).")

    _engine: BlendEngine = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _calls: deque = PrivateAttr(default_factory=lambda: deque(maxlen=64))

    def __init__(self, engine: BlendEngine | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        make_strategy(self.strategy, self.ratio, self.legolink_k)  # validate early
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

    def _record(self, prompt: str, layout, stats: Stats) -> None:
        self._calls.append(CallRecord(prompt, layout, stats))

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        window = min(self.context_window or engine.context_window, engine.context_window)
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=engine.name, system_role=MessageRole.SYSTEM)

    def _extend_prompt(self, formatted_prompt: str) -> str:
        # The system prompt is given to the chat template in `complete`, not glued onto the text.
        if self.query_wrapper_prompt:
            return self.query_wrapper_prompt.format(query_str=formatted_prompt)
        return formatted_prompt

    def _options(self, kwargs: dict) -> dict:
        return dict(strategy=make_strategy(kwargs.pop("strategy", self.strategy), self.ratio, self.legolink_k),
                    max_new_tokens=kwargs.pop("max_new_tokens", kwargs.pop("max_tokens", self.max_new_tokens)),
                    temperature=kwargs.pop("temperature", self.temperature),
                    top_p=kwargs.pop("top_p", self.top_p), seed=kwargs.pop("seed", self.seed),
                    stop=kwargs.pop("stop", None))

    def _layout(self, prompt: str, history: Sequence[tuple[str, str]] = (), system: str | None = None):
        return self.engine.find_chunks(prompt, system=system or self.system_prompt or None, history=history)

    def _response(self, text: str, stats: Stats, delta: str | None = None) -> CompletionResponse:
        return CompletionResponse(text=text, delta=delta, raw={"usage": usage_of(stats), "ragblend": stats.__dict__},
                                  additional_kwargs={"ragblend_stats": stats})

    # ------------------------------------------------------------------ completion
    # The decorated public methods fire LlamaIndex's callbacks; the async ones call the
    # undecorated helpers in a worker thread, so each call is reported once.

    def _complete(self, prompt: str, **kwargs: Any) -> CompletionResponse:
        options = self._options(kwargs)
        layout = self._layout(prompt)
        out = self.engine.generate(layout, **options)
        self._record(prompt, layout, out.stats)
        return self._response(out.text, out.stats)

    def _stream_complete(self, prompt: str, **kwargs: Any) -> CompletionResponseGen:
        options = self._options(kwargs)
        layout = self._layout(prompt)
        stream = self.engine.stream(layout, **options)
        text = ""
        for delta in stream:
            text += delta
            yield self._response(text, stream.stats, delta)
        self._record(prompt, layout, stream.stats)
        yield self._response(text, stream.stats, "")  # final usage, after decoding

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

    # ------------------------------------------------------------------ chat

    def _chat_layout(self, messages: Sequence[ChatMessage]):
        system = "\n\n".join(m.content or "" for m in messages if m.role == MessageRole.SYSTEM) or None
        turns = [m for m in messages if m.role != MessageRole.SYSTEM]
        if not turns or turns[-1].role != MessageRole.USER:
            raise InvalidInputError("BlendLLM.chat needs the last message to be from the user.")
        history = [("assistant" if m.role == MessageRole.ASSISTANT else "user", m.content or "") for m in turns[:-1]]
        return self._layout(turns[-1].content or "", history, system)

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        options = self._options(kwargs)
        layout = self._chat_layout(messages)
        out = self.engine.generate(layout, **options)
        self._record(messages[-1].content or "", layout, out.stats)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=out.text),
                            raw={"usage": usage_of(out.stats)}, additional_kwargs={"ragblend_stats": out.stats})

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        options = self._options(kwargs)
        layout = self._chat_layout(messages)
        stream = self.engine.stream(layout, **options)
        text = ""
        for delta in stream:
            text += delta
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                               raw={"usage": usage_of(stream.stats)})
        self._record(messages[-1].content or "", layout, stream.stats)
        yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta="",
                           raw={"usage": usage_of(stream.stats)}, additional_kwargs={"ragblend_stats": stream.stats})

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
