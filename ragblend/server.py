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
429 with ``Retry-After``; a client that disconnects stops its generation; a request that waits
and runs longer than ``request_timeout_s`` fails with 504. Errors have the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` and never carry a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError, PromptTooLongError, RagblendError
from ragblend.core.fusion import strategy_from_name
from ragblend.core.generate import SamplingParams
from ragblend.core.prompt import Chunk, ChunkSpan, PromptLayout, check_text

log = logging.getLogger("ragblend.server")

BLEND_SPECIAL_STR = " # # "
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ApiError(RagblendError):
    """An error answered to the client with ``status`` in the OpenAI error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------- the work queue


@dataclass
class Job:
    """One request's model work, run by the worker thread; ``emit`` receives its events."""

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


class Metrics:
    """Counters and a TTFT histogram, written as Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.reused_tokens = self.recomputed_tokens = self.prompt_tokens = self.generated_tokens = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0

    def request(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[path, status] = self.requests.get((path, status), 0) + 1

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
            metric("ragblend_requests_total", "counter", "HTTP requests by path and status.",
                   [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())])
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
               [(f'{{tier="{tier}"}}', _nbytes(s)) for tier, s in tiers.items() if s is not None])
        return "\n".join(lines) + "\n"


def _nbytes(store) -> int:
    try:
        return int(getattr(store, "nbytes", 0) or 0)
    except Exception:   # a broken disk tier must not take /metrics down
        return 0


# ---------------------------------------------------------------------------- requests → prompts


def _text_of(content, where: str) -> tuple[str | None, list]:
    """``(plain text, [])`` for a string content, or ``(None, segments)`` for content blocks
    (blocks marked with cache_control become Chunks)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where}.content must be a string or a non-empty list of text blocks.", param=where)
    segments: list = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ApiError(400, f"{where}.content[{i}] is a {kind!r} block; this server reads text blocks only.",
                           param=f"{where}.content")
        marked = isinstance(block.get("cache_control"), dict)
        segments.append(Chunk(block["text"]) if marked and block["text"] else block["text"])
    return None, [s for s in segments if s != ""]


def _joined(text: str | None, segments: list) -> str:
    return text if text is not None else "".join(s.text if isinstance(s, Chunk) else s for s in segments)


def chat_layout(engine: BlendEngine, messages) -> PromptLayout:
    """The prompt of a chat request: system and developer messages are the system prompt,
    earlier turns the history, the last user message the segments."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    system, history, last = [], [], None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, developer, user or assistant.",
                           param=f"messages[{i}]")
        text, segments = _text_of(message.get("content"), f"messages[{i}]")
        role = message["role"]
        if role in ("system", "developer"):
            system.append(_joined(text, segments))
        elif i == len(messages) - 1 and role == "user":
            last = (text, segments)
        else:
            history.append((role, _joined(text, segments)))
    if last is None:
        raise ApiError(400, "The last message must be the user's.", param="messages")
    system_text = "\n\n".join(system) or None
    text, segments = last
    if any(isinstance(s, Chunk) for s in segments):
        return engine.build_prompt(segments, system=system_text, history=history, separator="")
    return engine.find_chunks(_joined(text, segments), system=system_text, history=history)


def completion_layout(engine: BlendEngine, prompt, separator_ids: list[int]) -> PromptLayout:
    """The prompt of a completions request: raw text (stored chunks found inside it, no chat
    template), or token ids in LMCache's blending convention."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        if not prompt:
            raise ApiError(400, "prompt is empty.", param="prompt")
        return engine.find_chunks_in_ids(engine.tokenize(prompt))
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
        raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request).",
                       param="prompt")
    vocab = engine.entry_spec.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab}).", param="prompt")
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


def sampling(body: dict, engine: BlendEngine, prompt_tokens: int) -> SamplingParams:
    """Sampling from the OpenAI fields; ``max_tokens`` is capped by what the window has left."""
    room = engine.context_window - prompt_tokens
    if room < 1:
        raise PromptTooLongError(f"The prompt has {prompt_tokens} tokens and fills the model's context window "
                                 f"({engine.context_window}); shorten it.")
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    if requested is not None and (type(requested) is not int or requested < 1):
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {requested!r}.", param="max_tokens")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: this server answers one choice per request.", param="n")
    stop = body.get("stop")
    return SamplingParams(max_new_tokens=min(requested or room, room),
                          temperature=1.0 if body.get("temperature") is None else body["temperature"],
                          top_p=1.0 if body.get("top_p") is None else body["top_p"],
                          seed=body.get("seed"), stop=(stop,) if isinstance(stop, str) else tuple(stop or ()))


def requested_strategy(body: dict):
    options = body.get("ragblend") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "ragblend must be an object such as {\"strategy\": \"cacheblend\", \"ratio\": 0.3}.",
                       param="ragblend")
    name = options.get("strategy") or "default"
    if not isinstance(name, str):
        raise ApiError(400, "ragblend.strategy must be a strategy name.", param="ragblend.strategy")
    return strategy_from_name(name, options.get("ratio"))


def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            # Like a prefix cache's count: every prompt token whose KV the store served (the
            # fusion then recomputed a share of them; `ragblend.reused_tokens` are the rest).
            "prompt_tokens_details": {"cached_tokens": stats.cache_hit_tokens}}


# ---------------------------------------------------------------------------- the app


def create_app(engine: BlendEngine, *, api_key: str | None = None, queue_size: int = 16,
               request_timeout_s: float = 300.0, max_body_bytes: int = 4 << 20, model_name: str | None = None):
    """The FastAPI app serving ``engine`` (see the module docstring)."""
    if queue_size < 1 or request_timeout_s <= 0 or max_body_bytes < 1024:
        raise InvalidInputError("queue_size must be >= 1, request_timeout_s > 0 and max_body_bytes >= 1024.")
    app = FastAPI(title="ragblend", docs_url=None, redoc_url=None, openapi_url=None)
    worker, metrics = Worker(queue_size), Metrics()
    model_id = model_name or engine.name
    separator_ids = engine.tokenize(BLEND_SPECIAL_STR)

    def error_response(err: BaseException, path: str) -> JSONResponse:
        if not isinstance(err, ApiError):
            if isinstance(err, PromptTooLongError):
                err = ApiError(400, str(err), code="context_length_exceeded")
            elif isinstance(err, (InvalidInputError, RagblendError)):
                err = ApiError(400, str(err))
            else:
                log.error("internal error on %s", path, exc_info=err)
                err = ApiError(500, "Internal server error; see the server's log.", kind="server_error")
        metrics.request(path, err.status)
        headers = {"Retry-After": "1"} if err.status == 429 else {}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):   # unknown path, wrong method
        return error_response(ApiError(exc.status_code, str(exc.detail)), request.url.path)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if path != "/health" and api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(ApiError(401, "Missing or wrong API key: send Authorization: Bearer <key>.",
                                               kind="authentication_error", code="invalid_api_key"), path)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return error_response(ApiError(413, f"The request body is larger than {max_body_bytes} bytes."), path)
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        body = bytearray()
        async for piece in request.stream():   # also bounds bodies sent without a Content-Length
            body += piece
            if len(body) > max_body_bytes:
                raise ApiError(413, f"The request body is larger than {max_body_bytes} bytes.")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "The request body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        model = data.get("model")
        if model is not None and model != model_id:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {model_id!r}.",
                           param="model", code="model_not_found")
        return data

    def start_job(run: Callable[[Job], Any]) -> tuple[Job, asyncio.Queue]:
        """Queue ``run`` for the worker (a full queue raises 429 here, before any response starts)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(run, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        worker.submit(job)
        return job, events

    async def finish_job(job: Job, events: asyncio.Queue, on_item: Callable[[Any], Any] | None = None):
        """Pass each item the job emits to ``on_item``; return its result."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request_timeout_s
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(events.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise ApiError(504, f"The request took longer than {request_timeout_s:g} s.",
                                   kind="timeout_error", code="timeout") from None
                if kind == "item" and on_item is not None:
                    await on_item(value)
                elif kind == "error":
                    raise value
                elif kind == "done":
                    return value
        finally:
            job.cancelled.set()   # a client gone, a timeout or an error stops the generation

    async def run_job(run: Callable[[Job], Any], on_item: Callable[[Any], Any] | None = None):
        return await finish_job(*start_job(run), on_item)

    def generation(layout: PromptLayout, strategy, params: SamplingParams):
        """The worker's side of one answer: emits ("item", delta) and returns the stats."""
        def run(job: Job) -> Stats:
            stream = engine.stream(layout, strategy=strategy, params=params)
            try:
                for delta in stream:
                    if job.cancelled.is_set():
                        break
                    job.emit(("item", delta))
            finally:
                stream.close()
            stats = stream.stats
            metrics.answer(stats)
            return stats
        return run

    async def answer(request: Request, path: str, layout_of: Callable[[dict], PromptLayout], chat: bool):
        body = await read_json(request)
        layout = layout_of(body)
        params = sampling(body, engine, len(layout.token_ids))
        strategy = requested_strategy(body)
        run = generation(layout, strategy, params)
        created, ident = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            message = ({} if text is None else {"content": text}) if delta else {"role": "assistant", "content": text}
            return {"index": 0, ("delta" if delta else "message"): message, "logprobs": None, "finish_reason": finish}

        if not body.get("stream"):
            pieces: list[str] = []

            async def keep(delta):
                pieces.append(delta)
            stats = await run_job(run, keep)
            metrics.request(path, 200)
            return JSONResponse({"id": ident, "object": kind, "created": created, "model": model_id,
                                 "choices": [choice("".join(pieces), stats.finish_reason, False)],
                                 "usage": usage(stats), "ragblend": dict(stats.__dict__)})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        job, job_events = start_job(run)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def event(data: dict) -> bytes:
            return f"data: {json.dumps({'id': ident, 'object': chunk_kind, 'created': created, 'model': model_id, **data})}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            out: asyncio.Queue = asyncio.Queue()

            async def send(delta):
                await out.put(event({"choices": [choice(delta, None, True)]}))

            async def produce():
                try:
                    stats = await finish_job(job, job_events, send)
                    await out.put(event({"choices": [choice(None if chat else "", stats.finish_reason, True)],
                                         "ragblend": dict(stats.__dict__)}))
                    if include_usage:
                        await out.put(event({"choices": [], "usage": usage(stats)}))
                    metrics.request(path, 200)
                except BaseException as err:
                    response = error_response(err, path)
                    await out.put(f"data: {response.body.decode()}\n\n".encode())
                await out.put(b"data: [DONE]\n\n")
                await out.put(None)

            if chat:
                yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
            task = asyncio.create_task(produce())
            try:
                while (item := await out.get()) is not None:
                    yield item
            finally:
                task.cancel()        # the client went away: finish_job's cleanup cancels the job
                job.cancelled.set()  # (also when the stream ends before produce() ever ran)

        return StreamingResponse(events(), media_type="text/event-stream")

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
        return await answer(request, "/v1/chat/completions", lambda body: chat_layout(engine, body.get("messages")), True)

    @app.post("/v1/completions")
    @endpoint("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "/v1/completions",
                            lambda body: completion_layout(engine, body.get("prompt"), separator_ids), False)

    @app.post("/v1/chunks")
    @endpoint("/v1/chunks")
    async def chunks(request: Request):
        body = await read_json(request)
        texts = body.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise ApiError(400, "texts must be a non-empty list of non-empty strings.", param="texts")
        skip = bool(body.get("skip_unusable", False))
        refs = await run_job(lambda job: engine.precompute(texts, skip_unusable=skip))
        metrics.request("/v1/chunks", 200)
        # With skip_unusable, a chunk too short to be found or too long for the window has no KV.
        return {"object": "list", "data": [{"key": None, "tokens": 0, "stored": False} if r is None else
                                           {"key": r.key, "tokens": r.num_tokens, "stored": r.stored} for r in refs]}

    @app.post("/tokenize")
    @endpoint("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ApiError(400, "messages must be a list of chat messages.", param="messages")
            ids = engine.tokenizer.apply_chat_template(messages, tokenize=True,
                                                       add_generation_prompt=bool(body.get("add_generation_prompt", True)))
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)   # a BatchEncoding in transformers 5
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string (or send messages).", param="prompt")
            check_text(prompt, "prompt")
            ids = list(engine.tokenizer(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_window}

    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(engine: BlendEngine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          **options) -> None:
    """Serve ``engine`` with uvicorn until interrupted."""
    import uvicorn

    if api_key is None and not is_loopback(host):
        log.warning("ragblend serve binds %s without an API key: anyone who can reach it can use the model. "
                    "Pass --api-key or set RAGBLEND_API_KEY.", host)
    uvicorn.run(create_app(engine, api_key=api_key, **options), host=host, port=port, log_level="warning")
