"""Shared fixtures: tiny randomly initialised models of every supported family, and the real
default model (SmolLM2-135M-Instruct). The tiny models use the small byte-level BPE tokenizer in
``tests/data/tokenizer`` (1,024 tokens, ChatML template; ``tests/data/make_tokenizer.py`` rebuilds
it), so the unit tests (``make test-fast``) need no downloaded or converted model."""

import functools
import struct
import zlib
from pathlib import Path

import pytest
import torch

from ragblend import BlendEngine, Chunk
from ragblend.core.model.loading import load_model, resolve_model_dir
from ragblend.core.store.kv import ChunkKV
from ragblend.core.store.tiers import MAGIC, DiskStore, EntrySpec

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, vocab_size=1024,
            tie_word_embeddings=False)


def tiny_config(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":  # RoPE scaling variant, through the model's own rotary module
        return LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if arch == "mistral":  # a sliding window shorter than the test prompts
        return MistralConfig(**TINY, sliding_window=48)
    if arch == "qwen2":  # biased Q/K/V projections
        return Qwen2Config(**TINY)
    if arch == "qwen3":  # per-head q/k RMSNorm
        return Qwen3Config(**TINY)
    if arch == "gemma3":
        # Sliding-window layers (window shorter than the test prompts) beside global ones, with
        # RoPE bases far apart, so a layer rotated with the other kind's tables fails the tests;
        # q/k norms, sandwich norms, scaled embeddings, query_pre_attn_scalar != head_dim, and
        # the final logit soft-capping (Gemma 2's; off in real Gemma 3) on, so it is tested too.
        return Gemma3TextConfig(**TINY, sliding_window=48, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    raise ValueError(arch)


TINY_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="session")
def default_model_dir():
    return resolve_model_dir(None)


TOKENIZER_DIR = Path(__file__).parent / "data" / "tokenizer"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@functools.lru_cache(maxsize=None)
def tiny_model(arch):
    """A tiny random model of ``arch``, built once per session (engines never change it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa").eval()
    # Random init at std 0.02 makes attention nearly uniform; a larger spread makes the
    # fusion strategies actually differ from each other.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def make_tiny_engine(arch, tokenizer, **kwargs):
    """A fresh engine (its own store and settings) over the shared tiny model of ``arch``. It always
    fuses (``min_fusion_speedup=0``) unless told otherwise: on a tiny model a pass's fixed cost
    outweighs any saving, so the engine's own strategy would run every prompt as a full prefill,
    and these tests are of the fusion (tests/unit/test_fusion_cost.py tests the skip). For the same
    reason it has no prefix tier unless told (``prefix_cache_bytes``): the tests of the fusion and
    of the store ask a prompt again to read the store, which the tier would answer instead
    (tests/unit/test_prefix_cache.py tests the tier), and it keeps no history pieces unless told
    (``history_pieces``: an answered prompt's text would be found as pieces in the next one;
    tests/unit/test_pieces.py tests them)."""
    kwargs.setdefault("min_fusion_speedup", 0)
    kwargs.setdefault("prefix_cache_bytes", 0)
    kwargs.setdefault("history_pieces", False)
    return BlendEngine(tiny_model(arch), tokenizer, **kwargs)


@pytest.fixture(params=TINY_ARCHS)
def tiny_engine(request, tokenizer):
    """A fresh engine per test, so a test may change its store or settings freely."""
    return make_tiny_engine(request.param, tokenizer)


@pytest.fixture(scope="session")
def smol_engine(tmp_path_factory):
    # No prefix tier, as make_tiny_engine: one engine for the session, whose tests ask prompts again to
    # read the store (the tier would answer them instead); the tier's tests build their own engines.
    return BlendEngine.from_pretrained(kv_dir=tmp_path_factory.mktemp("kv"), prefix_cache_bytes=0,
                                       history_pieces=False)


@pytest.fixture(scope="session")
def smol_model():
    model, _ = load_model(None, dtype=torch.float32)   # the default model's GGUF, dequantized to float32
    return model


def reused_floor(engine, chunk_tokens: int) -> float:
    """The least reuse to expect when ``chunk_tokens`` tokens of known chunks are in a prompt:
    90% of what the engine's default strategy leaves reused (it recomputes ``ratio`` of them, or
    up to FLOOR_SHARE where its floor for each chunk, ``per_chunk``, asks more)."""
    from ragblend.core.fusion.selection import FLOOR_SHARE

    strategy = engine.strategy
    share = max(strategy.ratio, FLOOR_SHARE) if getattr(strategy, "per_chunk", 0) else strategy.ratio
    return 0.9 * (1 - share) * chunk_tokens


def ran_as_a_full_prefill(stats) -> bool:
    """Whether a prefill skipped the fusion because a full prefill computes less there (a short
    chunk beside a long template or question: QuestionAttention.cheaper_than_a_prefill)."""
    return stats.fusion_skipped and stats.strategy == "full_recompute" and \
        "would compute more than a full prefill" in stats.strategy_reason


PASSAGES = [
    "The lighthouse at Cape Orrin was first lit in 1871 and burned whale oil until 1903.",
    "Mara Tellis ran the ferry between the two islands for thirty-one years without a single accident.",
    "In the village bakery, rye loaves are proofed overnight in baskets lined with linen.",
    "The council voted seven to two to replace the old stone bridge with a wider steel one.",
]


@pytest.fixture(scope="session")
def bench_prompt():
    """The benchmark's 6 chunks of ~500 tokens and its question."""
    from ragblend.data import load_sample

    sample = load_sample()
    return sample["chunks"], sample["question"]


def run_with_ticker(make_coro):
    """Run ``make_coro()`` in an event loop next to a 10 ms ticker.

    Returns ``(result, ticks, elapsed_s)``; a loop that was never blocked ticks about
    ``elapsed_s / 0.01`` times.
    """
    import asyncio
    import time

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        result = await make_coro()
        elapsed = time.perf_counter() - t0
        task.cancel()
        return result, ticks, elapsed

    return asyncio.run(main())


# ---------------------------------------------------------------------------- KV store helpers

SPEC = EntrySpec("f" * 64, num_layers=3, num_kv_heads=2, head_dim=8)


def synthetic_entry(i: int, tokens: int = 16, dtype=torch.float16, spec=SPEC) -> ChunkKV:
    g = torch.Generator().manual_seed(i)
    shape = (spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim)
    keys = torch.randn(shape, generator=g).to(dtype)
    values = torch.randn(shape, generator=g).to(dtype)
    return ChunkKV(f"{i:064x}", list(range(i, i + tokens)), keys, values)


def entry_path(store: DiskStore, key: str) -> Path:
    (filename,) = store.cache._sql("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()
    return store.directory / filename


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def with_header(blob: bytes, header: bytes) -> bytes:
    """An entry file with ``header`` (and a valid CRC for it) in place of its own."""
    (old_len,) = struct.unpack("<I", blob[4:8])
    layers = blob[8 + old_len + 4:]
    return MAGIC + struct.pack("<I", len(header)) + header + struct.pack("<I", zlib.crc32(header)) + layers


# A prompt over three stored passages, and an engine whose store is a DiskStore (store, pipeline
# and controller tests).
SEGMENTS = [Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), Chunk(PASSAGES[2]), "Question: who ran the ferry?"]


@pytest.fixture
def disk_engine(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = DiskStore(tmp_path / "kv", engine.entry_spec)
    return engine
