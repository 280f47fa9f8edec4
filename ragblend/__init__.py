"""ragblend: fast RAG on local models by fusing precomputed per-chunk KV caches (CacheBlend)."""

from .core.engine import BlendEngine, Generation, Prefill, Stats
from .core.errors import (InvalidInputError, ModelNotFoundError, PromptTooLongError, RagblendError,
                          SegmentTypeError, UnsupportedModelError)
from .core.fusion import CacheBlend, FullRecompute, FullReuse, LegoLink
from .core.kv import ChunkRef
from .core.prompt import Chunk

__version__ = "0.1.0"

__all__ = [
    "BlendEngine", "Chunk", "ChunkRef", "CacheBlend", "LegoLink", "FullReuse", "FullRecompute",
    "Generation", "Prefill", "Stats", "RagblendError", "InvalidInputError", "SegmentTypeError",
    "PromptTooLongError", "UnsupportedModelError", "ModelNotFoundError",
]
