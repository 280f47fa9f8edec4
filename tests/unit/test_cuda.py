"""On a CUDA device the engine computes what it computes on the CPU: the chunks' stored K/V,
the fused prefill of every strategy, and the answer's decoding steps after it (the CPU's own
kernels and low-bit decoding weights are not used there). Skipped without CUDA."""

import copy

import pytest
import torch

from ragblend import BlendEngine, CacheBlend, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import answer_logits

from ..conftest import PASSAGES, SEGMENTS, entry_path, flip_byte, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ATOL = 2e-3   # float32 on two devices: matmuls accumulate in another order (TF32 off)


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def engines(arch, tokenizer):
    """The same tiny model on the CPU and on the GPU (a copy: the shared one stays on the CPU)."""
    cpu = BlendEngine(tiny_model(arch), tokenizer, kv_dtype="float32")
    gpu = BlendEngine(copy.deepcopy(tiny_model(arch)).to("cuda"), tokenizer, kv_dtype="float32")
    for engine in (cpu, gpu):
        engine.precompute(PASSAGES[:3])
    return cpu, gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_stored_chunks_match_the_cpus(arch, tokenizer):
    cpu, gpu = engines(arch, tokenizer)
    for text in PASSAGES[:3]:
        key = cpu.key_of(text)
        assert gpu.key_of(text) == key   # the same model, the same entry key
        a, b = cpu.store.get(key), gpu.store.get(key)
        for layer in range(len(a.keys)):
            torch.testing.assert_close(b.keys[layer].float().cpu(), a.keys[layer].float(), atol=ATOL, rtol=1e-3)
            torch.testing.assert_close(b.values[layer].float().cpu(), a.values[layer].float(), atol=ATOL, rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("strategy", [QueryAware(0.3), CacheBlend(0.3), FullReuse(), FullRecompute()], ids=repr)
def test_fused_prefill_and_answer_match_the_cpus(arch, strategy, tokenizer):
    cpu, gpu = engines(arch, tokenizer)
    on_cpu = cpu.prefill(SEGMENTS, strategy=strategy)
    on_gpu = gpu.prefill(SEGMENTS, strategy=strategy)
    assert on_gpu.keys[0].device.type == "cuda"
    assert on_gpu.stats.recomputed_tokens == on_cpu.stats.recomputed_tokens   # the same selection
    torch.testing.assert_close(on_gpu.logits.float().cpu(), on_cpu.logits.float(), atol=ATOL, rtol=1e-3)
    # The answer's steps after the prefill, teacher-forced on the CPU's greedy answer.
    answer = cpu.generate(SEGMENTS, strategy=strategy, max_new_tokens=6).token_ids
    torch.testing.assert_close(answer_logits(gpu, on_gpu, answer).cpu(), answer_logits(cpu, on_cpu, answer),
                               atol=ATOL, rtol=1e-3)


def test_a_partly_used_chunk_is_read_ahead_to_the_gpu_as_on_the_cpu(tokenizer, tmp_path):
    """Windows (a chunk's tokens a prompt uses) go through the pinned read-ahead contiguous, from
    the memory tier and from a disk store, and give the CPU's layers."""
    from ragblend.core.fusion.pipeline import PrefetchSource, SequentialSource, _pinned_copy
    from ragblend.core.store.tiers import DiskStore, MemoryReader

    cpu, gpu = engines("qwen2", tokenizer)
    entries = [cpu.store.get(cpu.key_of(text)) for text in PASSAGES[:3]]
    windows = [slice(2, 9), slice(None), slice(0, 5)]
    disk = DiskStore(tmp_path / "kv", cpu.entry_spec)
    for entry in entries:
        disk.put(entry)
    for readers in ([MemoryReader(e) for e in entries], [disk.open(e.key) for e in entries]):
        want = SequentialSource([MemoryReader(e) for e in entries], "cpu", windows)
        got = PrefetchSource(readers, "cuda", windows)
        got.prepare(list(range(len(entries[0].keys))))
        for layer in range(len(entries[0].keys)):
            for (k, v), (ek, ev) in zip(got.layer(layer), want.layer(layer)):
                assert k.device.type == "cuda"
                assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev)
        got.close()
    window = torch.arange(24.0).view(2, 3, 4)[:, 1:]   # a strided view, as a chunk's window is
    pinned = _pinned_copy(window)
    assert pinned.is_pinned() and pinned.is_contiguous() and torch.equal(pinned, window)


def test_a_corrupt_entry_on_disk_is_recomputed_on_the_gpu(tokenizer, tmp_path):
    """A layer that fails its check in the read-ahead thread: the entry is dropped and the
    chunk recomputed, as on the CPU (the answer is the clean store's)."""
    from ragblend.core.store.tiers import DiskStore

    _, gpu = engines("qwen2", tokenizer)
    gpu.store = DiskStore(tmp_path / "kv", gpu.entry_spec)
    gpu.precompute_batch_tokens = 0   # one chunk a pass, as a query's recompute does
    refs = gpu.precompute(PASSAGES[:3])
    clean = gpu.prefill(SEGMENTS, strategy=QueryAware(0.3))
    assert clean.stats.chunks_reused == 3 and clean.stats.tiers == {"disk": 3}
    flip_byte(entry_path(gpu.store, refs[1].key), entry_path(gpu.store, refs[1].key).stat().st_size - 3)
    again = gpu.prefill(SEGMENTS, strategy=QueryAware(0.3))
    assert again.stats.chunks_computed == 1 and again.stats.chunks_reused == 2
    torch.testing.assert_close(again.logits.float().cpu(), clean.logits.float().cpu(), atol=ATOL, rtol=1e-3)
