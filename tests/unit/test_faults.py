"""Faults of the KV store's disk tier: each one is a miss, and the answer equals a clean run's.

Real faults where the machine allows them: a second process holding an exclusive SQLite lock,
the KV folder deleted under a running engine, a full tmpfs and a read-only bind mount (need
root: skipped otherwise), a garbage database file, hostile entry headers with valid CRCs, a
writer killed at random points. ``python -m tests.robustness.faults`` runs the heavy versions.
"""

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ragblend import Chunk, InvalidInputError
from ragblend.core.store.tiers import DiskStore, MemoryStore, TieredStore, open_store

from ..conftest import PASSAGES, SPEC, entry_path, make_tiny_engine, synthetic_entry, with_header

CHUNKS = [f"{a} {b}" for a, b in zip(PASSAGES, PASSAGES[1:] + PASSAGES[:1])]
SEGMENTS = [Chunk(c) for c in CHUNKS[:3]] + ["Question: who ran the ferry?"]


@pytest.fixture
def engine(tokenizer, tmp_path):
    """A tiny engine whose KV lives on disk only (memory tier off), with the chunks stored."""
    engine = make_tiny_engine("qwen2", tokenizer, kv_dtype="float32")
    engine.store = TieredStore(MemoryStore(0), DiskStore(tmp_path / "kv", engine.entry_spec))
    engine.precompute(CHUNKS)
    return engine


@pytest.fixture
def clean(engine):
    pre = engine.prefill(SEGMENTS)
    assert pre.stats.chunks_reused == 3  # served from disk
    return pre.logits


def assert_clean_answer(engine, clean_logits, seconds=5.0):
    t0 = time.perf_counter()
    pre = engine.prefill(SEGMENTS)
    assert time.perf_counter() - t0 < seconds
    assert (pre.logits - clean_logits).abs().max() <= 1e-5
    return pre


def files_in(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its size: what a fault must not leave behind or change."""
    return {str(p.relative_to(folder)): p.lstat().st_size for p in folder.rglob("*") if not p.is_dir()}


def unnamed_entry_files(store: DiskStore) -> set[str]:
    """Entry files that no row of the database names: leaks."""
    named = {row[0] for row in store.cache._sql("SELECT filename FROM Cache")}
    return {str(p.relative_to(store.directory)) for p in store.directory.rglob("*.val")} - named


def mount(*args) -> None:
    done = subprocess.run(["mount", *args], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount here ({done.stderr.decode().strip()}); needs root")


@contextlib.contextmanager
def write_lock_held(folder: Path):
    """Another process holding an exclusive SQLite lock on the store in ``folder``."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         f"c = sqlite3.connect({str(folder / 'cache.db')!r}, isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_locked_database_is_a_quick_miss(engine, clean):
    with write_lock_held(engine.store.disk.directory):
        pre = assert_clean_answer(engine, clean)
        assert pre.stats.chunks_reused == 0 and pre.stats.store_faults > 0
    engine.flush()
    assert engine.prefill(SEGMENTS).stats.chunks_reused == 3  # back once the lock is gone


def test_the_kv_folder_deleted_under_a_running_engine(engine, clean, caplog):
    engine.flush()
    folder = engine.store.disk.directory
    shutil.rmtree(folder)
    pre = assert_clean_answer(engine, clean)
    assert pre.stats.chunks_reused == 0
    engine.flush()  # write-back into the vanished folder is skipped, not raised
    assert engine.store.stats()["disk"]["entries"] >= 0  # statistics still answer
    refs = engine.precompute(["A chunk first seen after the folder was deleted."])
    assert not refs[0].stored and "could not be stored" in caplog.text
    assert not folder.exists()  # nothing written into a re-created folder nobody reads


def test_a_full_disk_skips_writes_and_keeps_answering(tokenizer, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}); needs root")
    try:
        engine = make_tiny_engine("qwen2", tokenizer, kv_dtype="float32")
        clean = engine.prefill(SEGMENTS).logits  # memory store only: the reference
        engine.store = TieredStore(MemoryStore(0), DiskStore(mount / "kv", engine.entry_spec))
        engine.precompute(CHUNKS)
        many = [f"{CHUNKS[i % 4]} Copy {i}." for i in range(40)]  # ~40 KB each: more than the disk holds
        engine.precompute(many)  # writes past the full disk are skipped, nothing raises
        assert engine.store.disk.faults > 0
        filler = mount / "filler"
        with open(filler, "wb") as out, pytest.raises(OSError):
            out.write(b"\0" * (1 << 20))  # whatever room was left is gone now
            out.flush()
        assert_clean_answer(engine, clean)
        engine.flush()
        assert not unnamed_entry_files(engine.store.disk)  # failed writes left no partial file
        assert sum(not ref.stored for ref in engine.precompute([f"{c} Once more." for c in CHUNKS])) > 0
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_store_falls_back_to_memory(tokenizer, tmp_path, caplog):
    source, view = tmp_path / "kv", tmp_path / "read-only"
    engine = make_tiny_engine("qwen2", tokenizer, kv_dtype="float32")
    clean = engine.prefill(SEGMENTS).logits
    writer = DiskStore(source, engine.entry_spec)
    engine.store = writer
    engine.precompute(CHUNKS[:2])   # the third chunk is not stored
    writer.close()
    view.mkdir()
    mount("--bind", str(source), str(view))
    try:
        mount("-o", "remount,bind,ro", str(view))
        before = files_in(source)
        # SQLite cannot open a database in a read-only folder (its WAL needs a -shm file)
        engine.store = open_store(view, engine.entry_spec)
        assert isinstance(engine.store, MemoryStore) and "keeping KV in memory only" in caplog.text
        pre = assert_clean_answer(engine, clean)
        assert pre.stats.chunks_computed == 3
        engine.flush()
        assert files_in(source) == before
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


def test_a_store_that_becomes_read_only_while_running(engine, clean):
    folder = engine.store.disk.directory
    mount("--bind", str(folder), str(folder))
    try:
        mount("-o", "remount,bind,ro", str(folder))
        assert_clean_answer(engine, clean)
        refs = engine.precompute(["A chunk written after the folder became read-only."])
        assert not refs[0].stored and engine.store.faults > 0
        assert not unnamed_entry_files(engine.store.disk)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_garbage_database_cannot_be_opened_as_a_store(tmp_path, tokenizer):
    from ragblend.core.store.tiers import store_faults

    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not a database" * 100)
    engine = make_tiny_engine("llama", tokenizer)
    with pytest.raises(store_faults()):
        DiskStore(folder, engine.entry_spec)


def test_memory_bytes_zero_turns_the_memory_tier_off():
    store = MemoryStore(0)
    from ragblend.core.store.kv import ChunkKV

    store.put(ChunkKV("k" * 64, [1, 2], torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)))
    assert len(store) == 0 and store.nbytes == 0
    with pytest.raises(InvalidInputError, match="memory_bytes"):
        MemoryStore(-1)


# ---------------------------------------------------------------------------- hostile headers


def hostile_headers(real: dict) -> dict[str, bytes]:
    def edited(**fields):
        return json.dumps({**real, **fields}).encode()

    ids = real["token_ids"]
    return {
        "token id 10**30": edited(token_ids=[10**30] + ids[1:]),
        "token id past the vocabulary": edited(token_ids=[10**6] + ids[1:]),
        "negative token id": edited(token_ids=[-1] + ids[1:]),
        "nested lists as token ids": edited(token_ids=[[i] for i in ids]),
        "200k nested arrays": b'{"token_ids": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        "booleans as sizes": edited(tokens=True, token_ids=[1]),
        "a 5000-digit number": b'{"format": ' + b"9" * 5000 + b"}",
        "an array, not an object": json.dumps(list(real)).encode(),
        "a string as checksums": edited(layer_crc32="0000"),
    }


@pytest.mark.parametrize("case", list(hostile_headers({"token_ids": [1, 2]})))
def test_a_hostile_header_is_dropped_and_recomputed(engine, clean, case):

    store = engine.store.disk
    key = engine.key_of(CHUNKS[1])   # the prompt's second chunk (the first is read from its lead entry)
    path = entry_path(store, key)
    blob = path.read_bytes()
    (header_len,) = struct.unpack("<I", blob[4:8])
    real = json.loads(blob[8:8 + header_len])
    path.write_bytes(with_header(blob, hostile_headers(real)[case]))
    assert store.verify(key) is not None       # `ragblend cache verify` names it
    layout = engine.find_chunks("Anything at all.")  # scanning the store's headers survives it
    assert layout.token_ids
    pre = assert_clean_answer(engine, clean)
    assert pre.stats.chunks_reused == 2 and pre.stats.chunks_computed == 1   # dropped, recomputed
    engine.flush()
    assert store.verify(key) is None           # and written back sound


def test_a_huge_header_length_is_refused_without_reading_it(tmp_path):

    store = DiskStore(tmp_path, SPEC)
    entry = synthetic_entry(1)
    store.put(entry)
    path = entry_path(store, entry.key)
    blob = bytearray(path.read_bytes())
    blob[4:8] = struct.pack("<I", 0xFFFFFFFF)
    path.write_bytes(bytes(blob))
    assert store.verify(entry.key) == "header larger than the file or than any real entry's"
    assert store.open(entry.key) is None and entry.key not in store


# ---------------------------------------------------------------------------- identity and leaks


def test_the_storage_dtype_is_part_of_an_entrys_identity(tokenizer, tmp_path):
    half = make_tiny_engine("llama", tokenizer, kv_dtype="float16")
    full = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    half.store = DiskStore(tmp_path, half.entry_spec)
    full.store = DiskStore(tmp_path, full.entry_spec)
    ids = half.prompts.tokenize(CHUNKS[0])
    assert half.ingestion.key_for(ids) != full.ingestion.key_for(ids)
    half.precompute([CHUNKS[0]])
    assert full.prefill([Chunk(CHUNKS[0]), "Q?"]).stats.chunks_reused == 0   # not the fp16 entry
    full.flush()
    assert half.store.get(half.ingestion.key_for(ids)).keys.dtype == torch.float16
    # computed as the prompt's first chunk: its lead entry
    assert full.store.get(full.ingestion.key_for(ids, lead=True)).keys.dtype == torch.float32


def test_opening_a_store_reclaims_files_no_row_names(tmp_path):

    store = DiskStore(tmp_path / "kv", SPEC)
    store.put(synthetic_entry(1))
    store.close()
    folder = tmp_path / "kv"
    old, young = folder / "ab/cd" / ("e" * 28 + ".val"), folder / "ab/cd" / ("f" * 28 + ".val")
    old.parent.mkdir(parents=True, exist_ok=True)   # the real entry's random folders may include it
    old.write_bytes(b"half of an entry")
    young.write_bytes(b"another process's write in progress")
    os.utime(old, (time.time() - 3600,) * 2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ("0" * 28 + ".val")).write_bytes(b"not the store's")
    os.utime(outside / ("0" * 28 + ".val"), (time.time() - 3600,) * 2)
    top = folder / next(f"{i:02x}" for i in range(256) if not (folder / f"{i:02x}").exists())
    top.mkdir()
    (top / "34").symlink_to(outside)      # a symlinked sub-folder is never followed
    (folder / "notes.txt").write_text("the user's")
    store = DiskStore(folder, SPEC)
    assert store.reclaimed == 1 and not old.exists() and young.exists()
    assert (outside / ("0" * 28 + ".val")).exists() and (folder / "notes.txt").exists()
    assert store.get(synthetic_entry(1).key) is not None


WRITER = """
import sys
from tests.conftest import make_tiny_engine, PASSAGES, TOKENIZER_DIR
from transformers import AutoTokenizer
from ragblend.core.store.tiers import DiskStore
engine = make_tiny_engine("qwen2", AutoTokenizer.from_pretrained(TOKENIZER_DIR), kv_dtype="float32")
engine.store = DiskStore(sys.argv[1], engine.entry_spec)
print("ready", flush=True)
for i in range(10**6):
    engine.precompute([f"{PASSAGES[i % len(PASSAGES)]} Variant {i}." * 30])
    print("stored", flush=True)
"""


def test_a_writer_killed_at_random_points_leaves_a_sound_store(engine, clean):
    """SIGKILL a process writing entries at random moments; every entry left must verify,
    no unnamed file may stay after the next open, and answers stay clean."""
    import random
    import signal

    folder = engine.store.disk.directory
    root = Path(__file__).resolve().parents[2]
    rng = random.Random(0)
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], cwd=root, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().strip() == "stored"   # at least one entry, however busy the machine
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = DiskStore(folder, engine.entry_spec, orphan_age_s=0)   # no writer is left: unnamed files are leaks
    assert not unnamed_entry_files(store)
    assert {key: store.verify(key) for key in store.keys()} == dict.fromkeys(store.keys())   # all sound
    assert len(store) > len(CHUNKS)
    engine.store = TieredStore(MemoryStore(0), store)
    assert assert_clean_answer(engine, clean).stats.chunks_reused == 3


def test_cache_stats_and_clear_on_a_store_too_broken_to_open(tmp_path, capsys):
    from ragblend.cli import main


    folder = tmp_path / "kv"
    store = DiskStore(folder, SPEC)
    for i in range(3):
        store.put(synthetic_entry(i))
    store.close()
    (folder / "cache.db").write_bytes(b"this is not a database" * 100)
    (folder / "notes.txt").write_text("the user's")
    assert main(["cache", "stats", "--kv-dir", str(folder)]) == 2
    assert "cannot be opened" in capsys.readouterr().err
    assert main(["cache", "clear", "--kv-dir", str(folder)]) == 0
    assert "Removed the broken store's database and 3 entry file(s)" in capsys.readouterr().out
    assert files_in(folder) == {"notes.txt": len("the user's")}   # only the store's own files went
    assert main(["cache", "stats", "--kv-dir", str(folder)]) == 0   # no store left, and none created
    assert "No KV store at" in capsys.readouterr().out and not (folder / "cache.db").exists()


def test_a_store_locked_at_open_falls_back_quickly_and_is_not_cleared(tmp_path, capsys, caplog):
    from ragblend.cli import main


    folder = tmp_path / "kv"
    store = DiskStore(folder, SPEC)
    store.put(synthetic_entry(1))
    store.close()
    before = files_in(folder)
    with write_lock_held(folder):
        t0 = time.perf_counter()
        assert isinstance(open_store(folder, SPEC), MemoryStore)   # diskcache alone would wait 60 s
        assert time.perf_counter() - t0 < 3 and "keeping KV in memory only" in caplog.text
        assert main(["cache", "clear", "--kv-dir", str(folder)]) == 2
        assert "no other process holds the store" in capsys.readouterr().err
        assert before.items() <= files_in(folder).items()   # a busy store is not a broken one: nothing removed
    assert DiskStore(folder, SPEC).get(synthetic_entry(1).key) is not None
