"""KV at real sizes (issue 55, item 4): bytes per token per stored dtype, the projected KV of a whole
index against the store's budget (printed at ingest and in `ragblend cache stats`, warned about once),
and a budget too small for one prompt's chunks, which still answers and says so once. Tiny random
models, real Chroma on disk and the real CLI entry point."""

import logging

import pytest
import torch

from ragblend import CacheBlend, Chunk
from ragblend.core.store.kv import ChunkKV, ChunkRef, to_storage
from ragblend.core.store.kv_budget import (
    BudgetWarnings,
    KVShape,
    bytes_per_token,
    entry_bytes,
    project,
    store_budget,
)
from ragblend.core.store.tiers import DiskStore, EntrySpec, MemoryStore, encode_entry, open_store

from ..conftest import PASSAGES, make_tiny_engine, synthetic_entry

LLAMA_8B = KVShape.from_config(dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                    hidden_size=4096))


def test_bytes_per_token_follow_the_shape_and_the_stored_dtype():
    assert (LLAMA_8B.num_layers, LLAMA_8B.num_kv_heads, LLAMA_8B.head_dim) == (32, 8, 128)
    payload = 32 * 8 * 128 * 2   # K and V values a token
    per_token = {d: bytes_per_token(LLAMA_8B, d) for d in ("float32", "float16", "int8", "uint4")}
    assert payload * 2 < per_token["float16"] < payload * 2 * 1.001                # 128 KiB, plus the header
    assert per_token["float32"] == pytest.approx(2 * per_token["float16"], rel=1e-3)
    assert payload * 1.0 < per_token["int8"] < payload * 1.01                      # a byte a value, plus scales
    assert payload * 0.625 <= per_token["uint4"] < payload * 0.63                  # half a byte, plus 1/8 for steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.uint4])
def test_entry_bytes_is_what_an_encoded_entry_weighs(dtype):
    spec = EntrySpec("f" * 64, num_layers=3, num_kv_heads=2, head_dim=64)
    exact = synthetic_entry(7, tokens=300, dtype=torch.float32, spec=spec)
    exact = ChunkKV(exact.key, [20000 + i for i in range(300)], exact.keys, exact.values)   # 5-digit ids
    encoded = len(encode_entry(to_storage(exact, dtype), spec.fingerprint))
    estimate = entry_bytes(KVShape(3, 2, 64), 300, dtype)
    assert abs(estimate - encoded) < 0.02 * encoded


def test_a_projection_says_what_share_the_budget_holds_and_what_to_do():
    whole = project(LLAMA_8B, "float16", chunks=10_000, tokens_per_chunk=512, entries_per_chunk=2, budget=8 << 30)
    assert whole.bytes == 2 * 10_000 * entry_bytes(LLAMA_8B, 512, "float16")
    assert whole.share_kept == pytest.approx((8 << 30) / whole.bytes) and not whole.fits
    line = whole.describe()
    assert line.startswith("KV for 10,000 chunks: 1342.3 GB projected (float16, 2 entries of ~512 tokens a chunk)")
    assert "KV budget 8.0 GiB holds 1%" in line and "disk_bytes" in line and "kv_dtype='int8'" in line
    small = project(LLAMA_8B, "uint4", chunks=10, tokens_per_chunk=512, entries_per_chunk=1, budget=8 << 30)
    assert small.fits and small.describe().endswith("KV budget 8.0 GiB holds all of it.")
    tiered = open_store.__defaults__   # (memory_bytes, disk_bytes): the largest tier bounds what is kept
    assert store_budget(MemoryStore(1000)) == 1000 and max(tiered) == 8 << 30


def test_budget_warnings_count_each_chunk_once_and_say_each_thing_once(caplog):
    shape = KVShape(2, 1, 8)
    warnings, store = BudgetWarnings(shape, entries_per_chunk=2), MemoryStore(3 * entry_bytes(shape, 100, "float16"))
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        refs = [ChunkRef("a", 100, True), None]
        assert warnings.count(refs, store, torch.float16) is refs               # 2 entries of 1 chunk: fits
        warnings.count([ChunkRef("a", 100, True), ChunkRef("b", 100, True)], store, torch.float16)   # 4: not
        warnings.count([ChunkRef("c", 100, True)], store, torch.float16)
        warnings.check_prompt([100] * 3, store, torch.float16)                  # fits
        warnings.check_prompt([100] * 4, store, torch.float16)
        warnings.check_prompt([100] * 5, store, torch.float16)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("ragblend: KV for 2 chunks:") and "4 chunk(s)" in said[1]
    assert warnings.precomputed == {"a": 100, "b": 100, "c": 100}
    assert warnings.project(store, torch.float16, 1, 100, warn=False).fits


def test_precompute_past_the_budget_warns_once_and_the_memory_tier_counts(tokenizer, caplog):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = MemoryStore(100_000)           # two of the tiny model's chunks (~40 tokens, 2 entries each)
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        engine.precompute(PASSAGES[:2])
        assert not [r for r in caplog.records if "projected" in r.getMessage()]   # fits: silent
        engine.precompute(PASSAGES[2:])
        engine.precompute(PASSAGES[:1] + ["A fifth chunk of text, about the harbour's night ferry and its crew."])
    warned = [r.getMessage() for r in caplog.records if "projected" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("ragblend: KV for 4 chunks:")
    assert "KV budget 97.7 KiB holds" in warned[0] and "computed at query time" in warned[0]
    assert engine.kv_projection(5, 40, warn=False).budget == 100_000


def test_a_budget_too_small_for_one_prompts_chunks_still_answers_and_says_so_once(tokenizer, caplog):
    roomy = make_tiny_engine("llama", tokenizer)
    tight = make_tiny_engine("llama", tokenizer)
    tight.store = MemoryStore(8_000)              # less than one chunk's entry
    segments = [Chunk(p) for p in PASSAGES[:3]] + ["Question: who ran the ferry?"]
    expected = roomy.prefill(segments, strategy=CacheBlend(0.3))   # every chunk computed, as in `tight`
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        first = tight.prefill(segments, strategy=CacheBlend(0.3))
        tight.flush()
        second = tight.prefill(segments, strategy=CacheBlend(0.3))
        answer = tight.generate(segments, max_new_tokens=4)
    assert torch.equal(first.logits, expected.logits) and torch.equal(second.logits, expected.logits)
    assert first.stats.chunks_computed == second.stats.chunks_computed == 3   # nothing kept: computed each time
    assert answer.text is not None and answer.stats.chunks_computed == 3
    said = [r.getMessage() for r in caplog.records if "more than the KV store keeps" in r.getMessage()]
    assert len(said) == 1 and "3 chunk(s)" in said[0] and "disk_bytes" in said[0]
    assert len(tight.store) == 0


def test_a_disk_tier_too_small_evicts_and_the_prompt_is_answered(tokenizer, tmp_path, caplog):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = open_store(tmp_path / "kv", engine.entry_spec, memory_bytes=0, disk_bytes=40_000)
    assert isinstance(engine.store.disk, DiskStore) and store_budget(engine.store) == 40_000
    segments = [Chunk(p) for p in PASSAGES] + ["Question: who ran the ferry?"]
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        for _ in range(2):
            out = engine.generate(segments, max_new_tokens=4)
            engine.flush()
    assert out.text is not None and out.stats.chunks_computed >= 1
    assert len([r for r in caplog.records if "more than the KV store keeps" in r.getMessage()]) == 1


# ---------------------------------------------------------------------------- the CLI


pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")


def test_ingest_and_cache_stats_print_the_projected_kv_of_the_whole_index(tmp_path, tokenizer, monkeypatch, capsys,
                                                                            caplog):
    from ragblend import cli
    from ragblend.integrations.local_index import LocalIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i:02d}.md").write_text(f"Note {i}: {PASSAGES[i % len(PASSAGES)]} It was recorded in {1900 + i}.\n")
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec, memory_bytes=0, disk_bytes=150_000)
    monkeypatch.setattr(cli.ingest, "open_index", lambda args, options=None: LocalIndex(args.index, engine=engine))
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        assert cli.main(["ingest", str(docs), "--index", str(tmp_path / "index"), "--kv", "skip"]) == 0
    out = capsys.readouterr().out
    # 12 chunks of up to 256 tokens (LocalIndex's chunk size), 2 entries each, 512 bytes a token in float16
    line = next(line for line in out.splitlines() if line.startswith("KV for 12 chunks:"))
    assert "projected (float16, 2 entries of ~256 tokens a chunk)" in line
    assert "KV budget 146.5 KiB holds" in line and "computed at query time" in line
    warned = [r.getMessage() for r in caplog.records if "projected" in r.getMessage()]
    assert len(warned) == 1 and "KV for 12 chunks" in warned[0]   # logged once, by the library

    # `cache stats` (no model): from what the stored chunks weigh, against the store's limit
    from ragblend.vectorstore_hooks.llamaindex import llm_text

    engine.store.disk.close()
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec)   # the default budget
    engine.precompute([llm_text(node) for node in LocalIndex(tmp_path / "index", engine=engine)
                       .vector_store.get_nodes()][:3])
    engine.store.disk.close()
    assert cli.main(["cache", "stats", "--index", str(tmp_path / "index")]) == 0
    stats = capsys.readouterr().out
    projected = next(line for line in stats.splitlines() if "projected:" in line)
    assert "KV for 12 chunks:" in projected and "as the " in projected and "holds all of it" in projected


def test_info_says_what_a_token_of_stored_kv_weighs_and_why_that_dtype(tokenizer, capsys):
    from ragblend import cli

    cli._print_stored_kv(make_tiny_engine("llama", tokenizer, kv_dtype="uint4"))
    line = capsys.readouterr().out
    per_token = bytes_per_token(KVShape(4, 2, 16), "uint4")   # the tiny model: 4 layers x 2 KV heads x 16
    assert line.startswith(f"Stored KV (kv_dtype='uint4'): {per_token:,.0f} bytes a token; a 512-token chunk")
    assert "float16 stays the default" in line and "Stored KV dtypes" in line
