"""TTFT benchmark on the embedded default model (CPU).

A prompt of 6 chunks of ~500 tokens (ragblend/data/lowenmark.json) plus a question. Every
strategy runs interleaved with the model's own forward pass (sdpa attention, same token ids)
in one process, so machine noise hits all of them alike; each figure is the median of
``--runs`` rounds. Also reported: the fraction of tokens recomputed, the first-token KL to
a full prefill, whether 32 greedy tokens match full prefill's, and, as the yardstick for
fidelity, the same two numbers for a full prefill of the chunks in reversed order.

    python -m benchmarks.ttft            # prints a markdown table
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse, LegoLink
from ragblend.data import load_sample

STRATEGIES = {
    "FullRecompute": FullRecompute(),
    "CacheBlend(0.15)": CacheBlend(0.15),
    "CacheBlend(0.05)": CacheBlend(0.05),
    "CacheBlend(0.30)": CacheBlend(0.30),
    "LegoLink(16)": LegoLink(16),
    "FullReuse": FullReuse(),
}


def first_token_kl(ref: torch.Tensor, logits: torch.Tensor) -> float:
    return torch.nn.functional.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(ref, -1),
                                      log_target=True, reduction="sum").item()


def cold_start_load_s() -> tuple[float, float]:
    """A fresh process: seconds to import ragblend (torch, transformers), then to load the
    already-converted default model with ``BlendEngine.from_pretrained()``."""
    code = ("import time; t=time.perf_counter(); from ragblend import BlendEngine; i=time.perf_counter()-t; "
            "t=time.perf_counter(); BlendEngine.from_pretrained(); print(i, time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import_s, load_s = out.stdout.strip().splitlines()[-1].split()
    return float(import_s), float(load_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds; the median is reported")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    engine = BlendEngine.from_pretrained()
    import_s, load_s = cold_start_load_s()
    sample = load_sample()
    chunks, question = sample["chunks"], sample["question"]
    t0 = time.perf_counter()
    engine.precompute(chunks)
    precompute_s = time.perf_counter() - t0
    segments = [Chunk(c) for c in chunks] + [question]
    reversed_segments = [Chunk(c) for c in reversed(chunks)] + [question]
    token_ids = engine.prefill(segments, strategy=FullRecompute()).token_ids
    ids = torch.tensor([token_ids])

    def hf_forward():
        t = time.perf_counter()
        with torch.inference_mode():
            engine.hf_model(ids, logits_to_keep=1)
        return time.perf_counter() - t

    times = {name: [] for name in ["HF forward (sdpa)", *STRATEGIES]}
    for _ in range(args.runs):
        times["HF forward (sdpa)"].append(hf_forward())
        for name, strategy in STRATEGIES.items():
            times[name].append(engine.prefill(segments, strategy=strategy).stats.ttft_s)

    greedy = dict(max_new_tokens=args.greedy_tokens, temperature=0.0)
    ref_pre = engine.prefill(segments, strategy=FullRecompute())
    ref_out = engine.generate(segments, strategy=FullRecompute(), **greedy)
    base = statistics.median(times["HF forward (sdpa)"])
    rows = [("HF forward (sdpa)", base, 1.0, 1.0, 0.0, True)]
    for name, strategy in STRATEGIES.items():
        pre = engine.prefill(segments, strategy=strategy)
        out = engine.generate(segments, strategy=strategy, **greedy)
        ttft = statistics.median(times[name])
        rows.append((name, ttft, base / ttft, pre.stats.recompute_fraction,
                     first_token_kl(ref_pre.logits, pre.logits), out.token_ids == ref_out.token_ids))
    rev_pre = engine.prefill(reversed_segments, strategy=FullRecompute())
    rev_out = engine.generate(reversed_segments, strategy=FullRecompute(), **greedy)

    print(f"Prompt: {len(token_ids)} tokens (6 chunks of {[len(engine.prompts.tokenize(c)) for c in chunks]} "
          f"tokens + question), {torch.get_num_threads()} threads, median of {args.runs} interleaved runs.\n")
    print("| strategy | TTFT (s) | speed-up vs HF forward | recomputed | first-token KL | 32 greedy tokens = full prefill |")
    print("|---|---:|---:|---:|---:|:---:|")
    for name, ttft, speedup, frac, kl_value, same in rows:
        print(f"| {name} | {ttft:.3f} | {speedup:.2f}x | {frac:.1%} | {kl_value:.4f} | {'yes' if same else 'no'} |")
    print(f"\nOrder noise (full prefill, chunks reversed): first-token KL {first_token_kl(ref_pre.logits, rev_pre.logits):.4f}, "
          f"greedy tokens identical: {'yes' if rev_out.token_ids == ref_out.token_ids else 'no'}")
    print(f"Full prefill answer: {ref_out.text!r}")
    print(f"Precompute of the 6 chunks: {precompute_s:.2f} s. Default model, already converted, in a fresh "
          f"process: `import ragblend` {import_s:.2f} s, then `BlendEngine.from_pretrained()` {load_s:.2f} s")


if __name__ == "__main__":
    main()
