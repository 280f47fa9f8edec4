"""ragblend: fast RAG on local models by fusing precomputed per-chunk KV caches (CacheBlend)."""

from .core.decode.generate import SamplingParams
from .core.engine import BlendEngine, Generation, Prefill, Stats
from .core.errors import (
    InvalidInputError,
    InvalidTypeError,
    ModelFileError,
    ModelNotFoundError,
    PromptTooLongError,
    RagblendError,
    SegmentTypeError,
    StoreUnavailableError,
    UnsupportedModelError,
)
from .core.fusion.strategies import CacheBlend, FullRecompute, FullReuse, LegoLink, QueryAware
from .core.options import EngineOptions
from .core.prompt import Chunk
from .core.store.kv import ChunkRef

__version__ = "0.1.0"

# Framework integrations are optional extras: imported on first use, so `import ragblend`
# needs neither LlamaIndex nor LangChain.
_LAZY = {
    "BlendLLM": "ragblend.integrations.llamaindex_llm",
    "BlendSynthesizer": "ragblend.integrations.llamaindex_synthesizer",
    "KVPrecompute": "ragblend.vectorstore_hooks.llamaindex",
    "BlendChatModel": "ragblend.integrations.langchain_chat",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as err:   # its framework is an extra: say how to install it
            from .core.extras import missing_extra

            hint = missing_extra(err.name, name)
            if hint is None:
                raise
            raise hint from None
        return getattr(module, name)
    raise AttributeError(f"module 'ragblend' has no attribute {name!r}")

__all__ = [
    "BlendEngine", "EngineOptions", "Chunk", "ChunkRef", "CacheBlend", "QueryAware", "LegoLink", "FullReuse", "FullRecompute",
    "Generation", "Prefill", "Stats", "SamplingParams", "RagblendError", "InvalidInputError", "InvalidTypeError", "SegmentTypeError",
    "PromptTooLongError", "UnsupportedModelError", "ModelNotFoundError", "ModelFileError", "StoreUnavailableError",
    "BlendLLM", "BlendSynthesizer", "KVPrecompute", "BlendChatModel",
]
