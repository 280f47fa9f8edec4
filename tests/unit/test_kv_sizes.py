"""KV at real sizes (issue 55, item 4): bytes per token per stored dtype, the projected KV of a whole
index against the store's budget (printed at ingest and in `ragblend cache stats`, warned about once),
and a budget too small for one prompt's chunks, which still answers and says so once. Tiny random
models, real Chroma on disk and the real CLI entry point."""

import logging

import pytest
import torch

from ragblend import CacheBlend, Chunk
from ragblend.core.options import byte_size
from ragblend.core.store.kv import ChunkKV, ChunkRef, to_storage
from ragblend.core.store.kv_budget import (
    BudgetWarnings,
    KVShape,
    bytes_per_token,
    entry_bytes,
    project,
    store_budget,
    store_tiers,
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
    assert "KV budget 8.0 GiB (disk tier) holds 1%" in line and "disk_bytes" in line and "kv_dtype='int8'" in line
    small = project(LLAMA_8B, "uint4", chunks=10, tokens_per_chunk=512, entries_per_chunk=1, budget=8 << 30)
    assert small.fits and small.describe().endswith("KV budget 8.0 GiB (disk tier) holds all of it.")
    assert store_budget(MemoryStore(1000)) == 1000


def test_the_disk_tier_is_judged_where_there_is_one_and_both_tiers_are_said(tmp_path, caplog):
    # Trial 43: disk_bytes=20 MiB beside the default 2 GiB memory tier was judged by the memory tier ("holds all
    # of it"), and the next process reused nothing. What the next process finds is the disk tier's.
    spec = EntrySpec("f" * 64, num_layers=2, num_kv_heads=1, head_dim=8)
    store = open_store(tmp_path / "kv", spec, memory_bytes=2 << 30, disk_bytes=20 << 20)
    assert store_budget(store) == 20 << 20 and store_tiers(store) == {"budget": 20 << 20, "memory": 2 << 30,
                                                                    "persists": True}
    warnings = BudgetWarnings(KVShape(2, 1, 8), entries_per_chunk=2)
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        big = warnings.project(store, torch.float16, chunks=100_000, tokens_per_chunk=256)
    assert not big.fits and big.budget == 20 << 20 and big.memory == 2 << 30
    line = big.describe()
    assert "KV budget 20.0 MiB (disk tier, kept across processes; the memory tier's 2.0 GiB lasts one process)" in line
    assert "Raise disk_bytes to 3.5 GiB or more" in line   # 3.499 GiB, rounded up to what holds it
    assert [r.getMessage() for r in caplog.records] == ["ragblend: " + line]   # the disk keeps less: warned
    flags = big.describe(flags=True)   # as the CLI says it: its flags, a size its --disk-bytes takes back
    raise_to = flags.split("Raise --disk-bytes to ")[1].split(" ")[0]
    assert byte_size(raise_to) >= big.bytes and "--kv-dtype int8" in flags and "disk_bytes" not in flags
    store.disk.close()
    memory_only = warnings.project(MemoryStore(2 << 30), torch.float16, chunks=1_000, tokens_per_chunk=256)
    assert memory_only.describe().endswith("KV budget 2.0 GiB (memory only: none of it outlives the process) "
                                           "holds all of it.")
    tight = project(KVShape(2, 1, 8), "float16", 100_000, 256, 2, **store_tiers(MemoryStore(1 << 20)))
    assert "Raise memory_bytes" in tight.describe() and "disk" not in tight.describe()
    assert "Raise --memory-bytes" in tight.describe(flags=True)


def test_a_memory_tier_too_small_for_an_entry_says_why_once(tokenizer, caplog):
    # Trial 43: a 1 MiB memory-only store said "6 of 6 chunk(s) could not be stored (cause logged above)" with
    # nothing logged above at the default level. The tier itself says why, once, at WARNING.
    store = MemoryStore(1000)
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        assert not store.put(synthetic_entry(1)) and not store.put(synthetic_entry(2))
    assert len(caplog.records) == 1 and "larger than the whole memory tier (memory_bytes=1000" in caplog.text
    assert not MemoryStore(0).put(synthetic_entry(1)) and len(caplog.records) == 1   # 0: the tier is off, on purpose
    caplog.clear()
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = MemoryStore(8_000)   # less than one chunk's entry
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        refs = engine.precompute(PASSAGES[:3])
    said = [r.getMessage() for r in caplog.records]
    assert not any(ref.stored for ref in refs)
    cause = next(i for i, m in enumerate(said) if "larger than the whole memory tier" in m)
    assert cause < next(i for i, m in enumerate(said) if "could not be stored" in m)   # logged above, indeed


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
    assert "KV budget 97.7 KiB (memory only: none of it outlives the process) holds" in warned[0]
    assert "computed at query time" in warned[0] and "Raise memory_bytes" in warned[0] and "disk_bytes" not in warned[0]
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
    assert len(said) == 1 and "3 chunk(s)" in said[0] and "(7.8 KiB)" in said[0]
    assert "Raise memory_bytes" in said[0] and "disk_bytes" not in said[0]   # a memory-only store has no disk tier
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
    # 12 chunks of their mean length (not LocalIndex's chunk size, 256), 2 entries each, 512 bytes a token in float16
    from ragblend.vectorstore_hooks.llamaindex import llm_text

    nodes = LocalIndex(tmp_path / "index", engine=engine).vector_store.get_nodes()
    mean = -(-sum(engine.count_tokens(llm_text(node)) for node in nodes) // len(nodes))
    assert mean < 128
    line = next(line for line in out.splitlines() if line.startswith("KV for 12 chunks:"))
    assert f"projected (float16, 2 entries of ~{mean} tokens a chunk)" in line
    assert "KV budget 146.5 KiB (disk tier) holds" in line and "computed at query time" in line
    assert "Raise --disk-bytes to " in line and "--kv-dtype int8" in line   # the flags ingest has
    assert len([line for line in out.splitlines() if "projected" in line]) == 1
    assert not [r for r in caplog.records if "projected" in r.getMessage()]   # said once: not logged too

    # `cache stats` (no model): from what the stored chunks weigh, against the store's limit
    engine.store.disk.close()
    assert cli.main(["cache", "stats", "--index", str(tmp_path / "index")]) == 0   # nothing stored yet (--kv skip)
    empty = capsys.readouterr().out
    assert "projected:   nothing of the index stored yet to weigh" in empty and "--model M counts M's instead" in empty
    # a larger limit given: saved with the store, so `cache stats` judges by it
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec, disk_bytes=8 << 30)
    engine.precompute([llm_text(node) for node in LocalIndex(tmp_path / "index", engine=engine)
                       .vector_store.get_nodes()][:3])
    engine.store.disk.close()
    assert cli.main(["cache", "stats", "--index", str(tmp_path / "index")]) == 0
    stats = capsys.readouterr().out
    projected = next(line for line in stats.splitlines() if "projected:" in line)
    assert "KV for 12 chunks:" in projected and "as the " in projected and "holds all of it" in projected


def _ingest_projection(tmp_path, tokenizer, monkeypatch, capsys, notes: list[str], **engine_attrs) -> str:
    """The KV projection line `ragblend ingest` prints for ``notes`` (one file each) into a tiny
    engine's store of 400,000 disk bytes, with ``engine_attrs`` set on the engine."""
    from ragblend import cli
    from ragblend.integrations.local_index import LocalIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, note in enumerate(notes):
        (docs / f"{i}.md").write_text(note)
    engine = make_tiny_engine("llama", tokenizer)
    for name, value in engine_attrs.items():
        setattr(engine, name, value)
    engine.store = open_store(tmp_path / "index" / "kv", engine.entry_spec, memory_bytes=0, disk_bytes=400_000)
    monkeypatch.setattr(cli.ingest, "open_index", lambda args, options=None: LocalIndex(args.index, engine=engine))
    assert cli.main(["ingest", str(docs), "--index", str(tmp_path / "index"), "--kv", "skip"]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("KV for "))


def test_a_few_short_documents_are_projected_at_their_own_length(tmp_path, tokenizer, monkeypatch, capsys, caplog):
    # Trial 44: three short notes got "budget holds 44%", each chunk weighed at the chunk size (256 tokens).
    # ~260 KB at their own length; 3 chunks x 2 entries x 256 tokens would be ~800 KB
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        line = _ingest_projection(tmp_path, tokenizer, monkeypatch, capsys,
                                  [f"Note {i}: {PASSAGES[i]}\n" for i in range(3)])
    assert line.startswith("KV for 3 chunks:") and "holds all of it" in line and "~256 tokens" not in line
    assert not [r for r in caplog.records if "projected" in r.getMessage()]


def test_chunks_too_short_for_a_kv_entry_are_not_projected(tmp_path, tokenizer, monkeypatch, capsys):
    # Review 45: one-line notes (no KV entry: under min_chunk_tokens) were projected at the chunk size.
    # Each note with its metadata is ~16 tokens: with a 200-token floor none gets a key.
    line = _ingest_projection(tmp_path, tokenizer, monkeypatch, capsys, [f"Note {i}.\n" for i in range(3)],
                              min_chunk_tokens=200)
    assert line.startswith("KV for 0 chunks:") and "holds all of it" in line


def test_info_says_what_a_token_of_stored_kv_weighs_and_why_that_dtype(tokenizer, capsys):
    from ragblend import cli

    cli._print_stored_kv(make_tiny_engine("llama", tokenizer, kv_dtype="uint4"))
    line = capsys.readouterr().out
    per_token = bytes_per_token(KVShape(4, 2, 16), "uint4")   # the tiny model: 4 layers x 2 KV heads x 16
    assert line.startswith(f"Stored KV (kv_dtype='uint4'): {per_token:,.0f} bytes a token; a 512-token chunk")
    assert "float16 stays the default" in line and "Stored KV dtypes" in line


def test_the_cli_advice_can_be_followed_from_the_commands_that_build_a_store():
    # Trial 43: ingest said "Raise disk_bytes ... or kv_dtype='int8'" and ingest/ask/cache had neither flag.
    from ragblend import cli
    from ragblend.core import options as engine_options

    parser = cli.build_parser()
    for argv in (["ingest", "docs"], ["ask", "a question"], ["cache", "fill"], ["serve"]):
        args = parser.parse_args(argv + ["--disk-bytes", "40GiB", "--memory-bytes", "1MiB", "--kv-dtype", "int8"])
        options = engine_options.from_args(args)
        assert (options.disk_bytes, options.memory_bytes, options.kv_dtype) == (40 << 30, 1 << 20, "int8")
    # A command ingest suggests (`ragblend cache fill ...`) keeps them: another dtype is other entries, a
    # smaller limit evicts.
    suggested = cli._index_option(parser.parse_args(["ingest", "docs", "--index", "ix", "--kv-dtype", "int8",
                                                     "--disk-bytes", "1GiB"]))
    assert suggested == f" --index ix --kv-dtype int8 --disk-bytes {1 << 30}"
    assert cli._index_option(parser.parse_args(["ingest", "docs", "--index", "ix"])) == " --index ix"
    with pytest.raises(SystemExit):
        parser.parse_args(["ingest", "docs", "--disk-bytes", "lots"])
