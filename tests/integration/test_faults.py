"""Faults of the KV store with the real default model: from_pretrained falls back to memory when its
store cannot open (the disk tier's faults on tiny models are in tests/unit/test_faults.py)."""


import pytest

from ragblend import Chunk
from ragblend.core.store.tiers import MemoryStore

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
