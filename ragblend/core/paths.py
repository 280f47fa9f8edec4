"""Where ragblend keeps its files: the root of its cache. A leaf every room may import."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of ragblend's cache (converted models, KV store, measurements).

    ``$RAGBLEND_CACHE_DIR`` overrides the platform's user cache dir.
    """
    env = os.environ.get("RAGBLEND_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ragblend"))
