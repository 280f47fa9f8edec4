"""The files of a disk store's folder: which are the store's own, and how they are opened,
removed and recognised.

A :class:`~ragblend.core.store.tiers.DiskStore` keeps its entries as files in a ``diskcache``
folder. Its database says which file holds each entry, so a tampered database could point
anywhere; everything here touches only the store's own files (named by its scheme, inside its
folder, regular files) and only folders marked as a ragblend store (``ragblend-store.json``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from ..errors import RagblendError, StoreUnavailableError

log = logging.getLogger("ragblend")

DATABASE = "cache.db"   # diskcache's database file in the store's folder


class CorruptEntryError(RagblendError):
    """A stored KV entry failed verification. The store drops it; the engine recomputes it."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"KV entry {key[:12]}... is unusable ({reason}); it is dropped and recomputed.")
        self.key = key
        self.reason = reason


_ENTRY_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


def entry_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """The store's own entry files in ``directory``: named by its scheme, regular files, not
    reached through a symlink. Yields ``(name relative to the folder, path)``."""
    root = os.path.realpath(directory)
    for path in Path(root).glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*.val"):
        name = path.relative_to(root).as_posix()
        with contextlib.suppress(FileNotFoundError):   # removed by another process meanwhile
            if (_ENTRY_FILE.fullmatch(name) and os.path.realpath(path) == str(path)
                    and stat.S_ISREG(path.lstat().st_mode)):
                yield name, path


def orphan_entry_files(directory: Path, named: set[str], min_age_s: float) -> list[str]:
    """The store's own entry files in ``directory`` that no database row names (``named``) and
    that are at least ``min_age_s`` old (younger ones may be another process's write in progress)."""
    now = time.time()
    return [name for name, path in entry_files(directory)
            if name not in named and now - path.lstat().st_mtime >= min_age_s]


def reclaim_orphan_files(cache, directory: Path, min_age_s: float) -> int:
    """Remove the entry files of ``cache`` (the store's ``diskcache.Cache`` in ``directory``) that no
    row names and that are :func:`orphan_entry_files` old enough (left by a writer killed
    mid-write); returns how many. The store's faults (OSError, SQLite's) reach the caller."""
    named = {row[0] for row in cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    orphans = orphan_entry_files(directory, named, min_age_s)
    for name in orphans:
        cache.disk.remove(name)
    if orphans:
        log.info("ragblend: removed %d unfinished KV file(s) from %s.", len(orphans), directory)
    return len(orphans)


def file_identity(path: Path) -> tuple[int, int] | None:
    """Which file ``path`` is (device, inode), to notice it being deleted or replaced; None if missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def own_entry_path(directory: str, filename) -> str | None:
    """The full path of one of the store's entry files in ``directory``, or None for any other name."""
    if not isinstance(filename, str) or not _ENTRY_FILE.fullmatch(filename):
        return None
    root = os.path.realpath(directory)
    path = os.path.join(root, filename)
    # No symlinked sub-folder. The file itself may be a symlink: open_entry_file refuses it
    # (O_NOFOLLOW) and remove_entry_file deletes the link, never its target.
    return path if os.path.realpath(os.path.dirname(path)) == os.path.dirname(path) else None


def open_entry_file(directory: str, filename) -> BinaryIO:
    """The entry file ``filename`` of the store in ``directory``, open for reading; a
    :class:`CorruptEntryError` when it is not one of the store's own regular files."""
    path = own_entry_path(directory, filename)
    if path is None:
        raise CorruptEntryError(str(filename), "entry file outside the store's own files")
    # O_NONBLOCK: a FIFO opens at once (and is then refused) instead of waiting for a writer.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:   # O_NOFOLLOW met a symlink
            raise CorruptEntryError(str(filename), "entry is a symlink") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptEntryError(str(filename), "entry is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def remove_entry_file(directory: str, filename) -> None:
    """Delete the entry file ``filename`` (a symlink itself, not its target) and its two
    sub-folders when they are left empty; nothing when it is not one of the store's own names."""
    path = own_entry_path(directory, filename)
    if path is None:
        return  # not the store's: never delete it
    with contextlib.suppress(OSError):
        os.remove(path)
    for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only when empty


def safe_disk_class():
    """A diskcache ``Disk`` that only ever touches the store's own files.

    The cache database says which file holds each value, so a tampered database could point
    anywhere. This ``Disk`` refuses pickled keys and values (nothing is ever unpickled), and
    opens or deletes a value file only when its name follows the store's own naming scheme,
    it resolves inside the store's directory and it is a regular file (no symlink, FIFO or
    device: opening a FIFO would block the query). Deleting removes the file (a symlink
    itself, not its target) and at most its two empty sub-folders, never a folder above the
    store. A new class per store: ``written`` is the store's own.
    """
    import diskcache
    from diskcache.core import MODE_BINARY, UNKNOWN

    class SafeDisk(diskcache.Disk):
        written = threading.local()   # the file each thread wrote last, removed if its row fails

        def store(self, value, read, key=UNKNOWN):
            self.written.filename = None
            size, mode, filename, db_value = super().store(value, read, key)
            self.written.filename = filename
            return size, mode, filename, db_value

        def _write(self, full_path, iterator, mode, encoding=None):
            try:
                return super()._write(full_path, iterator, mode, encoding)
            except BaseException:
                # a full disk mid-write must not leave a partial file behind
                with contextlib.suppress(OSError):
                    os.remove(full_path)
                raise

        def get(self, key, raw):
            if not raw:
                raise CorruptEntryError(str(key), "non-string key in the cache database")
            return super().get(key, raw)

        def fetch(self, mode, filename, value, read):
            if mode != MODE_BINARY:
                raise CorruptEntryError(str(filename), "value not stored as a plain binary file")
            handle = open_entry_file(self._directory, filename)
            if read:
                return handle
            with handle:
                return handle.read()

        def remove(self, file_path):
            remove_entry_file(self._directory, file_path)

    return SafeDisk


MARKER = "ragblend-store.json"
MARKER_FORMAT = "ragblend-kv-store"
# What a ragblend store's folder may hold: the marker (and its temporary file while a
# process writes it), diskcache's database files and the xx/ sub-folders of entry files.
_MARKER_DRAFT = re.compile(re.escape(MARKER) + r"\.\d+\.tmp")   # a marker being written (_write_marker)
_STORE_NAMES = re.compile(rf"{re.escape(MARKER)}|{_MARKER_DRAFT.pattern}|cache\.db(-wal|-shm|-journal)?|[0-9a-f]{{2}}")


class NotAStoreError(StoreUnavailableError):
    """A KV store folder that holds files ragblend did not write; nothing in it is read,
    changed or deleted."""


def _marker_problem(path: Path) -> str | None:
    """What is wrong with the marker at ``path`` (said as the message's end), or None when it
    is ragblend's: a small regular JSON file naming ragblend's format (never follows a link)."""
    return _read_marker(path)[1]


def _read_marker(path: Path) -> tuple[dict, str | None]:
    """The marker's content and None, or ``{}`` and what is wrong with it (see :func:`_marker_problem`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        return {}, f"that cannot be read ({err.strerror or err})"
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return {}, "that is not a regular file"
        raw = handle.read(4097)
    if not raw.strip():
        return {}, "that is empty"
    if len(raw) > 4096:
        return {}, "that is too large to be ragblend's"
    try:
        content = json.loads(raw)
    except ValueError:
        return {}, "that is not JSON"
    if not isinstance(content, dict) or "format" not in content:
        return {}, f"that names no format (ragblend's names \"format\": {json.dumps(MARKER_FORMAT)})"
    if content["format"] != MARKER_FORMAT:   # the value found next to the one expected
        return {}, f"whose format is {json.dumps(content['format'])[:80]}, not {json.dumps(MARKER_FORMAT)}"
    return content, None


def read_marker(directory: str | os.PathLike) -> dict:
    """What the store's marker says (``{}`` where it is missing or not ragblend's)."""
    return _read_marker(Path(directory) / MARKER)[0]


def _write_marker(directory: Path, replace: bool = True, **settings) -> None:
    """Write the marker atomically (a temporary file renamed over), so a concurrent opener
    reads either none or a whole one. ``settings``: what the store keeps beside its format
    (``disk_bytes``, the size limit saved with it: see :mod:`.disk_limit`). With ``replace``
    False a marker already there is kept: two processes making one new store at once must not
    overwrite the settings the other saved with a bare marker."""
    partial = directory / f"{MARKER}.{os.getpid()}{threading.get_ident()}.tmp"   # one per writer, threads too
    text = json.dumps({"format": MARKER_FORMAT, "version": 1,
                       "about": "a ragblend KV store (a cache: deleting it only costs recomputation)", **settings})
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)   # never through a planted link
    try:
        fd = os.open(partial, flags, 0o644)
    except FileExistsError:   # a draft this process and thread left when killed: its own name, removed
        os.unlink(partial)
        fd = os.open(partial, flags, 0o644)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    if replace:
        os.replace(partial, directory / MARKER)
        return
    try:
        os.link(partial, directory / MARKER)   # fails where a marker is there: that one stays
    except FileExistsError:
        pass
    except OSError:   # a file system without hard links: renamed over, as before
        os.replace(partial, directory / MARKER)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def update_marker(directory: str | os.PathLike, **settings) -> None:
    """Rewrite the marker of the store at ``directory`` with ``settings`` over what it says."""
    directory = Path(directory)
    kept = {k: v for k, v in read_marker(directory).items() if k not in ("format", "version", "about")}
    _write_marker(directory, **{**kept, **settings})


def _looks_like_old_store(directory: Path) -> str | None:
    """Why ``directory`` (no marker, non-empty) is not a store written by an earlier ragblend,
    or None when it unmistakably is one: only diskcache's files, its database opened
    read-only (``immutable``: nothing is written, not even a lock) with exactly diskcache's
    two tables, the settings ragblend gives it (cull_limit 0, least-recently-used) and only
    ragblend's rows (64-hex string keys stored as entry files)."""
    import sqlite3

    names = sorted(os.listdir(directory))
    foreign = [n for n in names if not _STORE_NAMES.fullmatch(n)]
    if foreign:
        return f"it holds {', '.join(repr(n) for n in foreign[:3])}{' ...' if len(foreign) > 3 else ''}"
    database = directory / DATABASE
    try:
        if not stat.S_ISREG(database.lstat().st_mode):
            return f"its {DATABASE} is not a regular file"
    except FileNotFoundError:
        return f"it has sub-folders but no {DATABASE}"
    try:
        connection = sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables != {"Cache", "Settings"}:
                return f"its {DATABASE} has tables {sorted(tables)}, not a KV store's"
            settings = dict(connection.execute("SELECT key, value FROM Settings"))
            if settings.get("cull_limit") != 0 or settings.get("eviction_policy") != "least-recently-used":
                return f"its {DATABASE} is a diskcache with other settings than ragblend's"
            (others,) = connection.execute(
                "SELECT COUNT(*) FROM Cache WHERE raw != 1 OR typeof(key) != 'text' OR length(key) != 64 "
                "OR filename IS NULL OR mode != 2").fetchone()
            if others:
                return f"its {DATABASE} holds {others} row(s) ragblend does not write"
        finally:
            connection.close()
    except sqlite3.Error as err:
        return f"its {DATABASE} cannot be read ({err})"
    return None


def _check_marker(directory: Path) -> bool:
    """Whether ``directory`` has ragblend's marker (refusing a marker that is not ragblend's)."""
    marker = directory / MARKER
    if not os.path.lexists(marker):
        return False
    problem = _marker_problem(marker)
    if problem is not None:
        raise NotAStoreError(f"{directory} has a {MARKER} {problem}, so it is not ragblend's KV store marker; "
                             "ragblend will not use this folder as a KV store. Use another folder (ragblend "
                             f"creates it); or, if this folder is a KV store you gave ragblend, delete its {MARKER}: "
                             "ragblend then adopts the folder if it holds nothing but a KV store's files.")
    return True


def _empty_but_for_hidden_files(directory: Path) -> bool:
    """Whether ``directory`` holds nothing but markers being written (``_write_marker``'s
    temporary files) and hidden regular files: a ``.gitkeep`` or Finder's ``.DS_Store`` does
    not make a new folder someone else's. Never opened, never deleted; a hidden folder
    (``.git``) or link still marks a folder that is not ours."""
    for name in os.listdir(directory):
        if _MARKER_DRAFT.fullmatch(name):
            continue
        try:
            hidden_file = name.startswith(".") and stat.S_ISREG((directory / name).lstat().st_mode)
        except FileNotFoundError:   # removed since the listing
            continue
        if not hidden_file:
            return False
    return True


def check_store_folder(directory: str | os.PathLike, create: bool = True) -> None:
    """Refuse (:class:`NotAStoreError`) a folder that is not ragblend's KV store, before
    anything in it is read or changed.

    A store's folder has the marker ``ragblend-store.json``. A missing or empty folder is
    fine, and so is one holding only hidden regular files (``.gitkeep``, ``.DS_Store``, kept):
    with ``create`` it is made a store (folder and marker). A folder without the marker
    written by an earlier ragblend (see :func:`_looks_like_old_store`) is adopted: the
    marker is added, and a log line says so (with ``create`` only). Anything else, e.g.
    another application's cache, is refused.
    """
    directory = Path(directory).expanduser()
    if _check_marker(directory):
        return
    if not directory.exists() or _empty_but_for_hidden_files(directory):
        # Empty (hidden files aside), or another process is writing its marker right now (two
        # opening one new store).
        if create:
            directory.mkdir(parents=True, exist_ok=True)
            _write_marker(directory, replace=False)
        return
    reason = _looks_like_old_store(directory)
    if reason is not None and _check_marker(directory):
        return   # the marker came in while we looked: another process made the store meanwhile
    if reason is not None:
        raise NotAStoreError(
            f"{directory} is not a ragblend KV store: it has no {MARKER} and {reason}. ragblend will not read, "
            "change or delete anything in it. Pass a new or empty folder as the KV store (--kv-dir, kv_dir=, or "
            "another --index); if this folder is one you gave ragblend before, delete it (the KV is a cache: "
            "ragblend recomputes it).")
    if create:
        _write_marker(directory, replace=False)
        log.info("ragblend: adopted the KV store in %s, written by an earlier ragblend (added %s).", directory, MARKER)


def check_write_lock(database: Path, timeout_s: float) -> None:
    """Fail within ``timeout_s`` when another process holds the database's write lock (or the
    file is not a database): diskcache's own set-up retries for 60 s."""
    import sqlite3

    if not database.is_file():
        return
    connection = sqlite3.connect(database, timeout=timeout_s, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("ROLLBACK")
    finally:
        connection.close()


def remove_store_files(directory: str | os.PathLike) -> int:
    """Delete a store that cannot be opened (e.g. a garbage ``cache.db``): its database
    and the entry files named by its own scheme, then its empty sub-folders and its
    marker. Nothing else in ``directory`` is touched; a folder without the marker is
    refused (:class:`NotAStoreError`). Returns how many entry files were removed."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise StoreUnavailableError(f"{directory} is not a KV store folder")
    if not os.path.lexists(directory / MARKER):
        # a broken database cannot show it is an earlier ragblend's: not ours to delete
        raise NotAStoreError(f"{directory} has no {MARKER}: ragblend cannot tell it is its own KV store, so it "
                             "deletes nothing there. If it is, delete the folder yourself (the KV is a cache).")
    check_store_folder(directory, create=False)
    removed = 0
    for _, path in entry_files(directory):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    for folder in sorted(directory.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]")) + sorted(
            directory.glob("[0-9a-f][0-9a-f]")):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty and a real folder
    for name in (DATABASE, DATABASE + "-wal", DATABASE + "-shm", MARKER):   # the marker last
        path = directory / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
    return removed
