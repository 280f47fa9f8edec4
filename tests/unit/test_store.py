"""KV store tiers, the binary format, integrity, process safety and eviction."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ragblend import CacheBlend, FullReuse
from ragblend.cli import main
from ragblend.core.errors import InvalidInputError
from ragblend.core.options import EngineOptions
from ragblend.core.store.disk_limit import DEFAULT_DISK_BYTES
from ragblend.core.store.kv import ChunkKV, quantize_int8, quantize_uint4
from ragblend.core.store.tiers import (
    MARKER,
    CorruptEntryError,
    DiskStore,
    MemoryStore,
    TieredStore,
    encode_entry,
    open_store,
)

from ..conftest import PASSAGES, SEGMENTS, SPEC, entry_path, flip_byte, make_tiny_engine, synthetic_entry

# ---------------------------------------------------------------------------- format


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_per_dtype(tmp_path, dtype):
    store = DiskStore(tmp_path, SPEC)
    entry = synthetic_entry(1, dtype=dtype)
    store.put(entry)
    back = store.get(entry.key)
    assert back.token_ids == entry.token_ids and back.keys.dtype == dtype
    assert torch.equal(back.keys, entry.keys) and torch.equal(back.values, entry.values)
    reader = store.open(entry.key)
    k, v = reader.layer(2)  # one layer, read on its own
    reader.close()
    assert torch.equal(k, entry.keys[2]) and torch.equal(v, entry.values[2])
    assert store.verify(entry.key) is None


def test_int8_entries_round_trip_with_their_scales(tmp_path):
    exact = synthetic_entry(1, tokens=40, dtype=torch.float32)
    exact.keys[:, :, :, 3] *= 20                       # an outlier channel, as K has
    entry = quantize_int8(exact)
    store = DiskStore(tmp_path, SPEC)
    store.put(entry)
    back = store.get(entry.key)                        # as stored: int8 values and their scales
    assert back.keys.dtype == torch.int8 and torch.equal(back.keys, entry.keys)
    assert torch.equal(back.key_scales, entry.key_scales) and torch.equal(back.value_scales, entry.value_scales)
    reader = store.open(entry.key)
    k, v = reader.layer(1)                             # dequantized, layer by layer
    reader.close()
    assert k.dtype == torch.float16 and torch.equal(k, entry.layer(1)[0]) and torch.equal(v, entry.layer(1)[1])
    # Rounding to the nearest step: off by at most half a step (plus float16 rounding).
    k_step = entry.key_scales[1].float()[:, None, :]
    v_step = entry.value_scales[1].float()[:, :, None]
    assert ((k.float() - exact.keys[1]).abs() <= 0.51 * k_step + 1e-3).all()
    assert ((v.float() - exact.values[1]).abs() <= 0.51 * v_step + 1e-3).all()
    # About half the bytes of float16: one byte a value, plus the scales.
    half = synthetic_entry(1, tokens=40)
    assert entry.nbytes < 0.6 * half.nbytes
    assert store.verify(entry.key) is None
    flip_byte(entry_path(store, entry.key), -3)        # a flipped bit in a scale is caught too
    assert store.verify(entry.key) is not None


def test_uint4_entries_round_trip_with_their_steps_and_read_back_as_they_decode_in_memory(tmp_path):
    exact = synthetic_entry(2, tokens=45, dtype=torch.float32)   # 45 tokens: a short last K group
    entry = quantize_uint4(exact)
    store = DiskStore(tmp_path, SPEC)
    store.put(entry)
    assert store.entries_by_dtype() == {"uint4": {"entries": 1, "bytes": store.nbytes}}
    back = store.get(entry.key)                        # as stored: packed codes, steps and minimums
    assert back.storage_dtype == torch.uint4 and torch.equal(back.keys, entry.keys)
    assert torch.equal(back.key_scales, entry.key_scales) and torch.equal(back.value_scales, entry.value_scales)
    reader = store.open(entry.key)
    for layer in range(SPEC.num_layers):               # decoded layer by layer, as the memory tier decodes
        k, v = reader.layer(layer)
        assert k.dtype == torch.float16 and torch.equal(k, entry.layer(layer)[0]) and torch.equal(v, entry.layer(layer)[1])
    reader.close()
    assert store.verify(entry.key) is None
    flip_byte(entry_path(store, entry.key), -3)        # a flipped bit in a minimum is caught
    assert store.verify(entry.key) is not None


def test_every_sound_header_parses_whatever_its_checksum_bytes():
    """The header checks look at the header's own bytes only: a CRC that happens to contain
    a bracket byte must not make a sound entry look hostile (~3% of entries would)."""
    import io

    from ragblend.core.store.tiers import FileReader

    for i in range(400):
        blob = encode_entry(synthetic_entry(i, tokens=2), SPEC.fingerprint)
        FileReader(io.BytesIO(blob), f"{i:064x}", SPEC, len(blob)).close()


def test_layout_is_layer_major_with_one_read_per_layer(tmp_path):
    entry = synthetic_entry(2)
    blob = encode_entry(entry, SPEC.fingerprint)
    layer_bytes = 2 * 2 * 16 * 8 * 2  # K and V, [2 heads, 16 tokens, 8 dims], fp16
    data = blob[len(blob) - 3 * layer_bytes:]
    layer1 = data[layer_bytes:2 * layer_bytes]
    assert layer1[:layer_bytes // 2] == entry.keys[1].numpy().tobytes()
    assert layer1[layer_bytes // 2:] == entry.values[1].numpy().tobytes()


# ---------------------------------------------------------------------------- integrity




def corrupt(kind: str, engine, store: DiskStore, key: str) -> None:
    path = entry_path(store, key)
    entry = store.get(key)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "bit flip in the last layer":
        flip_byte(path, path.stat().st_size - 3)
    elif kind == "bit flip in the header":
        flip_byte(path, 30)
    elif kind == "foreign model":
        path.write_bytes(encode_entry(entry, "0" * 64))
    elif kind == "wrong shape":
        narrow = ChunkKV(key, entry.token_ids, entry.keys[:, :1].contiguous(), entry.values[:, :1].contiguous())
        path.write_bytes(encode_entry(narrow, engine.fingerprint))
    elif kind == "other token ids":
        other = ChunkKV(key, [t + 1 for t in entry.token_ids], entry.keys, entry.values)
        path.write_bytes(encode_entry(other, engine.fingerprint))
    elif kind == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif kind == "file deleted":
        path.unlink()
    else:
        raise ValueError(kind)


KINDS = ["truncated", "bit flip in the last layer", "bit flip in the header", "foreign model", "wrong shape",
         "other token ids", "garbage", "file deleted"]


@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_entry_is_dropped_recomputed_and_answer_unchanged(disk_engine, kind):
    engine, store = disk_engine, disk_engine.store
    # One chunk per pass, as a query's recompute does, so the recomputed entry is bit-identical
    # (packed passes agree to ~1e-6, which can flip a float16 rounding).
    engine.precompute_batch_tokens = 0
    refs = engine.precompute(PASSAGES[:3])
    clean = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    clean_text = engine.generate(SEGMENTS, strategy=CacheBlend(0.3), max_new_tokens=8).text
    assert clean.stats.chunks_reused == 3 and clean.stats.tiers == {"disk": 3}

    victim = refs[1].key
    corrupt(kind, engine, store, victim)
    again = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    assert torch.equal(again.logits, clean.logits)
    assert again.stats.chunks_computed == 1 and again.stats.chunks_reused == 2
    engine.flush()
    assert store.verify(victim) is None  # written back, sound
    assert engine.generate(SEGMENTS, strategy=CacheBlend(0.3), max_new_tokens=8).text == clean_text


def test_corrupt_layer_raises_from_reader(tmp_path):
    store = DiskStore(tmp_path, SPEC)
    entry = synthetic_entry(3)
    store.put(entry)
    flip_byte(entry_path(store, entry.key), entry_path(store, entry.key).stat().st_size - 1)
    reader = store.open(entry.key)  # the header is fine
    assert reader.layer(0)[0].shape == (2, 16, 8)
    with pytest.raises(CorruptEntryError, match="layer 2 checksum"):
        reader.layer(2)
    reader.close()
    assert store.verify(entry.key) == "layer 2 checksum mismatch"
    assert store.get(entry.key) is None and entry.key not in store  # dropped


def test_pickled_values_are_never_unpickled(tmp_path):
    import diskcache

    DiskStore(tmp_path, SPEC).close()   # a ragblend store (with its marker)...
    raw = diskcache.Cache(str(tmp_path))
    raw.set("a" * 64, Exploit())  # ...where plain diskcache stored a pickled value
    raw.close()
    store = DiskStore(tmp_path, SPEC)
    assert store.open("a" * 64) is None
    assert EXPLOITED == []
    assert "a" * 64 not in store


EXPLOITED = []


def _exploit():
    EXPLOITED.append(True)


class Exploit:
    def __reduce__(self):
        return (_exploit, ())


def test_no_pickle_or_torch_load_in_the_package():
    package = Path(__file__).resolve().parents[2] / "ragblend"
    offenders = []
    for path in package.rglob("*.py"):
        text = path.read_text()
        for needle in ("import pickle", "pickle.load", "torch.load(", "cPickle", "dill"):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert offenders == []


# ---------------------------------------------------------------------------- processes


ORDERED_WRITER = """
import sys
from ragblend.core.store.tiers import DiskStore
from tests.conftest import SPEC, synthetic_entry
store = DiskStore(sys.argv[1], SPEC)
for i in (range(50) if sys.argv[2] == "up" else reversed(range(50))):
    store.put(synthetic_entry(i, tokens=64))
store.close()
"""


def test_two_processes_writing_the_same_50_chunks(tmp_path):
    # Plain interpreters rather than multiprocessing's spawn, which re-runs whatever
    # sys.modules["__main__"] is (the Streamlit app, if an app test's script thread is alive).
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", ORDERED_WRITER, str(tmp_path), order], cwd=root,
                              stderr=subprocess.PIPE, text=True) for order in ("up", "down")]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    store = DiskStore(tmp_path, SPEC)
    assert len(store) == 50
    assert all(store.verify(f"{i:064x}") is None for i in range(50))
    assert torch.equal(store.get(f"{7:064x}").keys, synthetic_entry(7, tokens=64).keys)


WRITER = """
import sys, torch
from ragblend.core.store.tiers import DiskStore
from tests.conftest import SPEC, synthetic_entry
store = DiskStore(sys.argv[1], SPEC)
i = 0
while True:
    store.put(synthetic_entry(i, tokens=20000))
    i += 1
    print(i, flush=True)
"""


def test_process_killed_mid_write_leaves_store_readable(tmp_path):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True)
    written = 0
    deadline = time.time() + 60
    while written < 3 and time.time() < deadline:
        written = int(proc.stdout.readline() or 0)
    time.sleep(0.05)  # most likely in the middle of the next write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert written >= 3
    store = DiskStore(tmp_path, SPEC)
    keys = list(store.keys())
    assert len(keys) >= 3
    assert all(store.verify(k) is None for k in keys)  # no torn entry
    store.put(synthetic_entry(999))
    assert store.verify(f"{999:064x}") is None


# ---------------------------------------------------------------------------- tiers


def test_memory_tier_stays_under_its_limit():
    entry_bytes = synthetic_entry(0).nbytes
    store = MemoryStore(max_bytes=3 * entry_bytes + 10)
    for i in range(10):
        store.put(synthetic_entry(i))
        assert store.nbytes <= store.max_bytes
    assert len(store) == 3
    assert f"{9:064x}" in store and f"{0:064x}" not in store  # least recently used went first


def test_disk_tier_stays_under_its_limit(tmp_path):
    big = synthetic_entry(0, tokens=4000)
    limit = 5 * big.nbytes
    store = DiskStore(tmp_path, SPEC, max_bytes=limit)
    for i in range(20):
        store.put(synthetic_entry(i, tokens=4000))
        assert store.nbytes <= limit
    assert 0 < len(store) < 20
    assert f"{19:064x}" in store


def test_a_store_keeps_the_size_limit_given_when_a_later_opener_names_none(tmp_path, capsys):
    # Issue 55: `ragblend ingest --disk-bytes 20GB`, then a command without the flag (or the Python
    # API's default) opened the store at 8 GiB and evicted down to it.
    big = synthetic_entry(0, tokens=4000)
    limit = 5 * big.nbytes
    DiskStore(tmp_path, SPEC, max_bytes=limit).close()
    store = DiskStore(tmp_path, SPEC)   # names no limit: the saved one
    assert store.max_bytes == limit
    for i in range(12):
        store.put(synthetic_entry(i, tokens=4000))
        assert store.nbytes <= limit
    assert 0 < len(store) < 12
    store.close()
    assert open_store(tmp_path, SPEC).stats()["disk"]["max_bytes"] == limit
    DiskStore(tmp_path, SPEC, max_bytes=20 << 30).close()   # a larger one given is saved too
    assert open_store(tmp_path, SPEC).stats()["disk"]["max_bytes"] == 20 << 30
    assert main(["cache", "stats", "--kv-dir", str(tmp_path)]) == 0
    assert "(limit 20 GiB)" in capsys.readouterr().out


def test_a_smaller_limit_given_wins_and_says_what_it_evicts(tmp_path, caplog):
    store = DiskStore(tmp_path, SPEC, max_bytes=1 << 30)
    for i in range(6):
        store.put(synthetic_entry(i, tokens=4000))
    store.close()
    entry_bytes = synthetic_entry(0, tokens=4000).nbytes
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        store = DiskStore(tmp_path, SPEC, max_bytes=int(2.5 * entry_bytes))
    said = [r.getMessage() for r in caplog.records if "limit given now" in r.getMessage()]
    assert len(said) == 1 and "holds" in said[0] and "in 6 entries" in said[0] and "(it kept 1.0 GiB)" in said[0]
    assert "its next write evicts at least the 4 least recently used" in said[0]
    store.put(synthetic_entry(6, tokens=4000))
    assert len(store) == 2 and f"{6:064x}" in store and f"{5:064x}" in store
    store.close()
    assert DiskStore(tmp_path, SPEC).max_bytes == int(2.5 * entry_bytes)   # kept for later openers


def test_a_store_saved_without_a_limit_keeps_the_default(tmp_path):
    DiskStore(tmp_path, SPEC).close()
    marker = json.loads((tmp_path / MARKER).read_text())
    assert "disk_bytes" not in marker   # a default is not saved: the default may change
    assert DiskStore(tmp_path, SPEC).max_bytes == DEFAULT_DISK_BYTES == 8 << 30
    (tmp_path / MARKER).write_text(json.dumps({**marker, "disk_bytes": "lots"}))   # not bytes: as if none
    assert DiskStore(tmp_path, SPEC).max_bytes == 8 << 30
    with pytest.raises(InvalidInputError, match="disk_bytes must be a whole number"):
        DiskStore(tmp_path, SPEC, max_bytes=-1)
    with pytest.raises(InvalidInputError, match="disk_bytes must be a whole number"):
        EngineOptions(disk_bytes=1.5)


def test_tiered_store_promotes_disk_hits(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = TieredStore(MemoryStore(), DiskStore(tmp_path, engine.entry_spec))
    engine.precompute(PASSAGES[:3])
    engine.store.memory = MemoryStore()  # a new process: memory empty, disk full
    hits = engine.store.stats()["disk"]["hits"]
    # CacheBlend never reads layer 0 from the store; promotion must still copy whole entries
    first = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    assert first.stats.tiers == {"disk": 3}
    engine.flush()  # promotion runs in the background
    second = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    assert second.stats.tiers == {"memory": 3}
    assert torch.equal(first.logits, second.logits)
    stats = engine.store.stats()
    # the 3 entries read (the first chunk's lead entry, the others' own) of the 6 stored
    assert stats["memory"]["entries"] == 3 and stats["disk"]["entries"] == 6
    # Three chunks read from disk are three hits: neither promotion nor verification counts.
    assert all(engine.store.disk.verify(key) is None for key in engine.store.disk.keys())
    assert stats["disk"]["hits"] == engine.store.stats()["disk"]["hits"] == hits + 3


def test_fp16_storage_halves_bytes_and_stays_close(tokenizer, tmp_path):
    e32 = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    e16 = make_tiny_engine("llama", tokenizer, kv_dtype="float16")
    r32, r16 = e32.precompute(PASSAGES[:3]), e16.precompute(PASSAGES[:3])
    # different keys: the storage dtype changes an entry's bytes, so it is part of its identity
    assert [r.num_tokens for r in r32] == [r.num_tokens for r in r16] and not {r.key for r in r32} & {r.key for r in r16}
    b32 = sum(e32.store.get(r.key).nbytes for r in r32)
    b16 = sum(e16.store.get(r.key).nbytes for r in r16)
    assert b16 * 2 == b32
    l32 = e32.prefill(SEGMENTS, strategy=FullReuse()).logits
    l16 = e16.prefill(SEGMENTS, strategy=FullReuse()).logits
    assert (l32 - l16).abs().max() < 0.05


def test_int8_storage_stays_close_and_never_meets_float16_entries(tokenizer, tmp_path):
    e16 = make_tiny_engine("llama", tokenizer, kv_dtype="float16")
    e8 = make_tiny_engine("llama", tokenizer, kv_dtype="int8")
    e16.store, e8.store = DiskStore(tmp_path, e16.entry_spec), DiskStore(tmp_path, e8.entry_spec)
    r16 = e16.precompute(PASSAGES[:3])
    # An int8 engine on the same folder does not read the float16 entries (nor the reverse):
    # the storage dtype is part of the key, so each computes and stores its own.
    assert e8.prefill(SEGMENTS, strategy=FullReuse()).stats.chunks_reused == 0
    e8.flush()
    r8 = e8.precompute(PASSAGES[:3])
    assert not {r.key for r in r8} & {r.key for r in r16}
    assert all(e8.store.get(r.key).keys.dtype == torch.int8 for r in r8)
    b16 = sum(e16.store.get(r.key).nbytes for r in r16)
    assert sum(e8.store.get(r.key).nbytes for r in r8) < 0.6 * b16
    l16 = e16.prefill(SEGMENTS, strategy=FullReuse())
    l8 = e8.prefill(SEGMENTS, strategy=FullReuse())
    assert l8.stats.chunks_reused == 3 and l16.stats.chunks_reused == 3
    gap = (l16.logits - l8.logits).abs()
    assert gap.max() < 0.25 and gap.mean() < 0.03 * l16.logits.std()
    # Values beyond float16's range (int8 entries are read back in float16) stay float32.
    shape = e8.adapter.shape
    huge = torch.full((shape.num_layers, shape.num_kv_heads, 4, shape.head_dim), 7e4)
    assert e8.ingestion.storage_entry([1, 2, 3, 4], huge, huge).keys.dtype == torch.float32


# ---------------------------------------------------------------------------- the engine over a disk store


def test_stream_does_not_hold_the_engine_across_yields(disk_engine):
    import threading

    engine = disk_engine
    stream = engine.stream(["Say something long."], max_new_tokens=6)
    next(stream)
    other = threading.Thread(target=lambda: engine.prefill(["Another prompt."]))
    other.start()
    other.join(30)
    assert not other.is_alive()  # a second caller is not blocked by a paused stream
    rest = list(stream)
    # every text delta holds at least one token (a token may wait for the next to decode)
    assert 1 + len(rest) <= stream.stats.generated_tokens <= 6
    assert engine.last_stats is stream.stats   # the stream finished last
