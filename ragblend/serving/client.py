"""RemoteEngine: the engine's interface over HTTP, for BlendLLM, BlendChatModel and the
ingestion hooks when the model runs in a server.

Two backends speak the OpenAI API:

* ``"ragblend"`` — a ``ragblend serve``. Chunks travel as chat content blocks marked
  ``"cache_control": {"type": "ephemeral"}`` (plain text is searched for stored chunks by
  the server, as the local engine does); ``precompute`` warms the server's store through
  ``POST /v1/chunks``; every answer carries the server's full stats in its ``ragblend``
  field.
* ``"vllm-lmcache"`` — a vLLM server with LMCache blending on. Prompts go to
  ``/v1/completions`` as token ids in LMCache's convention: the template's start, then each
  chunk, then the question and the template's end, separated by the token ids of
  ``blend_special_str`` (``" # # "``). Each segment is tokenized on its own, so no token
  merges across a boundary. ``precompute`` warms each chunk with a ``max_tokens=1`` request.
  Tokens come from the server's ``/tokenize`` (vLLM's, and ``ragblend serve``'s) unless a
  local ``tokenizer`` is given.

Example::

    from ragblend.serving.client import RemoteEngine
    from ragblend import BlendLLM

    engine = RemoteEngine("http://127.0.0.1:8000", api_key="...")
    engine.precompute(["First chunk ...", "Second chunk ..."])
    llm = BlendLLM(engine=engine)            # or BlendLLM(base_url=..., api_key=...)
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Sequence

from ragblend.core.decode.generate import SamplingParams, sampling_params
from ragblend.core.engine import Stats, TextStream
from ragblend.core.errors import InvalidInputError, PromptTooLongError, RagblendError
from ragblend.core.prompt import Chunk, PromptBuilder, check_segments, check_text
from ragblend.core.store.kv import ChunkRef

from .protocol import BLEND_SPECIAL_STR, blocks_of, lmcache_ids, read_stats, strategy_to_json

log = logging.getLogger("ragblend")

Backend = Literal["ragblend", "vllm-lmcache"]
BACKENDS = ("ragblend", "vllm-lmcache")


class RemoteError(RagblendError, ConnectionError):
    """The server could not be reached, or answered with an error."""


@dataclass
class RemotePrompt:
    """A prompt for a server: the system text, earlier turns and the last user message's
    segments (:class:`~ragblend.Chunk` s marked for reuse, plain strings as they are)."""

    segments: list
    system: str | None = None
    history: list = field(default_factory=list)   # (role, text) turns before the last

    def as_chat(self) -> "RemotePrompt":
        """As it is: the server marks a chat request's turns itself (``PromptLayout.as_chat``)."""
        return self


@dataclass
class RemoteGeneration:
    """Result of :meth:`RemoteEngine.generate` (text and stats, as the server reported them)."""

    text: str
    finish_reason: str | None
    stats: Stats


class RemoteEngine:
    """The subset of :class:`~ragblend.BlendEngine` the integrations use, answered by a server.

    ``base_url`` is the server's root (``http://host:port``, with or without ``/v1``);
    ``model`` the served model's id (default: the first of ``GET /v1/models``).
    """

    min_chunk_tokens = 16

    def __init__(self, base_url: str, *, api_key: str | None = None, backend: Backend = "ragblend",
                 model: str | None = None, timeout_s: float = 300.0, tokenizer=None,
                 blend_special_str: str = BLEND_SPECIAL_STR):
        import httpx

        if backend not in BACKENDS:
            raise InvalidInputError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise InvalidInputError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000, got {base_url!r}.")
        root = base_url.rstrip("/")
        self.base_url = root[:-3] if root.endswith("/v1") else root
        self.backend, self.blend_special_str = backend, blend_special_str
        if hasattr(api_key, "get_secret_value"):   # a pydantic SecretStr: its str() is "**********"
            api_key = api_key.get_secret_value()
        if api_key is not None and not isinstance(api_key, str):
            raise InvalidInputError(f"api_key must be a str, got {type(api_key).__name__}.")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self._tokenizer = tokenizer
        # Local tokenization goes through a PromptBuilder: text is tokenized as text.
        self._prompts = None if tokenizer is None else PromptBuilder(tokenizer)
        self.last_stats = None
        listed = self._request("GET", "/v1/models")["data"]
        if not listed:
            raise RemoteError(f"The server at {self.base_url} serves no model.")
        entry = next((m for m in listed if m["id"] == model), None) if model else listed[0]
        if entry is None and backend == "ragblend":   # ragblend serves any name with its one model
            entry = dict(listed[0], id=model)
        if entry is None:
            raise InvalidInputError(f"The server at {self.base_url} does not serve {model!r}; it serves "
                                    f"{', '.join(m['id'] for m in listed)}.")
        self.name = entry["id"]
        self.fingerprint = f"{self.backend}:{self.base_url}:{self.name}"
        self.context_window = int(entry.get("max_model_len") or entry.get("context_window") or 4096)

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as err:
            raise RemoteError(f"Cannot reach {self.base_url}{path} ({type(err).__name__}: {err}). "
                              "Is the server running, and is base_url right?") from None
        self._check(response, path)
        return response.json()

    def _check(self, response, path: str) -> None:
        if response.status_code < 400:
            return
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:300]
        cls = PromptTooLongError if "window" in message or "too long" in message else (
            InvalidInputError if response.status_code in (400, 404, 413, 422) else RemoteError)
        raise cls(f"{self.base_url}{path} answered {response.status_code}: {message}")

    def _events(self, path: str, body: dict) -> Iterator[dict]:
        """The JSON events of a server-sent-event stream."""
        import httpx

        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response, path)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise RemoteError(f"{self.base_url}{path}: {event['error'].get('message', event['error'])}")
                    yield event
        except httpx.HTTPError as err:
            raise RemoteError(f"The stream from {self.base_url}{path} broke ({type(err).__name__}: {err}).") from None

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ tokens

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (the local tokenizer if given, else
        the server's ``/tokenize``)."""
        check_text(text, "text")
        if self._prompts is not None:
            return self._prompts.tokenize(text)
        body = {"model": self.name, "prompt": text, "add_special_tokens": False}
        return list(self._request("POST", "/tokenize", body)["tokens"])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    # ------------------------------------------------------------------ chunks

    def precompute(self, texts: str | Iterable[str], *, progress: bool = False,
                   skip_unusable: bool = False) -> list[ChunkRef | None]:
        """Warm the server's KV for each text; returns what the server stored (None for a
        chunk skipped with ``skip_unusable``, as :meth:`BlendEngine.precompute` does)."""
        if isinstance(texts, str):
            texts = [texts]
        texts = [check_text(t, "chunk") for t in texts]
        if self.backend == "ragblend":
            refs = self._request("POST", "/v1/chunks", {"model": self.name, "texts": texts,
                                                          "skip_unusable": skip_unusable})["data"]
            return [None if not r.get("key") else ChunkRef(r["key"], int(r["tokens"]), bool(r["stored"]))
                    for r in refs]
        refs = []
        for text in texts:
            ids = self.tokenize(text)
            if skip_unusable and not self.min_chunk_tokens <= len(ids) <= self.context_window:
                refs.append(None)
                continue
            self._request("POST", "/v1/completions", {"model": self.name, "prompt": ids, "max_tokens": 1,
                                                       "temperature": 0})
            refs.append(ChunkRef(hashlib.sha256(json.dumps(ids).encode()).hexdigest(), len(ids)))
        return refs

    def forget(self, keys: Iterable[str]) -> int:
        """The server's store evicts by itself (LRU); nothing is dropped from here."""
        return 0

    def remember_chunk(self, text: str) -> str:
        """The server finds stored chunks itself; nothing to remember here."""
        return ""

    # ------------------------------------------------------------------ prompts

    def build_prompt(self, segments: Sequence, *, system: str | None = None,
                     history: Sequence[tuple[str, str]] = (), separator: str | None = None) -> RemotePrompt:
        segments = check_segments(segments)
        if separator == "":   # segments already carry their own spacing: keep them as one message
            return RemotePrompt(list(segments), system, list(history))
        joined: list = []
        for segment in segments:
            if joined:
                joined.append("\n\n")
            joined.append(segment)
        return RemotePrompt(joined, system, list(history))

    def find_chunks(self, prompt: str, *, system: str | None = None,
                    history: Sequence[tuple[str, str]] = ()) -> RemotePrompt:
        return RemotePrompt([check_text(prompt, "prompt")], system, list(history))

    # ------------------------------------------------------------------ generation

    def stream(self, prompt: RemotePrompt | Sequence, *, system: str | None = None, strategy=None,
               params: SamplingParams | None = None, **sampling) -> TextStream:
        """Stream the answer's text from the server; ``stats`` complete once exhausted."""
        if not isinstance(prompt, RemotePrompt):
            prompt = self.build_prompt(prompt, system=system)
        params = sampling_params(params, **sampling)   # as BlendEngine.stream takes them
        stream = TextStream()
        stream.stats = Stats()
        path, body = self._request_body(prompt, strategy, params)
        stream._deltas = self._deltas(path, body, stream.stats)
        return stream

    def generate(self, prompt: RemotePrompt | Sequence, **options) -> RemoteGeneration:
        stream = self.stream(prompt, **options)
        text = "".join(stream)
        return RemoteGeneration(text, stream.stats.finish_reason, stream.stats)

    def _deltas(self, path: str, body: dict, stats) -> Iterator[str]:
        for event in self._events(path, body):
            for choice in event.get("choices") or ():
                delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if delta:
                    yield delta
                if choice.get("finish_reason"):
                    stats.finish_reason = choice["finish_reason"]
            read_stats(stats, event)
        self.last_stats = stats

    def _request_body(self, prompt: RemotePrompt, strategy, params: SamplingParams) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": self.name, "stream": True, "stream_options": {"include_usage": True},
                                "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if self.backend == "vllm-lmcache":
            body["prompt"] = self._lmcache_ids(prompt)
            return "/v1/completions", body
        if strategy is not None:
            body["ragblend"] = strategy_to_json(strategy)   # every setting, not just the name
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        messages += [{"role": role, "content": text} for role, text in prompt.history]
        messages.append({"role": "user", "content": blocks_of(prompt.segments)})
        body["messages"] = messages
        return "/v1/chat/completions", body

    def _lmcache_ids(self, prompt: RemotePrompt) -> list[int]:
        """LMCache's blending prompt: template start (+ system), each chunk, then the rest of the
        user message and the template's end, separated by ``blend_special_str``'s tokens."""
        head, tail = self._template_parts(prompt)
        segments, text = [], ""
        for segment in prompt.segments:
            if isinstance(segment, Chunk):
                if text.strip():
                    segments.append(self.tokenize(text))
                segments.append(self.tokenize(segment.text))
                text = ""
            else:
                text += segment
        segments.append(self.tokenize(text) + list(tail))
        return lmcache_ids(head, segments, self.tokenize(self.blend_special_str))

    def _template_parts(self, prompt: RemotePrompt) -> tuple[list[int], list[int]]:
        """Token ids of the chat template before and after the last user message: the parts
        two renders with different user texts share at their start and at their end (rendered
        by the local tokenizer, or by the server's ``/tokenize``, which takes chat messages)."""
        renders = [self._render(prompt, text) for text in ("Hello", "Goodbye")]
        head = 0
        while head < min(map(len, renders)) and renders[0][head] == renders[1][head]:
            head += 1
        tail = 0
        while tail < min(map(len, renders)) - head and renders[0][-1 - tail] == renders[1][-1 - tail]:
            tail += 1
        return renders[0][:head], renders[0][len(renders[0]) - tail:]

    def _render(self, prompt: RemotePrompt, user_text: str) -> list[int]:
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        messages += [{"role": r, "content": t} for r, t in prompt.history] + [{"role": "user", "content": user_text}]
        if self._tokenizer is None:
            body = {"model": self.name, "messages": messages, "add_generation_prompt": True}
            return list(self._request("POST", "/tokenize", body)["tokens"])
        if not self._prompts.use_chat_template:
            return self._prompts.tokenize(user_text)
        return self._prompts.chat_ids(messages)

