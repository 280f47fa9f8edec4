"""The wire protocol of ``ragblend serve``, written once for the server and its clients.

What a request means (messages and content blocks to prompt segments, LMCache's token-id
blending convention, the sampling fields), what an answer reports (usage), and the errors a
request gets (:class:`ApiError`, in the OpenAI error shape). The server
(:mod:`ragblend.serving.app`), :class:`~ragblend.serving.client.RemoteEngine` and the
LangChain chat model read and write requests through this module. No web framework here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ragblend.core.chat_template import split_chat
from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError, PromptTooLongError, RagblendError
from ragblend.core.fusion.strategies import STRATEGIES, STRATEGY_NAMES, strategy_from_name
from ragblend.core.prompt import Chunk, ChunkSpan, PromptLayout, TooLong, check_text

# LMCache's blending convention: a token-id prompt's segments (template start, chunks, question)
# are separated by the token ids of this string.
BLEND_SPECIAL_STR = " # # "
# What marks a content block as a chunk whose KV is reused (Anthropic's prompt-caching mark).
CACHE_CONTROL = {"type": "ephemeral"}
# Where frameworks join the texts they retrieve (LangChain's stuff chain and LlamaIndex's
# synthesizers put "\n\n" between documents): unmarked text is split into passages here. A
# blank line with Windows line endings ("\r\n\r\n", as read from a CRLF file) is a break too:
# else a CRLF prompt is one passage, and its documents are never stored on their own.
PASSAGE_BREAK = re.compile(r"\r?\n\r?\n")

# Counts checked before anything is tokenized. Every message and every non-empty block costs
# at least one token, so more than these never fit a small model's window anyway; the caps keep
# the per-item work of a request (validation, one chunk per marked block) bounded.
MAX_MESSAGES = 1024
MAX_PARTS = 1024       # content blocks over all messages of a request
MAX_TEXTS = 1024       # texts of one /v1/chunks request
MAX_STOPS = 16
# JSON values (outside strings) a body may hold beyond a token-id prompt's (one per token):
# ample for the caps above. Parsing (and freeing) millions of values holds the GIL for
# 0.1-0.5 s at a time, which would stall the event loop; counting them first costs ~ms.
MAX_JSON_VALUES = 16384


# Fields of the OpenAI API for features this server does not implement, with the values that
# mean "not used" (clients often send those); any other value is a 400, never silently dropped.
UNSUPPORTED = {
    "tools": ((None, []), "tool calling"),
    "tool_choice": ((None, "none"), "tool calling"),
    "parallel_tool_calls": ((None,), "tool calling"),
    "functions": ((None, []), "function calling"),
    "function_call": ((None, "none"), "function calling"),
    "response_format": ((None, {"type": "text"}), "structured output (only {\"type\": \"text\"})"),
    "logprobs": ((None, False), "log probabilities"),
    "top_logprobs": ((None, 0), "log probabilities"),
    "logit_bias": ((None, {}), "logit bias"),
    "presence_penalty": ((None, 0, 0.0), "presence and frequency penalties"),
    "frequency_penalty": ((None, 0, 0.0), "presence and frequency penalties"),
    "best_of": ((None, 1), "best_of (one choice per request)"),
    "echo": ((None, False), "echoing the prompt"),
    "suffix": ((None, ""), "a suffix (insertion)"),
    "audio": ((None,), "audio"),
    "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"),
}


# The ``code`` of every 400 this server answers, as the OpenAI API names them (a client tells
# failures apart by code, never by message; ``param`` names the field at fault where there is one).
INVALID_TYPE = "invalid_type"                    # a field of the wrong JSON type
INVALID_VALUE = "invalid_value"                  # the right type, but a value outside what the field takes
MISSING_PARAMETER = "missing_required_parameter"  # a required field left out (or null)
UNKNOWN_PARAMETER = "unknown_parameter"          # a field no request takes (a setting a strategy lacks)
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # an OpenAI feature this server does not implement (n > 1, images)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"   # a prompt that cannot fit the model's window
INVALID_JSON = "invalid_json"                    # a body that is not JSON (or nests it too deeply)
REQUEST_TOO_LARGE = "request_too_large"          # a body over the size limit (413), or with too many JSON values
ERROR_CODES = (INVALID_TYPE, INVALID_VALUE, MISSING_PARAMETER, UNKNOWN_PARAMETER, UNSUPPORTED_PARAMETER,
               CONTEXT_LENGTH_EXCEEDED, INVALID_JSON, REQUEST_TOO_LARGE)
# The codes of the other client errors that no route answers: a path the server lacks, a method its route lacks.
NOT_FOUND = "not_found"                          # 404
METHOD_NOT_ALLOWED = "method_not_allowed"        # 405


class ApiError(RagblendError):
    """An error answered to the client with ``status`` in the OpenAI error shape. A 400 always
    carries a ``code`` (:data:`ERROR_CODES`): one that names none is :data:`INVALID_VALUE`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        if code is None and status == 400:
            code = INVALID_VALUE
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


CLIENT_CLOSED = 499   # nginx's status for a client that disconnected before its answer


class ClientGone(ApiError):
    """The client disconnected before its answer was ready (:data:`CLIENT_CLOSED`; nobody reads it)."""

    def __init__(self):
        super().__init__(CLIENT_CLOSED, "The client closed the connection.", kind="client_closed_request")


# ---------------------------------------------------------------------------- request bodies


def json_values(body: bytes, step: int = 1 << 16) -> int:
    """About how many JSON values ``body`` holds (its commas, brackets and braces outside
    strings, an upper bound for valid JSON), counted slice by slice so that other threads run
    in between."""
    body = body.replace(b"\\\\", b"").replace(b'\\"', b"")   # escaped backslashes, then escaped quotes
    count, in_string = 0, False
    for start in range(0, len(body), step):
        parts = body[start:start + step].split(b'"')
        count += sum(p.count(b",") + p.count(b"[") + p.count(b"{") for p in parts[1 if in_string else 0::2])
        in_string ^= len(parts) % 2 == 0   # an odd number of quotes in this slice
    return count


def parse_json(body: bytes, max_values: int):
    """The JSON value of a request body, refused before parsing if it holds more values than
    any valid request (run in a thread: the count lets the event loop run)."""
    values = json_values(body)
    if values > max_values:
        raise ApiError(400, f"The request body holds about {values} JSON values; a request here needs at most "
                            f"{max_values}.", code=REQUEST_TOO_LARGE)
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, "The request body nests JSON too deeply.", code=INVALID_JSON) from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON.", code=INVALID_JSON) from None


def check_unsupported(body: dict) -> None:
    """A 400 for each OpenAI field asking for a feature this server does not implement."""
    for name, (unused, feature) in UNSUPPORTED.items():
        value = body.get(name)
        # compared with the type too, so that True is not taken for 1, nor 0 for False
        if not any(value == u and type(value) is type(u) for u in unused):
            raise ApiError(400, f"{name} is not supported: this server does not implement {feature}. "
                                "Leave the field out.", param=name, code=UNSUPPORTED_PARAMETER)


def check_window(engine: BlendEngine, prompt_tokens: int) -> None:
    if prompt_tokens >= engine.context_window:
        raise PromptTooLongError(f"The prompt has {prompt_tokens} tokens and fills the model's context window "
                                 f"({engine.context_window}); shorten it.")


# ---------------------------------------------------------------------------- strategies


def _settings(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def strategy_to_json(strategy) -> dict:
    """A strategy as the ``ragblend`` field of a request: its name and every setting (None:
    ``{"strategy": "default"}``, the server engine's own choice)."""
    if strategy is None:
        return {"strategy": "default"}
    if not isinstance(strategy, STRATEGIES):
        raise InvalidInputError(f"{type(strategy).__name__} cannot be sent to a server; use one of "
                                f"{', '.join(cls.__name__ for cls in STRATEGIES)}.")
    out = {"strategy": strategy.name}
    for name in _settings(type(strategy)):
        value = getattr(strategy, name)
        out[name] = [list(step) for step in value] if isinstance(value, tuple) else value
    return out


def strategy_from_json(options: dict):
    """The strategy of a request's ``ragblend`` field: ``strategy`` (a name) and any of that
    strategy's settings (``ratio``, ``check_layer``, ``gradual``, ``deviation``, ``k`` or
    ``legolink_k``, ``whole_chunks``, ``query_tokens``, ``cached_attention_scale``, ``neighbour_window``,
    ``scale_in_decoding``). A setting the strategy does not have is a 400, never ignored."""
    name = options.get("strategy") or "default"
    if not isinstance(name, str):
        raise ApiError(400, "ragblend.strategy must be a strategy name.", param="ragblend.strategy",
                       code=INVALID_TYPE)
    settings = {k: v for k, v in options.items() if k != "strategy"}
    if "legolink_k" in settings:   # the integrations' and the CLI's name for LegoLink's k
        settings["k"] = settings.pop("legolink_k")
    if set(settings) <= {"ratio"}:   # the common case, with strategy_from_name's defaults and checks
        try:
            return strategy_from_name(name, settings.get("ratio"))
        except InvalidInputError as err:   # an unknown name, or a ratio the strategy does not take
            known = name == "default" or any(c.name == name for c in STRATEGIES)
            raise ApiError(400, str(err), param="ragblend.ratio" if known else "ragblend.strategy",
                           code=INVALID_VALUE) from None
    cls = next((c for c in STRATEGIES if c.name == name), None)
    if cls is None:
        raise ApiError(400, f"ragblend.strategy {name!r} takes no settings but a ratio; choose one of "
                            f"{', '.join(STRATEGY_NAMES)}.", param="ragblend.strategy", code=INVALID_VALUE)
    unknown = sorted(set(settings) - set(_settings(cls)))
    if unknown:
        raise ApiError(400, f"ragblend.{unknown[0]} is not a setting of strategy {name!r}; its settings are "
                            f"{', '.join(_settings(cls)) or 'none'}.", param=f"ragblend.{unknown[0]}",
                       code=UNKNOWN_PARAMETER)
    if "gradual" in settings:
        gradual = settings["gradual"]
        if not isinstance(gradual, list) or not all(isinstance(g, list) and len(g) == 2 for g in gradual):
            raise ApiError(400, "ragblend.gradual must be a list of [layer, ratio] pairs.", param="ragblend.gradual",
                           code=INVALID_TYPE)
        settings["gradual"] = tuple(tuple(step) for step in gradual)
    try:
        return cls(**settings)
    except (TypeError, ValueError) as err:   # InvalidInputError (the strategy's own checks) included
        raise ApiError(400, f"ragblend: {err}", param="ragblend", code=INVALID_VALUE) from None


class TextLimit:
    """The most characters a prompt can have and still fit the window: no token covers more
    characters than the vocabulary's longest entry (twice that, for tokenizers that normalize;
    ``PromptBuilder.max_chars_per_token``). Checked on the event loop, before the worker
    tokenizes anything; the worker then tokenizes a long text in bounded prefixes
    (``PromptBuilder.tokenize_bounded``), so a prompt under this limit that still overflows the
    window is refused after a few tens of milliseconds of tokenizing, not seconds."""

    def __init__(self, engine: BlendEngine):
        self.window, self.max_chars = engine.context_window, engine.context_window * engine.prompts.max_chars_per_token

    def check(self, chars: int, what: str, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"{what}: {chars} characters, more than fit the model's context window "
                                f"({self.window} tokens, at most {self.max_chars} characters); shorten it.",
                           param=param, code=CONTEXT_LENGTH_EXCEEDED)


# ---------------------------------------------------------------------------- requests → prompts


def is_marked(block) -> bool:
    """Whether a content block is marked as a chunk: ``cache_control`` at its top level, or
    under ``extras`` (where LangChain keeps fields it does not know)."""
    return isinstance(block, dict) and bool(block.get("cache_control")
                                            or (block.get("extras") or {}).get("cache_control"))


def blocks_of(segments: Sequence) -> list[dict]:
    """Chat content blocks of prompt segments: each :class:`Chunk` a block marked with
    ``cache_control``, each string a plain text block (joined as they are by the server)."""
    return [{"type": "text", "text": s.text, "cache_control": dict(CACHE_CONTROL)} if isinstance(s, Chunk)
            else {"type": "text", "text": s} for s in segments]


def text_of(content) -> str:
    """The plain text of a message's content: a string, or its text blocks joined as they are."""
    if isinstance(content, str):
        return content
    return "".join(b if isinstance(b, str) else b.get("text", "") for b in content
                   if isinstance(b, str) or (isinstance(b, dict) and b.get("type") == "text"))


def segments_of(content) -> list:
    """Prompt segments of a content list, leniently (a client's own messages): marked text
    blocks are Chunks, other text blocks and strings plain text, other blocks dropped."""
    return [Chunk(b["text"]) if is_marked(b) and b.get("text") else text_of([b]) for b in content
            if isinstance(b, str) or (isinstance(b, dict) and b.get("type") == "text")]


def _text_of(content, where: str) -> tuple[str | None, list]:
    """``(plain text, [])`` for a string content, or ``(None, segments)`` for content blocks
    (blocks marked with cache_control become Chunks), strictly: a request's."""
    if isinstance(content, str):
        return valid_text(content, f"{where}.content"), []
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where}.content must be a string or a non-empty list of text blocks.",
                       param=f"{where}.content",
                       code=_missing_or(content, INVALID_VALUE if content == [] else INVALID_TYPE))
    segments: list = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            # a block of another type (an image) is OpenAI's but not served here; anything else is malformed
            other = isinstance(block, dict) and isinstance(kind, str) and kind != "text"
            raise ApiError(400, f"{where}.content[{i}] is a {kind!r} block; this server reads text blocks only "
                                "({\"type\": \"text\", \"text\": \"...\"}).", param=f"{where}.content[{i}]",
                           code=UNSUPPORTED_PARAMETER if other else INVALID_TYPE)
        mark = block.get("cache_control")
        if mark is not None and not (isinstance(mark, dict) and mark.get("type") == CACHE_CONTROL["type"]):
            raise ApiError(400, f"{where}.content[{i}].cache_control must be {{\"type\": \"ephemeral\"}}.",
                           param=f"{where}.content[{i}].cache_control", code=INVALID_VALUE)
        text = valid_text(block["text"], f"{where}.content[{i}].text")
        segments.append(Chunk(text) if mark is not None and text else text)
    return None, [s for s in segments if s != ""]


def valid_text(text: str, where: str) -> str:
    """``text`` if UTF-8 can encode it; else a 400 naming the field the client sent it in."""
    try:
        return check_text(text, where)
    except InvalidInputError as err:
        raise ApiError(400, str(err), param=where, code=INVALID_VALUE) from None


def _missing_or(value, code: str) -> str:
    """:data:`MISSING_PARAMETER` for a required field left out (or sent as null), else ``code``."""
    return MISSING_PARAMETER if value is None else code


def _joined(text: str | None, segments: list) -> str:
    return text if text is not None else "".join(s.text if isinstance(s, Chunk) else s for s in segments)


def passages(texts: Iterable[str], question: Iterable[str] = ()) -> list[str]:
    """The passages of unmarked texts, split where frameworks join documents (paragraph
    breaks), each once, in order. Their KV is stored after an answer so that the next prompt
    holding them reuses it, with no setup by the client.

    ``question``: the texts of the prompt's last user turn, whose passages count too except its
    last one, where RAG templates put the question. A question is seldom asked twice, and one
    whose KV came from the store would leave QueryAware's question pass with nothing to ask. A
    bare answer cue after it (``"Answer:"``) does not count as that last passage."""
    seen: dict[str, None] = {}
    for text in texts:
        for piece in _pieces(text):
            seen.setdefault(piece)
    asked = [piece for text in question for piece in _pieces(text)]
    if asked and len(asked[-1].split()) <= 2 and asked[-1].endswith(":"):
        asked.pop()   # a bare answer cue ("Answer:") after the question: the question is the one before
    for piece in asked[:-1]:
        seen.setdefault(piece)
    return list(seen)


def _pieces(text: str) -> list[str]:
    return [piece for piece in map(str.strip, PASSAGE_BREAK.split(text)) if piece]


def _checked_role(message, i: int) -> str:
    """The role of ``messages[i]``, a message this server answers (no tool calls)."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with a role and a content.", param=f"messages[{i}]",
                       code=INVALID_TYPE)
    role = message.get("role")
    if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
        raise ApiError(400, f"messages[{i}] is a tool call or result; this server does not implement "
                            "tool calling.", param=f"messages[{i}]", code=UNSUPPORTED_PARAMETER)
    if role not in ("system", "developer", "user", "assistant"):
        raise ApiError(400, f"messages[{i}].role must be system, developer, user or assistant, "
                            f"got {role!r}.", param=f"messages[{i}].role", code=_missing_or(role, INVALID_VALUE))
    return role


@dataclass
class ChatPrompt:
    """A chat request's messages, checked: a first system or developer message is the system
    prompt (an empty one too: the template's default prompt is not put in its place), the other
    messages before the last, in their order, the history, the last user message the segments."""

    system: str | None
    history: list[tuple[str, str]]
    text: str | None
    segments: list
    unmarked: list[str] = dataclasses.field(default_factory=list)   # texts and unmarked blocks, for passages()
    question: list[str] = dataclasses.field(default_factory=list)   # the last user turn's, likewise
    turns: list[str] = dataclasses.field(default_factory=list)      # the earlier turns' (history) texts

    @classmethod
    def parse(cls, messages, limit: TextLimit) -> "ChatPrompt":
        """Structure, counts and characters only: nothing here tokenizes."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list.", param="messages",
                           code=_missing_or(messages, INVALID_VALUE if messages == [] else INVALID_TYPE))
        if len(messages) > MAX_MESSAGES:
            raise ApiError(400, f"messages has {len(messages)} messages; at most {MAX_MESSAGES} are accepted.",
                           param="messages", code=INVALID_VALUE)
        parts, chars, said = 0, 0, []
        for i, message in enumerate(messages):
            role = _checked_role(message, i)
            content = message.get("content")
            if isinstance(content, list):
                parts += len(content)
                if parts > MAX_PARTS:
                    raise ApiError(400, f"The messages hold more than {MAX_PARTS} content blocks; merge them.",
                                   param=f"messages[{i}].content", code=INVALID_VALUE)
            text, segments = _text_of(content, f"messages[{i}]")
            chars += len(_joined(text, segments))
            limit.check(chars, "The messages", "messages")
            plain = [text] if text is not None else [s for s in segments if isinstance(s, str)]
            said.append(("system" if role == "developer" else role, (text, segments, plain)))  # developer: OpenAI's system
        try:   # the library's splitter: messages in their order, as apply_chat_template renders them
            system, history, last = split_chat(said, "The request")
        except InvalidInputError:   # the one thing split_chat refuses
            raise ApiError(400, "The last message must be the user's: end `messages` with a "
                                "{\"role\": \"user\", \"content\": ...} message (this server answers a user "
                                "turn; it does not continue an assistant's or answer a system message alone).",
                           param="messages", code=INVALID_VALUE) from None
        unmarked = [t for _, (_, _, plain) in said[:-1] for t in plain]
        turns = [t for _, (_, _, plain) in history for t in plain]
        history = [(role, _joined(text, segments)) for role, (text, segments, _) in history]
        system = None if system is None else _joined(*system[:2])   # "" stays: no template default
        return cls(system, history, last[0], last[1], unmarked, last[2], turns)

    def passages(self, history: bool = True) -> list[str]:
        """The passages of the messages' unmarked text but the question's (see :func:`passages`);
        marked chunks are stored by the fusion. ``history=False``: none of the earlier turns' either
        (the engine keeps a conversation's turns as history pieces: storing them twice costs twice)."""
        turns = set() if history else set(self.turns)
        texts = [t for t in self.unmarked if t not in turns]
        return passages(texts, self.question)

    def layout(self, engine: BlendEngine, *, find_chunks: bool = True, namespace: str = "") -> PromptLayout:
        """Tokenize (worker thread). With ``find_chunks``, a prompt over the window is refused
        before stored chunks are looked for in it: the shared ones and ``namespace``'s (the
        request's tenant's), where marked chunks are also stored."""
        if any(isinstance(s, Chunk) for s in self.segments):
            return engine.build_prompt(self.segments, system=self.system, history=self.history, separator="",
                                       namespace=namespace)
        layout = engine.build_prompt([_joined(self.text, self.segments)], system=self.system, history=self.history,
                                     namespace=namespace)   # the builder's remembered layouts are per tenant too
        if not find_chunks:
            return layout
        check_window(engine, len(layout.token_ids))
        return engine.find_chunks_in_ids(layout.token_ids, namespace=namespace, conversation=layout.conversation)


def check_prompt(prompt, limit: TextLimit, vocab: int, window: int):
    """A completions prompt, checked without tokenizing: a text, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        limit.check(len(prompt), "prompt", "prompt")
        valid_text(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "prompt is empty.", param="prompt", code=INVALID_VALUE)
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request).",
                       param="prompt", code=_missing_or(prompt, INVALID_VALUE if prompt == [] else INVALID_TYPE))
    if len(prompt) >= window:
        raise ApiError(400, f"The prompt has {len(prompt)} tokens and fills the model's context window ({window}); "
                            "shorten it.", param="prompt", code=CONTEXT_LENGTH_EXCEEDED)
    if not all(type(t) is int for t in prompt):
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request).",
                       param="prompt", code=INVALID_TYPE)
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt", code=INVALID_VALUE)
    return prompt


def completion_layout(engine: BlendEngine, prompt, separator_ids: list[int], namespace: str = "") -> PromptLayout:
    """The prompt of a completions request (checked by :func:`check_prompt`): raw text (stored
    chunks found inside it, no chat template), or token ids in LMCache's blending convention.

    A token-id chunk is a chunk (read from ``namespace``, the sender's, or the shared one, and
    written back to ``namespace``) only where it is the engine's own tokenization of some text
    (:meth:`~ragblend.BlendEngine.is_own_tokenization`); any other is computed as part of the
    prompt. A chunk sent alone (LMCache's warm-up, stored by the server before) is answered as a
    plain prompt: its first tokens are the prompt's attention sink, which no stored KV stands in for."""
    if isinstance(prompt, str):
        ids = engine.prompts.tokenize_bounded(prompt, engine.context_window - 1)
        if isinstance(ids, TooLong):   # found by tokenizing no more than a bounded start of it, where it is long
            raise PromptTooLongError(f"The prompt has {ids} and fills the model's context window "
                                     f"({engine.context_window}); shorten it.")
        return engine.find_chunks_in_ids(ids, namespace=namespace)
    segments = split_lmcache(prompt, separator_ids)
    if len(segments) == 1:   # a chunk on its own: LMCache's way of warming its KV (is_lmcache_warmup)
        return PromptLayout(list(prompt), [])
    if any(not s for s in segments):
        raise ApiError(400, "The token-id prompt has an empty segment: two separators in a row, or one at "
                            "the start or end.", param="prompt", code=INVALID_VALUE)
    ids, spans = list(segments[0]), []
    for segment in segments[1:-1]:
        ids += separator_ids
        if engine.is_own_tokenization(segment):
            spans.append(ChunkSpan(len(ids), len(ids) + len(segment), tuple(segment), namespace=namespace))
        ids += segment
    ids += separator_ids + segments[-1]
    return PromptLayout(ids, spans)


def is_lmcache_warmup(prompt, separator_ids: list[int]) -> bool:
    """Whether a completions prompt (checked) is a chunk on its own: LMCache's way of warming its KV."""
    return isinstance(prompt, list) and len(split_lmcache(prompt, separator_ids)) == 1


def split_lmcache(ids: list[int], separator: list[int]) -> list[list[int]]:
    """The segments of a token-id prompt in LMCache's convention (see :func:`lmcache_ids`)."""
    parts, start, i, n = [], 0, 0, len(separator)
    while n and i <= len(ids) - n:
        if ids[i:i + n] == separator:
            parts.append(ids[start:i])
            i = start = i + n
        else:
            i += 1
    return parts + [ids[start:]]


def lmcache_ids(head: Sequence[int], segments: Sequence[Sequence[int]], separator: Sequence[int]) -> list[int]:
    """A token-id prompt in LMCache's blending convention: ``head`` (the template's start), then
    every segment (chunks, and the text between them; the last one is the question and the
    template's end), each after ``separator`` (the ids of :data:`BLEND_SPECIAL_STR`)."""
    ids = list(head)
    for segment in segments:
        ids += list(separator) + list(segment)
    return ids


def cached_tokens(stats: Stats) -> int:
    """The prompt tokens an answer reports as cached, everywhere (the server's
    ``usage.prompt_tokens_details.cached_tokens``, BlendChatModel's ``cache_read``, BlendLLM's
    ``cached_prompt_tokens``): every prompt token whose KV came from the store, as a prefix
    cache counts its hits. The fusion then recomputes a share of them; ``Stats.reused_tokens``
    are the ones it kept."""
    return stats.cache_hit_tokens


def usage(stats: Stats) -> dict:
    """The OpenAI ``usage`` object of an answer."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(stats)}}


def read_stats(stats: Stats, event: dict) -> None:
    """Fill ``stats`` from an answer or a stream event: the ``ragblend`` field when the server
    sends one (its full stats), else the OpenAI usage (another server, such as vLLM's)."""
    extension = event.get("ragblend")
    if isinstance(extension, dict):
        known = {f.name for f in dataclasses.fields(stats)}
        for name, value in extension.items():
            if name in known:
                setattr(stats, name, value)
    answer_usage = event.get("usage")
    if isinstance(answer_usage, dict):
        stats.prompt_tokens = answer_usage.get("prompt_tokens", stats.prompt_tokens)
        stats.generated_tokens = answer_usage.get("completion_tokens", stats.generated_tokens)
        cached = (answer_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            stats.cache_hit_tokens = cached
