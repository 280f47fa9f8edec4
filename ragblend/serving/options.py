"""The server's settings, declared once (as :class:`~ragblend.core.options.EngineOptions` declares
the engine's): :func:`~ragblend.serving.app.create_app` takes them as keywords, with these
defaults, and ``ragblend serve``'s flags default to them. Needs no web framework."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    """How much work ``ragblend serve`` takes on at once, and for how long."""

    queue_size: int = 16                 # requests that may wait; more get 429
    request_timeout_s: float = 300.0     # how long a request may wait and run; then 504
    max_body_bytes: int = 4 << 20        # the largest request body; then 413
    max_batch: int = 8                   # answers decoded together: kernels.DRAFT_ROWS, the most rows a
    #                                      decoding pass runs (its LM head's kernel takes no more)
    max_kv_bytes: int | None = 2 << 30   # KV buffers of the answers being decoded: ~45 answers of 1,000
    #                                      positions with SmolLM2 (46 KB a position); None: no limit
    max_completion_tokens: int = 4096    # tokens one answer may ask for (and gets unasked; never past the
    #                                      model's window); more is a 400, as OpenAI's per-model limit


SERVER_DEFAULTS = ServerOptions()
