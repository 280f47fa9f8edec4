"""TTFT of the default strategy and of a full prefill on the sample prompt (SmolLM2), median of 5,
for whichever ragblend tree is first on ``PYTHONPATH``: run it alternately on two trees to check
that a change (a refactor) left TTFT where it was.

    git archive 05106e6 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    for i in 1 2; do
      PYTHONPATH=/tmp/before python -m benchmarks.compare_trees before
      PYTHONPATH=. python -m benchmarks.compare_trees after
    done
"""

from __future__ import annotations

import statistics
import sys
import time

import ragblend
from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.data import load_sample


def main(label: str = "this tree") -> None:
    engine = BlendEngine.from_pretrained(None, kv_dir=False)
    sample = load_sample()
    engine.precompute(sample["chunks"])
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]

    def ttft(strategy=None) -> float:
        t = time.perf_counter()
        engine.prefill(segments, strategy=strategy)
        return time.perf_counter() - t

    ttft(), ttft(FullRecompute())
    fused, full = [], []
    for _ in range(5):
        fused.append(ttft())
        full.append(ttft(FullRecompute()))
    print(f"{label}: default {statistics.median(fused) * 1e3:.0f} ms, full prefill {statistics.median(full) * 1e3:.0f} ms, "
          f"speed-up {statistics.median(full) / statistics.median(fused):.2f}x ({ragblend.__file__})", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
