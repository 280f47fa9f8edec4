"""Ingestion speed: KV precompute one chunk at a time vs packed, and whole corpora.

1. **Precompute rate.** Real paragraphs (SQuAD v1.1 dev and the SQuAD-shifts Wikipedia,
   Reddit and Amazon sets, from the bigbench sdist; see :mod:`benchmarks.squad`) precomputed
   into an empty memory store one chunk per forward pass, then packed (``precompute_batch_tokens``
   chunk tokens per pass), in chunk tokens per second; and the largest difference between a
   chunk's packed and one-at-a-time K/V, in float32.
2. **Corpora.** ``ragblend ingest``'s path (:class:`LocalIndex`: split, precompute, embed, write
   Chroma on disk and the docstore) on the sample documents and on ``--files`` one-paragraph
   files, against the same pipeline without the KV precompute (embeddings only).

    python -m benchmarks.ingest --paragraphs 300 --files 10000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.core.fusion import isolated_kv, packed_isolated_kv
from ragblend.core.model import cache_dir
from ragblend.core.store import MemoryStore, open_store
from ragblend.data import sample_dir
from ragblend.integrations.local_index import LocalIndex, read_text_files

from .models import MODELS, model_path
from .run import command_line, write_report
from .squad import bigbench_squad_files

SOURCES = ["squaddev_v1.1.json", "new_wiki_v1.0.json", "reddit_v1.0.json", "amazon_reviews_v1.0.json"]


def paragraphs() -> list[str]:
    """Every distinct paragraph of the SOURCES, in file order (cached as JSON)."""
    path = cache_dir() / "benchmarks" / "paragraphs_v1.json"
    if not path.exists():
        files = bigbench_squad_files([f"bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/{s}" for s in SOURCES])
        seen = dict.fromkeys(p["context"].strip() for f in files for a in f["data"] for p in a["paragraphs"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([p for p in seen if p]))
    return json.loads(path.read_text())


def precompute_rates(engine: BlendEngine, texts: list[str], packs: list[int]) -> list[str]:
    tokens = sum(len(engine.prompts.tokenize(t)) for t in texts)
    lines = [f"Precompute of {len(texts)} paragraphs ({tokens:,} chunk tokens, {tokens / len(texts):.0f} a chunk) "
             "into an empty memory store:", "", "| chunk tokens per pass | chunk tokens/s | vs one at a time |",
             "|---|---:|---:|"]
    base = None
    for pack in packs:
        engine.store, engine.precompute_batch_tokens = MemoryStore(16 << 30), pack
        engine.precompute(texts[:4])                       # warm-up, not timed
        t0 = time.perf_counter()
        engine.precompute(texts[4:])
        rate = sum(len(engine.prompts.tokenize(t)) for t in texts[4:]) / (time.perf_counter() - t0)
        base = base or rate
        label = "one chunk" if pack == 0 else f"up to {pack:,}"
        lines.append(f"| {label} | {rate:,.0f} | {rate / base:.2f}x |")
        print(lines[-1], flush=True)
    chunks = [engine.prompts.tokenize(t) for t in texts[:32]]
    diff, scale = 0.0, 0.0
    for ids, (k, v) in zip(chunks, packed_isolated_kv(engine.adapter, engine.sink_ids, chunks)):
        alone_k, alone_v = isolated_kv(engine.adapter, engine.sink_ids, ids)
        diff = max(diff, (k - alone_k).abs().max().item(), (v - alone_v).abs().max().item())
        scale = max(scale, alone_k.abs().max().item(), alone_v.abs().max().item())
    lines += ["", f"Largest |packed - one at a time| over the K/V of 32 chunks, float32: {diff:.1e} "
              f"({diff / scale:.1e} of the largest |K|, |V|: {scale:.0f})."]
    return lines


def ingest_times(engine: BlendEngine, docs: Path, work: Path, label: str) -> str:
    """One table row: ragblend's ingestion of ``docs`` against embeddings only."""
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore
    from llama_index.vector_stores.chroma import ChromaVectorStore

    engine.store = open_store(work / "index" / "kv", engine.entry_spec, 2 << 30, 64 << 30)
    rag = LocalIndex(work / "index", engine=engine)
    # The same pipeline as LocalIndex's (splitter, embeddings, Chroma, docstore written after each
    # batch of 64), only without the KV precompute.
    plain = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=rag.chunk_size, chunk_overlap=rag.chunk_overlap, tokenizer=engine.tokenize),
        rag.embed_model], vector_store=ChromaVectorStore(
            chroma_collection=rag.client.get_or_create_collection("embeddings-only")),
        docstore=SimpleDocumentStore(), docstore_strategy=DocstoreStrategy.UPSERTS)
    t0 = time.perf_counter()
    documents, _ = read_text_files([docs])
    for start in range(0, len(documents), 64):
        plain.run(documents=documents[start:start + 64])
        plain.docstore.persist(str(work / "embeddings-only-docstore.json"))
    embeddings_only = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = rag.ingest([docs], show_progress=True)
    engine.flush()
    full = time.perf_counter() - t0
    row = (f"| {label} | {len(report.files):,} | {report.nodes:,} | {embeddings_only:.1f} | {full:.1f} | "
           f"{full / embeddings_only:.1f}x | {report.nodes / full:.1f} |")
    print(row, flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--paragraphs", type=int, default=300, help="paragraphs for the precompute rate")
    parser.add_argument("--packs", type=int, nargs="+", default=[0, 1024, 2048],
                        help="precompute_batch_tokens values (0 = one chunk per pass)")
    parser.add_argument("--files", type=int, default=1000, help="one-paragraph files to ingest (0: skip)")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=False)
    corpus = paragraphs()
    lines = [f"## {args.model}, {torch.get_num_threads()} threads", "",
             *precompute_rates(engine, corpus[:args.paragraphs], args.packs), "",
             "Ingestion with `LocalIndex.ingest` (what `ragblend ingest` runs; KV on disk, Chroma on disk), "
             "against the same splitter, embedding model and Chroma without the KV precompute:", "",
             "| corpus | files | chunks | embeddings only s | ragblend s | ratio | chunks/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    engine.precompute_batch_tokens = 1024
    with tempfile.TemporaryDirectory(prefix="ingest-", dir=cache_dir()) as tmp:
        lines.append(ingest_times(engine, sample_dir(), Path(tmp) / "sample", "sample documents"))
        if args.files:
            docs = Path(tmp) / "files"
            docs.mkdir()
            for i, text in enumerate(corpus[:args.files]):
                (docs / f"{i:05d}.txt").write_text(text + "\n", encoding="utf-8")
            lines.append(ingest_times(engine, docs, Path(tmp) / "files-index",
                                      f"{min(args.files, len(corpus)):,} one-paragraph files"))
    print("\n".join(lines), flush=True)
    write_report(args.out, "ingest-run.md", "Ingestion", command_line("benchmarks.ingest", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
