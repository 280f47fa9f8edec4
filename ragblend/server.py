"""``ragblend serve``: an OpenAI-compatible HTTP server over one :class:`~ragblend.BlendEngine`.

Endpoints (the OpenAI API's shapes, plus ragblend's own):

* ``GET /health`` (no key needed), ``GET /v1/models``, ``GET /metrics`` (Prometheus text);
* ``POST /v1/chat/completions`` and ``POST /v1/completions``, with or without SSE streaming;
* ``POST /v1/chunks`` — precompute texts' KV (``{"texts": [...]}``), returns keys and token counts;
* ``POST /tokenize`` — token ids of a text or of chat messages, as vLLM's server answers it.

Where chunks are: chat content blocks carrying ``"cache_control": {"type": "ephemeral"}`` are
chunks; otherwise stored chunks are found in the plain text, as the engine does locally. A
completions prompt of token ids follows LMCache's blending convention: segments separated by
the ids of ``" # # "``; the first is the template's start, the last the question, every one in
between a chunk. Usage reports the prompt tokens served from the KV store in
``usage.prompt_tokens_details.cached_tokens``;
every answer's ``ragblend`` field carries the engine's full stats (``reused_tokens``: the
cached tokens the fusion kept, ``recomputed_tokens``: those it computed again). A request may pick the
fusion with ``"ragblend": {"strategy": "cacheblend", "ratio": 0.3}``.

One engine serves every request, one at a time, from a bounded queue: a full queue answers
429 with ``Retry-After``. The event loop only reads, size-checks and type-checks requests;
everything that costs CPU (tokenizing, finding chunks, the model) runs in the worker thread,
so ``/health`` answers at once whatever a request holds. A request that waits and runs longer
than ``request_timeout_s`` fails with 504, and a client that disconnects is let go: either way
its work stops within one layer or one decoding step. Errors have the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``, name the field at fault and never carry a
traceback; a field for a feature this server lacks (tools, structured output, logprobs...) is
a 400, never ignored.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError, PromptTooLongError, RagblendError
from ragblend.core.fusion import cancellable, strategy_from_name
from ragblend.core.generate import SamplingParams
from ragblend.core.net import is_loopback
from ragblend.core.prompt import Chunk, ChunkSpan, PromptLayout, check_text

log = logging.getLogger("ragblend.server")

BLEND_SPECIAL_STR = " # # "
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

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

# The paths /metrics counts by name; any other path is counted as "other", so that a client
# cannot add series (or forge labels) by requesting made-up paths.
ROUTES = frozenset({"/health", "/v1/models", "/metrics", "/v1/chat/completions", "/v1/completions",
                    "/v1/chunks", "/tokenize"})

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


class ApiError(RagblendError):
    """An error answered to the client with ``status`` in the OpenAI error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ClientGone(ApiError):
    """The client disconnected before its answer was ready (nginx's 499; nobody reads it)."""

    def __init__(self):
        super().__init__(499, "The client closed the connection.", kind="client_closed_request")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------- the work queue


@dataclass
class Job:
    """One request's work, run by the worker thread; ``emit`` receives its events. Setting
    ``cancelled`` stops it: skipped if still queued, else at the model's next layer or step."""

    run: Callable[["Job"], Any]
    emit: Callable[[Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs jobs one at a time from a bounded queue (the engine computes one prompt at a time)."""

    def __init__(self, queue_size: int):
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.running = 0
        threading.Thread(target=self._loop, name="ragblend-serve-worker", daemon=True).start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(429, "The server is busy (request queue full); retry shortly.",
                           kind="rate_limit_error", code="queue_full") from None

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + self.running

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue
            self.running = 1
            try:
                # Every model pass in this block checks the flag per layer / decoding step and
                # raises fusion.Cancelled once the request has timed out or its client left.
                with cancellable(job.cancelled.is_set):
                    outcome = ("done", job.run(job))
            except BaseException as err:   # handed to the request's handler
                outcome = ("error", err)
            finally:
                self.running = 0
            try:
                job.emit(outcome)
            except RuntimeError:   # the request's event loop is gone; nobody is waiting
                pass


# ---------------------------------------------------------------------------- metrics


def route_label(path: str) -> str:
    """The ``path`` label of a request: its route, or "other" (a fixed set of values)."""
    return path if path in ROUTES else "other"


def _label(value) -> str:
    """A Prometheus label value, escaped as the text format requires."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """Counters and a TTFT histogram, written as Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.reused_tokens = self.recomputed_tokens = self.prompt_tokens = self.generated_tokens = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0

    def request(self, path: str, status: int) -> None:
        key = (route_label(path), int(status))
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1

    def answer(self, stats: Stats) -> None:
        with self.lock:
            self.reused_tokens += stats.reused_tokens
            self.recomputed_tokens += stats.recomputed_tokens
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.generated_tokens
            self.ttft_sum += stats.ttft_s
            bucket = next((i for i, edge in enumerate(TTFT_BUCKETS) if stats.ttft_s <= edge), len(TTFT_BUCKETS))
            self.ttft_counts[bucket] += 1

    def text(self, queue_depth: int, store) -> str:
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        with self.lock:
            metric("ragblend_requests_total", "counter", "HTTP requests by route and status.",
                   [(f'{{path="{_label(p)}",status="{_label(s)}"}}', n) for (p, s), n in sorted(self.requests.items())])
            metric("ragblend_errors_total", "counter", "HTTP requests answered with an error status.",
                   [("", sum(n for (_, s), n in self.requests.items() if s >= 400))])
            metric("ragblend_queue_depth", "gauge", "Requests waiting or running.", [("", queue_depth)])
            cumulative, samples = 0, []
            for edge, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
                cumulative += count
                samples.append((f'_bucket{{le="{edge}"}}', cumulative))
            samples += [("_sum", round(self.ttft_sum, 6)), ("_count", cumulative)]
            lines.extend(["# HELP ragblend_ttft_seconds Time to first token of each answer.",
                          "# TYPE ragblend_ttft_seconds histogram"])
            lines.extend(f"ragblend_ttft_seconds{suffix} {value}" for suffix, value in samples)
            for name, value, help_text in (
                    ("ragblend_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of all answers."),
                    ("ragblend_reused_tokens_total", self.reused_tokens, "Prompt tokens whose KV came from the store."),
                    ("ragblend_recomputed_tokens_total", self.recomputed_tokens, "Prompt tokens computed through every layer."),
                    ("ragblend_generated_tokens_total", self.generated_tokens, "Answer tokens generated.")):
                metric(name, "counter", help_text, [("", value)])
        tiers = {"memory": getattr(store, "memory", None), "disk": getattr(store, "disk", None)}
        if tiers["memory"] is None and tiers["disk"] is None:
            tiers = {"memory": store}
        metric("ragblend_store_bytes", "gauge", "Bytes of KV held per store tier.",
               [(f'{{tier="{_label(tier)}"}}', _nbytes(s)) for tier, s in tiers.items() if s is not None])
        return "\n".join(lines) + "\n"


def _nbytes(store) -> int:
    try:
        return int(getattr(store, "nbytes", 0) or 0)
    except Exception:   # a broken disk tier must not take /metrics down
        return 0


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
                            f"{max_values}.")
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, "The request body nests JSON too deeply.") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON.") from None


def check_unsupported(body: dict) -> None:
    """A 400 for each OpenAI field asking for a feature this server does not implement."""
    for name, (unused, feature) in UNSUPPORTED.items():
        value = body.get(name)
        # compared with the type too, so that True is not taken for 1, nor 0 for False
        if not any(value == u and type(value) is type(u) for u in unused):
            raise ApiError(400, f"{name} is not supported: this server does not implement {feature}. "
                                "Leave the field out.", param=name, code="unsupported_parameter")


def check_options(body: dict) -> None:
    """Type checks of the fields every completion request may carry (each error names its field)."""
    check_unsupported(body)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream must be true or false.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object such as {\"include_usage\": true}.",
                           param="stream_options")
        if options.get("include_usage") is not None and not isinstance(options["include_usage"], bool):
            raise ApiError(400, "stream_options.include_usage must be true or false.",
                           param="stream_options.include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string.", param="user")
    sampling_fields(body)


def sampling_fields(body: dict) -> dict:
    """The OpenAI sampling fields, checked: ``max_tokens`` (or None), ``temperature``,
    ``top_p``, ``seed`` and ``stop`` as SamplingParams takes them."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = body.get(name)
    if requested is not None and (type(requested) is not int or requested < 1):
        raise ApiError(400, f"{name} must be an integer >= 1, got {requested!r}.", param=name)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(400, f"n must be 1: this server answers one choice per request (got {n!r}).", param="n")
    temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 2):
        raise ApiError(400, f"temperature must be a number from 0 to 2, got {temperature!r}.", param="temperature")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ApiError(400, f"top_p must be a number in (0, 1], got {top_p!r}.", param="top_p")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise ApiError(400, f"seed must be an integer in [0, 2**63), got {seed!r}.", param="seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else None
    if stop is not None and (stops is None or len(stops) > MAX_STOPS
                             or not all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings.",
                       param="stop")
    return {"requested": requested, "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p, "seed": seed, "stop": tuple(stops or ())}


def check_window(engine: BlendEngine, prompt_tokens: int) -> None:
    if prompt_tokens >= engine.context_window:
        raise PromptTooLongError(f"The prompt has {prompt_tokens} tokens and fills the model's context window "
                                 f"({engine.context_window}); shorten it.")


def sampling(body: dict, engine: BlendEngine, prompt_tokens: int) -> SamplingParams:
    """Sampling from the OpenAI fields; ``max_tokens`` is capped by what the window has left."""
    check_window(engine, prompt_tokens)
    room = engine.context_window - prompt_tokens
    fields = sampling_fields(body)
    return SamplingParams(max_new_tokens=min(fields["requested"] or room, room), temperature=fields["temperature"],
                          top_p=fields["top_p"], seed=fields["seed"], stop=fields["stop"])


def requested_strategy(body: dict):
    options = body.get("ragblend") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "ragblend must be an object such as {\"strategy\": \"cacheblend\", \"ratio\": 0.3}.",
                       param="ragblend")
    name = options.get("strategy") or "default"
    if not isinstance(name, str):
        raise ApiError(400, "ragblend.strategy must be a strategy name.", param="ragblend.strategy")
    return strategy_from_name(name, options.get("ratio"))


class TextLimit:
    """The most characters a prompt can have and still fit the window: no token covers more
    characters than the vocabulary's longest entry (twice that, for tokenizers that normalize).
    Checked before tokenizing, so an oversized prompt costs no tokenizer time."""

    def __init__(self, engine: BlendEngine):
        longest = max(map(len, engine.tokenizer.get_vocab()), default=1)
        self.window, self.max_chars = engine.context_window, 2 * engine.context_window * max(longest, 1)

    def check(self, chars: int, what: str, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"{what}: {chars} characters, more than fit the model's context window "
                                f"({self.window} tokens, at most {self.max_chars} characters); shorten it.",
                           param=param, code="context_length_exceeded")


# ---------------------------------------------------------------------------- requests → prompts


def _text_of(content, where: str) -> tuple[str | None, list]:
    """``(plain text, [])`` for a string content, or ``(None, segments)`` for content blocks
    (blocks marked with cache_control become Chunks)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where}.content must be a string or a non-empty list of text blocks.",
                       param=f"{where}.content")
    segments: list = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ApiError(400, f"{where}.content[{i}] is a {kind!r} block; this server reads text blocks only "
                                "({\"type\": \"text\", \"text\": \"...\"}).", param=f"{where}.content[{i}]")
        mark = block.get("cache_control")
        if mark is not None and not (isinstance(mark, dict) and mark.get("type") == "ephemeral"):
            raise ApiError(400, f"{where}.content[{i}].cache_control must be {{\"type\": \"ephemeral\"}}.",
                           param=f"{where}.content[{i}].cache_control")
        segments.append(Chunk(block["text"]) if mark is not None and block["text"] else block["text"])
    return None, [s for s in segments if s != ""]


def _joined(text: str | None, segments: list) -> str:
    return text if text is not None else "".join(s.text if isinstance(s, Chunk) else s for s in segments)


@dataclass
class ChatPrompt:
    """A chat request's messages, checked: system and developer messages are the system
    prompt, earlier turns the history, the last user message the segments."""

    system: str | None
    history: list[tuple[str, str]]
    text: str | None
    segments: list

    @classmethod
    def parse(cls, messages, limit: TextLimit) -> "ChatPrompt":
        """Structure, counts and characters only: nothing here tokenizes."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list.", param="messages")
        if len(messages) > MAX_MESSAGES:
            raise ApiError(400, f"messages has {len(messages)} messages; at most {MAX_MESSAGES} are accepted.",
                           param="messages")
        system, history, last, parts, chars = [], [], None, 0, 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ApiError(400, f"messages[{i}] must be an object with a role and a content.",
                               param=f"messages[{i}]")
            role = message.get("role")
            if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
                raise ApiError(400, f"messages[{i}] is a tool call or result; this server does not implement "
                                    "tool calling.", param=f"messages[{i}]", code="unsupported_parameter")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"messages[{i}].role must be system, developer, user or assistant, "
                                    f"got {role!r}.", param=f"messages[{i}].role")
            content = message.get("content")
            if isinstance(content, list):
                parts += len(content)
                if parts > MAX_PARTS:
                    raise ApiError(400, f"The messages hold more than {MAX_PARTS} content blocks; merge them.",
                                   param=f"messages[{i}].content")
            text, segments = _text_of(content, f"messages[{i}]")
            chars += len(_joined(text, segments))
            limit.check(chars, "The messages", "messages")
            if role in ("system", "developer"):
                system.append(_joined(text, segments))
            elif i == len(messages) - 1 and role == "user":
                last = (text, segments)
            else:
                history.append((role, _joined(text, segments)))
        if last is None:
            raise ApiError(400, "The last message must be the user's.", param="messages")
        return cls("\n\n".join(system) or None, history, *last)

    def layout(self, engine: BlendEngine, *, find_chunks: bool = True) -> PromptLayout:
        """Tokenize (worker thread). With ``find_chunks``, a prompt over the window is refused
        before stored chunks are looked for in it."""
        if any(isinstance(s, Chunk) for s in self.segments):
            return engine.build_prompt(self.segments, system=self.system, history=self.history, separator="")
        layout = engine.build_prompt([_joined(self.text, self.segments)], system=self.system, history=self.history)
        if not find_chunks:
            return layout
        check_window(engine, len(layout.token_ids))
        return engine.find_chunks_in_ids(layout.token_ids)


def check_prompt(prompt, limit: TextLimit, vocab: int, window: int):
    """A completions prompt, checked without tokenizing: a text, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        limit.check(len(prompt), "prompt", "prompt")
        check_text(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "prompt is empty.", param="prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request).",
                       param="prompt")
    if len(prompt) >= window:
        raise ApiError(400, f"The prompt has {len(prompt)} tokens and fills the model's context window ({window}); "
                            "shorten it.", param="prompt", code="context_length_exceeded")
    if not all(type(t) is int for t in prompt):
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request).",
                       param="prompt")
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt")
    return prompt


def completion_layout(engine: BlendEngine, prompt, separator_ids: list[int]) -> PromptLayout:
    """The prompt of a completions request (checked by :func:`check_prompt`): raw text (stored
    chunks found inside it, no chat template), or token ids in LMCache's blending convention."""
    if isinstance(prompt, str):
        ids = engine.tokenize(prompt)
        check_window(engine, len(ids))
        return engine.find_chunks_in_ids(ids)
    segments = _split(prompt, separator_ids)
    if len(segments) == 1:   # a chunk on its own: LMCache's way of warming its KV
        return PromptLayout(list(prompt), [ChunkSpan(0, len(prompt), tuple(prompt))])
    if any(not s for s in segments):
        raise ApiError(400, "The token-id prompt has an empty segment: two separators in a row, or one at "
                            "the start or end.", param="prompt")
    ids, spans = list(segments[0]), []
    for segment in segments[1:-1]:
        ids += separator_ids
        spans.append(ChunkSpan(len(ids), len(ids) + len(segment), tuple(segment)))
        ids += segment
    ids += separator_ids + segments[-1]
    return PromptLayout(ids, spans)


def _split(ids: list[int], separator: list[int]) -> list[list[int]]:
    parts, start, i, n = [], 0, 0, len(separator)
    while n and i <= len(ids) - n:
        if ids[i:i + n] == separator:
            parts.append(ids[start:i])
            i = start = i + n
        else:
            i += 1
    return parts + [ids[start:]]


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            # Like a prefix cache's count: every prompt token whose KV the store served (the
            # fusion then recomputed a share of them; `ragblend.reused_tokens` are the rest).
            "prompt_tokens_details": {"cached_tokens": stats.cache_hit_tokens}}


# ---------------------------------------------------------------------------- the app


class Guard:
    """Checks the API key and the declared body size before any route runs. Plain ASGI (not
    Starlette's BaseHTTPMiddleware), so handlers keep the server's own ``receive`` and see a
    client's disconnect."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, refuse: Callable):
        self.app, self.max_body_bytes, self.refuse = app, max_body_bytes, refuse
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        error = None
        if path != "/health" and self.expected is not None:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                error = ApiError(401, "Missing or wrong API key: send Authorization: Bearer <key>.",
                                 kind="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if error is None and length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            error = ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.")
        if error is None:
            return await self.app(scope, receive, send)
        await self.refuse(error, path)(scope, receive, send)


class Stream(StreamingResponse):
    """An SSE response that calls ``on_end(finished)`` once it is over, also when the client
    left before the first event (then the body iterator never ran, and nothing else would)."""

    def __init__(self, content, on_end: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.on_end = on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:   # how ASGI 2.4 servers report a client gone (a failed send)
            pass
        finally:
            self.on_end()


def create_app(engine: BlendEngine, *, api_key: str | None = None, queue_size: int = 16,
               request_timeout_s: float = 300.0, max_body_bytes: int = 4 << 20, model_name: str | None = None):
    """The FastAPI app serving ``engine`` (see the module docstring)."""
    if queue_size < 1 or request_timeout_s <= 0 or max_body_bytes < 1024:
        raise InvalidInputError("queue_size must be >= 1, request_timeout_s > 0 and max_body_bytes >= 1024.")
    app = FastAPI(title="ragblend", docs_url=None, redoc_url=None, openapi_url=None)
    worker, metrics = Worker(queue_size), Metrics()
    model_id = model_name or engine.name
    separator_ids = engine.tokenize(BLEND_SPECIAL_STR)
    limit = TextLimit(engine)
    # What the tokenizer adds around a text with add_special_tokens (a BOS, say), so that
    # /tokenize can tokenize the text itself through the engine's own tokenize.
    probe = "a"
    with_specials = list(engine.tokenizer(probe, add_special_tokens=True)["input_ids"])
    bare = engine.tokenize(probe)
    at = next((i for i in range(len(with_specials)) if with_specials[i:i + len(bare)] == bare), 0)
    special_head, special_tail = with_specials[:at], with_specials[at + len(bare):]

    def error_response(err: BaseException, path: str) -> JSONResponse:
        if not isinstance(err, ApiError):
            if isinstance(err, PromptTooLongError):
                err = ApiError(400, str(err), code="context_length_exceeded")
            elif isinstance(err, (InvalidInputError, RagblendError)):
                err = ApiError(400, str(err))
            else:
                log.error("internal error on %s", route_label(path), exc_info=err)
                err = ApiError(500, "Internal server error; see the server's log.", kind="server_error")
        if isinstance(err, ClientGone):
            log.info("client disconnected from %s before its answer; its work was stopped", route_label(path))
        metrics.request(path, err.status)
        headers = {"Retry-After": "1"} if err.status == 429 else {}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, refuse=error_response)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):   # unknown path, wrong method
        return error_response(ApiError(exc.status_code, str(exc.detail)), request.url.path)

    async def read_json(request: Request) -> dict:
        body = bytearray()
        async for piece in request.stream():   # also bounds bodies sent without a Content-Length
            body += piece
            if len(body) > max_body_bytes:
                raise ApiError(413, f"The request body is larger than {max_body_bytes} bytes.")
        data = await run_in_threadpool(parse_json, bytes(body), MAX_JSON_VALUES + engine.context_window)
        if not isinstance(data, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        model = data.get("model")
        if model is not None and model != model_id:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {model_id!r}.",
                           param="model", code="model_not_found")
        return data

    class Call:
        """One request's job, seen from its handler: the job's events, the deadline, and a
        watch on the client's connection (a disconnect cancels the job)."""

        def __init__(self, request: Request, run: Callable[[Job], Any]):
            loop = asyncio.get_running_loop()
            self.loop, self.events = loop, asyncio.Queue()
            self.job = Job(run, lambda item: loop.call_soon_threadsafe(self.events.put_nowait, item))
            self.deadline = loop.time() + request_timeout_s
            self.finished = False
            worker.submit(self.job)   # a full queue raises 429 here, before any response starts
            self.watch = asyncio.create_task(self._watch(request))

        async def _watch(self, request: Request) -> None:
            # The body is read: the next message the server sends is the disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.job.cancelled.set()
            self.events.put_nowait(("gone", None))

        async def next(self) -> tuple[str, Any]:
            """The job's next event: ("ready" | "item", value); raises its error, ClientGone, or 504."""
            try:
                kind, value = await asyncio.wait_for(self.events.get(), max(0.0, self.deadline - self.loop.time()))
            except asyncio.TimeoutError:
                self.close()
                raise ApiError(504, f"The request took longer than {request_timeout_s:g} s.",
                               kind="timeout_error", code="timeout") from None
            if kind == "gone":
                raise ClientGone()
            if kind == "error":
                raise value
            if kind == "done":
                self.finished = True
            return kind, value

        async def until(self, wanted: str, on_item: Callable[[Any], None] | None = None):
            while True:
                kind, value = await self.next()
                if kind == "item" and on_item is not None:
                    on_item(value)
                if kind == wanted:
                    return value

        def stop_watching(self) -> None:
            self.watch.cancel()

        def close(self) -> None:
            """Stop the job unless it finished (a timeout, an error, a client gone)."""
            self.stop_watching()
            self.job.cancelled.set()

    async def run_job(request: Request, run: Callable[[Job], Any]):
        call = Call(request, run)
        try:
            return await call.until("done")
        finally:
            call.close()

    async def answer(request: Request, path: str, body: dict, layout_of: Callable[[], PromptLayout], chat: bool):
        check_options(body)
        strategy = requested_strategy(body)

        def run(job: Job) -> Stats:   # the worker's side: tokenize, then prefill and decode
            layout = layout_of()
            params = sampling(body, engine, len(layout.token_ids))
            job.emit(("ready", None))
            stream = engine.stream(layout, strategy=strategy, params=params)
            try:
                for delta in stream:
                    job.emit(("item", delta))
            finally:
                stream.close()
            metrics.answer(stream.stats)
            return stream.stats

        created, ident = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            message = ({} if text is None else {"content": text}) if delta else {"role": "assistant", "content": text}
            return {"index": 0, ("delta" if delta else "message"): message, "logprobs": None, "finish_reason": finish}

        call = Call(request, run)
        if not body.get("stream"):
            pieces: list[str] = []
            try:
                stats = await call.until("done", pieces.append)
            finally:
                call.close()
            metrics.request(path, 200)
            return JSONResponse({"id": ident, "object": kind, "created": created, "model": model_id,
                                 "choices": [choice("".join(pieces), stats.finish_reason, False)],
                                 "usage": usage(stats), "ragblend": dict(stats.__dict__)})

        # Streaming: wait until the prompt is tokenized and checked, so that a bad prompt is a
        # real 400 (not an error event after a 200); from then on the stream reports errors.
        try:
            await call.until("ready")
        except BaseException:
            call.close()
            raise
        call.stop_watching()   # the streaming response listens for the disconnect from here on
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def event(data: dict) -> bytes:
            return f"data: {json.dumps({'id': ident, 'object': chunk_kind, 'created': created, 'model': model_id, **data})}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            if chat:
                yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
            try:
                while True:
                    kind, value = await call.next()
                    if kind == "item":
                        yield event({"choices": [choice(value, None, True)]})
                    elif kind == "done":
                        break
            except Exception as err:   # not CancelledError: a client gone is handled in ended()
                response = error_response(err, path)
                call.finished = True
                yield f"data: {response.body.decode()}\n\n".encode()
            else:
                yield event({"choices": [choice(None if chat else "", value.finish_reason, True)],
                             "ragblend": dict(value.__dict__)})
                if include_usage:
                    yield event({"choices": [], "usage": usage(value)})
                metrics.request(path, 200)
            yield b"data: [DONE]\n\n"

        def ended() -> None:
            call.close()
            if not call.finished:
                log.info("client disconnected from %s during its stream; its generation was stopped",
                         route_label(path))
                metrics.request(path, 499)

        return Stream(events(), ended)

    def endpoint(path: str):
        """Route errors of ``path``'s handler into OpenAI-shaped responses."""
        def wrap(handler):
            async def handle(request: Request):
                try:
                    return await handler(request)
                except Exception as err:
                    return error_response(err, path)
            return handle
        return wrap

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "queue_depth": worker.depth}

    @app.get("/v1/models")
    async def models():
        metrics.request("/v1/models", 200)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "ragblend",
                                            "max_model_len": engine.context_window}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(worker.depth, engine.store), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    @endpoint("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        prompt = ChatPrompt.parse(body.get("messages"), limit)
        return await answer(request, "/v1/chat/completions", body, lambda: prompt.layout(engine), True)

    @app.post("/v1/completions")
    @endpoint("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        prompt = check_prompt(body.get("prompt"), limit, engine.entry_spec.vocab_size, engine.context_window)
        return await answer(request, "/v1/completions", body,
                            lambda: completion_layout(engine, prompt, separator_ids), False)

    @app.post("/v1/chunks")
    @endpoint("/v1/chunks")
    async def chunks(request: Request):
        body = await read_json(request)
        texts = body.get("texts")
        if isinstance(texts, list) and len(texts) > MAX_TEXTS:
            raise ApiError(400, f"texts has {len(texts)} texts; send at most {MAX_TEXTS} per request.", param="texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise ApiError(400, "texts must be a non-empty list of non-empty strings.", param="texts")
        skip = body.get("skip_unusable", False)
        if not isinstance(skip, bool):
            raise ApiError(400, "skip_unusable must be true or false.", param="skip_unusable")
        # A text over the character limit cannot fit the window: refused, or skipped, untokenized.
        fits = [len(t) <= limit.max_chars for t in texts]
        if not skip:
            for i, text in enumerate(texts):
                limit.check(len(text), f"texts[{i}]", f"texts[{i}]")
        kept = [t for t, ok in zip(texts, fits) if ok]
        refs = await run_job(request, lambda job: engine.precompute(kept, skip_unusable=skip) if kept else [])
        refs = iter(refs)
        refs = [next(refs) if ok else None for ok in fits]
        metrics.request("/v1/chunks", 200)
        # With skip_unusable, a chunk too short to be found or too long for the window has no KV.
        # JSONResponse, not a dict: FastAPI's encoder would walk a large answer on the event loop.
        return JSONResponse({"object": "list", "data": [
            {"key": None, "tokens": 0, "stored": False} if r is None else
            {"key": r.key, "tokens": r.num_tokens, "stored": r.stored} for r in refs]})

    @app.post("/tokenize")
    @endpoint("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        for name in ("tools", "chat_template", "continue_final_message"):
            if body.get(name) not in (None, False, []):
                raise ApiError(400, f"{name} is not supported by this server's /tokenize; leave it out.",
                               param=name, code="unsupported_parameter")
        for name in ("add_generation_prompt", "add_special_tokens"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise ApiError(400, f"{name} must be true or false.", param=name)
        if "messages" in body:
            if body.get("add_generation_prompt") is False:
                raise ApiError(400, "add_generation_prompt=false is not supported: messages are tokenized as "
                                    "the chat endpoint's prompt, which ends with the assistant's turn.",
                               param="add_generation_prompt", code="unsupported_parameter")
            # The very prompt the chat endpoint would build (the engine's PromptBuilder).
            prompt = ChatPrompt.parse(body["messages"], limit)

            def run(job: Job) -> list[int]:
                return prompt.layout(engine, find_chunks=False).token_ids
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError(400, "prompt must be a string (or send messages).", param="prompt")
            limit.check(len(text), "prompt", "prompt")
            check_text(text, "prompt")
            specials = body.get("add_special_tokens", True)

            def run(job: Job) -> list[int]:
                ids = engine.tokenize(text)
                return special_head + ids + special_tail if specials else ids
        ids = await run_job(request, run)
        metrics.request("/tokenize", 200)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.context_window})

    return app


def serve(engine: BlendEngine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          **options) -> None:
    """Serve ``engine`` with uvicorn until interrupted."""
    import uvicorn

    if api_key is None and not is_loopback(host):
        log.warning("ragblend serve binds %s without an API key: anyone who can reach it can use the model. "
                    "Pass --api-key or set RAGBLEND_API_KEY.", host)
    app = create_app(engine, api_key=api_key, **options)
    # The model, tokenizer and libraries are a few million objects that live as long as the
    # process; left to the garbage collector, each full collection walks them all with the GIL
    # held (~0.1-0.4 s here, /health stalled meanwhile). Frozen, collections walk only what
    # requests allocate.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="warning")
