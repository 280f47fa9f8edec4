"""core.fusion.pipeline: the layer sources. Reading ahead in a thread (PrefetchSource) gives exactly
the layers reading on demand (SequentialSource) gives, windows included, and closes its readers."""

import pytest
import torch

from ragblend import CacheBlend, FullReuse
from ragblend.core.fusion.pipeline import PrefetchSource, SequentialSource
from ragblend.core.store.tiers import MemoryReader

from ..conftest import PASSAGES, SEGMENTS, make_tiny_engine, synthetic_entry


@pytest.mark.parametrize("strategy", [CacheBlend(0.2), FullReuse()])
def test_pipelined_and_sequential_loading_give_identical_logits(disk_engine, strategy):
    engine = disk_engine
    engine.precompute(PASSAGES[:3])
    engine.prefetch = True
    piped = engine.prefill(SEGMENTS, strategy=strategy)
    engine.prefetch = False
    sequential = engine.prefill(SEGMENTS, strategy=strategy)
    engine.prefetch = True
    assert torch.equal(piped.logits, sequential.logits)
    assert all(torch.equal(a, b) for a, b in zip(piped.keys, sequential.keys))
    assert piped.stats.load_s > 0 and 0.0 <= piped.stats.load_hidden_fraction <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side-stream prefetch with pinned buffers)")
def test_cuda_prefetch_matches_sequential_and_cpu(tokenizer, tmp_path):
    engine = make_tiny_engine("qwen3", tokenizer)
    engine.precompute(PASSAGES[:3])
    cpu = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    engine.hf_model.to("cuda")
    engine.prefetch = True
    piped = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    engine.prefetch = False
    sequential = engine.prefill(SEGMENTS, strategy=CacheBlend(0.3))
    assert torch.equal(piped.logits, sequential.logits)
    assert (piped.logits.cpu() - cpu.logits).abs().max() < 1e-3
    assert piped.keys[0].device.type == "cuda"


class CountingReader(MemoryReader):
    """A memory reader that counts its reads and notes when it is closed."""

    def __init__(self, entry):
        super().__init__(entry)
        self.fetched, self.closed = [], False

    def fetch(self, index):
        self.fetched.append(index)
        return super().fetch(index)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetch_gives_the_sequential_layers_windows_included_and_closes_its_readers(depth):
    entries = [synthetic_entry(i) for i in range(3)]
    windows = [slice(None), slice(2, 9), slice(0, 4)]            # parts of chunks, as partial matches use
    plain = SequentialSource([MemoryReader(e) for e in entries], windows=windows)
    readers = [CountingReader(e) for e in entries]
    ahead = PrefetchSource(readers, windows=windows, depth=depth)
    ahead.prepare([1, 2])                                         # layer 0 is not needed (CacheBlend's check layer)
    for index in (1, 2):
        for (k, v), (pk, pv), window in zip(plain.layer(index), ahead.layer(index), windows):
            assert torch.equal(k, pk) and torch.equal(v, pv) and k.shape[1] == len(range(16)[window])
    ahead.close()
    assert all(r.closed and sorted(r.fetched) == [1, 2] for r in readers)   # each needed layer read once
