"""Linear-layer kernels on this CPU: ``F.linear`` against ragblend's ``CpuLinear``.

For every linear layer of a benchmark model (projections, MLP, LM head), run in order as a
forward pass does, the time of ``F.linear`` (what transformers calls; MKL's sgemm on x86)
and of :class:`~ragblend.core.model.linear.CpuLinear` with the kernel plan the engine runs on this
host (``engine.kernel_plan``: measured on the first engine, then cached; ``ragblend info``
shows it) at several row counts: 1-4 rows as a decoding pass has, ~140 as a chunk, ~660 as a
fused prefill's selected tokens, ~3k as a full prefill. The fastest of ``--runs`` interleaved
rounds; the kernel the plan picks, GFLOPS and GB/s of weights read, and the largest
difference between the two outputs (0 where the plan keeps ``F.linear``).

``--batch-rows``: instead, the linear layers of one decoding pass on the weights decoding runs on
(the engine's default ``decode_dtype``: 4-bit on SmolLM2) at 1-8 rows, as a batched step over
that many sequences runs them: ms, ratio to one row, GFLOPS. A step over 8 sequences can give
8x the tokens/s of one only if its cost stays near one row's; where it grows with the rows, the
pass is bound by arithmetic, not by reading the weights.

    python -m benchmarks.kernels --models smollm2 qwen2.5-0.5b
    python -m benchmarks.kernels --models smollm2 --batch-rows
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ragblend import BlendEngine
from ragblend.core.model.decode_weights import FusedRows
from ragblend.core.model.kernels import fastest_rounds
from ragblend.core.model.linear import CpuLinear

from .common import RUNS_DIR, report_per_model
from .models import MODELS, model_path

ROWS = (1, 2, 3, 4, 140, 660, 3116)


def measure(model: str, runs: int) -> list[str]:
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
    return [f"## {model}", "", *compare_kernels(engine, runs)]


def compare_kernels(engine: BlendEngine, runs: int, rows_to_time=ROWS) -> list[str]:
    """Table lines: ``F.linear`` against ``CpuLinear`` with ``engine``'s kernel plan, over the
    model's linear layers, at each of ``rows_to_time``."""
    layers = [m for m in engine.hf_model.modules() if type(m) is torch.nn.Linear]
    plan = engine.kernel_plan   # what the engine's passes run on this host
    fast = [CpuLinear(m, plan) for m in layers]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    lines = [f"{len(layers)} linear layers, {weight_bytes / 1e6:.0f} MB of float32 weights; "
             f"CpuLinear runs the engine's kernel plan ({plan.source}); fastest of {runs} interleaved rounds:", "",
             "| rows | F.linear ms | GFLOPS | GB/s | CpuLinear kernel | ms | GFLOPS | GB/s | speed-up | max abs diff |",
             "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|"]
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in rows_to_time:
            inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
            flops = sum(2 * rows * m.in_features * m.out_features for m in layers)
            seconds = fastest_rounds({
                "plain": lambda: [F.linear(inputs[m.in_features], m.weight, m.bias) for m in layers],
                "ours": lambda: [f(inputs[m.in_features]) for m, f in zip(layers, fast)]}, rounds=runs)
            plain, ours = seconds["plain"], seconds["ours"]
            diff = max((f(inputs[m.in_features]) - F.linear(inputs[m.in_features], m.weight, m.bias)).abs().max().item()
                       for m, f in zip(layers, fast))
            lines.append(f"| {rows:,} | {plain * 1e3:.1f} | {flops / plain / 1e9:.0f} | {weight_bytes / plain / 1e9:.0f} | "
                         f"{plan.kernel_for(rows)} | {ours * 1e3:.1f} | {flops / ours / 1e9:.0f} | {weight_bytes / ours / 1e9:.0f} | "
                         f"{plain / ours:.2f}x | {diff:.1e} |")
            print(lines[-1], flush=True)
    return [*lines, ""]


def batch_rows(model: str, runs: int) -> list[str]:
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)

    def width_and_size(matmul) -> tuple[int, int]:
        weights = matmul.weights if isinstance(matmul, FusedRows) else [matmul.weight]
        return weights[0].shape[1], sum(w.numel() for w in weights)

    # What a decoding pass runs: each fused group as one matmul, every other linear layer alone.
    calls = [(m, *width_and_size(m)) for m in engine.decode_weights.decoding_matmuls()]
    fused = [m for m, _, _ in calls if isinstance(m, FusedRows)]
    kinds = ", ".join(f"{n} {kind}" for kind, n in engine.decode_weights.layer_counts().items())
    lines = [f"## {model}", "", f"One decoding pass's linear layers ({kinds}) in {len(calls)} matmuls "
             f"({len(fused)} of them fused), {torch.get_num_threads()} threads, best of {runs}:", "",
             "| rows (sequences) | ms | vs 1 row | ms per row | GFLOPS |", "|---:|---:|---:|---:|---:|"]
    torch.manual_seed(0)
    one = None
    with torch.inference_mode():
        for rows in (1, 2, 4, 8):
            inputs = {n: torch.randn(rows, n) for n in {width for _, width, _ in calls}}
            flops = sum(2 * rows * weights for _, _, weights in calls)
            seconds = fastest_rounds({"step": lambda: [m(inputs[width]) for m, width, _ in calls]}, rounds=runs)["step"]
            one = one or seconds
            lines.append(f"| {rows} | {seconds * 1e3:.1f} | {seconds / one:.2f}x | {seconds / rows * 1e3:.1f} | "
                         f"{flops / seconds / 1e9:.0f} |")
            print(lines[-1], flush=True)
    return [*lines, ""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch-rows", action="store_true",
                        help="time one decoding pass's layers at 1-8 rows (a batched step) instead")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    if args.batch_rows:
        report_per_model(args.models, lambda model: batch_rows(model, args.runs), args.out, "kernels-batch-run.md",
                         "Decoding pass at 1-8 rows", "benchmarks.kernels", argv)
        return
    report_per_model(args.models, lambda model: measure(model, args.runs), args.out, "kernels-run.md",
                     "Linear-layer kernels", "benchmarks.kernels", argv)


if __name__ == "__main__":
    main()
