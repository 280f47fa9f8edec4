"""The disk tier's size limit, saved with the store.

A disk store's limit lives in its folder's marker (``ragblend-store.json``, key ``disk_bytes``),
so a store sized at ingestion (``ragblend ingest --disk-bytes 40GiB``) keeps that size when a
later command, another process or the Python API opens it without naming one. An opener that
names a limit saves it there: the last limit given is the store's. One below what the store
holds says what its next write evicts. A store whose marker names no limit (made before limits
were saved, or never given one) keeps :data:`DEFAULT_DISK_BYTES`.
"""

from __future__ import annotations

import logging
import numbers
import os

from ..errors import InvalidInputError
from .store_files import read_marker, update_marker

log = logging.getLogger("ragblend")

DEFAULT_DISK_BYTES = 8 << 30


def check_disk_bytes(value) -> int | None:
    """``value`` as a limit in bytes (None: the store's saved one); refuses anything else."""
    if value is None:
        return None
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 0:   # 20e9 and 1.5 * 2**30 are whole numbers too
        raise InvalidInputError(f"disk_bytes must be a whole number of bytes >= 0 (such as 20e9 or 20 << 30), or None "
                                f"for the limit saved with the store (8 GiB where none was), got {value!r}.")
    return int(value)


def saved_limit(directory: str | os.PathLike) -> int | None:
    """The limit saved in the store's marker, or None where it names none (or not one that reads as bytes)."""
    value = read_marker(directory).get("disk_bytes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def settle_limit(directory: str | os.PathLike, given: int | None, cache) -> int:
    """The limit the store at ``directory`` keeps, its diskcache ``cache`` open: ``given``
    (saved in the marker for later openers) or, where None, the saved one
    (:data:`DEFAULT_DISK_BYTES` where none was saved)."""
    saved = saved_limit(directory)
    if given is None:
        return DEFAULT_DISK_BYTES if saved is None else saved
    if given != saved:
        try:
            update_marker(directory, disk_bytes=given)
        except OSError as err:   # the store still opens; the next opener keeps the earlier limit
            log.warning("ragblend: the KV store in %s could not save its new size limit (%s: %s); a later command "
                        "that names none keeps %s.", directory, type(err).__name__, err,
                        size_text(DEFAULT_DISK_BYTES if saved is None else saved))
        _say_what_it_evicts(directory, given, DEFAULT_DISK_BYTES if saved is None else saved, cache)
    return given


def _say_what_it_evicts(directory, limit: int, before: int, cache) -> None:
    """Log what a limit below the store's contents evicts at the store's next write."""
    volume = cache.volume()   # entry files and the database, what eviction brings under the limit
    if volume <= limit:
        if limit < before:
            log.info("ragblend: the KV store in %s now keeps at most %s (it kept %s); it holds %s, so nothing is "
                     "evicted now.", directory, size_text(limit), size_text(before), size_text(volume))
        return
    sizes = [size for (size,) in cache._sql("SELECT size FROM Cache WHERE raw = 1 ORDER BY access_time")]
    evicted = freed = 0
    while evicted < len(sizes) and volume - freed > limit:
        freed += sizes[evicted]
        evicted += 1
    log.warning("ragblend: the KV store in %s holds %s in %d entries, more than the %s limit given now (it kept %s): "
                "its next write evicts at least the %d least recently used (%s), and it keeps %s from now on. To "
                "keep them, give it a limit of %d bytes or more (--disk-bytes / disk_bytes=).", directory,
                size_text(volume), len(sizes), size_text(limit), size_text(before), evicted, size_text(freed),
                size_text(limit), max(before, volume))


def size_text(n: int) -> str:
    """Bytes as ragblend prints a store's size (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
