"""How TTFT, KV bytes and store reads grow with the prompt: 2K to 16K tokens.

Prompts are real paragraphs (:func:`benchmarks.ingest.paragraphs`, ~150 tokens each) packed
into ~512-token chunks, as many as the target length needs, plus a question. For each size
that fits the model's window:

* TTFT of transformers' own forward (the full prefill) and of ragblend's default strategy with
  the chunks' KV in memory (median of ``--runs``, interleaved);
* the chunks' KV bytes as stored (float16), and the time to read every layer of every chunk
  from a disk store with the OS page cache dropped.

    python -m benchmarks.scaling --models smollm2 qwen2.5-0.5b --sizes 2048 4096 8192 16384

``--shape llama-8b --device cuda`` times a model of Llama 3 8B's shape instead, built with
random weights on the device (bfloat16): what a GPU's TTFT would be with such a model, where no
8B weights can be downloaded. Only timings mean anything there (its answers are noise; the
values change the timings only through which tokens QueryAware selects); the
chunks are the project's Lowenmark passages, numbered so that each is its own. Beside the
model's forward and the fused prefill with the chunks' KV in host memory, it times the fused
prefill reading them from a disk store (read ahead layer by layer, pinned buffers, the page
cache dropped before each run).

    python -m benchmarks.scaling --shape llama-8b --device cuda --sizes 4096 16384 --ratio 0.15
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, Chunk, QueryAware
from ragblend.core.fusion.controller import drop_page_cache
from ragblend.core.paths import cache_dir
from ragblend.core.store.tiers import DiskStore, MemoryStore
from ragblend.data import load_sample

from .common import RUNS_DIR, command_line, hf_forward_s, paragraphs, synced, write_report
from .models import MODELS, model_path

QUESTION = "Question: which of these passages mentions a date, and what happened then? Answer briefly."


def chunks_for(engine: BlendEngine, corpus: list[str], target_tokens: int, chunk_tokens: int = 512) -> list[str]:
    """~``chunk_tokens``-token chunks of consecutive paragraphs, ``target_tokens`` in all."""
    chunks, current, size, total = [], [], 0, 0
    for text in corpus:
        n = len(engine.prompts.tokenize(text))
        if size and size + n > chunk_tokens:
            chunks.append("\n".join(current))
            total += size
            current, size = [], 0
            if total >= target_tokens - chunk_tokens:
                return chunks
        current.append(text)
        size += n
    return chunks + ["\n".join(current)] if current else chunks


def disk_read_s(engine: BlendEngine, chunks: list[str], folder: Path) -> tuple[float, int]:
    """(seconds to read every layer of every chunk, cold; bytes on disk)."""
    store = DiskStore(folder, engine.entry_spec, max_bytes=1 << 40)
    keys = [ref.key for ref in engine.precompute(chunks)]
    for key in keys:
        store.put(engine.store.get(key))
    files = list(folder.rglob("*.val"))
    for path in files:
        drop_page_cache(path)
    t0 = time.perf_counter()
    for key in keys:
        reader = store.open(key)
        for layer in range(engine.adapter.shape.num_layers):
            reader.layer(layer)
        reader.close()
    seconds = time.perf_counter() - t0
    store.close()
    return seconds, sum(p.stat().st_size for p in files)


def measure(model: str, sizes: list[int], runs: int) -> list[str]:
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False, prefix_cache_bytes=0)   # fusion, timed
    corpus = paragraphs()
    lines = [f"## {model} (window {engine.context_window:,}; default strategy "
             f"{engine.strategy.name}({getattr(engine.strategy, 'ratio', '')}), {torch.get_num_threads()} threads)", "",
             "| prompt tokens | chunks | full prefill s | ragblend s | speed-up | KV MB (float16) | KV bytes/token | "
             "cold disk read of all KV s | read GB/s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        chunks = chunks_for(engine, corpus, size)
        segments = [Chunk(c) for c in chunks] + [QUESTION]
        token_ids = engine.build_prompt(segments).token_ids
        if len(token_ids) > engine.context_window:
            lines.append(f"| {size:,}: beyond the window | - | - | - | - | - | - | - | - |")
            continue
        engine.precompute(chunks)
        engine.prefill(segments)                      # warm-up, both
        hf_forward_s(engine, token_ids)
        full, fused = [], []
        for _ in range(runs):
            full.append(hf_forward_s(engine, token_ids))
            fused.append(engine.prefill(segments).stats.ttft_s)
        # Under the user cache, on the store's own device (a tmpfs /tmp would only measure RAM).
        with tempfile.TemporaryDirectory(prefix="scaling-", dir=cache_dir()) as tmp:
            read_s, nbytes = disk_read_s(engine, chunks, Path(tmp))
        chunk_tokens = sum(len(engine.prompts.tokenize(c)) for c in chunks)
        f, r = statistics.median(full), statistics.median(fused)
        lines.append(f"| {len(token_ids):,} | {len(chunks)} | {f:.2f} | {r:.2f} | {f / r:.2f}x | {nbytes / 1e6:.0f} | "
                     f"{nbytes / chunk_tokens:,.0f} | {read_s:.3f} | {nbytes / read_s / 1e9:.2f} |")
        print(lines[-1], flush=True)
    return lines + [""]


# Model shapes timed with random weights (``--shape``): Llama 3 8B's, with the tokenizer the
# tests use (its vocabulary only shrinks the last layer, which runs for one token).
SHAPES = {"llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=32768)}
TEST_TOKENIZER = Path(__file__).parent.parent / "tests" / "data" / "tokenizer"


def random_engine(shape: str, device: str, ratio: float) -> BlendEngine:
    """An engine over a model of ``shape`` with random weights, built on ``device`` in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(TEST_TOKENIZER)
    config = LlamaConfig(vocab_size=len(tokenizer), **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    # KV of a 16K-token prompt is ~2 GB here (twice, with lead entries): a memory store that holds it
    return BlendEngine(model, tokenizer, strategy=QueryAware(ratio), kv_dtype="float16", store=MemoryStore(32 << 30),
                       prefix_cache_bytes=0)


def numbered_passages(engine: BlendEngine, size: int) -> list[str]:
    """The sample passages in turn, each numbered (so each is its own chunk), as many as a
    prompt of ~``size`` tokens needs."""
    passages, chunks, tokens = load_sample()["chunks"], [], 0
    while tokens < size - 256:
        chunks.append(f"Part {len(chunks) + 1}.\n{passages[len(chunks) % len(passages)]}")
        tokens += len(engine.prompts.tokenize(chunks[-1]))
    return chunks


def measure_shape(shape: str, device: str, sizes: list[int], runs: int, ratio: float) -> list[str]:
    engine = random_engine(shape, device, ratio)
    now = synced(engine.adapter.device)
    lines = [f"## {shape}, random weights, bfloat16 on {torch.cuda.get_device_name() if device == 'cuda' else device} "
             f"(QueryAware({ratio}), KV stored float16)", "",
             "| prompt tokens | chunks | full prefill s | ragblend, KV in host memory s | speed-up | "
             "ragblend, KV on disk (cold) s | speed-up | KV MB | prompt tokens from the store (memory / disk) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    memory_store = engine.store
    for size in sizes:
        chunks = numbered_passages(engine, size)
        segments = [Chunk(c) for c in chunks] + [QUESTION]
        engine.store = memory_store
        engine.precompute(chunks)
        token_ids = engine.build_prompt(segments).token_ids

        def fused() -> float:
            t0 = now()
            engine.prefill(segments)
            return now() - t0

        hf_forward_s(engine, token_ids), fused()   # warm-up, both
        full, from_memory, from_disk = [], [], []
        for _ in range(runs):
            full.append(hf_forward_s(engine, token_ids))
            from_memory.append(fused())
            hits = engine.last_stats.cache_hit_tokens   # every chunk's KV from the store, not recomputed
        with tempfile.TemporaryDirectory(prefix="scaling-", dir=cache_dir()) as tmp:
            disk = DiskStore(Path(tmp), engine.entry_spec, max_bytes=1 << 40)
            for ref in engine.precompute(chunks):
                disk.put(memory_store.get(ref.key))
            files = list(Path(tmp).rglob("*.val"))
            nbytes = sum(p.stat().st_size for p in files)
            engine.store = disk
            fused()   # warm-up
            for _ in range(runs):
                for path in files:
                    drop_page_cache(path)
                from_disk.append(fused())
                disk_hits = engine.last_stats.cache_hit_tokens
            engine.store = memory_store
            disk.close()
        f, m, d = (statistics.median(x) for x in (full, from_memory, from_disk))
        lines.append(f"| {len(token_ids):,} | {len(chunks)} | {f:.3f} | {m:.3f} | {f / m:.2f}x | {d:.3f} | "
                     f"{f / d:.2f}x | {nbytes / 1e6:,.0f} | {hits:,} / {disk_hits:,} |")
        print(lines[-1], flush=True)
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--runs", type=int, default=3, choices=range(1, 101), metavar="N", help="timed rounds (1-100)")
    parser.add_argument("--shape", choices=SHAPES, help="time a model of this shape with random weights instead")
    parser.add_argument("--device", default="cpu", help="with --shape: where the model runs (cuda on a GPU)")
    parser.add_argument("--ratio", type=float, default=0.15, help="with --shape: QueryAware's ratio")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started, lines = time.perf_counter(), []
    if args.shape:
        lines += measure_shape(args.shape, args.device, args.sizes, args.runs, args.ratio)
    else:
        for model in args.models:
            lines += measure(model, args.sizes, args.runs)
    print("\n".join(lines), flush=True)
    write_report(args.out, "scaling-run.md", "Scaling with the prompt", command_line("benchmarks.scaling", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
