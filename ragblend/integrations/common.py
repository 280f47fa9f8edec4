"""Helpers shared by the framework integrations; imports no framework."""

from __future__ import annotations

import asyncio
import threading

from ragblend.core.engine import BlendEngine
from ragblend.core.fusion import STRATEGY_NAMES, strategy_from_name  # noqa: F401 (re-exported)


def make_strategy(name: str, ratio: float | str | None = None, legolink_k: int = 16):
    """A strategy object from its name (as used in configuration and the CLI); None for
    "default", the engine's own calibrated choice."""
    return strategy_from_name(name, ratio, legolink_k)


def lazy_engine(owner) -> BlendEngine:
    """``owner``'s engine, loaded on first use from its ``model_path`` and ``kv_dir``
    (``owner`` has ``_engine`` and ``_lock`` private attributes)."""
    with owner._lock:
        if owner._engine is None:
            owner._engine = BlendEngine.from_pretrained(owner.model_path, kv_dir=owner.kv_dir)
    return owner._engine


async def iterate_in_thread(make_iterator):
    """Consume a blocking iterator in a worker thread, yielding its items to the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def pump():
        try:
            for item in make_iterator():
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as err:  # handed to the consumer below
            loop.call_soon_threadsafe(queue.put_nowait, err)
        loop.call_soon_threadsafe(queue.put_nowait, done)

    threading.Thread(target=pump, daemon=True, name="ragblend-stream").start()
    while True:
        item = await queue.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
