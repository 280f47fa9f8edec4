"""Measurements of this host kept in the cache dir, so that every process on it chooses alike.

A few choices are made from a timing taken when an engine starts: what a drafted token costs
(:func:`~ragblend.core.answers.draft_row_cost`), whether an answer's K/V decode faster in 16 bits
(:func:`~ragblend.core.answers.decode_kv_dtype`). Timings vary from process to process, and a
choice that differs changes the float rounding of an answer: at a near-tie, its greedy words. So
the first process to measure stores the result under ``<cache>/host/``, keyed by the host (CPU
and flags, thread count, torch: :func:`~ragblend.core.kernels.host_key`) and by what was measured;
later processes read it and answer alike. A file that is unreadable, foreign, of another format
or not a regular file is ignored and measured again, never trusted; one that cannot be written
leaves the choice to this process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger("ragblend")
FORMAT = "ragblend-host-measurement"
VERSION = 1
MAX_FILE_BYTES = 1 << 16
T = TypeVar("T")


def remembered(name: str, key: dict, measure: Callable[[], tuple[T, bool]], valid: Callable[[object], bool], *,
               directory: Path | None = None) -> T:
    """The value ``measure`` gave for ``name`` and ``key`` on this host: read from the cache dir
    if a sound file holds one that ``valid`` accepts, else measured now. ``measure`` returns
    ``(value, trustworthy)``; an untrustworthy one (the machine was busy) serves this process
    and is not stored."""
    if directory is None:
        from .model import cache_dir

        directory = cache_dir() / "host"
    key = {"measure": name} | key
    path = directory / f"{name}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"
    cached = _read(path, key, valid)
    if cached is not None:
        return cached
    value, trustworthy = measure()
    if trustworthy:
        _write(path, key, value)
    return value


def _read(path: Path, key: dict, valid: Callable[[object], bool]):
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        log.info("ragblend: cannot read %s (%s); measuring again.", path, err)
        return None
    why = None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
        why = "not a regular file of at most 64 KiB"
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
                why = "another format"
            elif data.get("key") != key:
                why = "measured on another host, thread count, torch or model"
            elif not valid(data.get("value")):
                why = f"a value out of range ({str(data.get('value'))[:40]})"
            else:
                return data["value"]
        except (OSError, ValueError, RecursionError) as err:
            why = f"unreadable ({type(err).__name__})"
    log.warning("ragblend: ignoring the host measurement %s (%s); measuring again.", path, why)
    return None


def _write(path: Path, key: dict, value) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "version": VERSION, "key": key, "value": value}, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:   # a read-only cache dir: the choice holds for this process only
        log.info("ragblend: could not save the host measurement to %s (%s).", path, err)
