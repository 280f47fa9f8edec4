"""Where the fast prefill plan's answers part from the float32 file's: the weights' held form, or
the bfloat16 matmuls, and which matmuls.

``benchmarks.quantized`` compares the quantized engine against the same GGUF file dequantized to
float32, but its quantized engine differs in two ways at once: the weights it holds (4-bit scales
rounded to bfloat16, 5-8-bit blocks held as 8 bits a row: in the prefill *and* in its float32
decoding) and, on the fast plan, the bfloat16 matmuls. This separates them. For every prompt, the
float32 engine's full prefill and its 12 greedy tokens are the reference (its reversed-chunk
prefill the order noise), against:

* ``held form``: the quantized engine, float32 plan (what the weights' form alone changes);
* ``fast plan``: the quantized engine, ``RAGBLEND_QUANTIZED_PREFILL=bfloat16`` (form + bfloat16);
* ``fast plan, down_proj float32``: the same with the MLP's down projection kept in float32;
* ``the same, passes of <= 16 rows in float32``: and no pass on the low-bit kernels, those of up
  to 16 rows (decoding steps, the last row's LM head) in float32 (as the two variants below run them);
* ``bfloat16 matmuls``: the float32 engine with every prefill matmul of more than 16 rows in
  bfloat16 on the file's own weights (the fast plan's arithmetic without the held form);
* ``bfloat16 matmuls, down_proj float32``: the same with the down projection in float32.

Every engine decodes in float32, a full prefill each (no fusion: the fused prefill runs the same
matmuls on fewer rows). Reported per variant: first-token KL as a share of the order noise and the
prompts whose greedy answers are identical (the issue's rule: < 5% and >= 95%).

    python -m benchmarks.prefill_error --model smollm2 --sets squad:16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.model.linear import CpuLinear
from ragblend.core.model.quantized import QuantLinear

from .common import MUSIQUE, RUNS_DIR, SYSTEM, command_line, prompt_sets, write_report
from .models import MODELS, model_path

LONG_ROWS = 16   # passes of more rows than this count as the prefill's (decoding passes have at most 8)


@contextmanager
def bfloat16_matmuls(engine: BlendEngine, float32_parts: tuple[str, ...] = ()):
    """Within it, ``engine``'s float32 layers multiply passes of more than LONG_ROWS rows in
    bfloat16 (inputs and weights rounded, sums in float32), except the layers named with any of
    ``float32_parts``."""
    layers = [(name, m) for name, m in engine.adapter.hf_model.named_modules() if isinstance(m, CpuLinear)]
    for name, layer in layers:
        if not any(part in name for part in float32_parts):
            layer.rows = _bfloat16_rows(layer)
    try:
        yield
    finally:
        for _, layer in layers:
            layer.__dict__.pop("rows", None)


def _bfloat16_rows(layer: CpuLinear):
    exact = CpuLinear.rows.__get__(layer)

    def rows(flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] <= LONG_ROWS:
            return exact(flat)
        out = F.linear(flat.bfloat16(), layer.weight.bfloat16()).float()
        return out if layer.bias is None else out + layer.bias
    return rows


def quantized_engine(path: str, plan: str, float32_parts: tuple[str, ...] = ()) -> BlendEngine:
    """The quantized engine on ``plan`` ("float32" or "bfloat16"), the layers named with any of
    ``float32_parts`` multiplying in float32 on its prefill twin."""
    saved = os.environ.get("RAGBLEND_QUANTIZED_PREFILL")
    os.environ["RAGBLEND_QUANTIZED_PREFILL"] = plan
    try:
        engine = BlendEngine.from_pretrained(path, dtype="quantized", kv_dir=False, decode_dtype="float32",
                                             prefix_cache_bytes=0)
    finally:
        os.environ.pop("RAGBLEND_QUANTIZED_PREFILL")
        if saved is not None:
            os.environ["RAGBLEND_QUANTIZED_PREFILL"] = saved
    for name, module in engine.adapter.hf_model.named_modules():
        if isinstance(module, QuantLinear) and any(part in name for part in float32_parts):
            module.long_pass_dtype = torch.float32
    return engine


def float32_short_passes(engine: BlendEngine) -> BlendEngine:
    """``engine`` with its quantized prefill twin's passes of up to LONG_ROWS rows (decoding steps, the
    last row's LM head) dequantized and multiplied in float32, and its longer ones (a question's
    tokens too) all dequantized to its long-pass dtype, none on the low-bit kernels: as the
    ``bfloat16 matmuls`` variants run them, so what the fast plan's weights alone change."""
    for module in engine.adapter.hf_model.modules():
        if isinstance(module, QuantLinear):
            module.rows = _float32_below(module)
    return engine


def _float32_below(layer: QuantLinear):
    own = QuantLinear.rows.__get__(layer)

    def rows(flat: torch.Tensor) -> torch.Tensor:
        saved = layer.kernel_rows, layer.long_pass_dtype
        layer.kernel_rows = 0   # longer passes in its dtype, never on the kernel; short ones in float32
        if flat.shape[0] <= LONG_ROWS:
            layer.long_pass_dtype = torch.float32
        try:
            return own(flat)
        finally:
            layer.kernel_rows, layer.long_pass_dtype = saved
    return rows


def answer(engine: BlendEngine, prompt, tokens: int, reverse: bool = False):
    chunks = prompt.chunks[::-1] if reverse else prompt.chunks
    segments = [Chunk(c) for c in chunks] + [prompt.question]
    if not tokens:
        return engine.prefill(segments, system=SYSTEM, strategy=FullRecompute()).logits, []
    out = engine.generate(segments, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=tokens)
    return out.logits, out.token_ids


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["squad:16"])
    parser.add_argument("--chunk-chars", type=int, default=400, help="cut each chunk to this many characters")
    parser.add_argument("--greedy-tokens", type=int, default=12)
    parser.add_argument("--out", default=RUNS_DIR, help="folder of the report (prefill-error.md)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    sets = prompt_sets(args.sets, MUSIQUE)
    for prompts in sets.values():
        for prompt in prompts:
            prompt.chunks = [chunk[:args.chunk_chars] for chunk in prompt.chunks]
    path, tokens = model_path(args.model), args.greedy_tokens
    # No prefix tier: the bfloat16 variants run on this engine after its float32 reference, and an
    # exact repeat would be served the reference's K/V and logits (before 2026-12-06 12:20 UTC they were).
    exact = BlendEngine.from_pretrained(path, dtype=torch.float32, kv_dir=False, decode_dtype="float32",
                                        prefix_cache_bytes=0)
    held, fast = quantized_engine(path, "float32"), quantized_engine(path, "bfloat16")
    fast_down = quantized_engine(path, "bfloat16", ("down_proj",))
    fast_long = float32_short_passes(quantized_engine(path, "bfloat16", ("down_proj",)))

    def on_exact(parts):
        def run(prompt):
            with bfloat16_matmuls(exact, parts):
                return answer(exact, prompt, tokens)
        return run

    variants = {"held form": lambda p: answer(held, p, tokens), "fast plan": lambda p: answer(fast, p, tokens),
                "fast plan, down_proj float32": lambda p: answer(fast_down, p, tokens),
                f"the same, passes of <= {LONG_ROWS} rows in float32": lambda p: answer(fast_long, p, tokens),
                "bfloat16 matmuls": on_exact(()), "bfloat16 matmuls, down_proj float32": on_exact(("down_proj",))}
    results, noises, report = {v: [] for v in variants}, [], []
    for set_name, prompts in sets.items():
        for prompt in prompts:
            ref, ref_ids = answer(exact, prompt, tokens)
            noises.append(first_token_kl(ref, answer(exact, prompt, 0, reverse=True)[0]))
            line = f"{set_name} {len(noises):3d}: noise {noises[-1]:.4f}"
            for name, run in variants.items():
                logits, ids = run(prompt)
                results[name].append((first_token_kl(ref, logits), ids == ref_ids))
                line += f" | {name}: KL {results[name][-1][0]:.5f} {'same' if ids == ref_ids else 'DIFFERS'}"
            print(line, flush=True)
            report.append(f"    {line}")
    noise = statistics.mean(noises)
    report += ["", f"| {args.model} ({len(noises)} prompts, {tokens} greedy tokens) | KL / order noise | "
               "answers identical |", "|---|---:|---:|"]
    for name, rows in results.items():
        kl = statistics.mean(k for k, _ in rows)
        report.append(f"| {name} | {kl / noise:.2%} | {sum(s for _, s in rows)}/{len(rows)} |")
    print("\n".join(report[-len(results) - 2:]), flush=True)
    write_report(args.out, "prefill-error.md", "Where the fast prefill plan's answers part",
                 command_line("benchmarks.prefill_error", argv), time.perf_counter() - started, report)


if __name__ == "__main__":
    main()
