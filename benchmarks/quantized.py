"""The prefill on a GGUF file's quantized weights against the same file dequantized to float32.

For every prompt: the float32 engine's full prefill (the reference) and its full prefill of the
chunks in reversed order (the model's order noise), then the quantized engine's full prefill and
its fused prefill (the default strategy), each against the float32 engine's same prefill: first-
token KL, and whether the greedy answers (``--greedy-tokens``) are identical, both engines
decoding in float32 (``--decode-dtype``). The quantized engine decodes on its held weights
dequantized (4-bit scales in bfloat16, 5-8-bit blocks as 8 bits a row), so its answers differ by
that form as well as by the prefill; ``benchmarks.prefill_error`` separates the two. The rule
(issue 55): mean KL under 5% of the mean order noise, identical answers on >= 95% of prompts.

    python -m benchmarks.quantized --models smollm2 --sets fidelity:6 squad:16
    python -m benchmarks.quantized --sets fidelity:4 --chunk-chars 700 --full-only --greedy-tokens 12   # ~1k tokens
    python -m benchmarks.quantized --models smollm2 --sets squad:20 --chunk-chars 400 \
        --greedy-tokens 12 --max-minutes 30     # docs/benchmarks.md (one process per model there)

``--max-minutes`` bounds each model's prompts (on a busy machine): a model stops taking new
prompts once it has run that long, and its verdict says on how many it was measured. The report
(per prompt, then the verdicts) goes to ``--out``/quantized-fidelity.md. A larger sample runs in
parts, a range of prompts each, their rows kept with ``--json`` and pooled with ``--from-json``:

    python -m benchmarks.quantized --models qwen2.5-0.5b --sets squad:0-10 --chunk-chars 400 \
        --greedy-tokens 12 --json part1.json      # then squad:10-20 ... squad:30-40
    python -m benchmarks.quantized --greedy-tokens 12 --from-json part*.json    # the 40 prompts' verdicts
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.model.quantized import describe
from ragblend.core.options import DECODE_DTYPES

from .common import MUSIQUE, RUNS_DIR, SYSTEM, command_line, prompt_sets, write_report
from .models import MODELS, model_path


def run(engine, prompt, strategy, tokens, reverse=False):
    chunks = prompt.chunks[::-1] if reverse else prompt.chunks
    segments = [Chunk(c) for c in chunks] + [prompt.question]
    if not tokens:
        pre = engine.prefill(segments, system=SYSTEM, strategy=strategy)
        return pre.logits, [], pre.stats
    out = engine.generate(segments, system=SYSTEM, strategy=strategy, max_new_tokens=tokens)
    return out.logits, out.token_ids, out.stats


def parting(what: str, ids: list[int], ref_ids: list[int], tokenizer) -> str:
    """Where two greedy answers part, and the two texts ("" where they are the same)."""
    if ids == ref_ids:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
    return (f"\n      {what} answers part at token {at}: {tokenizer.decode(ref_ids)!r} (float32) vs "
            f"{tokenizer.decode(ids)!r}")


def measure(exact, quantized, prompt, args) -> dict:
    """One prompt's row: the order noise, each prefill's first-token KL and whether its answer is the same."""
    ref, ref_ids, ref_stats = run(exact, prompt, FullRecompute(), args.greedy_tokens)
    noise, _, _ = run(exact, prompt, FullRecompute(), 0, reverse=True)
    full, full_ids, full_stats = run(quantized, prompt, FullRecompute(), args.greedy_tokens)
    if args.full_only:
        fused_ref, fused_ref_ids, fused, fused_ids = ref, ref_ids, full, full_ids
    else:
        for engine in (exact, quantized):
            engine.precompute(prompt.chunks)
        fused_ref, fused_ref_ids, _ = run(exact, prompt, None, args.greedy_tokens)
        fused, fused_ids, _ = run(quantized, prompt, None, args.greedy_tokens)
    row = {"noise": first_token_kl(ref, noise), "full_kl": first_token_kl(ref, full),
           "fused_kl": first_token_kl(fused_ref, fused), "full_same": full_ids == ref_ids,
           "fused_same": fused_ids == fused_ref_ids, "ttft_exact": ref_stats.ttft_s,
           "ttft_quantized": full_stats.ttft_s}
    row["parting"] = (parting("full", full_ids, ref_ids, exact.tokenizer)
                      + parting("fused", fused_ids, fused_ref_ids, exact.tokenizer))
    return row


def row_line(name: str, r: dict) -> str:
    """A prompt's line of the report, numbered by its place in its set (``squad:20-40`` starts at 21)."""
    return (f"{name} {r['set']} {r['number']:3d}: noise {r['noise']:.4f} full KL {r['full_kl']:.5f} "
            f"fused KL {r['fused_kl']:.5f} same {r['full_same']}/{r['fused_same']} "
            f"TTFT full {r['ttft_exact']:.2f}s -> {r['ttft_quantized']:.2f}s{r['parting']}")


def verdicts(name: str, rows: list[dict], greedy_tokens: int, full_only: bool) -> list[str]:
    """The rule's verdict on each prefill: mean KL against the mean order noise, and identical answers."""
    noise, lines = statistics.mean(r["noise"] for r in rows), []
    for what in ("full",) if full_only else ("full", "fused"):
        kl = statistics.mean(r[f"{what}_kl"] for r in rows)
        same = sum(r[f"{what}_same"] for r in rows)
        lines.append(f"{name} {what} prefill on quantized weights: mean KL {kl:.5f} = {kl / noise:.2%} of the order "
                     f"noise ({noise:.4f}); greedy answers ({greedy_tokens} tokens) identical on {same} of "
                     f"{len(rows)} prompts: {'meets' if kl < 0.05 * noise and same >= 0.95 * len(rows) else 'MISSES'} "
                     "the rule")
    return lines


def first_numbers(spec: list[str]) -> dict[str, int]:
    """Each set's first prompt number as ``prompt_sets`` reads ``spec`` (``squad:20-40``: 21)."""
    return {item.partition(":")[0]: int(item.partition(":")[2].rpartition("-")[0] or 0) + 1 for item in spec}


def measure_model(name: str, sets: dict, args, rows: list[dict], save) -> list[str]:
    """Every prompt of ``sets`` on one model, its rows appended to ``rows`` (saved after each); its forms."""
    path = model_path(name)
    # No prefix tier: the fused prompt repeats the full prefill's tokens, and would be served its K/V.
    exact = BlendEngine.from_pretrained(path, dtype=torch.float32, kv_dir=False, decode_dtype=args.decode_dtype,
                                        prefix_cache_bytes=0)
    quantized = BlendEngine.from_pretrained(path, dtype="quantized", kv_dir=False, decode_dtype=args.decode_dtype,
                                            prefix_cache_bytes=0)
    started, numbers = time.perf_counter(), first_numbers(args.sets)
    for set_name, prompts in sets.items():
        for number, prompt in enumerate(prompts, numbers[set_name]):
            if args.max_minutes and time.perf_counter() - started > 60 * args.max_minutes:
                break
            rows.append({"model": name, "set": set_name, "number": number,
                         **measure(exact, quantized, prompt, args)})
            print(row_line(name, rows[-1]), flush=True)
            save()
    return [f"{name}'s quantized weights: " + "; ".join(line.strip() for line in describe(quantized.hf_model))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["fidelity:6", "squad:16"])
    parser.add_argument("--greedy-tokens", type=int, default=16)
    parser.add_argument("--chunk-chars", type=int, default=0, help="cut each chunk to this many characters (0: whole)")
    parser.add_argument("--full-only", action="store_true", help="the full prefill only (no precompute, no fused prefill)")
    parser.add_argument("--decode-dtype", default="float32", choices=DECODE_DTYPES,
                        help="both engines' decoding (default float32: the answers differ by the prefill alone)")
    parser.add_argument("--max-minutes", type=float, default=0, help="stop a model's new prompts after this long (0: none)")
    parser.add_argument("--json", type=Path, help="also write every per-prompt row here (after every prompt)")
    parser.add_argument("--from-json", type=Path, nargs="+",
                        help="no run: the verdicts on the rows of earlier --json files pooled (e.g. squad:20 and "
                             "squad:20-40), per model; give the runs' --greedy-tokens and --full-only")
    parser.add_argument("--out", default=RUNS_DIR, help="folder of the report (quantized-fidelity.md)")
    args = parser.parse_args(argv)
    started, rows, report = time.perf_counter(), [], []

    def save():
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))

    if args.from_json:
        rows = [row for path in args.from_json for row in json.loads(path.read_text())]
    else:
        sets = prompt_sets(args.sets, MUSIQUE)
        if args.chunk_chars:
            for prompts in sets.values():
                for prompt in prompts:
                    prompt.chunks = [chunk[:args.chunk_chars] for chunk in prompt.chunks]
    for name in dict.fromkeys(row["model"] for row in rows) if args.from_json else args.models:
        forms = [] if args.from_json else measure_model(name, sets, args, rows, save)
        mine = [row for row in rows if row["model"] == name]
        report += [f"    {row_line(name, row)}" for row in mine]
        lines = verdicts(name, mine, args.greedy_tokens, args.full_only)
        print("\n".join(lines), flush=True)
        report += [part for line in lines for part in ("", line)] + ["", *forms]
        write_report(args.out, "quantized-fidelity.md", "Prefill on quantized weights against float32",
                     command_line("benchmarks.quantized", argv), time.perf_counter() - started, report)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)")
