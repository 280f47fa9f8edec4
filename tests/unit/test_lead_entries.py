"""Lead entries: each chunk's KV also computed right after the template's opening, and read
where the chunk is a prompt's first passage (core.fusion.ingest, core.runner; docs/notes/lead-entries.md)."""

import dataclasses

import numpy as np
import pytest
import torch

from ragblend import Chunk, FullReuse, InvalidInputError
from ragblend.core.fusion.ingest import isolated_kv
from ragblend.core.prompt import ChunkSpan, PromptLayout

from ..conftest import PASSAGES, make_tiny_engine

QUESTION = "Which of these passages came first?"


def lead_key(engine, text):
    return engine.ingestion.key_for(engine.tokenize(text), lead=True)


def test_precompute_stores_each_chunk_as_a_later_and_as_the_first_passage(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32", precompute_batch_tokens=0)
    ids = engine.tokenize(PASSAGES[0])
    ref = engine.precompute(PASSAGES[:1])[0]
    assert ref.key == engine.key_of(PASSAGES[0]) and len(engine.store) == 2
    lead = engine.store.get(lead_key(engine, PASSAGES[0]))
    after_opening, _ = isolated_kv(engine.adapter, engine.prompts.sink_ids(), ids)
    assert (lead.keys - after_opening).abs().max() < 1e-5
    assert (lead.keys - engine.store.get(ref.key).keys).abs().max() > 1e-3   # another prefix, other KV
    # A store holding the chunk's own entry only (filled before lead entries) gets just the lead one.
    engine.store.delete(lead_key(engine, PASSAGES[0]))
    assert engine.precompute(PASSAGES[:1]) == [ref] and len(engine.store) == 2
    assert engine.forget([ref.key]) == 1 and len(engine.store) == 0          # both go
    # Off, or nothing for it to differ from (no chunk context): one entry a chunk, as before.
    for options in ({"lead_chunk_kv": False}, {"chunk_context": ""}):
        other = make_tiny_engine("llama", tokenizer, **options)
        other.precompute(PASSAGES[:1])
        assert other.lead_sink_ids is None and len(other.store) == 1
        assert other.calibration_id != engine.calibration_id
    with pytest.raises(InvalidInputError, match="lead_chunk_kv must be True or False"):
        make_tiny_engine("llama", tokenizer, lead_chunk_kv="yes")


def test_the_first_chunk_is_fused_from_its_lead_entry_the_others_from_their_own(tokenizer):
    segments = [Chunk(p) for p in PASSAGES[:3]] + [QUESTION]
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    engine.precompute(PASSAGES[:3])
    fused = engine.prefill(segments, strategy=FullReuse())
    assert fused.stats.chunks_reused == 3 and fused.stats.chunks_computed == 0
    # An engine without lead entries, its first chunk's entry swapped for the lead one, fuses the same.
    plain = make_tiny_engine("llama", tokenizer, kv_dtype="float32", lead_chunk_kv=False)
    plain.precompute(PASSAGES[:3])
    before = plain.prefill(segments, strategy=FullReuse())
    assert (before.logits - fused.logits).abs().max() > 1e-4
    lead = engine.store.get(lead_key(engine, PASSAGES[0]))
    plain.store.put(dataclasses.replace(lead, key=plain.key_of(PASSAGES[0])))
    assert torch.allclose(plain.prefill(segments, strategy=FullReuse()).logits, fused.logits, atol=1e-5)
    # A store without the lead entry (filled before lead entries, or by a query where the chunk came
    # later) misses it, though the chunk's own is there: computed, stored, and the same answer.
    engine.store.delete(lead_key(engine, PASSAGES[0]))
    missed = engine.prefill(segments, strategy=FullReuse())
    assert missed.stats.chunks_computed == 1 and torch.equal(missed.logits, fused.logits)
    engine.flush()
    assert lead_key(engine, PASSAGES[0]) in engine.store


def test_a_corrupt_lead_entry_is_a_miss_recomputed_not_the_own_entry(tokenizer, tmp_path):
    from ragblend.core.store.tiers import DiskStore

    segments = [Chunk(p) for p in PASSAGES[:2]] + [QUESTION]
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    engine.store = store = DiskStore(tmp_path / "kv", engine.entry_spec)
    engine.precompute(PASSAGES[:2])
    intact = engine.prefill(segments, strategy=FullReuse())
    lead = lead_key(engine, PASSAGES[0])   # the first chunk's lead entry file, cut short
    disk_key, raw = store.cache.disk.put(lead)
    name = store.cache._sql("SELECT filename FROM Cache WHERE key=? AND raw=?", (disk_key, raw)).fetchone()[0]
    path = tmp_path / "kv" / name
    path.write_bytes(path.read_bytes()[:-100])
    out = engine.prefill(segments, strategy=FullReuse())
    assert out.stats.chunks_computed == 1 and torch.equal(out.logits, intact.logits)
    engine.flush()
    assert lead in store and engine.prefill(segments, strategy=FullReuse()).stats.chunks_computed == 0


def test_a_query_reads_the_lead_entry_only_where_the_first_chunk_follows_little_more_than_the_opening(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    engine.precompute(PASSAGES[:2])
    long_text = " ".join([PASSAGES[3]] * 12)   # more text than the chunk context
    assert len(engine.tokenize(long_text)) > len(engine.sink_ids)
    for segments, lead in (([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), QUESTION], {0}),
                           (["A short note.", Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), QUESTION], {0}),
                           ([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[0]), QUESTION], {0}),
                           ([Chunk(PASSAGES[0]), Chunk(PASSAGES[0]), QUESTION], {0}),   # a repeat: its own
                           ([Chunk(PASSAGES[0]), "Another source:", Chunk(PASSAGES[0]), QUESTION], {0}),
                           ([long_text, Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), QUESTION], set())):
        assert engine.runner.lead_spans(engine.build_prompt(segments)) == lead
    ids = engine.tokenize(PASSAGES[0])   # a chunk alone, no template (LMCache's warm-up): its own entry
    assert engine.runner.lead_spans(PromptLayout(ids, [ChunkSpan(0, len(ids), tuple(ids))])) == set()
    # A query computes a missing chunk's entry as a hit would have read it: lead where it comes first.
    engine.prefill([Chunk(PASSAGES[2]), Chunk(PASSAGES[3]), QUESTION], strategy=FullReuse())
    engine.flush()
    assert lead_key(engine, PASSAGES[2]) in engine.store and engine.key_of(PASSAGES[2]) not in engine.store
    assert engine.key_of(PASSAGES[3]) in engine.store and lead_key(engine, PASSAGES[3]) not in engine.store


def test_forget_drops_a_lead_entry_a_query_stored_alone_and_stats_count_chunks(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    # A first and again third: its lead entry and its own entry computed, one chunk all the same.
    pre = engine.prefill([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[0]), QUESTION], strategy=FullReuse())
    assert pre.stats.chunks_computed == pre.stats.chunks_missing == 2
    engine.flush()
    assert len(engine.store) == 3
    engine.store.delete(engine.key_of(PASSAGES[0]))           # only A's lead entry left
    again = engine.prefill([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[0]), QUESTION], strategy=FullReuse())
    assert (again.stats.chunks_reused, again.stats.chunks_missing, again.stats.chunks_computed) == (1, 1, 1)
    engine.flush()
    engine.store.delete(engine.key_of(PASSAGES[0]))
    engine.write_back = False   # the repeat's own entry is then computed inside the prompt: still one chunk missing
    plain = engine.prefill([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[0]), QUESTION], strategy=FullReuse())
    assert (plain.stats.chunks_reused, plain.stats.chunks_missing, plain.stats.chunks_computed) == (1, 1, 0)
    engine.write_back = True
    assert engine.forget([engine.key_of(PASSAGES[0]), engine.key_of(PASSAGES[1])]) == 2
    assert len(engine.store) == 0
    # An engine without lead entries on the same store forgets a chunk's lead entry too.
    engine.precompute(PASSAGES[:1])
    plain = make_tiny_engine("llama", tokenizer, kv_dtype="float32", lead_chunk_kv=False, store=engine.store)
    assert plain.forget([engine.key_of(PASSAGES[0])]) == 1 and len(engine.store) == 0


def test_a_small_lru_store_keeps_the_own_entries_precompute_reports(tokenizer):
    from ragblend.core.store.tiers import MemoryStore

    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    engine.precompute(PASSAGES[:1])
    one_entry = engine.store.get(engine.key_of(PASSAGES[0])).nbytes
    engine.store = MemoryStore(max_bytes=one_entry * 3 // 2)   # room for one entry of a chunk
    ref = engine.precompute(PASSAGES[1:2])[0]
    assert ref.stored and ref.key in engine.store


def test_a_first_chunk_split_by_an_edit_reads_its_lead_entry_in_every_span(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float32")
    long_chunk = " ".join(PASSAGES[:3])
    engine.precompute([long_chunk, PASSAGES[3]])
    words = long_chunk.split()
    edited = " ".join(words[:20] + ["EDITED"] + words[21:])   # a word changed mid-chunk: two spans
    layout = engine.find_chunks(f"{edited}\n\n{PASSAGES[3]}\n\n{QUESTION}")
    firsts = [j for j, s in enumerate(layout.chunk_spans) if list(s.token_ids) == engine.tokenize(long_chunk)]
    assert len(firsts) == 2 and engine.runner.lead_spans(layout) == set(firsts)
    pre = engine.prefill(layout, strategy=FullReuse())
    assert pre.stats.chunks_computed == 0 and pre.stats.chunks_reused == 2


def test_precompute_ids_stores_a_chunk_given_as_token_ids_as_precompute_does(tokenizer):
    """LMCache's warm-up sends a chunk's ids alone; the server stores both its entries from them."""
    engine = make_tiny_engine("llama", tokenizer)
    ref = engine.precompute_ids([engine.tokenize(PASSAGES[0])])[0]
    assert ref.key == engine.key_of(PASSAGES[0]) and ref.stored and len(engine.store) == 2
    assert lead_key(engine, PASSAGES[0]) in engine.store
    for bad in ([], [-1], ["7"], [2.0], [True], torch.tensor([True, False]), {1, 2}, b"ab", 7,
                [engine.entry_spec.vocab_size], [1] * engine.context_window):
        with pytest.raises(InvalidInputError, match="chunk 0"):
            engine.precompute_ids([bad])
    assert len(engine.store) == 2
    # numpy's and torch's integers are token ids too (a tokenizer's return_tensors output)
    ids = engine.tokenize(PASSAGES[1])
    assert engine.precompute_ids([np.array(ids)])[0].key == engine.precompute_ids([torch.tensor(ids)])[0].key \
        == engine.key_of(PASSAGES[1])
