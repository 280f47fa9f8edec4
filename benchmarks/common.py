"""What the benchmarks share: the prompts they measure on, the measures, and how a study writes its
report. A benchmark module (``python -m benchmarks.X``) imports from here (and the model list from
``benchmarks.models``), never from another benchmark, so each one reads alone. The studies behind
the design choices live in ``research/`` and may import benchmarks.

Reports go to ``docs/runs/`` unless a study's ``--out`` says otherwise: raw run logs live there,
and ``docs/benchmarks.md`` keeps the current tables that link to them.
"""

from __future__ import annotations

import json
import math
import random
import re
import socket
import string
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from ragblend import BlendEngine
from ragblend.data import load_sample

RUNS_DIR = "docs/runs"   # where a study writes its report (its --out default)
SYSTEM = "Answer the question from the passages, briefly."
GREEDY_TOKENS = 32


# ---------------------------------------------------------------------------- reports


def command_line(module: str, argv) -> str:
    """The command that reproduces this run, for its report."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


def write_report(out_dir, file_name: str, title: str, command: str, seconds: float, lines: list[str]) -> None:
    """Write a study's markdown report under a title line with its command and duration."""
    from ragblend.core.model.kernels import cpu_summary

    text = "\n".join([f"# {title}: `{command}` ({seconds / 60:.1f} min, {torch.get_num_threads()} threads)",
                      "", f"Host: {cpu_summary()}.", "", *lines])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / file_name).write_text(text)


def report_per_model(models: list[str], measure, out_dir, file_name: str, title: str, module: str, argv) -> None:
    """Run ``measure(model) -> lines`` for each model, print each section as it ends, and
    write them all as one report."""
    started, lines = time.perf_counter(), []
    for model in models:
        section = measure(model)
        print("\n".join(section), flush=True)
        lines += section
    write_report(out_dir, file_name, title, command_line(module, argv), time.perf_counter() - started, lines)


# ---------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    chunks: list[str]
    question: str
    answers: list[str] = field(default_factory=list)  # gold answers (SQuAD), empty for fidelity prompts


def fidelity_prompts(n: int) -> list[Prompt]:
    """Six ~500-token passages written for the project; each prompt asks another question,
    with the passages in another order. There are as many distinct prompts as questions (6):
    more would repeat the first ones and count them twice."""
    sample = load_sample()
    questions = [sample["question"], *[q["question"] for q in sample["demo"]]]
    chunks = sample["chunks"]
    if n > len(questions):
        raise SystemExit(f"The passage set has {len(questions)} distinct prompts; asked for {n}.")
    return [Prompt(chunks[i % 6:] + chunks[:i % 6], questions[i % len(questions)]) for i in range(n)]


# The evaluation sets live beside the repository, in ../shared/data (its README gives their sources
# and licences: MuSiQue and SQuAD-shifts, CC BY 4.0); nothing is downloaded at benchmark time.
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
MUSIQUE = DATA_DIR / "musique-dev.json"
SQUAD_SHIFTS = [DATA_DIR / "reddit_v1.0.json", DATA_DIR / "amazon_reviews_v1.0.json"]
PARAGRAPHS_PER_SAMPLE = 6


def read_data(path: Path):
    """One evaluation set's JSON, or a clear exit naming the file and where it should be."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the benchmarks read their evaluation sets from ../shared/data "
                         "beside the repository (MuSiQue and the SQuAD-shifts Reddit and Amazon sets).")
    return json.loads(path.read_text())


def rag_samples(limit: int = 200, seed: int = 0, path: Path = SQUAD_SHIFTS[0]) -> list[dict]:
    """``[{"chunks": [6 str], "question": str, "answers": [str], "gold": int}, ...]`` from a SQuAD-format
    set (SQuAD-shifts' Reddit comments unless ``path`` says otherwise): a question, its paragraph and 5
    others of the same set, shuffled. Until 2026-12-05 these came from SQuAD v1.1 dev (6 paragraphs of
    one Wikipedia article), which the package registry no longer serves."""
    rng = random.Random(seed)
    paragraphs = [p for article in read_data(path)["data"] for p in article["paragraphs"]]
    golds = [i for i, p in enumerate(paragraphs) if p["qas"]]
    rng.shuffle(golds)
    samples = []
    for gold in golds[:limit]:
        qa = rng.choice(paragraphs[gold]["qas"])
        others = rng.sample([i for i in range(len(paragraphs)) if i != gold], PARAGRAPHS_PER_SAMPLE - 1)
        order = [gold, *others]
        rng.shuffle(order)
        samples.append({"chunks": [paragraphs[i]["context"] for i in order], "question": qa["question"],
                        "answers": sorted({a["text"] for a in qa["answers"]}), "gold": order.index(gold)})
    return samples


def squad_prompts(n: int) -> list[Prompt]:
    return [Prompt(s["chunks"], f"Question: {s['question']} Answer with a few words.", s["answers"])
            for s in rag_samples(n)]


def musique_prompts(n: int, path: Path = MUSIQUE) -> list[Prompt]:
    if n == 0 or not path.exists():
        return []
    items = json.loads(path.read_text())[:n]
    return [Prompt([f"{c['title']}\n{c['text']}" for c in item["ctxs"]],
                   f"Question: {item['question']} Answer with a few words.", item["answers"]) for item in items]


def prompt_sets(spec: list[str], musique_file: Path) -> dict[str, list[Prompt]]:
    """``spec`` items name a set and its first prompts, ``squad:12``, or a range of them,
    ``squad:12-20`` (prompts 12 to 19: more prompts without running the first ones again)."""
    sets = {}
    for item in spec:
        name, _, count = item.partition(":")
        first, _, last = (count or "8").rpartition("-")
        prompts = {"fidelity": fidelity_prompts, "squad": squad_prompts,
                   "musique": lambda k: musique_prompts(k, musique_file)}[name](int(last))
        sets[name] = prompts[int(first or 0):]
    return sets


def paragraphs() -> list[str]:
    """Every distinct paragraph of the SQuAD-shifts Reddit and Amazon sets, in file order (about 4,000:
    Reddit's ~165 words each first, then Amazon's ~50)."""
    seen = dict.fromkeys(p["context"].strip() for path in SQUAD_SHIFTS
                         for article in read_data(path)["data"] for p in article["paragraphs"])
    return [p for p in seen if p]


def pool_by_set(runs) -> dict[str, list]:
    """The per-prompt rows of several runs (their ``--json`` files, read), by set: a set's
    prompts from every run together (e.g. ``musique:8`` and ``musique:8-16``)."""
    pooled: dict[str, list] = {}
    for run in runs:
        for key, rows in run.items():
            pooled.setdefault(key, []).extend(rows)
    return pooled


def in_every(rows: list[dict]) -> set[str]:
    """The names every one of ``rows`` has: the columns every prompt of a pooled set measured."""
    return set.intersection(*(set(r) for r in rows))


# ---------------------------------------------------------------------------- measures


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_contained(prediction: str, gold: str) -> float:
    """1.0 when the normalised gold answer appears, as whole words, in the normalised prediction.

    Small chat models answer in sentences ("The Broncos won Super Bowl 50."), which exact
    match scores 0 even when right; this "has answer" accuracy is the usual RAG yardstick
    for free-form answers.
    """
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    return float(bool(ref) and f" {ref} " in f" {pred} ")


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


def extract_answer(text: str) -> str:
    """The answer part of a generation: its first non-empty line, without an ``Answer:``
    label, cut after the first sentence (later sentences only dilute F1)."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = re.sub(r"^(answer|a)\s*:\s*", "", line, flags=re.IGNORECASE)
    return re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]


def best_over_answers(metric, prediction: str, answers: list[str]) -> float:
    """SQuAD scores a prediction against the closest of the gold answers."""
    return max(metric(prediction, answer) for answer in answers)




def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` of ``values`` (nearest rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def wilson_interval(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``right / n`` (95% at z 1.96): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n right, which small buckets hit."""
    if n == 0:
        return 0.0, 1.0
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(first: list[bool], second: list[bool], z: float = 1.96) -> tuple[float, float, float]:
    """The difference of two accuracies on the same prompts, ``mean(first) - mean(second)``, with
    Newcombe's interval for paired proportions (his method 10, Statistics in Medicine 1998): the
    Wilson intervals of both, joined through the correlation of the pairs. Pairing is the right test
    here: both answer the same prompt, so only the prompts where they disagree carry information,
    and two unpaired intervals of 40 prompts each would be far wider than the difference's."""
    n = len(first)
    if n == 0 or n != len(second):
        raise ValueError(f"paired_difference needs two equally long non-empty lists, got {n} and {len(second)}")
    a = sum(x and y for x, y in zip(first, second))
    b = sum(x and not y for x, y in zip(first, second))
    c = sum(y and not x for x, y in zip(first, second))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson_interval(a + b, n, z), wilson_interval(a + c, n, z)
    cross = a * d - b * c
    if cross > 0:   # Newcombe's continuity correction of the correlation, toward none
        cross = max(cross - n / 2, 0)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = cross / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return p1 - p2, p1 - p2 - below, p1 - p2 + above


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure over whitespace tokens (longest common subsequence)."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def prefix_options(args) -> dict:
    """Engine options of the ``--no-chunk-context`` / ``--no-lead-entries`` flags: what chunks are
    precomputed after, as before each of those changes (docs/benchmarks.md)."""
    return {**({"chunk_context": ""} if args.no_chunk_context else {}),
            **({"lead_chunk_kv": False} if args.no_lead_entries else {})}


def first_token_and_answer(engine: BlendEngine, segments, strategy, greedy_tokens: int):
    """(first-token logits, stats, greedy answer) of one prompt; the answer is "" and only a
    prefill runs when ``greedy_tokens`` is 0."""
    if greedy_tokens:
        out = engine.generate(segments, system=SYSTEM, strategy=strategy, max_new_tokens=greedy_tokens)
        return out.logits, out.stats, out.text
    pre = engine.prefill(segments, system=SYSTEM, strategy=strategy)
    return pre.logits, pre.stats, ""


def synced(device: torch.device):
    """A clock that waits for the device's queued work first (a GPU returns before it is done)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def hf_forward_s(engine: BlendEngine, token_ids: list[int]) -> float:
    """Seconds of transformers' own forward over ``token_ids`` (the full prefill), on the model's device."""
    ids = torch.tensor([token_ids], device=engine.adapter.device)
    now = synced(engine.adapter.device)
    t0 = now()
    with torch.inference_mode():
        engine.hf_model(ids, logits_to_keep=1)
    return now() - t0


class TokenClock:
    """A transformers streamer that only notes when each token arrives (the first call
    gets the prompt, the second the first new token, after the prefill)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------- a server to load


class ServedProcess:
    """``ragblend serve`` in a child process on a free port of 127.0.0.1 (its URL is ``.url``), waited
    for until ``/health`` answers; ``stop()`` ends it. (The tests' server fixtures are apart, in
    tests/servers.py: a benchmark imports only this module.)"""

    def __init__(self, kv_dir: str, *extra: str, timeout_s: float = 120):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "ragblend.cli", "serve", "--port", str(port),
                                         "--kv-dir", kv_dir, *extra], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("ragblend serve did not start")
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:   # connection refused: not up yet
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=30)
