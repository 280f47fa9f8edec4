"""TTFT benchmark on the embedded default model (CPU).

A prompt of 6 chunks of ~500 tokens (ragblend/data/lowenmark/*.md) plus a question. Every
strategy runs interleaved with the model's own forward pass (sdpa attention, same token ids)
in one process, so machine noise hits all of them alike; each figure is the median of
``--runs`` rounds. Also reported: the fraction of tokens recomputed, the first-token KL to
a full prefill, whether 32 greedy tokens match full prefill's, and, as the yardstick for
fidelity, the same two numbers for a full prefill of the chunks in reversed order.

The storage section runs CacheBlend(0.15) on the same prompt with the chunks' KV (fp16) in
the memory tier, on disk with the pipelined loader, and on disk loaded layer by layer before
each layer's compute (no overlap). Before every disk run the entry files' pages are dropped
from the OS cache, so reads come from the device.

    python -m benchmarks.ttft                     # both sections, markdown tables
    python -m benchmarks.ttft --section storage
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse, LegoLink, QueryAware
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.controller import drop_page_cache
from ragblend.core.store.tiers import DiskStore, MemoryStore
from ragblend.data import load_sample

from .models import MODELS, model_path

STRATEGIES = {
    "FullRecompute": FullRecompute(),
    "QueryAware(0.05)": QueryAware(0.05),
    "QueryAware(0.10)": QueryAware(0.10),
    "QueryAware(0.15)": QueryAware(0.15),
    "QueryAware(0.20)": QueryAware(0.20),
    "QueryAware(0.30) (uncalibrated default)": QueryAware(0.30),
    "QueryAware(0.20, sentence runs)": QueryAware(0.20, sentence_runs=True),
    "CacheBlend(0.15)": CacheBlend(0.15),
    "CacheBlend(0.15, K deviation)": CacheBlend(0.15, deviation="key"),
    "CacheBlend(0.05)": CacheBlend(0.05),
    "CacheBlend(0.30)": CacheBlend(0.30),
    "LegoLink(16)": LegoLink(16),
    "FullReuse": FullReuse(),
}


def cold_start_load_s() -> tuple[float, float]:
    """A fresh process: seconds to import ragblend (torch, transformers), then to load the
    already-converted default model with ``BlendEngine.from_pretrained()``."""
    code = ("import time; t=time.perf_counter(); from ragblend import BlendEngine; i=time.perf_counter()-t; "
            "t=time.perf_counter(); BlendEngine.from_pretrained(); print(i, time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import_s, load_s = out.stdout.strip().splitlines()[-1].split()
    return float(import_s), float(load_s)


def strategy_section(engine: BlendEngine, chunks: list[str], question: str, args) -> None:
    import_s, load_s = cold_start_load_s() if args.model == "smollm2" else (float("nan"), float("nan"))
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

    strategies = {name: STRATEGIES[name] for name in args.strategies}
    if any(getattr(s, "sentence_runs", False) for s in strategies.values()):
        engine.prompts.sentence_end_ids   # made before timing, as an engine built with such a strategy makes it
    times = {name: [] for name in ["HF forward (sdpa)", *strategies]}
    for _ in range(args.runs):
        times["HF forward (sdpa)"].append(hf_forward())
        for name, strategy in strategies.items():
            times[name].append(engine.prefill(segments, strategy=strategy).stats.ttft_s)

    greedy = dict(max_new_tokens=args.greedy_tokens, temperature=0.0)
    ref_pre = engine.prefill(segments, strategy=FullRecompute())
    ref_out = engine.generate(segments, strategy=FullRecompute(), **greedy)
    base = statistics.median(times["HF forward (sdpa)"])
    rows = [("HF forward (sdpa)", base, 1.0, 1.0, 0.0, True)]
    for name, strategy in strategies.items():
        pre = engine.prefill(segments, strategy=strategy)
        out = engine.generate(segments, strategy=strategy, **greedy)
        ttft = statistics.median(times[name])
        rows.append((name, ttft, base / ttft, pre.stats.recompute_fraction,
                     first_token_kl(ref_pre.logits, pre.logits), out.token_ids == ref_out.token_ids))
    rev_pre = engine.prefill(reversed_segments, strategy=FullRecompute())
    rev_out = engine.generate(reversed_segments, strategy=FullRecompute(), **greedy)

    print(f"Prompt: {len(token_ids)} tokens (6 chunks of {[len(engine.prompts.tokenize(c)) for c in chunks]} "
          f"tokens + question), {torch.get_num_threads()} threads, KV stored as {str(engine.kv_dtype)[6:]}, "
          f"median of {args.runs} interleaved runs.\n")
    print("| strategy | TTFT (s) | speed-up vs HF forward | recomputed | first-token KL | 32 greedy tokens = full prefill |")
    print("|---|---:|---:|---:|---:|:---:|")
    for name, ttft, speedup, frac, kl_value, same in rows:
        print(f"| {name} | {ttft:.3f} | {speedup:.2f}x | {frac:.1%} | {kl_value:.4f} | {'yes' if same else 'no'} |")
    print(f"\nOrder noise (full prefill, chunks reversed): first-token KL {first_token_kl(ref_pre.logits, rev_pre.logits):.4f}, "
          f"greedy tokens identical: {'yes' if rev_out.token_ids == ref_out.token_ids else 'no'}")
    print(f"Full prefill answer: {ref_out.text!r}")
    print(f"Precompute of the 6 chunks: {precompute_s:.2f} s. Default model, already converted, in a fresh "
          f"process: `import ragblend` {import_s:.2f} s, then `BlendEngine.from_pretrained()` {load_s:.2f} s\n")


def storage_section(engine: BlendEngine, chunks: list[str], question: str, args) -> None:
    segments = [Chunk(c) for c in chunks] + [question]
    strategy = CacheBlend(0.15)
    with tempfile.TemporaryDirectory(prefix="ragblend-bench-kv-") as tmp:
        disk = DiskStore(tmp, engine.entry_spec)
        memory = MemoryStore()
        engine.store = memory
        refs = engine.precompute(chunks)
        for ref in refs:
            disk.put(memory.get(ref.key))
        files = list(Path(tmp).rglob("*.val"))
        stored_bytes = sum(f.stat().st_size for f in files)
        stored_tokens = sum(r.num_tokens for r in refs)

        def run(store, prefetch, cold):
            engine.store, engine.prefetch = store, prefetch
            if cold:
                for f in files:
                    drop_page_cache(f)
            return engine.prefill(segments, strategy=strategy)

        configs = {"KV in memory": (memory, True, False),
                   "KV on disk, pipelined": (disk, True, True),
                   "KV on disk, sequential (load, then compute)": (disk, False, True)}
        results = {name: [] for name in configs}
        for _ in range(args.runs):
            for name, config in configs.items():
                results[name].append(run(*config).stats)
        engine.store, engine.prefetch = memory, True

        base = statistics.median(s.ttft_s for s in results["KV in memory"])
        print(f"CacheBlend(0.15), {results['KV in memory'][0].prompt_tokens} "
              f"prompt tokens, median of {args.runs} interleaved runs; disk runs start with the entry files "
              "dropped from the page cache.\n")
        print("| KV location | TTFT (s) | vs memory | KV load (s) | load hidden behind compute | compute (s) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, stats in results.items():
            ttft = statistics.median(s.ttft_s for s in stats)
            load = statistics.median(s.load_s for s in stats)
            hidden = statistics.median(s.load_hidden_fraction for s in stats)
            compute = statistics.median(s.compute_s for s in stats)
            print(f"| {name} | {ttft:.3f} | {ttft / base:.2f}x | {load:.3f} | {hidden:.0%} | {compute:.3f} |")

        controller = engine.loading
        measured = controller.measurements(refresh=True)
        reused = stored_tokens
        plan = controller.plan(len(engine.prefill(segments).token_ids), reused)
        plan_disk = controller.plan(len(engine.prefill(segments).token_ids), reused, tier="disk")
        print(f"\nStored: {stored_bytes / stored_tokens:.0f} bytes per token on disk "
              f"({measured.bytes_per_token_layer} bytes per token and layer, {str(engine.kv_dtype)[6:]}, "
              f"{engine.adapter.shape.num_layers} layers, plus a header).")
        print(f"Controller measurements: prefill {measured.compute_s_per_token_layer * 1e6:.1f} us per token and layer; "
              f"read throughput memory {measured.read_bytes_per_s['memory'] / 1e9:.2f} GB/s, "
              f"disk {measured.read_bytes_per_s['disk'] / 1e9:.2f} GB/s.")
        print(f"Controller plan for this prompt: tier '{plan.tier}' (cheapest without delay), ratio {plan.ratio} "
              f"(with KV on disk: {plan_disk.ratio}); per layer: recompute {plan.recompute_s_per_layer * 1e3:.1f} ms, "
              f"load from disk {plan.load_s_per_layer['disk'] * 1e3:.2f} ms, "
              f"from memory {plan.load_s_per_layer['memory'] * 1e3:.2f} ms.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds; the median is reported")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--section", choices=["all", "strategies", "storage"], default="all")
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES, metavar="NAME",
                        help="strategies by their table name (default: all)")
    args = parser.parse_args(argv)

    engine = BlendEngine.from_pretrained(model_path(args.model), kv_dir=False)
    sample = load_sample()
    if args.section in ("all", "strategies"):
        strategy_section(engine, sample["chunks"], sample["question"], args)
    if args.section in ("all", "storage"):
        storage_section(engine, sample["chunks"], sample["question"], args)


if __name__ == "__main__":
    main()
