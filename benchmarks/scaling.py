"""How TTFT, KV bytes and store reads grow with the prompt: 2K to 16K tokens.

Prompts are real paragraphs (:func:`benchmarks.ingest.paragraphs`, ~150 tokens each) packed
into ~512-token chunks, as many as the target length needs, plus a question. For each size
that fits the model's window:

* TTFT of transformers' own forward (the full prefill) and of ragblend's default strategy with
  the chunks' KV in memory (median of ``--runs``, interleaved);
* the chunks' KV bytes as stored (float16), and the time to read every layer of every chunk
  from a disk store with the OS page cache dropped.

    python -m benchmarks.scaling --models smollm2 qwen2.5-0.5b --sizes 2048 4096 8192 16384
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, Chunk
from ragblend.core.controller import drop_page_cache
from ragblend.core.model import cache_dir
from ragblend.core.store import DiskStore

from .common import RUNS_DIR, command_line, hf_forward_s, paragraphs, write_report
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
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started, lines = time.perf_counter(), []
    for model in args.models:
        lines += measure(model, args.sizes, args.runs)
    print("\n".join(lines), flush=True)
    write_report(args.out, "scaling-run.md", "Scaling with the prompt", command_line("benchmarks.scaling", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
