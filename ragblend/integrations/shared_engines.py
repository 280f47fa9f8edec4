"""One local engine per (model, engine options) in the process, for the integrations.

``BlendLLM(model_path=X)`` and ``BlendChatModel(model_path=X)`` each load their engine on first
use. An app that uses both, or two BlendLLMs with different sampling, would load the model (and
open its KV store) twice: twice the memory, and two stores that do not see each other's writes
in memory. :func:`shared_engine` hands them the same :class:`~ragblend.BlendEngine` instead.

Sharing is safe: the engine serialises its model passes under its own lock (several threads
may answer through one engine; see :class:`~ragblend.BlendEngine`), and the integrations take
their per-call stats from the call, not from ``engine.last_stats``. The registry holds its
engines weakly: once no integration (nor anything else) holds an engine, it is freed, and the
next one asking for it loads it again.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref

from ragblend.core.engine import BlendEngine
from ragblend.core.options import EngineOptions

_engines: "weakref.WeakValueDictionary[EngineOptions, BlendEngine]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
# One lock per key while its engine loads: a second caller of the same model waits for the first
# one's load instead of loading it again; callers of other models are not held up by it.
_loading: dict[EngineOptions, threading.Lock] = {}


def _key(options: EngineOptions) -> EngineOptions:
    """``options`` with its paths absolute, so "model.gguf" and "./model.gguf" share an engine."""
    def absolute(path):
        return os.path.abspath(os.fspath(path)) if path else path
    return dataclasses.replace(options, model=absolute(options.model), kv_dir=absolute(options.kv_dir))


def shared_engine(options: EngineOptions) -> BlendEngine:
    """The process's engine for ``options``, loaded (``BlendEngine.from_pretrained``) on the
    first call with them and shared by every later one while anything holds it."""
    key = _key(options)
    with _registry_lock:
        engine = _engines.get(key)
        if engine is not None:
            return engine
        loading = _loading.setdefault(key, threading.Lock())
    with loading:
        with _registry_lock:
            engine = _engines.get(key)
        if engine is None:   # not loaded by a caller this one waited for
            engine = BlendEngine.from_pretrained(options=options)
            with _registry_lock:
                _engines[key] = engine
    return engine


def loaded_engines() -> list[BlendEngine]:
    """The engines the registry holds now (for tests and diagnostics)."""
    with _registry_lock:
        return list(_engines.values())
