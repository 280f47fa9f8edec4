# PYTHONPATH=. python3 research/scratch/userlike_candidates.py SCREEN QUESTIONS BUCKET...  (2026-12-06, SmolLM2)
# screen 1: `1 10 600-1200 1200-2000` (09:20-09:24 UTC); screen 2: `2 10 600-1200` (09:26-09:28 UTC)
"""Candidate default strategies on benchmarks.userlike's own prompts (the same corpora, SentenceSplitter
indexes, retrieval and bucket filling; only the buckets named, e.g. 600-1200 1200-2000): per bucket, each
candidate's gold-answer accuracy and repeating answers against full prefill's, and its mean compute. A
screen before the one full user-like run: it answers each prompt with explicit strategies, not the engine's
default, and times nothing."""

import itertools
import statistics
import sys

from llama_index.core.schema import MetadataMode

from benchmarks.common import GREEDY_TOKENS, answer_contained, best_over_answers, repeats
from benchmarks.fidelity import QuestionAttentionWithHeads
from benchmarks.models import model_path
from benchmarks.userlike import BUCKETS, CHUNK_SIZES, SQUAD_SHIFTS, Index, choose_config, sample_corpus, squad_corpus
from ragblend import BlendEngine, BlendLLM, FullRecompute, QueryAware
from ragblend.integrations.local_index import default_embed_model

FIRST_SCREEN = {
    "QA(0.10)": QueryAware(0.10),
    "QA(0.20)": QueryAware(0.20),
    "QA(0.10, starts 32)": QuestionAttentionWithHeads(0.10, 32, within_budget=True),
    "QA(0.15, starts 32)": QuestionAttentionWithHeads(0.15, 32, within_budget=True),
    "QA(0.20, starts 32)": QuestionAttentionWithHeads(0.20, 32, within_budget=True),
}
SECOND_SCREEN = {
    "QA(0.10)": QueryAware(0.10),
    "QA(0.30)": QueryAware(0.30),
    "QA(0.30, starts 32)": QuestionAttentionWithHeads(0.30, 32, within_budget=True),
    "QA(0.50)": QueryAware(0.50),
    "reversed (full)": "reversed",   # the order noise: full prefill, the retrieved chunks in reverse order
}

CANDIDATES = {"1": FIRST_SCREEN, "2": SECOND_SCREEN}[sys.argv[1]]
questions = int(sys.argv[2])
wanted = [tuple(int(x) for x in b.split("-")) for b in sys.argv[3:]] or list(BUCKETS)
engine = BlendEngine.from_pretrained(model_path("smollm2"), kv_dir=False, prefix_cache_bytes=0)
llm = BlendLLM(engine=engine, max_new_tokens=GREEDY_TOKENS)
embed_model = default_embed_model()
corpora = {"sample": sample_corpus(),
           **{path.stem.split("_v")[0]: squad_corpus(path, questions) for path in SQUAD_SHIFTS if path.exists()}}
queue = [pair for group in itertools.zip_longest(*([(n, it) for it in items] for n, (_, items) in corpora.items()))
         for pair in group if pair is not None]
indexes, counts, turn, rows = {}, dict.fromkeys(wanted, 0), 0, []
for name, item in queue:
    estimates = {}
    for chunk_size in CHUNK_SIZES:
        if (name, chunk_size) not in indexes:
            indexes[name, chunk_size] = Index(engine, corpora[name][0], chunk_size, embed_model)
        estimates[chunk_size] = indexes[name, chunk_size].retrieved_tokens(item["question"])
    chosen = []
    for bucket in sorted(wanted, key=lambda b: counts[b]):
        if counts[bucket] >= 13:   # as many as the benchmark's run had a bucket
            continue
        config = choose_config(estimates, bucket, turn)
        if config is not None and len(chosen) < 2:
            chosen.append(config)
            turn += 1
    for chunk_size, top_k in chosen:
        response = indexes[name, chunk_size].query_engine(llm, top_k).query(item["question"])
        call = llm.calls[-1]
        layout = call.layout if call.layout is not None else engine.find_chunks(call.prompt)
        tokens = len(layout.token_ids)
        bucket = next((b for b in wanted if b[0] <= tokens < b[1]), None)
        if bucket is None:
            continue
        counts[bucket] += 1
        row = {"bucket": bucket, "set": name, "tokens": tokens, "question": item["question"]}
        for label, strategy in {"full": FullRecompute(), **CANDIDATES}.items():
            if strategy == "reversed":
                texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
                forward = "\n\n".join(texts)
                if len(texts) < 2 or forward not in call.prompt:
                    row[label] = row["full"]
                    continue
                reversed_layout = engine.find_chunks(call.prompt.replace(forward, "\n\n".join(reversed(texts))))
                strategy, used = FullRecompute(), reversed_layout
            else:
                used = layout
            out = engine.generate(used, strategy=strategy, max_new_tokens=GREEDY_TOKENS)
            row[label] = (best_over_answers(answer_contained, out.text, item["answers"]), repeats(out.text),
                          out.stats.compute_fraction, out.text)
        rows.append(row)
        print(name, tokens, item["question"][:60], {k: (v[0], v[1]) for k, v in row.items() if isinstance(v, tuple)},
              flush=True)
        for label in CANDIDATES:
            if row[label][0] != row["full"][0] or (row[label][1] and not row["full"][1]):
                print(f"   {label}: {row[label][3]!r}  | full: {row['full'][3]!r}", flush=True)

for bucket in wanted:
    group = [r for r in rows if r["bucket"] == bucket]
    if not group:
        continue
    print(f"\n{bucket[0]}-{bucket[1]}: {len(group)} prompts")
    for label in ["full", *CANDIDATES]:
        right = statistics.mean(r[label][0] for r in group)
        new_repeats = sum(r[label][1] and not r["full"][1] for r in group)
        compute = statistics.mean(r[label][2] for r in group)
        print(f"  {label:22s} accuracy {right:.0%}  repeats full does not give {new_repeats}  compute {compute:.1%}")
