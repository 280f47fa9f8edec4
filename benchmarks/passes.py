"""Every pass over the layers, timed on two source trees alternated: a change to the layer loop
(``ragblend/core/model/layer_step.py``) against the tree before it.

Each round starts one process per tree (ABBA order across rounds, so drift hits both alike),
with ``PYTHONPATH`` on that tree; the process loads the embedded default model (SmolLM2-135M,
the 6 sample chunks of ~500 tokens + the question: ~3k tokens) and times, median of
``--reps`` each after one warm-up:

* ``precompute``: the 6 chunks' entries computed in one packed pass (tokens/s);
* ``full``: a full prefill's TTFT (``FullRecompute``), ``fused``: CacheBlend(0.15)'s and
  ``fused_qa``: QueryAware(0.15)'s (its question pass, then the second pass), chunks in memory;
* ``decode``: one-token decoding steps on the decoding adapter (tokens/s), ``verify``: passes
  over 4 tokens (how drafts are verified), ``batch4``: batched steps of 4 decoders (tokens/s).

    python -m benchmarks.passes --base /work/wt-base --new . --rounds 4

prints each figure per tree (median over rounds) and new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def timed(run, reps: int) -> float:
    run()   # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(reps: int) -> dict:
    import torch

    from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, QueryAware
    from ragblend.core.decode.batching import batch_extend
    from ragblend.core.decode.generate import KVDecoder
    from ragblend.data import load_sample

    engine = BlendEngine.from_pretrained(kv_dir=False, prefix_cache_bytes=0)
    sample = load_sample()
    chunks, question = sample["chunks"], sample["question"]
    ids = [engine.tokenize(c) for c in chunks]
    engine.precompute(chunks)
    segments = [Chunk(c) for c in chunks] + [question]
    out = {"prompt_tokens": len(engine.prefill(segments, strategy=FullRecompute()).token_ids)}
    out["precompute"] = sum(map(len, ids)) / timed(lambda: engine.ingestion.compute_entries(ids), reps)
    for name, strategy in (("full", FullRecompute()), ("fused", CacheBlend(0.15)), ("fused_qa", QueryAware(0.15))):
        out[name] = timed(lambda s=strategy: engine.prefill(segments, strategy=s), reps)
    pre = engine.prefill(segments, strategy=FullRecompute())
    adapter, steps, n = engine.decoding_adapter(), 8, len(pre.token_ids)
    kv_dtype = engine.answers.kv_dtype

    def decoder():
        return KVDecoder(adapter, pre.keys, pre.values, n + 4 * steps + 8, dtype=kv_dtype)

    tokens = [int(t) for t in torch.randint(100, 10000, (4 * steps,), generator=torch.Generator().manual_seed(0))]

    def decode():
        d = decoder()
        for t in tokens[:steps]:
            d.step(t)

    def verify():
        d = decoder()
        for i in range(steps // 4):
            d.extend(tokens[4 * i:4 * i + 4])

    def batch4():
        ds = [decoder() for _ in range(4)]
        for i in range(steps):
            batch_extend(ds, tokens[4 * i:4 * i + 4])

    out["decode"] = steps / timed(decode, reps)
    out["verify"] = steps // 4 / timed(verify, reps)
    out["batch4"] = 4 * steps / timed(batch4, reps)
    return out


def drive(args) -> None:
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    results = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            # Run from the tree's root as `-c`: its ragblend first on sys.path (not benchmarks/, whose
            # kernels.py would shadow the `kernels` package transformers imports).
            code = (f"import runpy, sys; sys.argv = ['passes', '--measure', '--reps', '{args.reps}']; "
                    f"runpy.run_path({os.path.abspath(__file__)!r}, run_name='__main__')")
            proc = subprocess.run([sys.executable, "-c", code], cwd=trees[name], env=env, capture_output=True,
                                  text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(row)
            print(f"round {r} {name}: {json.dumps({k: round(v, 4) for k, v in row.items()})}", flush=True)
    units = {"precompute": "tok/s", "full": "s", "fused": "s", "fused_qa": "s", "decode": "tok/s",
             "verify": "passes/s", "batch4": "tok/s"}
    print("\n| figure | base | new | new/base |\n|---|---|---|---|")
    for key, unit in units.items():
        base, new = (statistics.median(row[key] for row in results[name]) for name in ("base", "new"))
        print(f"| {key} ({unit}) | {base:.4g} | {new:.4g} | {new / base:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="time this process's ragblend, print JSON")
    parser.add_argument("--base", default=".")
    parser.add_argument("--new", default=".")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.reps)))
    else:
        drive(args)


if __name__ == "__main__":
    main()
