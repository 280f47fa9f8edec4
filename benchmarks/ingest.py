"""Ingestion speed: KV precompute one chunk at a time vs packed, and whole corpora.

1. **Precompute rate.** Real paragraphs (the SQuAD-shifts Reddit and Amazon sets in ../shared/data;
   see :func:`benchmarks.common.paragraphs`) precomputed
   into an empty memory store one chunk per forward pass, then packed (``precompute_batch_tokens``
   chunk tokens per pass), in chunk tokens per second; and the largest difference between a
   chunk's packed and one-at-a-time K/V, in float32.
2. **Corpora.** ``ragblend ingest``'s path (:class:`LocalIndex`: split, key, embed, write
   Chroma on disk and the docstore, then the KV) on the sample documents and on ``--files``
   one-paragraph files, against the same pipeline without ragblend (embeddings only): when the
   index is searchable, when a question is answered, and the KV rate in the foreground
   (``kv="now"``) and in the background worker (``kv="background"``).

    python -m benchmarks.ingest --paragraphs 0 --files 1000     # the corpora only
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.core.fusion.ingest import isolated_kv, packed_isolated_kv
from ragblend.core.paths import cache_dir
from ragblend.core.store.tiers import MemoryStore, open_store
from ragblend.data import load_sample, sample_dir
from ragblend.integrations.local_index import LocalIndex, read_text_files

from .common import RUNS_DIR, command_line, paragraphs, rag_samples, write_report
from .models import MODELS, model_path


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


def embeddings_only(rag: LocalIndex, docs: Path, work: Path) -> float:
    """Seconds for the same pipeline as LocalIndex's (splitter, embeddings, Chroma, docstore
    written after each batch of 64) without anything of ragblend's: no KV keys, no KV."""
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore
    from llama_index.vector_stores.chroma import ChromaVectorStore

    plain = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=rag.chunk_size, chunk_overlap=rag.chunk_overlap, tokenizer=rag.engine.tokenize),
        rag.embed_model], vector_store=ChromaVectorStore(
            chroma_collection=rag.client.get_or_create_collection("embeddings-only")),
        docstore=SimpleDocumentStore(), docstore_strategy=DocstoreStrategy.UPSERTS)
    t0 = time.perf_counter()
    documents, _ = read_text_files([docs])
    for start in range(0, len(documents), 64):
        plain.run(documents=documents[start:start + 64])
        plain.docstore.persist(str(work / "embeddings-only-docstore.json"))
    return time.perf_counter() - t0


def fresh_index(engine: BlendEngine, folder: Path) -> LocalIndex:
    """A LocalIndex in ``folder`` with its own empty KV store (no entry shared with another run)."""
    engine.store = open_store(folder / "kv", engine.entry_spec, 2 << 30, 64 << 30)
    return LocalIndex(folder, engine=engine)


def ingest_phases(engine: BlendEngine, docs: Path, work: Path, label: str, questions: list[dict],
                  kv: bool = True) -> dict:
    """One corpus, three ways: embeddings only; ragblend searchable first (``kv="skip"``), a
    question answered at once, then the KV in the foreground (``kv.run()``, what ``ragblend
    ingest`` does); ragblend with ``kv="background"`` on a fresh store: the worker's rate on an
    otherwise idle process, then a question asked twice at 100% coverage. ``kv=False`` stops
    after the question (a corpus whose KV would take too long to compute twice)."""
    row: dict = {"label": label}
    qa = questions[0] if questions else None
    fore = fresh_index(engine, work / "foreground")
    row["embeddings_s"] = embeddings_only(fore, docs, work)
    report = fore.ingest([docs], show_progress=True, kv="skip")
    row.update(files=len(report.files), chunks=report.nodes, searchable_s=report.searchable_s)
    if qa is not None:   # answered before any KV exists: its chunks are computed in the prefill
        t = time.perf_counter()
        answer = fore.ask(qa["question"], max_new_tokens=24)
        row["answered_s"] = report.searchable_s + time.perf_counter() - t
        row.update(answer=answer.text, first_ask=answer.stats,
                   correct=any(a.lower() in answer.text.lower() for a in qa["answers"]))
    if not kv:
        if questions:
            row["correctness"] = correctness(fore, questions)
        print(row, flush=True)
        return row
    t = time.perf_counter()
    fore.kv.run(progress=True)
    engine.flush()
    row["fg_s"] = time.perf_counter() - t
    row["fg_rate"] = fore.kv.tokens / row["fg_s"]

    back = fresh_index(engine, work / "background")
    t = time.perf_counter()
    report = back.ingest([docs], show_progress=True, kv="background")
    back.kv.wait()
    engine.flush()
    row["bg_s"] = time.perf_counter() - t - report.searchable_s   # from the end of the searchable phase
    row.update(bg_rate=back.kv.tokens / row["bg_s"], coverage=back.kv_coverage().fraction)
    if qa is not None:
        back.ask(qa["question"], max_new_tokens=24)
        row["repeat"] = back.ask(qa["question"], max_new_tokens=24).stats
        row["correctness"] = correctness(back, questions)
    print({k: v for k, v in row.items() if k not in ("first_ask", "repeat")}, flush=True)
    return row


def corpus_lines(rows: list[dict]) -> list[str]:
    lines = ["| corpus | files | chunks | embeddings only s | searchable s (ratio) | answered s (ratio) | "
             "KV foreground: s, chunk tok/s | KV background: s, chunk tok/s | background/foreground rate | coverage |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        emb = r["embeddings_s"]
        answered = (f"{r['answered_s']:.1f} ({r['answered_s'] / emb:.2f}x)" if "answered_s" in r else "-")
        kv = (f"{r['fg_s']:.1f}, {r['fg_rate']:,.0f} | {r['bg_s']:.1f}, {r['bg_rate']:,.0f} | "
              f"{r['bg_rate'] / r['fg_rate']:.2f} | {r['coverage']:.0%}" if "fg_s" in r else "- | - | - | -")
        lines.append(f"| {r['label']} | {r['files']:,} | {r['chunks']:,} | {emb:.1f} | {r['searchable_s']:.1f} "
                     f"({r['searchable_s'] / emb:.2f}x) | {answered} | {kv} |")
    lines.append("")
    for r in rows:
        if "answer" in r and "repeat" not in r:
            lines.append(f"- {r['label']}: a question asked once the index was searchable, before any KV, was "
                         f"answered {'correctly' if r['correct'] else 'INCORRECTLY'} ({r['answer'][:80]!r}); its "
                         f"chunks: {r['first_ask'].chunks_reused} reused, {r['first_ask'].chunks_computed} computed "
                         "in the prefill (KV phases not run: --no-kv).")
        elif "answer" in r:
            first, repeat = r["first_ask"], r["repeat"]
            lines.append(f"- {r['label']}: a question asked once the index was searchable, before any KV, was "
                         f"answered {'correctly' if r['correct'] else 'INCORRECTLY'} ({r['answer'][:80]!r}); its "
                         f"chunks: {first.chunks_reused} reused, {first.chunks_computed} computed in the prefill. "
                         f"Asked twice at 100% coverage (background index), the second time: {repeat.chunks_reused} "
                         f"chunks reused, {repeat.chunks_computed} computed, {repeat.chunks_missing} missing.")
        if "correctness" in r:
            c = r["correctness"]
            lines.append(f"  Of {c['asked']} questions (the sample documents' {len(sample_questions())}, then "
                         f"SQuAD's about these files): the answer's passage retrieved for "
                         f"{c['retrieved']}; answered correctly {c['fused']} with fusion, {c['full']} with a full "
                         "prefill over the same retrieved chunks (the model's own reach).")
    return lines


def sample_questions() -> list[dict]:
    """The sample documents' questions with their answers (no gold paragraph to check retrieval by)."""
    sample = load_sample()
    return [{"question": q["question"], "answers": [q["answer"]]} for q in sample["demo"]]


def questions_for(texts: list[str], n: int = 5) -> list[dict]:
    """Up to ``n`` SQuAD questions whose gold paragraph is one of ``texts`` (the files ingested)."""
    present = set(texts)
    return [s for s in rag_samples(limit=400) if s["chunks"][s["gold"]].strip() in present][:n]


def correctness(rag: LocalIndex, questions: list[dict]) -> dict:
    """How many questions were answered correctly (a gold answer in the text), with fusion and with
    a full prefill over the same retrieved chunks, and how often the gold paragraph was retrieved:
    what the model gets right from this index, not only what ragblend does."""
    counts = {"asked": len(questions), "fused": 0, "full": 0, "retrieved": 0}
    for qa in questions:
        fused = rag.ask(qa["question"], max_new_tokens=24)
        full = rag.ask(qa["question"], max_new_tokens=24, strategy="full_recompute")
        if "gold" in qa:
            gold = qa["chunks"][qa["gold"]].strip()
            counts["retrieved"] += any(n.node.get_content().strip() == gold for n in fused.sources)
        else:   # a sample document's question: the answer's document among the sources
            counts["retrieved"] += any(a.lower() in n.node.get_content().lower() for n in fused.sources
                                       for a in qa["answers"])
        for name, answer in (("fused", fused), ("full", full)):
            counts[name] += any(a.lower() in answer.text.lower() for a in qa["answers"])
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--paragraphs", type=int, default=300, help="paragraphs for the precompute rate")
    parser.add_argument("--packs", type=int, nargs="+", default=[0, 1024, 2048],
                        help="precompute_batch_tokens values (0 = one chunk per pass)")
    parser.add_argument("--files", type=int, default=1000, help="one-paragraph files to ingest (0: skip)")
    parser.add_argument("--no-kv", action="store_true",
                        help="for --files: measure searchable and answered only, not the KV phases")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=False)
    corpus = paragraphs()
    lines = [f"## {args.model}, {torch.get_num_threads()} threads", ""]
    if args.paragraphs:
        lines += [*precompute_rates(engine, corpus[:args.paragraphs], args.packs), ""]
    lines += ["Ingestion with `LocalIndex.ingest` (what `ragblend ingest` runs; KV on disk, Chroma on disk), "
              "against the same splitter, embedding model and Chroma without ragblend (embeddings only). "
              "Searchable: the chunks and embeddings committed; answered: searchable plus one question "
              "answered before any KV was computed; KV rates in chunk tokens per second of wall time, in the "
              "foreground (`ragblend ingest`'s second phase) and by the background worker (fresh store each):", ""]
    engine.precompute_batch_tokens = 1024
    rows = []
    with tempfile.TemporaryDirectory(prefix="ingest-", dir=cache_dir()) as tmp:
        if not args.no_kv:
            rows.append(ingest_phases(engine, sample_dir(), Path(tmp) / "sample", "sample documents", []))
        if args.files:
            docs = Path(tmp) / "files"
            docs.mkdir()
            texts = corpus[:args.files]
            # More files than distinct paragraphs (7,731): the rest are copies made distinct by a label.
            texts += [f"(Copy {i + 1}.) {corpus[i % len(corpus)]}" for i in range(args.files - len(texts))]
            for i, text in enumerate(texts):
                (docs / f"{i:05d}.txt").write_text(text + "\n", encoding="utf-8")
            # The sample documents too, whose questions the small model answers: a needle to find.
            for document in sample_dir().iterdir():
                if document.is_file():
                    (docs / document.name).write_bytes(document.read_bytes())
            rows.append(ingest_phases(engine, docs, Path(tmp) / "files-index",
                                      f"{len(texts):,} one-paragraph files + the sample documents",
                                      sample_questions() + questions_for(texts), kv=not args.no_kv))
    lines += corpus_lines(rows)
    print("\n".join(lines), flush=True)
    write_report(args.out, "ingest-run.md", "Ingestion", command_line("benchmarks.ingest", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
