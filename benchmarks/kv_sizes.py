"""Stored KV per model shape: bytes per token, a chunk's bytes, and the share of an index that fits.

For the benchmark models and the shapes of the 1-8B models people run (their configs written out:
no weights needed), per stored dtype: bytes per token of a 512-token chunk's entry (scales and
header included), that chunk's bytes with both its entries (the engine keeps a lead entry per
chunk by default), and the share of a 10,000-chunk index the default 8 GiB disk budget keeps
(the rest is computed at query time). Arithmetic only (:mod:`ragblend.core.store.kv_budget`); the
figures of the three real models match what their stores hold (``benchmarks.kv_dtypes``).

``--read-tokens N`` also times reading N tokens of stored KV back from a disk store (file in the
page cache: the CPU part, decoding included) per dtype, for the three benchmark models' shapes:
what a stored dtype adds to the TTFT of a prompt whose chunks are all stored.

    python -m benchmarks.kv_sizes
    python -m benchmarks.kv_sizes --chunks 100000 --chunk-tokens 256 --budget-gib 64
    python -m benchmarks.kv_sizes --read-tokens 3000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from ragblend.core.paths import cache_dir
from ragblend.core.store.disk_limit import DEFAULT_DISK_BYTES
from ragblend.core.store.kv import ChunkKV, to_storage
from ragblend.core.store.kv_budget import CHUNK_TOKENS, KVShape, bytes_per_token, entry_bytes, project
from ragblend.core.store.tiers import STORAGE_DTYPES, DiskStore, EntrySpec

DTYPES = ("float16", "int8", "uint4")
# The fields of each model's config.json that its KV size depends on.
SHAPES = {
    "SmolLM2 135M": dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576),
    "Qwen2.5 0.5B": dict(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896),
    "Gemma 3 270M": dict(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, hidden_size=640,
                         head_dim=256),
    "Qwen2.5 1.5B": dict(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536),
    "Qwen2.5 3B": dict(num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, hidden_size=2048),
    "Qwen2.5 7B": dict(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584),
    "Llama 3.2 1B": dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                         head_dim=64),
    "Llama 3.2 3B": dict(num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, hidden_size=3072,
                         head_dim=128),
    "Llama 3.1 8B": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096),
}


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def table(chunks: int, chunk_tokens: int, budget: int, entries_per_chunk: int) -> list[str]:
    head = " / ".join(DTYPES)
    lines = [f"| model (layers x KV heads x head_dim) | bytes per token, {head} | a {chunk_tokens}-token chunk, "
             f"{head} | share of {chunks:,} chunks in {budget / 2**30:g} GiB, {head} |", "|---|---:|---:|---:|"]
    for name, config in SHAPES.items():
        shape = KVShape.from_config(config)
        per_token = [f"{bytes_per_token(shape, d, chunk_tokens):,.0f}" for d in DTYPES]
        chunk = [_size(entries_per_chunk * entry_bytes(shape, chunk_tokens, d)) for d in DTYPES]
        shares = [project(shape, d, chunks, chunk_tokens, entries_per_chunk, budget).share_kept for d in DTYPES]
        lines.append(f"| {name} ({shape.num_layers} x {shape.num_kv_heads} x {shape.head_dim}) | "
                     f"{' / '.join(per_token)} | {' / '.join(chunk)} | {' / '.join(f'{s:.1%}' for s in shares)} |")
    return lines


def read_times(tokens: int, rounds: int = 5) -> list[str]:
    """Median seconds to read ``tokens`` tokens of stored KV (every layer, decoded to float16) per dtype."""
    lines = [f"| model | read {tokens:,} tokens of KV, {' / '.join(DTYPES)} | vs float16 |", "|---|---:|---:|"]
    generator = torch.Generator().manual_seed(0)
    for name in list(SHAPES)[:3]:
        shape = KVShape.from_config(SHAPES[name])
        spec = EntrySpec("f" * 64, shape.num_layers, shape.num_kv_heads, shape.head_dim)
        size = (shape.num_layers, shape.num_kv_heads, tokens, shape.head_dim)
        exact = ChunkKV("0" * 64, list(range(tokens)), torch.randn(size, generator=generator),
                        torch.randn(size, generator=generator))
        seconds = {}
        with tempfile.TemporaryDirectory(prefix="kvread-", dir=cache_dir()) as folder:
            store = DiskStore(folder, spec)
            for dtype in DTYPES:
                entry = to_storage(exact, STORAGE_DTYPES[dtype])
                entry.key = f"{dtype:0>64}"
                store.put(entry)
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    reader = store.open(entry.key)
                    for layer in range(shape.num_layers):
                        reader.layer(layer)
                    reader.close()
                    times.append(time.perf_counter() - t0)
                seconds[dtype] = statistics.median(times)
            store.close()
        base = seconds["float16"]
        lines.append(f"| {name} | {' / '.join(f'{seconds[d] * 1000:.0f} ms' for d in DTYPES)} | "
                     f"{' / '.join(f'{seconds[d] / base:.1f}x' for d in DTYPES)} |")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS)
    parser.add_argument("--budget-gib", type=float, default=DEFAULT_DISK_BYTES / 2**30)
    parser.add_argument("--entries-per-chunk", type=int, default=2, help="2: a lead entry too (the default)")
    parser.add_argument("--read-tokens", type=int, default=0, help="also time reading this many tokens back")
    args = parser.parse_args(argv)
    print("\n".join(table(args.chunks, args.chunk_tokens, int(args.budget_gib * 2**30), args.entries_per_chunk)))
    if args.read_tokens:
        print()
        read_times(args.read_tokens)


if __name__ == "__main__":
    main()
