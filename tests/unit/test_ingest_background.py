"""Searchable first, KV after: an ingest commits chunks and embeddings, then the KV filler
computes the missing KV (now, in a background thread, or later), resumably, recently
retrieved documents first, pausing for queries; coverage in the library and in
`ragblend cache stats`. Real Chroma on disk, the real embedding model, a tiny random LLM."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")

import ragblend  # noqa: E402
from ragblend.cli import main  # noqa: E402
from ragblend.core.errors import InvalidInputError  # noqa: E402
from ragblend.core.store.tiers import DiskStore, EntrySpec, MemoryStore, open_store  # noqa: E402
from ragblend.integrations.kv_fill import KVFillBusyError, fill_lock, store_room  # noqa: E402
from ragblend.integrations.local_index import LocalIndex  # noqa: E402
from ragblend.vectorstore_hooks.llamaindex import KV_KEY, llm_text  # noqa: E402

from ..conftest import make_tiny_engine, synthetic_entry  # noqa: E402

TOPICS = ["ferry", "lighthouse", "bakery", "bridge", "kite", "harbour", "museum", "orchard", "library", "market",
          "tram", "school"]


def paragraph(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Note {i} about the {topic}: the {topic} of Lowenmark opened in {1850 + i} and is run by the council; "
            f"visitors may see the {topic} every day from {i % 9 + 8} o'clock until the evening bell rings.\n")


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(24):
        (folder / f"{i:02d}.md").write_text(paragraph(i))
    return folder


@pytest.fixture
def rag(tmp_path, tokenizer):
    engine = make_tiny_engine("llama", tokenizer, precompute_batch_tokens=128)
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec)
    index = LocalIndex(tmp_path / "index", engine=engine)
    yield index
    index.kv.stop()


def keys_in_index(rag) -> set[str]:
    return {node.metadata[KV_KEY] for node in rag.vector_store.get_nodes()}


def count_precomputed(monkeypatch, engine) -> list[list[str]]:
    """Record the texts of every engine.precompute call."""
    calls, precompute = [], engine.precompute

    def recording(texts, **kwargs):
        calls.append(list(texts))
        return precompute(texts, **kwargs)

    monkeypatch.setattr(engine, "precompute", recording)
    return calls


def test_chunks_are_searchable_before_their_kv_and_a_query_computes_what_it_uses(rag, docs):
    report = rag.ingest([docs], show_progress=False, kv="skip")
    assert report.nodes == len(rag) == 24 and report.kv_computed == 0 and report.searchable_s > 0
    keys = keys_in_index(rag)
    assert len(keys) == 24 and not any(key in rag.engine.store for key in keys)   # keyed, nothing computed
    coverage = rag.kv_coverage()
    assert (coverage.chunks, coverage.keyed, coverage.stored, coverage.fraction) == (24, 24, 0, 0.0)
    # Each key is the one the engine stores the node's KV under.
    node = rag.vector_store.get_nodes()[0]
    assert rag.engine.key_of(llm_text(node)) == node.metadata[KV_KEY]

    answer = rag.ask("When did the lighthouse open?", top_k=2, max_new_tokens=4)
    assert answer.stats.chunks_computed == 2 and answer.stats.chunks_reused == 0   # answered at once
    rag.engine.flush()
    first, second = (n.node.metadata[KV_KEY] for n in answer.sources)
    # and written back: the second chunk's own entry, the first's as the prompt's first passage (its lead entry)
    assert second in rag.engine.store and first not in rag.engine.store and len(rag.engine.store) == 2
    coverage = rag.kv_coverage()   # the second chunk's own entry; the first's lead entry only
    assert (coverage.stored, coverage.lead_missing) == (1, 1)



def test_chunks_stored_during_a_fill_count_as_covered_not_computed(rag, docs, monkeypatch):
    rag.ingest([docs], show_progress=False, kv="skip")
    listed = rag.kv._pending(set())   # the filler lists what is missing; then another writer stores one chunk
    node = rag.vector_store.get_nodes()[0]
    rag.engine.precompute([llm_text(node)])   # both its entries, as queries' write-backs or another process would
    stored = {node.metadata[KV_KEY]}
    rounds = iter([listed])
    monkeypatch.setattr(rag.kv, "_pending", lambda tried: next(rounds, []))
    assert rag.kv.run() == 23 == rag.kv.computed   # 24 covered, one stored meanwhile, not computed here
    # ... so neither are its tokens in the filler's rate (it took it no computing)
    assert rag.kv.tokens == sum(rag.engine.count_tokens(llm_text(n)) for n in rag.vector_store.get_nodes()
                                if n.metadata[KV_KEY] not in stored)


def test_a_store_without_room_for_every_lead_entry_fills_what_fits_once(rag, docs, tokenizer, caplog):
    """Lead entries are the expendable ones: a fill adds those the store has room for, evicts no
    own entry, and does not compute them again on the next fill (it would evict and recompute)."""
    import logging

    rag.ingest([docs], show_progress=False, kv="skip")
    without_lead = make_tiny_engine("llama", tokenizer, lead_chunk_kv=False)
    without_lead.store = rag.engine.store
    without_lead.precompute([llm_text(node) for node in rag.vector_store.get_nodes()])
    disk = rag.engine.store.disk
    stats = disk.stats()["disk"]
    disk.max_bytes = int((stats["bytes"] + 5.5 * stats["bytes"] / stats["entries"]) / 0.9)   # room for 5 more
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        assert rag.kv.run() == 5
    assert "no room for the lead entries of 19 chunk(s)" in caplog.text
    assert all(key in rag.engine.store for key in keys_in_index(rag))   # no own entry evicted
    assert rag.kv.run() == 0 and rag.kv_coverage().lead_missing == 19


def test_store_room_counts_mean_sized_entries_below_90_percent_of_the_store():
    store = MemoryStore(1 << 20)
    assert store_room(store, 0) == 1 << 62   # empty: no entry size to go by, no bound
    for i in range(4):
        store.put(synthetic_entry(i))
    mean = store.nbytes / 4
    store.max_bytes = int((store.nbytes + 10.5 * mean) / 0.9)   # room for 10 more
    assert store_room(store, 0) == 10 and store_room(store, 3) == 7 and store_room(store, 30) == 0


def test_a_chunk_a_query_stored_one_entry_of_is_completed_by_the_fill(rag, docs):
    rag.ingest([docs], show_progress=False, kv="skip")
    answer = rag.ask("When did the lighthouse open?", top_k=2, max_new_tokens=4)
    rag.engine.flush()   # the first chunk's lead entry and the second's own entry
    first, second = (n.node.metadata[KV_KEY] for n in answer.sources)
    assert rag.kv.run() == 24   # each of the two gets its other entry
    assert all(entry in rag.engine.store for key in (first, second) for entry in rag.engine.entry_keys(key))


def test_background_fill_reaches_full_coverage_and_a_repeated_query_reuses_every_chunk(rag, docs):
    report = rag.ingest([docs], show_progress=False, kv="background")
    assert report.kv_computed == 0
    assert rag.kv.wait(timeout=120) and rag.kv.state == "idle"
    assert rag.kv.computed == 24 and rag.kv.rate() > 0
    assert rag.kv_coverage().fraction == 1.0
    question = "When did the bakery open?"
    for _ in range(2):
        stats = rag.ask(question, top_k=3, max_new_tokens=4).stats
        assert stats.chunks_computed == 0 and stats.chunks_missing == 0 and stats.chunks_reused == 3


def test_ingest_now_computes_the_kv_before_returning(rag, docs):
    report = rag.ingest([docs], show_progress=False)   # kv="now" by default
    assert report.kv_computed == 24 and rag.kv_coverage().pending == 0
    again = rag.ingest([docs], show_progress=False)
    assert again.unchanged == 24 and again.kv_computed == 0


def test_identical_documents_count_their_shared_chunk_once(rag, docs):
    (docs / "copy").mkdir()
    (docs / "copy" / "00.md").write_text((docs / "00.md").read_text())   # same text, another file
    report = rag.ingest([docs], show_progress=False)
    assert report.nodes == len(rag) == 25 and report.kv_computed == 24 == len(keys_in_index(rag))


def test_an_interrupted_fill_resumes_without_computing_a_chunk_twice(rag, docs, monkeypatch):
    rag.ingest([docs], show_progress=False, kv="skip")
    calls, precompute = [], rag.engine.precompute

    def interrupted(texts, **kwargs):
        calls.append(list(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt   # Ctrl-C during the third pass
        return precompute(texts, **kwargs)

    monkeypatch.setattr(rag.engine, "precompute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rag.kv.run()
    done = rag.kv_coverage().stored
    assert 0 < done < 24 and done == sum(map(len, calls[:2]))
    first_pass = calls[:2]
    calls.clear()
    monkeypatch.setattr(rag.engine, "precompute", lambda texts, **kw: (calls.append(list(texts)), precompute(texts, **kw))[1])
    assert rag.kv.run() == 24 - done
    assert rag.kv_coverage().stored == 24
    computed = [t for call in first_pass + calls for t in call]
    assert len(computed) == len(set(computed)) == 24   # every chunk exactly once


def test_a_store_filled_before_lead_entries_gets_them_from_a_fill(rag, docs, tokenizer, capsys):
    """Own entries alone (an engine without lead entries filled the store): the chunks are not
    covered for an engine that keeps lead entries, and a fill computes only those."""
    rag.ingest([docs], show_progress=False, kv="skip")
    without_lead = make_tiny_engine("llama", tokenizer, lead_chunk_kv=False)
    without_lead.store = rag.engine.store
    without_lead.precompute([llm_text(node) for node in rag.vector_store.get_nodes()])
    keys, store = keys_in_index(rag), rag.engine.store
    leads = {rag.engine.entry_keys(key)[1] for key in keys}
    assert all(key in store for key in keys) and not any(lead in store for lead in leads)
    coverage = rag.kv_coverage()
    assert (coverage.stored, coverage.lead_missing, coverage.to_compute) == (24, 24, 24)
    assert "24 without their lead entry" in coverage.describe()
    # `cache stats` (no model) counts own entries and says that a fill adds the lead ones
    assert main(["cache", "stats", "--index", str(rag.path)]) == 0
    assert "KV for 24 of 24 chunk(s)" in capsys.readouterr().out.replace("also adds any lead entries missing", "")

    assert rag.kv.run() == 24 and all(lead in store for lead in leads)
    # one entry of two computed per chunk: half their tokens count towards the fill's rate
    assert rag.kv.tokens == sum(rag.engine.count_tokens(llm_text(n)) // 2 for n in rag.vector_store.get_nodes())
    assert rag.kv_coverage().lead_missing == 0 and rag.kv.run() == 0
    answer = rag.ask("When did the lighthouse open?", top_k=2, max_new_tokens=4)
    assert answer.stats.chunks_computed == 0 and answer.stats.chunks_reused == 2


def test_chunks_of_recently_retrieved_documents_go_first(rag, docs, monkeypatch):
    rag.ingest([docs], show_progress=False, kv="skip")
    late = [str((docs / f"{i:02d}.md").resolve()) for i in (21, 22)]   # listed last in the index
    rag.kv.retrieved(late)
    calls = count_precomputed(monkeypatch, rag.engine)
    rag.kv.run()
    order = [t for call in calls for t in call]
    assert "Note 22 " in order[0] and "Note 21 " in order[1]   # the most recently retrieved document first
    assert len(order) == 24


def test_queries_go_through_the_query_engine_and_tell_the_filler(rag, docs):
    rag.ingest([docs], show_progress=False, kv="skip")
    response = rag.query_engine(top_k=1, max_new_tokens=2).query("When did the orchard open?")
    doc_id = response.source_nodes[0].node.ref_doc_id
    assert list(rag.kv._recent) == [doc_id]


def test_the_filler_pauses_while_a_query_runs(rag, docs):
    rag.ingest([docs], show_progress=False, kv="skip")
    with rag.kv.query():
        rag.kv.start()
        time.sleep(1.5)
        assert rag.kv.computed == 0 and rag.kv.state == "paused for a query" and rag.kv.running
    assert rag.kv.wait(timeout=120) and rag.kv.computed == 24


def test_a_second_filler_of_the_same_index_leaves_the_work_to_the_first(rag, docs):
    rag.ingest([docs], show_progress=False, kv="skip")
    with fill_lock(rag.path):   # held as another process's filler would hold it
        with pytest.raises(KVFillBusyError, match="is computing the KV of the index"):
            rag.kv.run()
        report = rag.ingest([docs / "00.md"], show_progress=False, kv="now")
        assert "is computing the KV" in report.kv_note and report.kv_computed == 0
        rag.kv.start()
        assert rag.kv.wait(timeout=30) and "is computing the KV" in rag.kv.state
    assert rag.kv.run() == 24


HOLD_FILL_LOCK = """import sys, time
from ragblend.integrations.kv_fill import fill_lock
with fill_lock(sys.argv[1]):   # as a `ragblend cache fill` process holds it while it fills
    print("held", flush=True)
    time.sleep(120)
"""


def test_cache_clear_refuses_while_another_process_fills_the_index(rag, docs, capsys):
    rag.ingest([docs], show_progress=False, kv="now")
    entries = len(rag.engine.store.disk)
    env = {**os.environ, "PYTHONPATH": str(Path(ragblend.__file__).resolve().parents[1])}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FILL_LOCK, str(rag.path)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["cache", "clear", "--index", str(rag.path)]) == 2
        err = capsys.readouterr().err
        assert "was not cleared" in err and f"process {holder.pid} is computing the KV" in err
        assert f"kill {holder.pid}" in err and "kv-fill.log" in err
        assert len(rag.engine.store.disk) == entries   # nothing removed
    finally:
        holder.kill()
        holder.wait()
    assert main(["cache", "clear", "--index", str(rag.path)]) == 0   # the kernel released the killed one's lock
    assert f"Removed {entries} entries" in capsys.readouterr().out
    # The coverage a fill reports counts the disk, not this process's memory tier's copies.
    assert rag.kv_coverage().stored == 0 and rag.kv.run() == 24 and rag.kv_coverage().stored == 24


def test_deleting_a_document_while_the_filler_runs_leaves_no_kv_for_it(rag, docs):
    rag.ingest([docs], show_progress=False, kv="skip")
    rag.kv.start()
    victim = docs / "05.md"
    rag.delete(victim)
    assert rag.kv.wait(timeout=120)
    coverage = rag.kv_coverage()
    assert coverage.chunks == 23 and coverage.fraction == 1.0
    victim_key = rag.engine.key_of(f"file_name: 05.md\n\n{paragraph(5).strip()}")
    assert victim_key not in rag.engine.store


def test_the_progress_bar_moves_per_file_not_per_batch(rag, docs, monkeypatch):
    import tqdm.auto

    updates = []

    class Recording(tqdm.auto.tqdm):
        def update(self, n=1):
            updates.append((self.desc, n))
            return super().update(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    rag.embed_model.embed_batch_size = 4
    rag.ingest([docs], show_progress=True, kv="now")
    indexing = [n for desc, n in updates if desc == "Indexing" and n]
    kv = [n for desc, n in updates if desc == "Computing KV" and n]
    assert sum(indexing) == 24 and max(indexing) <= 4 and len(indexing) >= 6   # 24 files in one batch of 64
    assert sum(kv) == 24 and len(kv) > 1


def test_kv_mode_is_checked(rag, docs):
    with pytest.raises(InvalidInputError, match="kv must be one of now, background, skip"):
        rag.ingest([docs], kv="later")


def test_cache_stats_splits_entries_by_dtype_and_shows_the_index_coverage(rag, docs, capsys):
    rag.ingest([docs], show_progress=False, kv="skip")
    rag.kv.run()
    rag.engine.store.disk.put(synthetic_entry(1, dtype=torch.float32, spec=rag.engine.entry_spec))
    # An entry written before the dtype was tagged: counted from its header.
    rag.engine.store.disk.put(synthetic_entry(2, dtype=torch.float32, spec=rag.engine.entry_spec))
    rag.engine.store.disk.cache._sql("UPDATE Cache SET tag = NULL WHERE key = ?", (f"{2:064x}",))
    by_dtype = rag.engine.store.disk.entries_by_dtype()
    # 24 chunks, each with its own entry and its lead entry
    assert {dtype: row["entries"] for dtype, row in by_dtype.items()} == {"float16": 48, "float32": 2}
    rag.engine.forget([next(iter(keys_in_index(rag)))])
    assert main(["cache", "stats", "--index", str(rag.path)]) == 0
    out = capsys.readouterr().out
    assert "by dtype:    float16: 48 entries" not in out and "float16: 46 entries" in out and "float32: 2 entries" in out
    assert "index:       KV for 23 of 24 chunk(s) (95.8%), 1 to compute" in out and "ragblend cache fill --index" in out
    # --kv-dir alone names no index: no coverage line
    assert main(["cache", "stats", "--kv-dir", str(rag.path / "kv")]) == 0
    assert "index:" not in capsys.readouterr().out


def test_entries_by_dtype_on_a_store_of_other_dtypes(tmp_path):
    spec = EntrySpec("f" * 16, 2, 2, 8)
    store = DiskStore(tmp_path / "kv", spec)
    for i, dtype in enumerate([torch.float16, torch.bfloat16, torch.bfloat16]):
        store.put(synthetic_entry(i, dtype=dtype, spec=spec))
    counts = {dtype: row["entries"] for dtype, row in store.entries_by_dtype().items()}
    assert counts == {"float16": 1, "bfloat16": 2}


def test_a_query_during_background_fill_is_answered(rag, docs):
    rag.ingest([docs], show_progress=False, kv="background")
    results = []
    thread = threading.Thread(target=lambda: results.append(rag.ask("When did the tram open?", top_k=2,
                                                                    max_new_tokens=4)))
    thread.start()
    thread.join(60)
    assert results and results[0].stats is not None
    assert rag.kv.wait(timeout=120) and rag.kv_coverage().fraction == 1.0


def test_entries_by_dtype_counts_an_old_entry_with_a_deeply_nested_header_as_unreadable(tmp_path):
    """An untagged (older) entry is counted from its header; one nested too deep for json is
    'unreadable', not a RecursionError out of `ragblend cache stats`."""
    import struct

    spec = EntrySpec("f" * 16, 2, 2, 8)
    store = DiskStore(tmp_path / "kv", spec)
    store.put(synthetic_entry(0, dtype=torch.float16, spec=spec))
    store.cache._sql("UPDATE Cache SET tag = NULL")
    (filename,) = store.cache._sql("SELECT filename FROM Cache").fetchone()
    header = b"[" * 200_000
    (tmp_path / "kv" / filename).write_bytes(b"RBKV" + struct.pack("<I", len(header)) + header)
    assert {dtype: row["entries"] for dtype, row in store.entries_by_dtype().items()} == {"unreadable": 1}
