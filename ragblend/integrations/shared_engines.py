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
import threading
import weakref
from pathlib import Path

import torch

from ragblend.core.engine import BlendEngine
from ragblend.core.options import EngineOptions

_engines: "weakref.WeakValueDictionary[EngineOptions, BlendEngine]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


class _Load:
    """One key's load: its lock (a second caller of the same model waits for the first one's load
    instead of loading it again; callers of other models are not held up by it) and how many
    callers are loading or waiting, so that the entry goes once none is (an app that builds many
    distinct models keeps no lock for each)."""

    def __init__(self):
        self.lock, self.callers = threading.Lock(), 0


_loading: dict[EngineOptions, _Load] = {}


def _path_key(path):
    """A model or KV path as one spelling: ``~`` expanded, absolute, symbolic links resolved."""
    return str(Path(path).expanduser().resolve()) if path else path


def _default_model_key():
    """The embedded default model's file, so that naming it shares the engine of ``model=None``;
    None where it is not installed (the load says so)."""
    from ragblend.core.errors import ModelNotFoundError
    from ragblend.core.model.loading import default_gguf_path

    try:
        return _path_key(default_gguf_path())
    except ModelNotFoundError:
        return None


def _key(options: EngineOptions) -> EngineOptions:
    """``options`` spelled one way, so that equivalent options share an engine: paths as
    :func:`_path_key` writes them ("model.gguf", "./model.gguf", "~/m/model.gguf" and a link to
    it are one model), no model as the default model's own file, dtypes by name
    (``torch.float32`` is "float32") and dtype "auto" as None (both the default)."""
    def named(value):
        return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value

    model = _path_key(options.model) if options.model is not None else _default_model_key()
    dtype = named(options.dtype)
    return dataclasses.replace(options, model=model, kv_dir=_path_key(options.kv_dir),
                               dtype=None if dtype == "auto" else dtype, kv_dtype=named(options.kv_dtype))


def shared_engine(options: EngineOptions) -> BlendEngine:
    """The process's engine for ``options``, loaded (``BlendEngine.from_pretrained``) on the
    first call with them and shared by every later one while anything holds it."""
    key = _key(options)
    with _registry_lock:
        engine = _engines.get(key)
        if engine is not None:
            return engine
        load = _loading.setdefault(key, _Load())
        load.callers += 1
    try:
        with load.lock:
            with _registry_lock:
                engine = _engines.get(key)
            if engine is None:   # not loaded by a caller this one waited for
                engine = BlendEngine.from_pretrained(options=options)
                with _registry_lock:
                    _engines[key] = engine
    finally:
        with _registry_lock:
            load.callers -= 1
            if not load.callers:
                del _loading[key]
    return engine


def loaded_engines() -> list[BlendEngine]:
    """The engines the registry holds now (for tests and diagnostics)."""
    with _registry_lock:
        return list(_engines.values())


def pending_loads() -> int:
    """How many keys have a load lock now: loads in progress or waited for (for tests)."""
    with _registry_lock:
        return len(_loading)
