"""What the framework integrations share: their common fields, the options and prompt
split they derive from them, and the usage they report. Imports no framework (pydantic
only, which both LlamaIndex and LangChain build on)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from typing import Any, Iterable, Literal, Optional, Sequence

from pydantic import BaseModel, Field, SecretStr

from ragblend.core.chat_template import RESULT_AS_TEXT, split_chat
from ragblend.core.decode.generate import SamplingParams
from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError
from ragblend.core.fusion.strategies import STRATEGY_NAMES, strategy_from_name
from ragblend.core.options import DECODE_DTYPES, KV_DTYPES, WEIGHT_DTYPES, EngineOptions, field_default, field_help
from ragblend.serving.client import Backend, RemoteEngine
from ragblend.serving.protocol import cached_tokens

from .shared_engines import shared_engine

# Literal[tuple] lists the tuple's values: the names come from each strategy class's `name`.
StrategyName = Literal[STRATEGY_NAMES]  # type: ignore[valid-type]
KvDtype = Literal[KV_DTYPES]  # type: ignore[valid-type]
DecodeDtype = Literal[DECODE_DTYPES]  # type: ignore[valid-type]
WeightDtype = Literal[WEIGHT_DTYPES]  # type: ignore[valid-type]


SAMPLING = SamplingParams()   # the sampling defaults, declared once (ragblend.core.decode.generate)


class EngineFields(BaseModel):
    """The fields BlendLLM and BlendChatModel share: which engine, which strategy, how to sample."""

    # The engine's own options: their help and defaults are declared once, in ragblend.core.options.
    model_path: Optional[str] = Field(default=field_default("model"), description=field_help("model"))
    dtype: Optional[WeightDtype] = Field(default=field_default("dtype"), description=field_help("dtype"))
    kv_dir: Optional[str] = Field(default=field_default("kv_dir"), description=field_help("kv_dir"))
    kv_dtype: KvDtype = Field(default=field_default("kv_dtype"), description=field_help("kv_dtype"))
    decode_dtype: DecodeDtype = Field(default=field_default("decode_dtype"), description=field_help("decode_dtype"))
    strategy: StrategyName = Field(default="default", description="Fusion strategy; default = the engine's calibrated choice.")
    ratio: Optional[float | str] = Field(default=None, description="Recompute ratio in (0, 1] (CacheBlend also 'auto'); None = the strategy's default.")
    legolink_k: int = Field(default=16, description="LegoLink: tokens recomputed at the start of each chunk.")
    temperature: float = Field(default=SAMPLING.temperature, description="0 = greedy decoding.")
    top_p: float = Field(default=SAMPLING.top_p, description="Nucleus sampling mass (with temperature > 0).")
    seed: Optional[int] = Field(default=SAMPLING.seed, description="Seed for sampling.")
    base_url: Optional[str] = Field(default=None, description="A server to answer instead of a local model: `ragblend serve` or vLLM + LMCache (http://host:port).")
    api_key: Optional[str] = Field(default=None, description="Bearer key for base_url (None = $RAGBLEND_API_KEY, if set).", repr=False)
    backend: Backend = Field(default="ragblend", description="What base_url runs: 'ragblend' (ragblend serve) or 'vllm-lmcache' (vLLM with LMCache blending).")
    keep_first_turns: bool = Field(default=True, description="Keep a chat's first turn as a history piece (a background pass after the answer), so its next turn reuses it; False for single-shot chains.")

    def engine_options(self) -> EngineOptions:
        """The :class:`~ragblend.core.options.EngineOptions` of the local engine these fields ask for."""
        return EngineOptions(model=self.model_path, dtype=self.dtype, kv_dir=self.kv_dir, kv_dtype=self.kv_dtype,
                             decode_dtype=self.decode_dtype)

    def check_strategy(self) -> None:
        """Fail on a bad strategy or ratio at construction, before any model loads."""
        strategy_from_name(self.strategy, self.ratio, self.legolink_k)

    def as_chat(self, layout):
        """``layout`` marked as a chat's (``PromptLayout.chat``), unless ``keep_first_turns`` is off: a
        chat's first turn will likely go on, so its turn is kept as a piece too (core.store.pieces).
        A server's prompt is returned as it is: the server marks its chat requests itself."""
        return layout.as_chat() if self.keep_first_turns else layout

    def generation_options(self, kwargs: dict, max_new_tokens: int) -> dict:
        """Keyword arguments for ``engine.generate/stream``: this call's ``kwargs`` (popped)
        over the fields."""
        name = kwargs.pop("strategy", self.strategy)
        # The field's ratio belongs to the field's strategy: a call naming another strategy and
        # no ratio gets that strategy's own default (full_recompute takes none at all).
        ratio = kwargs.pop("ratio", self.ratio if name == self.strategy else None)
        strategy = strategy_from_name(name, ratio, self.legolink_k)
        return dict(strategy=strategy, max_new_tokens=max_new_tokens,
                    temperature=kwargs.pop("temperature", self.temperature), top_p=kwargs.pop("top_p", self.top_p),
                    seed=kwargs.pop("seed", self.seed), stop=kwargs.pop("stop", None))


# The chat template's role for the role names frameworks and APIs use: OpenAI's "developer" is a
# system turn, LangChain's "human"/"ai" are the user's and the assistant's, Gemini's "model" and
# Cohere's "chatbot" the assistant's; a tool's or (OpenAI's older name) a function's result is a
# tool turn, which the core lays out with the template's tool role or refuses (never as the user's).
TEMPLATE_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user",
                  "assistant": "assistant", "ai": "assistant", "model": "assistant", "chatbot": "assistant",
                  "tool": "tool", "function": "tool"}


def template_role(name: str, unknown: str | None = None) -> str:
    """The chat template's role for the role ``name`` (any case); an unknown name gives
    ``unknown``, or stays itself when that is None."""
    return TEMPLATE_ROLES.get(name.lower(), name if unknown is None else unknown)


def split_conversation(turns: Sequence[tuple[str, str]], framework: str):
    """``(system, history, last user text)`` from ``(role, text)`` turns, role one of "system",
    "user", "assistant", in the order the chat template renders them: the core's one splitter
    (:func:`ragblend.core.chat_template.split_chat`), as the server uses it. An empty first
    system message stays (the system prompt ""), a later one keeps its place in the history.

    The system messages that open the chat are joined into one first: the frameworks send
    several there (LlamaIndex's ContextChatEngine its context, then a memory's summary; a
    LangChain prompt two system templates), and templates such as Gemma 3's and Mistral's
    refuse a second system turn."""
    turns = list(turns)
    lead = next((i for i, (role, _) in enumerate(turns) if role != "system"), len(turns))
    if lead > 1:
        turns = [("system", "\n\n".join(text for _, text in turns[:lead])), *turns[lead:]]
    return split_chat(turns, framework)


def refuse_tool_calls(calls: Iterable[tuple[int, str]], framework: str) -> None:
    """Refuse the first assistant message that calls a tool instead of laying out its text alone:
    the model would read a turn in which it said nothing, or its text without the call the tool's
    result answers (``ragblend serve`` refuses such messages with a 400). ``calls`` gives each such
    message as ``(message index, the tool's name)``."""
    for index, name in calls:
        raise InvalidInputError(f"{framework}: messages[{index}] is an assistant's call of the tool {name!r}, and "
                                "ragblend does not implement tool calling (bind no tools to this model): leave the "
                                f"call out (keep its text as an assistant message) and {RESULT_AS_TEXT}.")


def refuse_tool_results(turns: Sequence[tuple[str, str]], engine, framework: str) -> None:
    """Refuse the first tool result of a chat (a ``(role, text)`` turn of role "tool") where the
    engine's chat template has no tool role, naming it as the other message errors do
    (``BlendChatModel: messages[3] ...``); the engine would refuse it too, without saying which
    message. A tool result that ends the chat is :func:`split_conversation`'s to refuse. A remote
    engine (``base_url``) has no local template: its server lays the turn out or refuses it."""
    prompts = getattr(engine, "prompts", None)
    first = next((i for i, (role, _) in enumerate(turns[:-1]) if role == "tool"), None)
    if first is not None and prompts is not None:
        prompts.check_tool_turns([turns[first]], f"{framework}: messages[{first}]")


def refuse_media(media: Iterable[tuple[int, str]], framework: str) -> None:
    """Refuse the first image, audio, video or file block of a chat instead of dropping it: the
    text-only model would answer as if it had seen it (``ragblend serve`` refuses such blocks with
    a 400). ``media`` gives each such block as ``(message index, what it is)``."""
    for index, kind in media:
        raise InvalidInputError(f"{framework}: messages[{index}] has {kind} content, and the local model reads "
                                "text only; send its text (or a description) as a text block instead.")


def token_usage(stats: Stats) -> dict[str, Any]:
    """OpenAI-style usage of one call; ``cached_prompt_tokens`` as the server counts them
    (:func:`ragblend.serving.protocol.cached_tokens`: prompt tokens whose KV came from the store)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "cached_prompt_tokens": cached_tokens(stats)}


# A strategy object from its name (as used in configuration and the CLI); None for "default",
# the engine's own calibrated choice. The one parser of strategy names, under the name the CLI uses.
make_strategy = strategy_from_name


def lazy_engine(owner) -> BlendEngine | RemoteEngine:
    """``owner``'s engine (an :class:`EngineFields`), made on first use: a :class:`RemoteEngine` for
    its ``base_url``, else the process's local engine for its :meth:`~EngineFields.engine_options`,
    shared with every other owner asking for the same (``owner`` has ``_engine`` and ``_lock``
    private attributes)."""
    with owner._lock:
        if owner._engine is None and owner.base_url:
            # BlendChatModel keeps its key as a pydantic SecretStr, whose str() is "**********".
            key = owner.api_key.get_secret_value() if isinstance(owner.api_key, SecretStr) else owner.api_key
            owner._engine = RemoteEngine(owner.base_url, api_key=key or os.environ.get("RAGBLEND_API_KEY"),
                                         backend=owner.backend)
        elif owner._engine is None:   # one engine per model and options in the process (shared_engines)
            owner._engine = shared_engine(owner.engine_options())
    return owner._engine


async def iterate_in_thread(make_iterator):
    """Consume a blocking iterator in a worker thread, yielding its items to the event loop.

    A consumer that stops early (``break``, cancellation, its event loop closing) stops the
    worker too: the iterator is closed at its next item, so an abandoned answer stops decoding
    instead of running to ``max_tokens`` in the background."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    stop = threading.Event()

    def hand_over(item) -> bool:
        """Give ``item`` to the consumer; False once nobody will take it."""
        if stop.is_set():
            return False
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:   # the consumer's event loop is closed
            return False
        return True

    def pump():
        iterator = None
        try:
            iterator = make_iterator()
            for item in iterator:
                if not hand_over(item):
                    return
        except BaseException as err:  # handed to the consumer below
            hand_over(err)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()   # a generator's own cleanup runs (a stopped stream releases the engine)
        hand_over(done)

    # in the caller's context (its contextvars: e.g. compare.fusion_only's prefix-tier bypass)
    threading.Thread(target=contextvars.copy_context().run, args=(pump,), daemon=True, name="ragblend-stream").start()
    try:
        while True:
            item = await queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
