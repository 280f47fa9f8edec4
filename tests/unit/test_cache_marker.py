"""`ragblend cache` and DiskStore act only on a folder that is a ragblend KV store (it has the
marker ragblend-store.json, or is unmistakably a store an earlier ragblend wrote); another
application's cache is refused and left byte-identical."""

import logging
import os
import sqlite3

import pytest

from ragblend.cli import main
from ragblend.core.store.tiers import MARKER, DiskStore, NotAStoreError, open_store

from ..conftest import SPEC, synthetic_entry


def snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


@pytest.fixture
def foreign_diskcache(tmp_path):
    """Another application's diskcache: pickled and string keys, values inline and in files."""
    import diskcache

    folder = tmp_path / "other-app-cache"
    cache = diskcache.Cache(str(folder))
    cache["session"] = {"user": 42}
    cache.set("b" * 64, b"x" * 100_000)
    cache.close()
    return folder


@pytest.fixture
def foreign_sqlite(tmp_path):
    """Another application's SQLite database that happens to be called cache.db."""
    folder = tmp_path / "other-app"
    folder.mkdir()
    connection = sqlite3.connect(folder / "cache.db")
    connection.execute("CREATE TABLE pages (url TEXT, body TEXT)")
    connection.execute("INSERT INTO pages VALUES ('https://example.org', 'hello')")
    connection.commit()
    connection.close()
    return folder


@pytest.mark.parametrize("action", ["clear", "stats"])
def test_cache_commands_refuse_a_foreign_diskcache(foreign_diskcache, action, capsys):
    before = snapshot(foreign_diskcache)
    assert main(["cache", action, "--kv-dir", str(foreign_diskcache)]) == 2
    err = capsys.readouterr().err
    assert "is not a ragblend KV store" in err and MARKER in err and "new or empty folder" in err
    assert snapshot(foreign_diskcache) == before


@pytest.mark.parametrize("action", ["stats", "clear"])
def test_cache_commands_leave_a_foreign_sqlite_cache_db_byte_identical(foreign_sqlite, action, capsys):
    before = snapshot(foreign_sqlite)
    assert main(["cache", action, "--kv-dir", str(foreign_sqlite)]) == 2
    assert "has tables ['pages']" in capsys.readouterr().err
    assert snapshot(foreign_sqlite) == before


def test_an_engine_store_on_a_foreign_folder_is_memory_only_and_writes_nothing(foreign_sqlite, caplog):
    before = snapshot(foreign_sqlite)
    with pytest.raises(NotAStoreError, match="ragblend will not read, change or delete anything"):
        DiskStore(foreign_sqlite, SPEC)
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        store = open_store(foreign_sqlite, SPEC)   # the KV is a cache: the engine runs without its disk tier
    assert store.put(synthetic_entry(1)) and store.get(synthetic_entry(1).key) is not None
    assert "keeping KV in memory only" in caplog.text
    assert snapshot(foreign_sqlite) == before


def test_a_new_store_gets_the_marker_and_an_old_one_is_adopted(tmp_path, caplog):
    folder = tmp_path / "kv"
    store = DiskStore(folder, SPEC)
    store.put(synthetic_entry(1))
    store.close()
    assert (folder / MARKER).is_file()
    (folder / MARKER).unlink()   # as an earlier ragblend left it
    with caplog.at_level(logging.INFO, logger="ragblend"):
        store = DiskStore(folder, SPEC)
    assert "adopted the KV store" in caplog.text and (folder / MARKER).is_file()
    assert store.get(synthetic_entry(1).key) is not None


def test_an_empty_folder_becomes_a_store_but_a_folder_with_other_files_does_not(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    DiskStore(empty, SPEC).close()
    assert (empty / MARKER).is_file()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(NotAStoreError, match="'todo.txt'"):
        DiskStore(notes, SPEC)
    assert snapshot(notes) == {"todo.txt": b"mine"}


@pytest.mark.parametrize("hidden", [[".gitkeep"], [".DS_Store", ".gitkeep"]])
def test_a_new_folder_with_only_hidden_files_becomes_a_store_and_keeps_them(tmp_path, capsys, hidden):
    folder = tmp_path / "kv"
    folder.mkdir()
    for name in hidden:
        (folder / name).write_bytes(b"the user's")
    store = open_store(folder, SPEC)   # an engine's store: with its disk tier, not memory-only
    assert store.put(synthetic_entry(1)) and (folder / MARKER).is_file()
    store.disk.close()
    assert main(["cache", "stats", "--kv-dir", str(folder)]) == 0
    assert "disk tier:   1 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--kv-dir", str(folder)]) == 0
    assert all((folder / name).read_bytes() == b"the user's" for name in hidden)


def test_a_hidden_folder_or_link_still_makes_a_folder_not_ours(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    with pytest.raises(NotAStoreError, match="'.git'"):
        DiskStore(repo, SPEC)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".profile").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotAStoreError, match="'.profile'"):
        DiskStore(linked, SPEC)
    assert sorted(p.name for p in repo.iterdir()) == [".git"] and [p.name for p in linked.iterdir()] == [".profile"]


def test_a_marker_of_another_format_is_refused(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / MARKER).write_text('{"format": "something-else"}')
    with pytest.raises(NotAStoreError, match="not ragblend's"):
        DiskStore(folder, SPEC)


@pytest.mark.parametrize("content, says", [
    ("", "that is empty"),
    ("{not json", "that is not JSON"),
    ('["ragblend-kv-store"]', 'names no format (ragblend\'s names "format": "ragblend-kv-store")'),
    ('{"format": "something-else"}', 'whose format is "something-else", not "ragblend-kv-store"'),
])
def test_a_bad_marker_is_refused_saying_what_is_wrong_and_what_to_do(tmp_path, capsys, content, says):
    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / MARKER).write_text(content)
    with pytest.raises(NotAStoreError) as caught:
        DiskStore(folder, SPEC)
    assert says in str(caught.value) and f"delete its {MARKER}" in str(caught.value)
    for action in ("stats", "clear"):   # the cache commands say the same, not "nothing stored yet"
        assert main(["cache", action, "--kv-dir", str(folder)]) == 2
        assert says in capsys.readouterr().err
    assert snapshot(folder) == {MARKER: content.encode()}


def test_cache_stats_on_a_store_with_only_its_marker_creates_nothing(tmp_path, capsys):
    folder = tmp_path / "kv"
    DiskStore(folder, SPEC).close()
    (folder / "cache.db").unlink()
    before = snapshot(folder)
    assert main(["cache", "stats", "--kv-dir", str(folder)]) == 0
    assert "nothing has been stored there yet" in capsys.readouterr().out
    assert snapshot(folder) == before


def test_clear_deletes_nothing_in_a_broken_folder_without_the_marker(tmp_path, capsys):
    folder = tmp_path / "kv"
    store = DiskStore(folder, SPEC)
    store.put(synthetic_entry(1))
    store.close()
    (folder / MARKER).unlink()
    (folder / "cache.db").write_bytes(b"not a database" * 100)
    before = snapshot(folder)
    assert main(["cache", "clear", "--kv-dir", str(folder)]) == 2
    assert "is not a ragblend KV store" in capsys.readouterr().err
    assert snapshot(folder) == before
