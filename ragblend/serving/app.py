"""``ragblend serve``: an OpenAI-compatible HTTP server over one :class:`~ragblend.BlendEngine`.

Endpoints (the OpenAI API's shapes, plus ragblend's own):

* ``GET /health`` (no key needed), ``GET /v1/models``, ``GET /metrics`` (Prometheus text: requests,
  TTFT, tokens, the store's bytes and entries per tier, and the passages whose KV is stored after
  the answers: ``ragblend_kv_fill_pending``, ``_stored_total``, ``_failed_total``);
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

Each API key is a tenant (:mod:`.tenants`): what a tenant's requests store (passages, chunks
computed during a query, marked chunks, token-id warm-ups, its ``/v1/chunks``) is found only in its
own prompts, and every prompt also finds the shared chunks (the operator's: an ingested index, its
``/v1/chunks``; with no key at all, everything). A request's ``cache_salt`` partitions further.

One engine serves every request from a bounded queue: a full queue answers 429 with
``Retry-After``. Each request is prefilled on its own; the answers then decode together, one
pass over the weights per step for all of them (``serving.worker``, up to ``max_batch`` answers
and ``max_kv_bytes`` of KV; a request that does not fit waits in the queue). The event loop
only reads, size-checks and type-checks requests; everything that costs CPU (tokenizing,
finding chunks, the model) runs in the worker thread, so ``/health`` answers at once whatever a request holds. A request that waits and runs longer
than ``request_timeout_s`` fails with 504, and a client that disconnects is let go: either way
its work stops within one layer or one decoding step. Errors have the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``, name the field at fault and never carry a
traceback; a field for a feature this server lacks (tools, structured output, logprobs...) is
a 400, never ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ragblend.core.decode.batching import kv_bytes_for
from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError, PromptTooLongError, RagblendError
from ragblend.core.net import is_loopback
from ragblend.core.prompt import PromptLayout, TooLong, is_conversation

from .options import SERVER_DEFAULTS
from .protocol import (
    BLEND_SPECIAL_STR,
    CLIENT_CLOSED,
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_TYPE,
    INVALID_VALUE,
    MAX_JSON_VALUES,
    METHOD_NOT_ALLOWED,
    MISSING_PARAMETER,
    NOT_FOUND,
    REQUEST_TOO_LARGE,
    UNSUPPORTED_PARAMETER,
    ApiError,
    ChatPrompt,
    ClientGone,
    TextLimit,
    cached_tokens,
    check_prompt,
    completion_layout,
    is_lmcache_warmup,
    parse_json,
    passages,
    usage,
    valid_text,
)
from .requests import ChunksRequest, TokenizeRequest, check_options, requested_strategy, sampling
from .reuse import PassageKeeper
from .tenants import OPERATOR, Tenants
from .worker import Decode, Job, Worker

log = logging.getLogger("ragblend.server")
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Bounds on a request's head, enforced before the API key is checked or any route runs, so that
# a client without the key costs the server little. Two checks, at two moments:
# * a head still arriving: uvicorn's h11 parser (``serve`` picks it) buffers at most
#   MAX_HEADER_BYTES of an incomplete head, then answers 400 and closes the connection, however
#   much is still coming (its default parser, httptools, has no bound: a 256 MB head took 67 s
#   of CPU). A head that completes within one read of the socket is not bounded there.
# * a completed head: the Guard (under any ASGI server) answers 431 to more than MAX_HEADERS
#   header fields, or more than MAX_HEADER_BYTES in the target (path and query) and the header
#   fields' names and values together.
# nginx's default buffers take a 32 KB head too (4 x 8k); docs/serving.md has the proxy settings.
MAX_HEADER_BYTES = 32 << 10
MAX_HEADERS = 100

# The paths /metrics counts by name; any other path is counted as "other", so that a client
# cannot add series (or forge labels) by requesting made-up paths.
ROUTES = frozenset({"/health", "/v1/models", "/metrics", "/v1/chat/completions", "/v1/completions",
                    "/v1/chunks", "/tokenize"})
# The field a text over the model's window came in, by route (OpenAI names "messages" for a chat).
TOO_LONG_PARAM = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/chunks": "texts"}


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
        self.fusion_skipped = self.fusion_fallbacks = self.history_tokens = 0
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
            self.fusion_skipped += bool(stats.fusion_skipped)
            self.fusion_fallbacks += bool(stats.fallback_tokens)   # as engine.fusion_fallbacks: those that ran
            self.history_tokens += stats.history_tokens
            self.ttft_sum += stats.ttft_s
            bucket = next((i for i, edge in enumerate(TTFT_BUCKETS) if stats.ttft_s <= edge), len(TTFT_BUCKETS))
            self.ttft_counts[bucket] += 1

    def text(self, queue_depth: int, store, keeper: PassageKeeper | None = None, prefix: dict | None = None,
             pieces: dict | None = None, background_jobs: int = 0) -> str:
        """The Prometheus text of the counters, the queue (``queue_depth``: requests;
        ``background_jobs``: the server's own work), the store, the background KV fill, the
        prefix tier (``prefix``: :meth:`~ragblend.BlendEngine.prefix_info`) and the history pieces'
        memory (``pieces``: :meth:`~ragblend.core.store.pieces.PieceStore.info`)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        with self.lock:
            metric("ragblend_requests_total", "counter", "HTTP requests by route and status.",
                   [(f'{{path="{_label(p)}",status="{_label(s)}"}}', n) for (p, s), n in sorted(self.requests.items())])
            # A client that hung up (499) got no answer, erroneous or not: it is counted under requests only.
            metric("ragblend_errors_total", "counter", "HTTP requests answered with an error status (not "
                   "the 499s of clients that disconnected).",
                   [("", sum(n for (_, s), n in self.requests.items() if s >= 400 and s != CLIENT_CLOSED))])
            metric("ragblend_queue_depth", "gauge", "Requests waiting or running.", [("", queue_depth)])
            metric("ragblend_background_jobs", "gauge", "The server's own jobs (storing passages' KV, KV "
                   "write-backs, a conversation's history pieces) waiting or running.", [("", background_jobs)])
            cumulative, samples = 0, []
            for edge, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
                cumulative += count
                samples.append((f'_bucket{{le="{edge}"}}', cumulative))
            samples += [("_sum", round(self.ttft_sum, 6)), ("_count", cumulative)]
            metric("ragblend_ttft_seconds", "histogram", "Time to first token of each answer.", samples)
            for name, value, help_text in (
                    ("ragblend_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of all answers."),
                    ("ragblend_reused_tokens_total", self.reused_tokens, "Prompt tokens whose stored KV the fusion kept (an "
                     "answer's cached_tokens also counts the stored tokens it recomputed)."),
                    ("ragblend_recomputed_tokens_total", self.recomputed_tokens, "Prompt tokens computed through every layer."),
                    ("ragblend_generated_tokens_total", self.generated_tokens, "Answer tokens generated."),
                    ("ragblend_history_tokens_total", self.history_tokens, "Prompt tokens found in a conversation's "
                     "stored turns (history pieces), fused like chunks."),
                    ("ragblend_fusion_skipped_total", self.fusion_skipped, "Answers whose prompt ran as the exact full "
                     "prefill because fusing it was not predicted to pay (short prompts; stats.skip_reason says why)."),
                    ("ragblend_fusion_fallbacks_total", self.fusion_fallbacks, "Fused answers that began to loop and "
                     "went on from the exact K/V of prompt and answer (stats.fusion_fallback says where).")):
                metric(name, "counter", help_text, [("", value)])
        tiers = _tiers(store)
        metric("ragblend_store_bytes", "gauge", "Bytes of KV held per store tier.",
               [(f'{{tier="{_label(tier)}"}}', _nbytes(s)) for tier, s in tiers.items()])
        metric("ragblend_store_entries", "gauge", "KV entries (chunks) held per store tier.",
               [(f'{{tier="{_label(tier)}"}}', _entries(s)) for tier, s in tiers.items()])
        if keeper is not None:   # serving.reuse: the passages' KV stored after the answers, off the request path
            metric("ragblend_kv_fill_pending", "gauge", "Passages from requests whose KV is not stored yet (waiting or being stored).",
                   [("", keeper.pending_count())])
            metric("ragblend_kv_fill_stored_total", "counter", "Passages whose KV the server stored after an answer.",
                   [("", keeper.stored)])
            metric("ragblend_kv_fill_failed_total", "counter",
                   "Passages whose KV could not be stored (store full or broken); their next prompt computes it.",
                   [("", keeper.failed)])
        for info, (name, kind, field, help_text) in [(prefix, m) for m in PREFIX_METRICS] + \
                [(pieces, m) for m in PIECE_METRICS]:
            if info:   # the tier is on
                metric(name, kind, help_text, [("", info[field])])
        return "\n".join(lines) + "\n"


# (name, kind, field of PrefixCache.info / PieceStore.info, help)
PREFIX_METRICS = (
    ("ragblend_prefix_hits_total", "counter", "hits", "Prompts that reused a recent prompt's K/V (prefix tier)."),
    ("ragblend_prefix_misses_total", "counter", "misses", "Prompts the prefix tier had no prefix for."),
    ("ragblend_prefix_hit_tokens_total", "counter", "hit_tokens", "Prompt tokens served by the prefix tier."),
    ("ragblend_prefix_bytes", "gauge", "bytes", "Bytes of K/V the prefix tier holds."),
    ("ragblend_prefix_evictions_total", "counter", "evictions", "Prefix tier entries evicted (LRU)."),
    ("ragblend_prefix_faults_total", "counter", "faults", "K/V the prefix tier could not keep (logged)."))
PIECE_METRICS = (
    ("ragblend_history_pieces_entries", "gauge", "entries", "Conversation turns kept as history pieces."),
    ("ragblend_history_pieces_bytes", "gauge", "bytes", "Bytes of K/V the history pieces' memory holds."),
    ("ragblend_history_pieces_evictions_total", "counter", "evictions", "History pieces evicted (LRU)."))


def _tiers(store) -> dict[str, Any]:
    """The store's tiers by name: a tiered store's memory and disk, else the store itself."""
    tiers = {"memory": getattr(store, "memory", None), "disk": getattr(store, "disk", None)}
    if tiers["memory"] is None and tiers["disk"] is None:
        tiers = {"memory": store}
    return {name: tier for name, tier in tiers.items() if tier is not None}


def _nbytes(store) -> int:
    try:
        return int(getattr(store, "nbytes", 0) or 0)
    except Exception:   # a broken disk tier must not take /metrics down
        return 0


def _entries(store) -> int:
    try:
        return len(store)
    except Exception:   # as _nbytes
        return 0


# ---------------------------------------------------------------------------- the app


class Guard:
    """Checks the completed head (its header fields' count, and the bytes of its target and
    header fields), then the API key and the declared body size, before any route runs, and records the request's tenant (``request.state.tenant``: see
    :mod:`.tenants`). Plain ASGI (not Starlette's BaseHTTPMiddleware), so handlers keep the
    server's own ``receive`` and see a client's disconnect."""

    def __init__(self, app, *, tenants: Tenants, max_body_bytes: int, refuse: Callable):
        self.app, self.max_body_bytes, self.refuse, self.tenants = app, max_body_bytes, refuse, tenants

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        error = None
        tenant = self.tenants.tenant_of(headers.get(b"authorization", b""))
        state = scope.setdefault("state", {})
        state["tenant"], state["arrived"] = tenant, time.perf_counter()   # a TTFT counts from here
        fields = len(scope["headers"])
        target = len(scope.get("raw_path") or path.encode()) + len(scope.get("query_string") or b"")
        head = target + sum(len(k) + len(v) for k, v in scope["headers"])
        if fields > MAX_HEADERS:
            error = ApiError(431, f"The request has {fields} header fields; at most {MAX_HEADERS} are accepted.",
                             code="request_header_fields_too_large")
        elif head > MAX_HEADER_BYTES:
            error = ApiError(431, f"The request's target and header fields hold {head} bytes ({target} in the "
                                  f"target); at most {MAX_HEADER_BYTES} are accepted. Send large data in the body.",
                             code="request_header_fields_too_large")
        elif path != "/health" and tenant is None:
            error = ApiError(401, "Missing or wrong API key: send Authorization: Bearer <key>.",
                             kind="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if error is None and length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            error = ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                             code=REQUEST_TOO_LARGE)
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


class Server:
    """What every route reads: the engine, its worker and metrics, the passages kept between
    requests (serving.reuse), the model's names and the request limits. One per app, in
    ``app.state.server``."""

    def __init__(self, engine: BlendEngine, *, queue_size: int, request_timeout_s: float, max_body_bytes: int,
                 model_name: str | None, max_batch: int, max_kv_bytes: int | None, tenants: Tenants | None = None,
                 max_completion_tokens: int = SERVER_DEFAULTS.max_completion_tokens):
        self.engine, self.request_timeout_s, self.max_body_bytes = engine, request_timeout_s, max_body_bytes
        self.tenants = tenants or Tenants()
        self.worker, self.metrics = Worker(queue_size, max_batch, max_kv_bytes), Metrics()
        self.model_id = model_name or engine.name
        # The most tokens one answer may ask for (OpenAI's limit per model): never past the window.
        self.max_completion_tokens = min(max_completion_tokens, engine.context_window)
        # Passages of the requests' plain text, stored between requests (serving.reuse).
        self.keeper = PassageKeeper(engine, self.worker.submit, lambda: self.worker.load, queued=self.worker.queued)
        self.separator_ids = engine.tokenize(BLEND_SPECIAL_STR)
        self.limit = TextLimit(engine)
        self.special_head, self.special_tail = _special_tokens(engine)

    @property
    def background_jobs(self) -> int:
        """The server's own work, waiting or running: the worker's passage storing and the engine's
        (KV write-backs, a conversation's history pieces); /health's ``background_jobs``."""
        return self.worker.background_jobs + self.engine.background_jobs()

    def error_response(self, err: BaseException, path: str) -> JSONResponse:
        """``err`` as an OpenAI-shaped error response, logged and counted."""
        if not isinstance(err, ApiError):
            if isinstance(err, PromptTooLongError):   # found once tokenized: the field that holds the text is named
                err = ApiError(400, str(err), param=TOO_LONG_PARAM.get(path), code=CONTEXT_LENGTH_EXCEEDED)
            elif isinstance(err, (InvalidInputError, RagblendError)):   # the engine's refusal of what was sent
                err = ApiError(400, str(err), code=INVALID_VALUE)
            else:
                log.error("internal error on %s", route_label(path), exc_info=err)
                err = ApiError(500, "Internal server error; see the server's log.", kind="server_error")
        if isinstance(err, ClientGone):
            log.info("client disconnected from %s before its answer; its work was stopped", route_label(path))
        elif err.status < 500:   # a 500 is logged above, with its traceback
            log.info("%s %d: %s", route_label(path), err.status, err.message[:200])
        self.metrics.request(path, err.status)
        headers = {"Retry-After": "1"} if err.status == 429 else {}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def record(self, path: str, stats: Stats | None = None, what: str = "") -> None:
        """Count a request answered 200 and log its one line (errors: error_response)."""
        self.metrics.request(path, 200)
        if stats is not None:
            what = (f"{stats.prompt_tokens} prompt tokens ({cached_tokens(stats)} cached), "
                    f"{stats.generated_tokens} generated, TTFT {stats.ttft_s:.3f} s, {stats.finish_reason}")
        log.info("%s 200: %s", route_label(path), what)

    async def read_json(self, request: Request) -> dict:
        """The request's body: a JSON object, size-checked; its ``model`` a string."""
        body = bytearray()
        async for piece in request.stream():   # also bounds bodies sent without a Content-Length
            body += piece
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                               code=REQUEST_TOO_LARGE)
        data = await run_in_threadpool(parse_json, bytes(body), MAX_JSON_VALUES + self.engine.context_window)
        if not isinstance(data, dict):
            raise ApiError(400, "The request body must be a JSON object.", code=INVALID_TYPE)
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "model must be a string.", param="model", code=INVALID_TYPE)
        # Any name is served by the one model (ChatOpenAI sends "gpt-3.5-turbo" unless told
        # otherwise), but /v1/models lists only the served name: a name one tenant sent is no
        # other tenant's business.
        return data

    def namespace_of(self, request: Request, body: dict) -> str:
        """The namespace a request reads and stores KV in (its tenant's, salt's and user's: see
        :mod:`.tenants`; "" is the shared one)."""
        return self.tenants.namespace(getattr(request.state, "tenant", None) or OPERATOR, body)

    async def run_job(self, request: Request, run: Callable[[Job], Any]):
        """Run ``run`` in the worker; its result (its error raised here)."""
        call = Call(self, request, run)
        try:
            return await call.until("done")
        finally:
            call.close()


def _special_tokens(engine: BlendEngine) -> tuple[list[int], list[int]]:
    """What the tokenizer adds before and after a text with add_special_tokens (a BOS, say), so
    that /tokenize can tokenize the text itself through the engine's own tokenize."""
    probe = "a"
    with_specials = list(engine.tokenizer(probe, add_special_tokens=True)["input_ids"])
    bare = engine.tokenize(probe)
    at = next((i for i in range(len(with_specials)) if with_specials[i:i + len(bare)] == bare), 0)
    return with_specials[:at], with_specials[at + len(bare):]


class Call:
    """One request's job, seen from its handler: the job's events, the deadline, and a
    watch on the client's connection (a disconnect cancels the job)."""

    def __init__(self, server: Server, request: Request, run: Callable[[Job], Any],
                 awaits_storing: bool | Callable[[], bool] = False):
        loop = asyncio.get_running_loop()
        self.loop, self.events, self.timeout_s = loop, asyncio.Queue(), server.request_timeout_s
        self.job = Job(run, lambda item: loop.call_soon_threadsafe(self.events.put_nowait, item),
                       awaits_storing=awaits_storing)
        self.deadline = loop.time() + self.timeout_s
        self.finished = False
        server.worker.submit(self.job)   # a full queue raises 429 here, before any response starts
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
            raise ApiError(504, f"The request took longer than {self.timeout_s:g} s.",
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


# ---------------------------------------------------------------------------- completions


class Reply:
    """One completion's answer in the OpenAI shapes: its id, and its choice whole or as SSE chunks."""

    def __init__(self, model_id: str, chat: bool):
        self.model_id, self.chat = model_id, chat
        self.created, self.ident = int(time.time()), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def choice(self, text: str | None, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        message = ({} if text is None else {"content": text}) if delta else {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): message, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, stats: Stats) -> dict:
        return {"id": self.ident, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": [self.choice(text, stats.finish_reason, False)],
                "usage": usage(stats), "ragblend": dict(stats.__dict__)}

    def event(self, data: dict) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps({'id': self.ident, 'object': kind, 'created': self.created, 'model': self.model_id, **data})}\n\n".encode()


def _decode_job(server: Server, body: dict, layout_of: Callable[[], PromptLayout],
                arrived: float | None = None) -> Callable[[Job], Decode]:
    """The worker's side of a completion: tokenize (``layout_of``); the worker then prefills and
    decodes the returned :class:`Decode` in its batch. Its TTFT counts from ``arrived``
    (``time.perf_counter()`` when the request came), its wait in the queue included."""
    engine, strategy = server.engine, requested_strategy(body)
    began: list[float] = []
    arrived = time.perf_counter() if arrived is None else arrived

    def run(job: Job) -> Decode:
        layout = layout_of()
        params = sampling(body, engine, len(layout.token_ids), server.max_completion_tokens)
        job.emit(("ready", None))
        positions = min(len(layout.token_ids) + params.max_new_tokens, engine.context_window)

        def start():
            began.append(time.perf_counter())
            return engine.begin(layout, strategy=strategy, params=params)
        return Decode(start, kv_bytes_for(engine.adapter, positions, engine.answers.kv_dtype), finished)

    def finished(decoding) -> Stats:
        stats = engine.finish(decoding)
        # What a client waits for: the queue (other requests' steps, a storing job's last layer) and the tokenizing too.
        stats.queued_s = max(0.0, began[0] - arrived) if began else 0.0
        stats.ttft_s += stats.queued_s
        server.metrics.answer(stats)
        return stats

    return run


async def answer(server: Server, request: Request, path: str, body: dict, layout_of: Callable[[], PromptLayout],
                 chat: bool, texts: list[str], namespace: str, ids_of: Callable[[], list[int]] | None = None):
    """Answer a completion; then store the KV of ``texts`` (the passages of its plain
    text) in ``namespace`` between requests, so that the next prompt of that namespace holding
    them reuses it. ``ids_of``: the prompt's token ids, cheaper than ``layout_of`` (no chunks
    looked for), where a storing job under way asks which passages the prompt reads."""
    check_options(body, server.max_completion_tokens)   # a 400 now, not after the queue
    # Whatever route laid the prompt out, its K/V are its tenant's in the prefix tier (core.decode.prefix_cache),
    # even where --shared-cache shares passages: prompts and answers are never shared.
    own = server.tenants.namespace(getattr(request.state, "tenant", None) or OPERATOR, body, own=True)
    laid_out: list[PromptLayout] = []   # the prompt as the worker laid it out: which passages it read stored

    def own_layout() -> PromptLayout:
        laid_out.append(dataclasses.replace(layout_of(), namespace=own))
        return laid_out[-1]
    run = _decode_job(server, body, own_layout, getattr(request.state, "arrived", None))
    reply = Reply(server.model_id, chat)
    # A prompt that will read passages still being stored lets the storing finish; any other (one
    # whose passages lie in the prefix its tenant's prefix tier holds too) makes it yield (serving.reuse).
    awaits = server.keeper.awaited_by(texts, namespace, ids_of or (lambda: layout_of().token_ids), own,
                                      reads_tier=requested_strategy(body) is None)
    call = Call(server, request, run, awaits_storing=awaits)
    if not body.get("stream"):
        pieces: list[str] = []
        try:
            stats = await call.until("done", pieces.append)
        finally:
            call.close()
        server.record(path, stats)
        server.keeper.add(texts, namespace, laid_out[-1] if laid_out else None)
        return JSONResponse(reply.whole("".join(pieces), stats))

    # Streaming: wait until the prompt is tokenized and checked, so that a bad prompt is a
    # real 400 (not an error event after a 200); from then on the stream reports errors.
    try:
        await call.until("ready")
    except BaseException:
        call.close()
        raise
    call.stop_watching()   # the streaming response listens for the disconnect from here on
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def ended() -> None:
        call.close()
        if not call.finished:
            log.info("client disconnected from %s during its stream; its generation was stopped", route_label(path))
            server.metrics.request(path, CLIENT_CLOSED)

    return Stream(_events(server, call, reply, path, include_usage, texts, namespace, laid_out), ended)


async def _events(server: Server, call: Call, reply: Reply, path: str, include_usage: bool,
                  texts: list[str], namespace: str, laid_out: list[PromptLayout]) -> AsyncIterator[bytes]:
    """A streamed completion's SSE events, through ``[DONE]``."""
    if reply.chat:
        yield reply.event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
    try:
        while True:
            kind, value = await call.next()
            if kind == "item":
                yield reply.event({"choices": [reply.choice(value, None, True)]})
            elif kind == "done":
                break
    except Exception as err:   # not CancelledError: a client gone is handled by the Stream's on_end
        response = server.error_response(err, path)
        call.finished = True
        yield f"data: {response.body.decode()}\n\n".encode()
    else:
        last = {"choices": [reply.choice(None if reply.chat else "", value.finish_reason, True)],
                "ragblend": dict(value.__dict__)}
        if not include_usage:   # usage rides on the last chunk (ChatOpenAI.stream shows it as is)
            last["usage"] = usage(value)
        yield reply.event(last)
        if include_usage:   # the OpenAI way: a chunk of its own, with no choices
            yield reply.event({"choices": [], "usage": usage(value)})
        server.record(path, value)
        server.keeper.add(texts, namespace, laid_out[-1] if laid_out else None)
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------- routes


router = APIRouter()


def endpoint(path: str):
    """A route handler of ``path`` taking ``(server, request)``, its errors answered as
    OpenAI-shaped responses."""
    def wrap(handler: Callable[[Server, Request], Awaitable[Any]]):
        async def handle(request: Request):
            server = request.app.state.server
            try:
                return await handler(server, request)
            except Exception as err:
                return server.error_response(err, path)
        return handle
    return wrap


@router.get("/health")
async def health(request: Request):
    server = request.app.state.server
    # queue_depth: the clients' requests only; the server's own storing of passages is background_jobs.
    return {"status": "ok", "model": server.model_id, "queue_depth": server.worker.depth,
            "background_jobs": server.background_jobs}


@router.get("/v1/models")
async def models(request: Request):
    server = request.app.state.server
    server.metrics.request("/v1/models", 200)
    # Only the served model (its --model-name, as started): any name a request sends is served by it,
    # but listing those names would show one tenant's to every other.
    return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0, "owned_by": "ragblend",
                                        "root": server.model_id, "max_model_len": server.engine.context_window,
                                        "max_completion_tokens": server.max_completion_tokens}]}


@router.get("/metrics")
async def prometheus(request: Request):
    server = request.app.state.server
    return PlainTextResponse(server.metrics.text(server.worker.depth, server.engine.store, server.keeper,
                                                   server.engine.prefix_info(), server.engine.pieces_info(),
                                                   background_jobs=server.background_jobs),
                             media_type="text/plain; version=0.0.4")


@router.post("/v1/chat/completions")
@endpoint("/v1/chat/completions")
async def chat_completions(server: Server, request: Request):
    body = await server.read_json(request)
    prompt = ChatPrompt.parse(body.get("messages"), server.limit)
    check_options(body)
    namespace = server.namespace_of(request, body)
    # A conversation's earlier turns are kept as the engine's history pieces (for its own strategy), not as passages.
    pieces = is_conversation(prompt.history) and getattr(getattr(server.engine, "runner", None), "keeps_pieces", False) \
        and requested_strategy(body) is None
    return await answer(server, request, "/v1/chat/completions", body,
                        lambda: prompt.layout(server.engine, namespace=namespace).as_chat(), True,
                        prompt.passages(history=not pieces), namespace,
                        lambda: prompt.layout(server.engine, find_chunks=False, namespace=namespace).token_ids)


@router.post("/v1/completions")
@endpoint("/v1/completions")
async def completions(server: Server, request: Request):
    body = await server.read_json(request)
    engine = server.engine
    prompt = check_prompt(body.get("prompt"), server.limit, engine.entry_spec.vocab_size, engine.context_window)
    check_options(body)   # a bad request does no work
    namespace = server.namespace_of(request, body)
    if is_lmcache_warmup(prompt, server.separator_ids) and engine.write_back and \
            len(prompt) + len(engine.sink_ids) <= engine.context_window:
        # LMCache warms a chunk by sending it alone: store every entry /v1/chunks would (its lead one too,
        # which the prompt alone, with no template before it, would not), in the sender's namespace, and
        # only ids the server itself makes of some text (no template markup, nothing no text gives).
        await server.run_job(request, lambda job: _warm_up(engine, prompt, namespace))
    return await answer(server, request, "/v1/completions", body,
                        lambda: completion_layout(engine, prompt, server.separator_ids, namespace), False,
                        passages([], question=[prompt]) if isinstance(prompt, str) else [], namespace)


def _warm_up(engine: BlendEngine, ids: list[int], namespace: str) -> None:
    """Store a token-id chunk sent alone, where it is the engine's own tokenization of some text."""
    if engine.is_own_tokenization(ids):
        engine.precompute_ids([ids], namespace=namespace)
    else:
        log.info("a token-id chunk of %d tokens is not this model's tokenization of any text (template "
                 "markup, or ids no text gives); answered, not stored", len(ids))


@router.post("/v1/chunks")
@endpoint("/v1/chunks")
async def chunks(server: Server, request: Request):
    body = await server.read_json(request)
    request_body = ChunksRequest.of(body)   # its salt too, checked before any work
    texts, skip = request_body.texts, request_body.skip_unusable
    # A text over the character limit cannot fit the window: refused, or skipped, untokenized.
    fits = [len(t) <= server.limit.max_chars for t in texts]
    if not skip:
        for i, text in enumerate(texts):
            server.limit.check(len(text), f"texts[{i}]", f"texts[{i}]")
    kept = [t for t, ok in zip(texts, fits) if ok]
    namespace = server.namespace_of(request, body)   # the operator's chunks are shared, a tenant's its own
    refs = await server.run_job(request, lambda job: server.engine.precompute(kept, skip_unusable=skip,
                                                                              namespace=namespace) if kept else [])
    refs = iter(refs)
    refs = [next(refs) if ok else None for ok in fits]
    server.record("/v1/chunks", what=f"{sum(r is not None for r in refs)} of {len(refs)} texts stored")
    # With skip_unusable, a chunk too short to be found or too long for the window has no KV.
    # JSONResponse, not a dict: FastAPI's encoder would walk a large answer on the event loop.
    return JSONResponse({"object": "list", "data": [
        {"key": None, "tokens": 0, "stored": False} if r is None else
        {"key": r.key, "tokens": r.num_tokens, "stored": r.stored} for r in refs]})


@router.post("/tokenize")
@endpoint("/tokenize")
async def tokenize(server: Server, request: Request):
    body = await server.read_json(request)
    TokenizeRequest.of(body)
    ids = await server.run_job(request, _tokenize_job(server, body))
    server.record("/tokenize", what=f"{len(ids)} tokens")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.engine.context_window})


def _tokenize_job(server: Server, body: dict) -> Callable[[Job], list[int]]:
    """The worker's side of /tokenize: the token ids of the body's messages or prompt (checked here)."""
    engine = server.engine
    if "messages" in body:
        if body.get("add_generation_prompt") is False:
            raise ApiError(400, "add_generation_prompt=false is not supported: messages are tokenized as "
                                "the chat endpoint's prompt, which ends with the assistant's turn.",
                           param="add_generation_prompt", code=UNSUPPORTED_PARAMETER)
        # The very prompt the chat endpoint would build (the engine's PromptBuilder).
        prompt = ChatPrompt.parse(body["messages"], server.limit)
        return lambda job: prompt.layout(engine, find_chunks=False).token_ids
    text = body.get("prompt")
    if not isinstance(text, str):
        raise ApiError(400, "prompt must be a string (or send messages).", param="prompt",
                       code=MISSING_PARAMETER if text is None else INVALID_TYPE)
    server.limit.check(len(text), "prompt", "prompt")
    valid_text(text, "prompt")
    specials = body.get("add_special_tokens", True)

    def run(job: Job) -> list[int]:
        ids = engine.prompts.tokenize_bounded(text, engine.context_window)
        if isinstance(ids, TooLong):   # found by tokenizing no more than a bounded start of it, where it is long
            raise PromptTooLongError(f"prompt has {ids}, more than the model's context window "
                                     f"({engine.context_window}).")
        return server.special_head + ids + server.special_tail if specials else ids
    return run


def _endpoints() -> str:
    """The server's endpoints, ``"GET /health, ..., POST /tokenize"`` (a 404 lists them)."""
    return ", ".join(f"{method} {route.path}" for route in router.routes for method in sorted(route.methods - {"HEAD"}))


def _shown(text: str, limit: int = 200) -> str:
    """A client's path or method as a message may quote it: escaped unless plain printable ASCII
    (a decoded ``%0a`` would otherwise start a line of its own in the server's log), and bounded."""
    text = text[:limit]
    return text if text.isascii() and text.isprintable() else ascii(text)


async def _http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own refusals (a path no route has: 404; a method its route lacks: 405) in the
    OpenAI error shape, with a code and what to send instead."""
    path, method = request.scope["path"], request.method   # as sent (request.url strips tabs and newlines)
    if exc.status_code == 404:
        # The usual slip: a client's base_url without /v1 (the openai SDK adds only /chat/completions).
        hint = f" An OpenAI client's base_url ends in /v1: did you mean /v1{path}?" if f"/v1{path}" in ROUTES else ""
        bare = path.removeprefix("/v1")
        if path.startswith("/v1/") and bare in ROUTES:   # the other slip: a route outside /v1 asked under a /v1 base_url
            hint = f" {bare} has no /v1 prefix: send it to the server's root ({bare})."
        err = ApiError(404, f"No endpoint at {_shown(path)}.{hint} This server has: {_endpoints()}.", code=NOT_FOUND)
    elif exc.status_code == 405:
        allowed = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip() not in ("", "HEAD")]
        err = ApiError(405, f"{path} does not take {_shown(method, 20)}; send {' or '.join(allowed)}.",
                       code=METHOD_NOT_ALLOWED)
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    response = request.app.state.server.error_response(err, path)
    response.headers.update(exc.headers or {})   # a 405's Allow
    return response


def create_app(engine: BlendEngine, *, api_key: str | None = None, tenants: dict[str, str] | None = None,
               operator_key: str | None = None, shared_cache: bool = False, partition_by_user: bool = False,
               queue_size: int = SERVER_DEFAULTS.queue_size, request_timeout_s: float = SERVER_DEFAULTS.request_timeout_s,
               max_body_bytes: int = SERVER_DEFAULTS.max_body_bytes, model_name: str | None = None,
               max_batch: int = SERVER_DEFAULTS.max_batch, max_kv_bytes: int | None = SERVER_DEFAULTS.max_kv_bytes,
               max_completion_tokens: int = SERVER_DEFAULTS.max_completion_tokens):
    """The FastAPI app serving ``engine`` (see the module docstring). Up to ``max_batch``
    answers decode together, their KV buffers holding at most ``max_kv_bytes`` (serving.worker);
    a request may ask for at most ``max_completion_tokens`` (and the window's room), else 400.

    Keys (:mod:`.tenants`): ``api_key`` and ``operator_key`` are the operator's (a server with one
    key is one user's: its KV is the shared pool, as with no key); ``tenants`` maps each client's
    key to its tenant's name, whose requests find only the shared chunks and their own.
    ``shared_cache`` puts every tenant in the shared pool; ``partition_by_user`` splits a tenant's
    namespace by the requests' ``user`` field."""
    if queue_size < 1 or request_timeout_s <= 0 or max_body_bytes < 1024 or max_completion_tokens < 1:
        raise InvalidInputError("queue_size and max_completion_tokens must be >= 1, request_timeout_s > 0 and "
                                "max_body_bytes >= 1024.")
    who = Tenants.of(api_key, tenants, operator_key, shared_cache=shared_cache, partition_by_user=partition_by_user)
    server = Server(engine, queue_size=queue_size, request_timeout_s=request_timeout_s, max_body_bytes=max_body_bytes,
                    model_name=model_name, max_batch=max_batch, max_kv_bytes=max_kv_bytes, tenants=who,
                    max_completion_tokens=max_completion_tokens)
    app = FastAPI(title="ragblend", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.worker, app.state.keeper = server.worker, server.keeper   # for tests and tools: their counters
    app.add_middleware(Guard, tenants=who, max_body_bytes=max_body_bytes, refuse=server.error_response)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    return app


# uvicorn's settings for the server: the h11 parser, its head bounded by MAX_HEADER_BYTES.
UVICORN_SETTINGS = {"http": "h11", "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def uvicorn_config(app, host: str, port: int, **settings):
    """A uvicorn ``Config`` for ``app`` with :data:`UVICORN_SETTINGS` (for servers run in a thread)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, **UVICORN_SETTINGS, **settings)


def serve(engine: BlendEngine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          **options) -> None:
    """Serve ``engine`` with uvicorn until interrupted (``options``: :func:`create_app`'s)."""
    import uvicorn

    if api_key is None and not options.get("tenants") and options.get("operator_key") is None \
            and not is_loopback(host):
        log.warning("ragblend serve binds %s without an API key: anyone who can reach it can use the model. "
                    "Pass --api-key or set RAGBLEND_API_KEY.", host)
    app = create_app(engine, api_key=api_key, **options)
    # The model, tokenizer and libraries are a few million objects that live as long as the
    # process; left to the garbage collector, each full collection walks them all with the GIL
    # held (~0.1-0.4 s here, /health stalled meanwhile). Frozen, collections walk only what
    # requests allocate.
    gc.collect()
    gc.freeze()
    if not log.handlers:   # one line per request on stderr (uvicorn's access log stays off)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    uvicorn.run(app, host=host, port=port, log_level="warning", **UVICORN_SETTINGS)
