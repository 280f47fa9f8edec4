"""core.store.store_files: the disk store touches only its own entry files. A database row naming any
other file (absolute, outside the folder, a symlink, a FIFO) is a miss and never read or deleted.
(The store folder's marker: test_cache_marker.py.)"""

import os
import time

import pytest

from ragblend.core.store.store_files import (
    MARKER,
    CorruptEntryError,
    check_store_folder,
    entry_files,
    open_entry_file,
    orphan_entry_files,
    own_entry_path,
    reclaim_orphan_files,
    remove_entry_file,
)
from ragblend.core.store.tiers import DiskStore, encode_entry

from ..conftest import SPEC, entry_path, synthetic_entry

NAME = "ab/cd/" + "0123456789abcdef0123456789ab.val"   # a name of the store's own scheme


def _point_row_at(store: DiskStore, key: str, filename: str) -> None:
    store.cache._sql("UPDATE Cache SET filename = ? WHERE key = ?", (filename, key))


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_tampered_row_never_reads_or_deletes_a_file_outside_the_store(tmp_path, where):
    store_dir, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    victim = outside / "precious.txt"
    victim.write_text("keep me")
    store = DiskStore(store_dir, SPEC)
    entries = [synthetic_entry(i) for i in range(3)]
    for entry in entries:
        store.put(entry)
    target = str(victim) if where == "absolute" else os.path.relpath(victim, store_dir)
    _point_row_at(store, entries[0].key, target)
    assert store.open(entries[0].key) is None          # a miss, and the row is dropped
    assert entries[0].key not in store
    assert store.verify(entries[1].key) is None
    _point_row_at(store, entries[1].key, target)
    assert store.verify(entries[1].key) is not None
    store.clear()
    assert victim.read_text() == "keep me" and outside.is_dir()
    assert len(store) == 0


def test_special_files_in_the_store_are_misses_not_hangs(tmp_path):
    import threading

    store = DiskStore(tmp_path / "kv", SPEC)
    fifo_entry, link_entry = synthetic_entry(1), synthetic_entry(2)
    store.put(fifo_entry)
    store.put(link_entry)
    fifo = entry_path(store, fifo_entry.key)
    fifo.unlink()
    os.mkfifo(fifo)
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(encode_entry(link_entry, SPEC.fingerprint))
    link = entry_path(store, link_entry.key)
    link.unlink()
    link.symlink_to(elsewhere)
    results = {}
    reader = threading.Thread(target=lambda: results.update(
        fifo=store.open(fifo_entry.key), link=store.open(link_entry.key)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "opening a FIFO in the store blocked"
    assert results == {"fifo": None, "link": None}
    assert elsewhere.exists()  # the symlink's target is never touched...
    assert not os.path.lexists(link)  # ...while the link, in the store's own place, is dropped


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.val", "ab/cd/../../x.val", "ab/cd/short.val",
                                  "AB/CD/" + "0123456789abcdef0123456789ab.val", None, 7])
def test_only_names_of_the_stores_own_scheme_are_its_files(tmp_path, name):
    assert own_entry_path(str(tmp_path), NAME) == os.path.join(os.path.realpath(tmp_path), NAME)
    assert own_entry_path(str(tmp_path), name) is None
    with pytest.raises(CorruptEntryError, match="outside the store"):
        open_entry_file(str(tmp_path), name)


def test_removing_an_entry_removes_a_symlink_not_its_target_and_the_empty_folders(tmp_path):
    target = tmp_path / "target.val"
    target.write_bytes(b"keep")
    link = tmp_path / "kv" / NAME
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    assert list(entry_files(tmp_path / "kv")) == []             # a symlink is not one of its files
    remove_entry_file(str(tmp_path / "kv"), NAME)
    assert target.read_bytes() == b"keep" and not os.path.lexists(link)
    assert list((tmp_path / "kv").iterdir()) == []              # its two sub-folders went with it


def test_orphans_are_unnamed_entry_files_old_enough_not_to_be_a_write_in_progress(tmp_path):
    for name in (NAME, NAME.replace("ab.val", "ac.val"), "ab/cd/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    named, orphan = {NAME}, NAME.replace("ab.val", "ac.val")
    assert orphan_entry_files(tmp_path, named, min_age_s=60) == []     # just written: maybe another process's
    old = time.time() - 120
    os.utime(tmp_path / orphan, (old, old))
    assert orphan_entry_files(tmp_path, named, min_age_s=60) == [orphan]   # never the named one nor notes.txt


def test_reclaiming_removes_only_old_unnamed_entry_files_of_the_store(tmp_path):
    store = DiskStore(tmp_path / "kv", SPEC)
    entry = synthetic_entry(1)
    assert store.put(entry)
    named = entry_path(store, entry.key)
    old = time.time() - 120
    for name in (NAME, NAME.replace("ab.val", "ac.val")):
        (store.directory / name).parent.mkdir(parents=True, exist_ok=True)
        (store.directory / name).write_bytes(b"x")
    os.utime(store.directory / NAME, (old, old))
    os.utime(named, (old, old))
    assert reclaim_orphan_files(store.cache, store.directory, min_age_s=60) == 1
    assert not (store.directory / NAME).exists() and (store.directory / NAME.replace("ab.val", "ac.val")).exists()
    assert named.exists() and entry.key in store   # a row names it
    store.close()


def test_a_folder_holding_only_another_process_marker_draft_is_a_new_store(tmp_path):
    # Two processes opening one new store: the second may look while the first's marker is a
    # temporary file (before its rename), and must not take the folder for a foreign one.
    (tmp_path / f"{MARKER}.4242.tmp").write_text("{")
    check_store_folder(tmp_path)
    assert (tmp_path / MARKER).is_file()
    store = DiskStore(tmp_path, SPEC)
    store.put(synthetic_entry(1, tokens=8))
    assert len(store) == 1
    store.close()


def test_the_marker_is_never_written_through_a_planted_link(tmp_path):
    # Review of issue 55's saved limit: the marker's draft name is predictable; a link planted there
    # must not make the store write over a file outside its folder.
    import threading

    from ragblend.core.store.disk_limit import saved_limit
    from ragblend.core.store.store_files import MARKER, check_store_folder, update_marker

    store, outside = tmp_path / "kv", tmp_path / "precious.txt"
    check_store_folder(store)
    outside.write_text("keep me")
    (store / f"{MARKER}.{os.getpid()}{threading.get_ident()}.tmp").symlink_to(outside)
    update_marker(store, disk_bytes=12345)
    assert outside.read_text() == "keep me"
    assert saved_limit(store) == 12345


def test_a_bare_marker_never_replaces_one_with_settings(tmp_path):
    # Two processes making one new store: the one without a limit must not erase the limit the other saved.
    from ragblend.core.store.disk_limit import saved_limit
    from ragblend.core.store.store_files import _write_marker, update_marker

    tmp_path.joinpath("kv").mkdir()
    store = tmp_path / "kv"
    _write_marker(store, replace=False)
    update_marker(store, disk_bytes=40 << 30)
    _write_marker(store, replace=False)   # the other process's bare marker, written late
    assert saved_limit(store) == 40 << 30
    assert sorted(os.listdir(store)) == ["ragblend-store.json"]   # no draft left behind
