"""core.fusion.ingest: computing chunks' isolated KV (alone, or packed several to a pass), the keys they
are stored under, and precompute's checks (everything is validated before anything is stored)."""


import pytest
import torch

from ragblend import InvalidInputError, PromptTooLongError
from ragblend.core.cancel import EngineLock
from ragblend.core.fusion.ingest import Ingestion, isolated_kv, packed_isolated_kv, packs
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.prompt import PromptBuilder
from ragblend.core.store.chunk_index import ChunkIndex
from ragblend.core.store.tiers import MemoryStore

from ..conftest import PASSAGES, make_tiny_engine, tiny_model


@pytest.fixture
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


def ingestion_alone(tokenizer, kv_dtype=torch.float32):
    """An Ingestion over the tiny llama, with its own chunk index, wired without an engine."""
    adapter, prompts = ModelAdapter(tiny_model("llama")), PromptBuilder(tokenizer)
    return Ingestion(adapter, prompts, prompts.chunk_sink(None, ""), adapter.fingerprint(tokenizer), kv_dtype,
                     EngineLock(), ChunkIndex())


def test_precompute_skips_existing_and_keys_depend_on_model(tokenizer, tiny_engine):
    from ..conftest import make_tiny_engine

    refs = tiny_engine.precompute(PASSAGES[:2])
    assert [r.num_tokens for r in refs] == [len(tiny_engine.prompts.tokenize(p)) for p in PASSAGES[:2]]
    again = tiny_engine.precompute(PASSAGES[:2])
    assert again == refs
    other = make_tiny_engine("qwen3" if tiny_engine.adapter.arch != "qwen3" else "llama", tokenizer)
    assert other.precompute(PASSAGES[:1])[0].key != refs[0].key


def test_packed_precompute_gives_each_chunk_its_isolated_kv(tiny_engine):
    engine = tiny_engine
    chunks = [engine.prompts.tokenize(p) for p in PASSAGES] + [[5], engine.prompts.tokenize(PASSAGES[0])]
    sink = engine.sink_ids
    windows = [w for i in range(engine.adapter.shape.num_layers) if (w := engine.adapter.window(i))]
    if windows and len(sink) + max(map(len, chunks)) > min(windows):
        sink = engine.prompts.sink_ids()   # the engine packs only what fits the window
    for (keys, values), ids in zip(packed_isolated_kv(engine.adapter, sink, chunks), chunks):
        alone_k, alone_v = isolated_kv(engine.adapter, sink, ids)
        assert keys.shape == alone_k.shape
        assert (keys - alone_k).abs().max() < 1e-5 and (values - alone_v).abs().max() < 1e-5


def test_precompute_packs_chunks_keeps_order_and_skips_what_cannot_be_stored(tiny_engine):
    engine = tiny_engine
    engine.kv_dtype = torch.float32
    too_long = "word " * (engine.context_window + 10)
    texts = [PASSAGES[0], too_long, PASSAGES[1], "hi", PASSAGES[0], PASSAGES[2]]
    refs = engine.precompute(texts, skip_unusable=True, progress=True)
    assert refs[1] is None and refs[3] is None                  # over the window, too short: skipped
    assert refs[4] == refs[0] and len({r.key for r in refs if r}) == 3
    for ref, text in zip(refs, texts):
        if ref is not None:
            ids = engine.prompts.tokenize(text)
            assert ref.num_tokens == len(ids) and ref.stored
            stored, (alone_k, _) = engine.store.get(ref.key), isolated_kv(engine.adapter, engine.sink_ids, ids)
            assert stored.token_ids == ids and (stored.keys - alone_k).abs().max() < 1e-5


def test_chunks_are_precomputed_after_the_template_opening_and_the_chunk_context(tokenizer):
    from ragblend.core.prompt import CHUNK_CONTEXT

    from ..conftest import make_tiny_engine

    engine, bare = make_tiny_engine("llama", tokenizer), make_tiny_engine("llama", tokenizer, chunk_context="")
    opening = engine.prompts.sink_ids()
    assert bare.sink_ids == opening
    assert engine.sink_ids == opening + engine.prompts.tokenize(CHUNK_CONTEXT) + engine.prompts._separator_ids
    # Another prefix gives other KV: another key, and another calibration.
    assert engine.precompute(PASSAGES[:1])[0].key != bare.precompute(PASSAGES[:1])[0].key
    assert engine.calibration_id != bare.calibration_id
    # A chunk computed for a query (missing from the store) equals the precomputed one exactly.
    ids = engine.prompts.tokenize(PASSAGES[1])
    engine.precompute_batch_tokens = 0
    stored = engine.store.get(engine.precompute(PASSAGES[1:2])[0].key)
    assert torch.equal(engine.ingestion.compute_entry(ids).keys, stored.keys)
    alone_k, _ = isolated_kv(engine.adapter, engine.sink_ids, ids)
    assert (stored.keys.float() - alone_k).abs().max() < 1e-2     # stored as float16
    with pytest.raises(InvalidInputError, match="chunk_context must be a str"):
        make_tiny_engine("llama", tokenizer, chunk_context=None)


def test_chunk_longer_than_window_stores_nothing(engine):
    before = len(engine.store)
    fine = "A short chunk that would be fine on its own."
    with pytest.raises(PromptTooLongError, match="Split it"):
        engine.precompute([fine, "word " * (engine.context_window + 10)])
    assert len(engine.store) == before  # validated before anything was stored
    assert engine.key_of(fine) not in engine.store


def test_precompute_rejects_empty_and_non_text(engine):
    with pytest.raises(InvalidInputError, match="empty"):
        engine.precompute(["ok", ""])
    with pytest.raises(InvalidInputError, match="str"):
        engine.precompute(["ok", 7])


def test_precompute_can_skip_what_could_never_be_reused(engine):
    """What the ingestion hooks use: one tokenization, and None where a chunk is unusable."""
    too_long = "word " * (engine.context_window + 10)
    refs = engine.precompute(["", "Too short.", PASSAGES[0], too_long], skip_unusable=True)
    assert refs[0] is None and refs[1] is None and refs[3] is None
    assert refs[2] is not None and refs[2].key in engine.store
    assert engine.count_tokens("Too short.") < engine.min_chunk_tokens


@pytest.mark.parametrize("bad, error", [(None, InvalidInputError), (123, InvalidInputError)])
def test_precompute_of_not_texts(engine, bad, error):
    with pytest.raises(error, match="precompute takes"):
        engine.precompute(bad)


def test_packs_are_consecutive_and_under_the_limit_and_a_long_item_goes_alone():
    sizes = [3, 4, 2, 9, 1, 1, 5]
    groups = list(packs(sizes, 8, size=lambda n: n))
    assert groups == [[3, 4], [2], [9], [1, 1, 5]]
    assert [n for group in groups for n in group] == sizes            # every item once, in order
    assert list(packs([], 8, size=lambda n: n)) == []


def test_ingestion_alone_stores_entries_learns_them_and_keys_them_by_dtype(tokenizer):
    ingestion, store = ingestion_alone(tokenizer), MemoryStore()
    refs = ingestion.precompute(PASSAGES[:2], store, batch_tokens=0)
    for ref, text in zip(refs, PASSAGES):
        ids = ingestion.prompts.tokenize(text)
        assert ref.key == ingestion.key_for(ids) and ref.stored and store.get(ref.key).token_ids == ids
    # The chunk index learnt both, so a flat prompt holding one has it marked.
    flat = ingestion.prompts.tokenize("Context: " + PASSAGES[1] + " What then?")
    assert [s.token_ids for s in ingestion.index.mark(flat, MemoryStore()).chunk_spans] == \
        [tuple(ingestion.prompts.tokenize(PASSAGES[1]))]
    # The storage dtype is part of the key: a float16 ingestion never reads float32 entries.
    half = ingestion_alone(tokenizer, torch.float16)
    assert half.key_for(ingestion.prompts.tokenize(PASSAGES[0])) != refs[0].key


def test_remember_declares_a_chunk_without_storing_it(tokenizer):
    ingestion, store = ingestion_alone(tokenizer), MemoryStore()
    key = ingestion.remember(PASSAGES[2])
    assert key == ingestion.key_for(ingestion.prompts.tokenize(PASSAGES[2])) and key not in store
    assert len(ingestion.index.mark(ingestion.prompts.tokenize(PASSAGES[2] + " Why?"), store).chunk_spans) == 1
