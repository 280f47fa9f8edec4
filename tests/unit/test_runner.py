"""core.runner: the prefill runner finds each chunk's KV (store tiers, or computed and written
back), fuses the prompt and counts what it reused; Background runs store writes off the TTFT
path. The engine's parts wired by hand prefill as BlendEngine does, and the runner's own parts
(core.chunk_reads, core.prefix_reuse) work alone."""

import threading
import time

import pytest
import torch

from ragblend import Chunk, FullRecompute, FullReuse
from ragblend.core.cancel import EngineLock
from ragblend.core.chunk_reads import ChunkReads
from ragblend.core.fusion.ingest import Ingestion
from ragblend.core.fusion.strategies import CacheBlend
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.plan import resolve_strategy
from ragblend.core.prefix_reuse import PrefixReuse
from ragblend.core.prompt import PromptBuilder
from ragblend.core.results import Stats
from ragblend.core.runner import Background, PrefillRunner
from ragblend.core.store.chunk_index import ChunkIndex
from ragblend.core.store.pieces import PieceStore
from ragblend.core.store.tiers import DiskStore, MemoryStore

from ..conftest import PASSAGES, make_tiny_engine, tiny_model


@pytest.fixture
def disk_engine(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = DiskStore(tmp_path / "kv", engine.entry_spec)
    return engine


PASSAGE = ("The lighthouse on the northern cape was first lit in 1871 and guided ships past the reef "
           "for more than a century before an automatic beacon replaced its keepers.")


def test_parts_wired_by_hand_prefill_as_the_engine_does(tokenizer):
    adapter, prompts, lock = ModelAdapter(tiny_model("llama")), PromptBuilder(tokenizer), EngineLock()
    index, store = ChunkIndex(), MemoryStore()
    sink = prompts.chunk_sink(None, "")
    ingestion = Ingestion(adapter, prompts, sink, adapter.fingerprint(tokenizer), torch.float32, lock, index)
    refs = ingestion.precompute([PASSAGE], store, batch_tokens=0)
    assert refs[0].stored and refs[0].key in store

    prompt = prompts.build([PASSAGE + "\n\nWhen was the lighthouse first lit?"], None).token_ids
    layout = index.mark(prompt, store)
    assert len(layout.chunk_spans) == 1
    plan = resolve_strategy(CacheBlend(0.3), engine_strategy=None, engine_chose=False, calibration=None,
                            num_layers=adapter.shape.num_layers)
    runner = PrefillRunner(adapter, ingestion, index, lock, loading=None, sentence_end_ids=lambda: prompts.sentence_end_ids)
    pre, trace = runner.run(layout, plan, store, prefetch=False, write_back=True, t0=0.0)
    assert pre.stats.reused_tokens > 0 and pre.stats.chunks_reused == 1

    engine = make_tiny_engine("llama", tokenizer, chunk_context="", kv_dtype="float32", precompute_batch_tokens=0)
    engine.precompute([PASSAGE])
    # The engine runs the same weights through its CPU kernels: equal up to float rounding.
    expected = engine.prefill(engine.find_chunks(PASSAGE + "\n\nWhen was the lighthouse first lit?"),
                              strategy=CacheBlend(0.3))
    assert expected.token_ids == pre.token_ids and expected.stats.reused_tokens == pre.stats.reused_tokens
    assert torch.allclose(expected.logits, pre.logits, atol=1e-3)


def test_any_order_repeats_and_unknown_chunks(tiny_engine):
    engine = tiny_engine
    engine.precompute(PASSAGES[:3])
    unknown_text = f"A chunk that was never stored ({engine.adapter.arch})."
    segs = [Chunk(PASSAGES[2]), Chunk(PASSAGES[0]), Chunk(PASSAGES[2]), Chunk(unknown_text), "Question?"]
    engine.write_back = False  # unknown chunks are then computed as plain text
    pre = engine.prefill(segs, strategy=FullReuse())
    # distinct chunks: PASSAGES[2] appears twice but is one chunk
    assert pre.stats.chunks_reused == 2 and pre.stats.chunks_missing == 1 and pre.stats.chunks_computed == 0
    assert sum(pre.stats.tiers.values()) == 2
    spans = pre.layout.chunk_spans
    assert pre.token_ids[spans[0].start:spans[0].end] == pre.token_ids[spans[2].start:spans[2].end]
    unknown = spans[3]
    assert pre.recomputed[unknown.start:unknown.end].all()  # computed as plain text
    assert not pre.recomputed[spans[0].start:spans[0].end].any()
    ref = engine.prefill(segs, strategy=FullRecompute())
    assert ref.token_ids == pre.token_ids


def test_unknown_chunk_is_computed_used_and_written_back(tiny_engine):
    engine = tiny_engine
    engine.precompute(PASSAGES[:2])
    text = f"Another chunk nobody precomputed ({engine.adapter.arch})."
    key = engine.key_of(text)
    segs = [Chunk(PASSAGES[0]), Chunk(text), Chunk(PASSAGES[1]), "Question?"]
    first = engine.prefill(segs, strategy=FullReuse())
    assert first.stats.chunks_missing == 1 and first.stats.chunks_computed == 1
    span = first.layout.chunk_spans[1]
    assert not first.recomputed[span.start:span.end].any()  # its isolated KV was used
    engine.flush()
    assert key in engine.store  # saved off the TTFT path
    second = engine.prefill(segs, strategy=FullReuse())
    assert second.stats.chunks_missing == 0 and second.stats.chunks_reused == 3
    assert torch.equal(first.logits, second.logits)


def test_reused_tokens_count_only_kv_from_the_store(disk_engine):
    engine = disk_engine
    engine.precompute(PASSAGES[:1])
    fresh = f"A chunk this engine never stored, long enough to matter ({len(PASSAGES)})."
    pre = engine.prefill([Chunk(PASSAGES[0]), Chunk(fresh), "Question?"], strategy=FullReuse())
    stored = pre.layout.chunk_spans[0]
    assert pre.stats.chunks_reused == 1 and pre.stats.chunks_computed == 1 and pre.stats.chunks_missing == 1
    assert pre.stats.reused_tokens == stored.end - stored.start


def test_background_writes_run_in_order_and_flush_waits_for_them():
    background, done = Background(), []

    def slow_write(i):
        time.sleep(0.05)
        done.append(i)

    for i in range(3):
        background.submit(slow_write, i)
    background.flush()
    assert done == [0, 1, 2]


def test_background_flush_re_raises_a_failed_write_once():
    background, done = Background(), []

    def failing_write():
        raise OSError("disk full")

    def slow_write(item):
        time.sleep(0.1)
        done.append(item)

    background.submit(done.append, "before")
    background.submit(failing_write)
    background.submit(slow_write, "after")
    with pytest.raises(OSError, match="disk full"):
        background.flush()
    assert done == ["before", "after"]          # every write was waited for, those after the failure too
    background.flush()                          # reported once: the next flush has nothing to raise


def test_background_writes_count_as_pending_until_done_also_while_a_flush_waits():
    background, release = Background(), threading.Event()
    background.submit(release.wait, 30)
    assert background.pending() == 1
    flushing = threading.Thread(target=background.flush)
    flushing.start()
    time.sleep(0.1)
    assert background.pending() == 1   # /health's background_jobs reads it while a flush waits
    release.set()
    flushing.join(30)
    assert background.pending() == 0


def test_chunk_reads_alone_find_stored_chunks_and_compute_or_leave_out_missing_ones(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, precompute_batch_tokens=0)
    engine.precompute([PASSAGE])
    fresh = f"A chunk this engine never stored, long enough to matter ({len(PASSAGES)})."
    layout = engine.build_prompt([Chunk(PASSAGE), Chunk(fresh), "When was the lighthouse first lit?"])
    plan = resolve_strategy(FullReuse(), engine_strategy=None, engine_chose=False, calibration=None,
                            num_layers=engine.adapter.shape.num_layers)
    background = Background()
    reads = ChunkReads(engine.ingestion, engine.index, background, PieceStore(1 << 20, lambda entry: None))
    stored = layout.chunk_spans[0]

    stats = Stats()
    found = reads.find(layout, plan, stats, {}, engine.store, write_back=False)
    found.close()
    assert found.count_tiers(stats) == {"memory": 1} and (stats.chunks_reused, stats.chunks_missing) == (1, 1)
    assert len(found.readers) == 1 and int(found.from_store.sum()) == stored.end - stored.start

    stats, computed = Stats(), {}
    found = reads.find(layout, plan, stats, computed, engine.store, write_back=True)
    found.close()
    assert found.count_tiers(stats) == {"memory": 1, "computed": 1} and stats.chunks_missing == 1
    assert int(found.from_store.sum()) == stored.end - stored.start   # a computed chunk is not the store's
    background.flush()
    assert all(key in engine.store for key in computed)   # written back off the TTFT path


def test_prefix_reuse_pays_only_where_the_prefix_is_as_long_as_the_chunks_after_it(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    layout = engine.build_prompt([Chunk(PASSAGE), "When was the lighthouse first lit?"])
    span = layout.chunk_spans[0]
    plan = resolve_strategy(FullReuse(), engine_strategy=None, engine_chose=False, calibration=None,
                            num_layers=engine.adapter.shape.num_layers)
    assert not PrefixReuse.pays(layout, plan, span.start)   # the whole chunk after it: fusing reuses more
    assert PrefixReuse.pays(layout, plan, span.end)
    off = PrefixReuse(engine.adapter, engine.ingestion, engine.lock, None)   # tier off
    assert off.lookup(layout, plan) is None and off.hit(layout, plan, None) is None
