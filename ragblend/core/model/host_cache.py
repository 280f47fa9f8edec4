"""Measurements of this host kept in the cache dir, so that every process on it chooses alike.

A few choices are made from a timing taken when an engine starts: what a drafted token costs
(:func:`~ragblend.core.decode.answers.draft_row_cost`), whether an answer's K/V decode faster in 16 bits
(:func:`~ragblend.core.decode.answers.decode_kv_dtype`). Timings vary from process to process, and a
choice that differs changes the float rounding of an answer: at a near-tie, its greedy words. So
the first process to measure stores the result under ``<cache>/host/``, keyed by the host (CPU
and flags, thread count, torch: :func:`~ragblend.core.model.kernels.host_key`) and by what was measured;
later processes read it and answer alike. A file that is unreadable, foreign, of another format
or not a regular file is ignored and measured again, never trusted; one that cannot be written
leaves the choice to this process.

A measurement taken while the machine was busy is kept too, marked unsettled: later processes
use it (they would otherwise all measure again, on a busy 2-core host for tens of seconds each)
and the first one that starts on a quiet host (:func:`host_is_quiet`) measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

from ..paths import cache_dir

log = logging.getLogger("ragblend")
FORMAT = "ragblend-host-measurement"
VERSION = 1
MAX_FILE_BYTES = 1 << 16
T = TypeVar("T")


def remembered(name: str, key: dict, measure: Callable[[], tuple[T, bool]], valid: Callable[[object], bool], *,
               directory: Path | None = None) -> T:
    """The value ``measure`` gave for ``name`` and ``key`` on this host: read from the cache dir
    if a sound file holds one that ``valid`` accepts, else measured now. ``measure`` returns
    ``(value, trustworthy)``; an untrustworthy one (the machine was busy) is stored as
    unsettled: used by later processes, and measured again by the first to start on a quiet host."""
    if directory is None:
        directory = cache_dir() / "host"
    key = {"measure": name} | key
    path = record_path(directory, key, f"{name}-")
    record, why = read_record(path, FORMAT, VERSION, key)
    unsettled = None
    if record is not None:
        if not valid(record.get("value")):
            why = f"a value out of range ({str(record.get('value'))[:40]})"
        elif record.get("settled", True) is not False or not host_is_quiet():
            return record["value"]
        else:   # measured on a busy machine, and the host is quiet now: measured again
            unsettled = record["value"]
    if why:
        log.warning("ragblend: ignoring the host measurement %s (%s); measuring again.", path, why)
    load = load_average()
    value, trustworthy = measure()
    if unsettled is not None and not trustworthy:
        return unsettled   # no sounder: keep choosing as the other processes do
    record = {"format": FORMAT, "version": VERSION, "key": key, "value": value, "settled": trustworthy,
              "measured_at": time.time(), "load_average": load}
    # No sound file: the first process to write wins, and the others take its value (they may
    # have measured at the same moment); a bad or unsettled file is replaced.
    if not write_record(path, record, replace=why is not None or unsettled is not None):
        record, _ = read_record(path, FORMAT, VERSION, key)
        if record is not None and valid(record.get("value")):
            return record["value"]
    return value


# The host counts as quiet while its 1-minute load average is below this share of its cores.
QUIET_LOAD_SHARE = 0.5


def load_average() -> float | None:
    """The host's 1-minute load average, or None where the OS does not say."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def host_is_quiet() -> bool:
    """Whether other work leaves this host's cores free enough to measure on (the 1-minute load
    average below ``QUIET_LOAD_SHARE`` of the cores; True where the OS does not say)."""
    load = load_average()
    return load is None or load < QUIET_LOAD_SHARE * (os.cpu_count() or 1)


def measured_twice(verdict: Callable[[], T], fallback: T) -> tuple[T, bool]:
    """A choice made from a timing, made twice: ``(the choice, whether the two agree)``, as
    :func:`remembered`'s ``measure`` wants it. Two that disagree were near a tie or disturbed
    (the machine was busy): ``fallback`` (the conservative choice) is taken, so that processes
    still choose alike, and kept as unsettled (measured again at a quiet start)."""
    first, second = verdict(), verdict()
    return (first, True) if first == second else (fallback, False)


def record_path(directory: Path, key: dict, prefix: str = "") -> Path:
    """Where the record for ``key`` lives in ``directory``: named by a digest of the key."""
    return directory / f"{prefix}{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"


def read_record(path: Path, fmt: str, version: int, key: dict,
                max_bytes: int = MAX_FILE_BYTES) -> tuple[dict | None, str | None]:
    """The JSON record at ``path`` if it is a regular file of format ``fmt`` and ``version`` made
    for ``key``: ``(record, None)``; else ``(None, why not)``, where ``why`` is None if there is
    no file. Never follows a link; reads at most ``max_bytes``."""
    try:   # opened without following a link or waiting on a pipe, then checked, then read bounded
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read: {err}"
    try:
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
                return None, f"not a regular file of at most {max_bytes // 1024} KiB"
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            return None, f"not a regular file of at most {max_bytes // 1024} KiB"
        record = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        # (RecursionError: JSON nested deeper than the decoder goes, e.g. a file of "[[[[...")
        return None, f"unreadable ({type(err).__name__})"
    if not isinstance(record, dict) or record.get("format") != fmt or record.get("version") != version:
        return None, "another format"
    if record.get("key") != key:
        return None, "measured on another host, thread count, torch or model"
    return record, None


def write_record(path: Path, record: dict, *, replace: bool = True) -> bool:
    """Write ``record`` to ``path`` as JSON, whole or not at all; whether it was written. Without
    ``replace`` a file already there stays (another process wrote first). A folder that cannot be
    written is logged (the caller's choice then holds for this process only)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        return True
    except OSError as err:
        log.info("ragblend: could not save %s (%s).", path, err)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
