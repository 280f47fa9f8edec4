"""The server's request bodies as pydantic models, the way FastAPI and vLLM's protocol declare them.

A field's type and bounds are declared once, on its model; :meth:`RequestModel.of` validates a
body and turns the first failure into the OpenAI-shaped 400 the server answers
(:class:`~ragblend.serving.protocol.ApiError`), worded by :data:`MESSAGES` and naming its field.
:meth:`CompletionOptions.to_sampling_params` is the one conversion from a request's sampling
fields to the engine's :class:`~ragblend.core.decode.generate.SamplingParams`.

The messages of a chat request and a completions prompt are parsed by
:mod:`~ragblend.serving.protocol` (``ChatPrompt``, ``check_prompt``): they become prompt
segments, counted against the model's window as they are read. Server only: this module needs
pydantic (FastAPI's own dependency); the clients in :mod:`ragblend.serving.client` do not.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ragblend.core.decode.generate import MIN_SAMPLING_VALUE, SamplingParams
from ragblend.core.engine import BlendEngine

from .protocol import (
    INVALID_TYPE,
    INVALID_VALUE,
    MAX_STOPS,
    MAX_TEXTS,
    MISSING_PARAMETER,
    UNSUPPORTED_PARAMETER,
    ApiError,
    check_unsupported,
    check_window,
    strategy_from_json,
)

MAX_SALT_CHARS = 1024

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonEmptyText = Annotated[str, Field(strict=True, min_length=1)]
Flag = Annotated[bool, Field(strict=True)]
# Sampling computes in float32: a positive value below its smallest normal number is zero or
# subnormal there, and the request's draw would fail (see generate.MIN_SAMPLING_VALUE).
Unit = Annotated[float, Field(strict=True, allow_inf_nan=False)]

# The 400's message for a field (by its place in the body), given the value sent. A failing check
# of a validator below says its own.
MESSAGES = {
    ("stream",): "stream must be true or false.",
    ("stream_options",): "stream_options must be an object such as {{\"include_usage\": true}}.",
    ("stream_options", "include_usage"): "stream_options.include_usage must be true or false.",
    ("user",): "user must be a string.",
    ("cache_salt",): f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters.",
    ("max_tokens",): "max_tokens must be an integer >= 1, got {value!r}.",
    ("max_completion_tokens",): "max_completion_tokens must be an integer >= 1, got {value!r}.",
    ("n",): "n must be 1: this server answers one choice per request (got {value!r}).",
    ("temperature",): "temperature must be a number from 0 to 2, got {value!r}.",
    ("top_p",): "top_p must be a number in (0, 1], got {value!r}.",
    ("seed",): "seed must be an integer in [0, 2**63), got {value!r}.",
    ("stop",): f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings.",
}
# A field whose value of the right type can be an OpenAI feature this server does not implement.
FEATURES = {("n",)}


class RequestModel(BaseModel):
    """A request body's fields this model reads; the others (``model``, ``messages``...) are
    left to the code that reads them (not copied here: a token-id prompt may be long)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    messages_table: ClassVar[dict] = MESSAGES

    @classmethod
    def of(cls, body: dict):
        """``body`` validated, or the OpenAI-shaped 400 of its first bad field."""
        try:
            return cls.model_validate(body)
        except ValidationError as err:
            raise _api_error(err, cls.messages_table) from None


def _api_error(err: ValidationError, messages: dict) -> ApiError:
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = tuple(str(part) for part in first["loc"])
    place = max((key for key in messages if loc[:len(key)] == key), key=len, default=loc[:1])
    param = ".".join(place)
    code = _code_of([e for e in errors if tuple(map(str, e["loc"]))[:len(place)] == place], place)
    if first["type"] == "value_error":   # one of the validators' own checks, worded there
        return ApiError(400, str(first["ctx"]["error"]), param=param, code=code)
    template = messages.get(place, f"{param} is not valid: {first['msg']}.")
    return ApiError(400, template.format(value=first["input"]), param=param, code=code)


def _code_of(errors: list[dict], place: tuple[str, ...]) -> str:
    """The OpenAI error code of one field's failures (a union field fails once per type it takes):
    missing (or null where a value is required), every failure of a type, or of a value."""
    if any(e["type"] == "missing" or e["input"] is None for e in errors):
        return MISSING_PARAMETER
    if all(e["type"].endswith(("_type", "_parsing")) or e["type"] == "int_from_float" for e in errors):
        return INVALID_TYPE
    return UNSUPPORTED_PARAMETER if place in FEATURES else INVALID_VALUE


class CacheSalted(RequestModel):
    """``cache_salt`` (vLLM's field): requests with different salts never share cached KV."""

    cache_salt: Optional[Annotated[str, Field(strict=True, min_length=1, max_length=MAX_SALT_CHARS)]] = None


def cache_salt(body: dict) -> str:
    """The request's ``cache_salt``, checked; "" when absent."""
    return CacheSalted.of(body).cache_salt or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    include_usage: Optional[Flag] = None


class CompletionOptions(CacheSalted):
    """The fields every completion request (chat or not) may carry besides its prompt: the
    cache salt, streaming, the caller, how to sample (as vLLM's ``CompletionRequest``), and
    ragblend's own ``ragblend`` field (the fusion strategy)."""

    stream: Optional[Flag] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Annotated[str, Field(strict=True)]] = None
    max_completion_tokens: Optional[PositiveInt] = None   # OpenAI's newer name (chat deprecates max_tokens)
    max_tokens: Optional[PositiveInt] = None   # the legacy /v1/completions' name; either, or both alike
    n: Optional[Annotated[int, Field(strict=True, ge=1, le=1)]] = None
    temperature: Optional[Annotated[Unit, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[Unit, Field(gt=0, le=1)]] = None
    seed: Optional[Annotated[int, Field(strict=True, ge=0, lt=2**63)]] = None
    stop: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)], None] = None
    ragblend: Any = None

    @classmethod
    def of(cls, body: dict) -> "CompletionOptions":
        check_unsupported(body)   # a feature not implemented: its own 400, before any other field
        options = super().of(body)
        both = (options.max_tokens, options.max_completion_tokens)
        if None not in both and both[0] != both[1]:   # never one of them silently dropped
            raise ApiError(400, f"max_tokens ({both[0]}) and max_completion_tokens ({both[1]}) differ; send one of "
                                "them (max_completion_tokens: OpenAI's chat API deprecates max_tokens for it) or "
                                "the same value in both.", param="max_tokens", code=INVALID_VALUE)
        return options

    @field_validator("temperature", "top_p")
    @classmethod
    def _not_zero_in_float32(cls, value, info):
        if value is not None and 0 < value < MIN_SAMPLING_VALUE:
            greedy = "0 for greedy decoding or " if info.field_name == "temperature" else ""
            raise ValueError(f"{info.field_name} {value!r} rounds to zero or to a subnormal number in float32, where "
                             f"sampling computes; use {greedy}at least {MIN_SAMPLING_VALUE:.3g}.")
        return value

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_limit(self, limit: int) -> None:
        """A 400 naming ``limit`` (the server's most tokens an answer) if the request asks for more,
        as OpenAI answers a max_tokens above its model's limit."""
        requested = self.requested_tokens
        if requested is not None and requested > limit:
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise ApiError(400, f"{name} is too large: {requested}. This server generates at most {limit} "
                                f"tokens an answer (ragblend serve --max-completion-tokens); ask for at most {limit}.",
                           param=name, code=INVALID_VALUE)

    def to_sampling_params(self, room: int) -> SamplingParams:
        """The engine's sampling settings; ``max_tokens`` capped by ``room``, what the model's
        window has left after the prompt (and the server's limit)."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_new_tokens=min(self.requested_tokens or room, room),
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, stop=stops)

    def strategy(self):
        """The strategy the ``ragblend`` field asks for (None: the engine's own)."""
        options = self.ragblend or {}
        if not isinstance(options, dict):
            raise ApiError(400, "ragblend must be an object such as {\"strategy\": \"cacheblend\", \"ratio\": 0.3}.",
                           param="ragblend", code=INVALID_TYPE)
        return strategy_from_json(options)


def check_options(body: dict, limit: int | None = None) -> None:
    """Type checks of the fields every completion request may carry (each error names its field);
    with ``limit`` (the server's most answer tokens), a request asking for more is a 400 too."""
    options = CompletionOptions.of(body)
    if limit is not None:
        options.check_limit(limit)


def sampling_fields(body: dict) -> dict:
    """The sampling fields of ``body``, checked: ``requested`` (max tokens, or None),
    ``temperature``, ``top_p``, ``seed`` and ``stop`` as SamplingParams takes them."""
    options = CompletionOptions.of(body)
    params = options.to_sampling_params(room=2**62)
    return {"requested": options.requested_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "seed": params.seed, "stop": params.stop}


def sampling(body: dict, engine: BlendEngine, prompt_tokens: int, limit: int | None = None) -> SamplingParams:
    """Sampling from the OpenAI fields; ``max_tokens`` is capped by what the window has left
    and by ``limit``, the server's most answer tokens (a request asking for more was refused
    by :func:`check_options`; one that names none gets at most that many)."""
    check_window(engine, prompt_tokens)
    room = engine.context_window - prompt_tokens
    return CompletionOptions.of(body).to_sampling_params(room if limit is None else min(room, limit))


def requested_strategy(body: dict):
    """The strategy a request asks for in its ``ragblend`` field (None: the engine's own)."""
    return CompletionOptions.of(body).strategy()


class ChunksRequest(CacheSalted):
    """``POST /v1/chunks``: texts whose KV the server stores (LMCache's warm-up, by text)."""

    messages_table: ClassVar[dict] = {**MESSAGES, ("texts",): "texts must be a non-empty list of non-empty strings.",
                                      ("skip_unusable",): "skip_unusable must be true or false."}

    texts: Annotated[list[NonEmptyText], Field(min_length=1)]
    skip_unusable: Flag = False

    @field_validator("texts", mode="before")
    @classmethod
    def _at_most_max_texts(cls, texts):
        if isinstance(texts, list) and len(texts) > MAX_TEXTS:
            raise ValueError(f"texts has {len(texts)} texts; send at most {MAX_TEXTS} per request.")
        return texts


class TokenizeRequest(CacheSalted):
    """``POST /tokenize`` (vLLM's): the options this server reads besides ``messages`` or ``prompt``."""

    messages_table: ClassVar[dict] = {**MESSAGES, **{(name,): f"{name} must be true or false."
                                                     for name in ("add_generation_prompt", "add_special_tokens")}}
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("tools", "chat_template", "continue_final_message")

    add_generation_prompt: Optional[Flag] = None
    add_special_tokens: Optional[Flag] = None

    @classmethod
    def of(cls, body: dict) -> "TokenizeRequest":
        for name in cls.UNSUPPORTED:
            if body.get(name) not in (None, False, []):
                raise ApiError(400, f"{name} is not supported by this server's /tokenize; leave it out.",
                               param=name, code=UNSUPPORTED_PARAMETER)
        return super().of(body)
