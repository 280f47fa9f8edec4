"""TTFT of the default strategy and of a full prefill on the sample prompt (SmolLM2), median of 5,
for whichever ragblend tree is first on ``PYTHONPATH``: run it alternately on two trees to check
that a change (a refactor) left TTFT where it was. ``decode`` as a second argument measures
decoding instead: one decoding pass after the sample prompt's fused prefill at 1 and 4 rows
(median of 20), and a 256-token greedy answer's tokens/s (end tokens suppressed).

    git archive 05106e6 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    for i in 1 2; do
      (cd /tmp/before && PYTHONPATH=. python "$OLDPWD/research/compare_trees.py" before)
      PYTHONPATH=. python research/compare_trees.py after
    done

(Run each tree from its own folder: an installed ragblend would otherwise shadow the other tree.)
"""

from __future__ import annotations

import statistics
import sys
import time

import ragblend
from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.data import load_sample


def main(label: str = "this tree", what: str = "ttft") -> None:
    engine = BlendEngine.from_pretrained(None, kv_dir=False)
    sample = load_sample()
    engine.precompute(sample["chunks"])
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    if what == "decode":
        return decoding(engine, segments, label)

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


def decoding(engine: BlendEngine, segments, label: str) -> None:
    from ragblend.core.decode.generate import KVDecoder

    pre = engine.prefill(segments)
    decoder = KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + 8, pre.key_bias,
                        dtype=engine.answers.kv_dtype)
    start, tokens, passes = decoder.length, pre.token_ids[-4:], {1: [], 4: []}
    for _ in range(20):
        for rows, seconds in passes.items():
            t = time.perf_counter()
            decoder.extend(tokens[:rows])
            seconds.append(time.perf_counter() - t)
            decoder.truncate(start)
    engine.answers.eos_ids = frozenset()   # exactly 256 tokens
    engine.generate(segments, max_new_tokens=256)
    rate = 255 / engine.last_stats.decode_s
    print(f"{label}: decoding pass {statistics.median(passes[1]) * 1e3:.1f} ms (1 row), "
          f"{statistics.median(passes[4]) * 1e3:.1f} ms (4 rows); 256-token answer {rate:.1f} tokens/s "
          f"({ragblend.__file__})", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
