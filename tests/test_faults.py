"""Faults of the KV store's disk tier: each one is a miss, and the answer equals a clean run's.

Real faults where the machine allows them: a second process holding an exclusive SQLite lock,
the KV folder deleted under a running engine, a full tmpfs (needs root: skipped otherwise), a
garbage database file.
"""

import shutil
import subprocess
import sys
import time

import pytest
import torch

from ragblend import Chunk, InvalidInputError
from ragblend.core.store import DiskStore, MemoryStore, TieredStore

from .conftest import PASSAGES, make_tiny_engine

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


def test_a_locked_database_is_a_quick_miss(engine, clean):
    db = engine.store.disk.directory / "cache.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         f"c = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        pre = assert_clean_answer(engine, clean)
        assert pre.stats.chunks_reused == 0 and engine.store.disk.faults > 0
    finally:
        holder.kill()
        holder.wait()
    engine.flush()
    assert engine.prefill(SEGMENTS).stats.chunks_reused == 3  # back once the lock is gone


def test_the_kv_folder_deleted_under_a_running_engine(engine, clean):
    engine.flush()
    shutil.rmtree(engine.store.disk.directory)
    pre = assert_clean_answer(engine, clean)
    assert pre.stats.chunks_reused == 0
    engine.flush()  # write-back into the vanished folder is skipped, not raised
    assert engine.store.stats()["disk"]["entries"] >= 0  # statistics still answer


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
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_garbage_database_cannot_be_opened_as_a_store(tmp_path, tokenizer):
    from ragblend.core.store import store_faults

    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not a database" * 100)
    engine = make_tiny_engine("llama", tokenizer)
    with pytest.raises(store_faults()):
        DiskStore(folder, engine.entry_spec)


@pytest.mark.slow
def test_from_pretrained_falls_back_to_memory_when_the_store_cannot_open(tmp_path, caplog):
    from ragblend import BlendEngine

    folder = tmp_path / "kv"
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"this is not a database" * 100)
    engine = BlendEngine.from_pretrained(kv_dir=folder)
    assert isinstance(engine.store, MemoryStore)
    assert "keeping KV in memory only" in caplog.text
    engine.precompute([CHUNKS[0]])
    assert engine.prefill([Chunk(CHUNKS[0]), "Q?"]).stats.chunks_reused == 1


def test_memory_bytes_zero_turns_the_memory_tier_off():
    store = MemoryStore(0)
    from ragblend.core.kv import ChunkKV

    store.put(ChunkKV("k" * 64, [1, 2], torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)))
    assert len(store) == 0 and store.nbytes == 0
    with pytest.raises(InvalidInputError, match="memory_bytes"):
        MemoryStore(-1)
