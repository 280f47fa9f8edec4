"""core.store.chunk_index: the chunks an engine knows, found in flat prompts: those added here and
those other processes stored (learnt from the store, reading only new entries, never deleting
another model's)."""

from ragblend.core.store.chunk_index import ChunkIndex
from ragblend.core.store.tiers import DiskStore, MemoryStore

from ..conftest import PASSAGES, make_tiny_engine, synthetic_entry


class CountingStore(MemoryStore):
    """A memory store that counts the entries opened in it."""

    def __init__(self):
        super().__init__()
        self.opened = 0

    def open(self, key, drop_unusable=True):
        self.opened += 1
        return super().open(key, drop_unusable)


def flat_prompt(entry):
    """A prompt with ``entry``'s tokens between text the index never saw."""
    return [900, 901, 902] + list(entry.token_ids) + [903, 904]


def test_mark_finds_an_added_chunk_and_not_an_unknown_one():
    index, known, unknown = ChunkIndex(), synthetic_entry(1, tokens=40), synthetic_entry(300, tokens=40)
    index.add(known.key, known.token_ids)
    layout = index.mark(flat_prompt(known), MemoryStore())
    assert layout.token_ids == flat_prompt(known)
    assert [(s.start, s.end, s.token_ids) for s in layout.chunk_spans] == [(3, 43, tuple(known.token_ids))]
    assert index.mark(flat_prompt(unknown), MemoryStore()).chunk_spans == []


def test_entries_others_stored_are_learnt_reading_only_new_ones():
    index, store = ChunkIndex(), CountingStore()
    first, second = synthetic_entry(1, tokens=40), synthetic_entry(300, tokens=40)
    store.put(first)                               # stored by another engine on the same store
    assert len(index.mark(flat_prompt(first), store).chunk_spans) == 1
    assert store.opened == 1
    index.mark(flat_prompt(first), store)          # nothing new in the store: no entry is read again
    assert store.opened == 1
    store.put(second)
    assert len(index.mark(flat_prompt(second), store).chunk_spans) == 1
    assert store.opened == 2                       # only the new entry was read


def test_scanning_a_shared_directory_never_deletes_other_models_entries(tokenizer, tmp_path):
    llama = make_tiny_engine("llama", tokenizer)
    qwen = make_tiny_engine("qwen3", tokenizer)
    llama.store = DiskStore(tmp_path, llama.entry_spec)
    qwen.store = DiskStore(tmp_path, qwen.entry_spec)
    llama.precompute(PASSAGES[:2])
    stored = len(llama.store)
    layout = qwen.find_chunks(f"Context: {PASSAGES[0]}\n\nQuestion?")  # scans every entry's header
    assert layout.chunk_spans == [] and len(llama.store) == stored == 4   # each chunk's own and lead entries
    assert llama.find_chunks(f"Context: {PASSAGES[0]}\n\nQuestion?").chunk_spans
