"""An answer computed on another thread than the one that loaded the model, with and without the
loading thread's idle OpenMP workers (ragblend.core.model.omp): TTFT and decoding tokens/s.

Servers answer on a worker thread, the KV filler computes on its own, Streamlit runs each script
on a new thread. libgomp stops spinning between kernels once a process holds more OpenMP workers
than cores, so idle workers of another thread slow every kernel. Rows, in interleaved rounds:

* main thread: the answer on the thread that loaded the model;
* another thread: the same on a new thread, as ragblend ships (each call hands its thread's
  workers back when it ends, so the loading thread holds none);
* another thread, loader's workers kept: the same after the loading thread ran one more kernel of
  its own (its team idle, as any call outside ragblend leaves it): what every thread but the
  loader's paid before core.model.omp.

    python -m research.threads --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from benchmarks.common import RUNS_DIR, command_line, write_report
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, Chunk
from ragblend.data import load_sample


def answer(engine: BlendEngine, segments: list, tokens: int) -> tuple[float, float]:
    """(TTFT s, decoding tokens/s) of one greedy answer."""
    t = time.perf_counter()
    out = engine.generate(segments, max_new_tokens=tokens)
    total = time.perf_counter() - t
    return out.stats.ttft_s, (out.stats.generated_tokens - 1) / (total - out.stats.ttft_s)


def on_new_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    thread.join()
    return result["value"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=False)
    sample = load_sample()
    engine.precompute(sample["chunks"])
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    run = lambda: answer(engine, segments, args.tokens)  # noqa: E731
    run()
    rows = {"main thread": [], "another thread": [], "another thread, loader's workers kept": []}
    for _ in range(args.rounds):
        rows["main thread"].append(run())
        rows["another thread"].append(on_new_thread(run))
        torch.randn(1 << 22).mul_(2.0)   # a kernel of the loading thread's own, outside ragblend
        rows["another thread, loader's workers kept"].append(on_new_thread(run))
    base_ttft = statistics.median(r[0] for r in rows["main thread"])
    base_rate = statistics.median(r[1] for r in rows["main thread"])
    lines = [f"{args.model}, sample prompt ({len(engine.prompts.build(segments).token_ids)} tokens), "
             f"{args.tokens}-token greedy answers, {torch.get_num_threads()} threads, medians of {args.rounds} "
             "interleaved rounds:", "",
             "| where the answer runs | TTFT s (vs main) | decoding tok/s (vs main) |", "|---|---:|---:|"]
    for name, values in rows.items():
        ttft, rate = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        lines.append(f"| {name} | {ttft:.3f} ({ttft / base_ttft:.2f}x) | {rate:.1f} ({rate / base_rate:.2f}x) |")
    print("\n".join(lines), flush=True)
    write_report(args.out, "threads-run.md", "Threads", command_line("research.threads", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
