"""How much better could CacheBlend's token selection get? Upper bounds at the paper's compute.

``research.selection`` compares selections a real run can make. This study asks what a
*perfect* choice would buy, using what only a full prefill knows. For each prompt it measures
the first-token KL to full prefill, and the compute used (``stats.compute_fraction``), of:

* the paper's selection (V deviation at layer 1, r=0.15; ragblend's default), the same at
  r=0.30, 0.50 and 0.80, and FullReuse (per prompt too: is KL monotone in the ratio?);
* gradual filtering at the default's compute: 0.4 of the reused tokens at layer 1, 0.12 from
  layer 3 on (the best of the equal-compute schedules tried on Qwen);
* **V oracle**: as many tokens as the default, chosen by their *true* V deviation (the full
  prefill's V against the cached V, summed over every layer after the check layer, each layer
  divided by its mean) instead of the deviation at layer 1;
* **whole chunks**: the same number of tokens, taken chunk by chunk in order of the chunks'
  mean V deviation at layer 1 (so a recomputed chunk is consistent with itself);
* **best single chunk (oracle)**: the one chunk whose recompute in context (the others reused
  as is, about 1/6 of the prompt) gives the lowest KL, found by trying each;
* order noise: full prefill of the chunks in reversed order.

Results go to ``docs/runs/bounds-run.md``; ``docs/notes/selection-bounds.md`` discusses them.

    python -m research.bounds --prompts 3 10     # ~30 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RUNS_DIR, SYSTEM, command_line, fidelity_prompts, squad_prompts, write_report
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.selection import TopScoreSelection, kv_deviation

DEFAULT = CacheBlend(0.15)
REAL = {  # selections a real run can make
    "FullReuse": FullReuse(),
    "V deviation, r=0.15 (paper; ragblend default)": DEFAULT,
    "V deviation, r=0.30": CacheBlend(0.30),
    "V deviation, r=0.50": CacheBlend(0.50),
    "V deviation, r=0.80": CacheBlend(0.80),
    "V deviation, gradual 0.4@1 then 0.12@3": CacheBlend(0.40, gradual=((3, 0.12),)),
}


def with_score(score, base: CacheBlend = DEFAULT) -> TopScoreSelection:
    """``base``'s selection with its check-layer score replaced by ``score(rows, deviation, chunk_sizes)``.

    ``rows`` index the candidate tokens among the prompt's reused tokens (in prompt order),
    ``deviation`` is the engine's own score for them and ``chunk_sizes`` the reused tokens of
    each chunk. The engine keeps the top scorers, exactly as with its own score.
    """
    def replaced(rows, fresh_k, fresh_v, cached):
        own = kv_deviation(base.deviation, fresh_k, fresh_v, cached, rows).float().cpu()
        sizes = [pair[1].shape[1] for pair in cached]
        return score(rows.cpu(), own, sizes).to(fresh_v.device)

    return TopScoreSelection(base.schedule(), replaced)


def whole_chunk_scores(rows: torch.Tensor, deviation: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Scores that rank whole chunks by their mean deviation, and tokens within a chunk by their own."""
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[rows]
    total = torch.zeros(len(sizes)).index_add_(0, chunk, deviation)
    mean = total / torch.bincount(chunk, minlength=len(sizes)).clamp_min(1)
    chunk_rank = torch.argsort(torch.argsort(mean)).float()  # 0 = lowest mean deviation
    return chunk_rank[chunk] + 0.5 * deviation / deviation.max().clamp_min(1e-12)


def true_v_deviation(full_values: list[torch.Tensor], cached_values: torch.Tensor,
                     positions: torch.Tensor, check_layer: int) -> torch.Tensor:
    """Per reused token: squared distance of the full prefill's V from the cached V, each layer
    after ``check_layer`` divided by its mean over the tokens, summed.

    ``full_values`` are the full prefill's per-layer V ``[kv_heads, N, head_dim]``;
    ``cached_values`` ``[layers, kv_heads, R, head_dim]`` for the reused tokens at ``positions``.
    """
    total = torch.zeros(positions.numel())
    for layer in range(check_layer, len(full_values)):
        distance = (full_values[layer][:, positions].float() - cached_values[layer].float()).pow(2).sum(dim=(0, 2))
        total += distance / distance.mean().clamp_min(1e-12)
    return total


def measure(engine: BlendEngine, prompt) -> dict[str, tuple[float, float]]:
    """(first-token KL to full prefill, compute fraction) per variant, for one prompt."""
    segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
    full = engine.prefill(segments, system=SYSTEM, strategy=FullRecompute())

    def run(strategy, segs=segments):
        out = engine.prefill(segs, system=SYSTEM, strategy=strategy)
        return first_token_kl(full.logits, out.logits), out.stats.compute_fraction

    rows = {name: run(strategy) for name, strategy in REAL.items()}

    spans = full.layout.chunk_spans
    positions = torch.cat([torch.arange(s.start, s.end) for s in spans])
    cached = torch.cat([engine.ingestion.compute_entry(list(s.token_ids)).values[:, :, s.offset:s.offset + s.end - s.start]
                        for s in spans], dim=2)
    oracle = true_v_deviation(full.values, cached, positions, DEFAULT.check_layer)
    rows["V oracle (true deviation), r=0.15"] = run(with_score(lambda rows_, deviation, sizes: oracle[rows_]))
    rows["whole chunks by mean V deviation, r=0.15"] = run(with_score(whole_chunk_scores))

    # One chunk passed as plain text is recomputed in context; the others are reused as is.
    one_fresh = [run(FullReuse(), [c if j == i else Chunk(c) for j, c in enumerate(prompt.chunks)] + [prompt.question])
                 for i in range(len(prompt.chunks))]
    rows["best single chunk recomputed (oracle)"] = min(one_fresh)

    reversed_full = [Chunk(c) for c in reversed(prompt.chunks)] + [prompt.question]
    rows["order noise: full prefill, chunks reversed"] = run(FullRecompute(), reversed_full)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--prompts", nargs=2, type=int, default=[3, 10], metavar=("FIDELITY", "SQUAD"))
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    lines = []
    for model in args.models:
        engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        prompts = fidelity_prompts(args.prompts[0]) + squad_prompts(args.prompts[1])
        results = []
        for i, prompt in enumerate(prompts):
            results.append(measure(engine, prompt))
            print(f"[{model}] prompt {i + 1}/{len(prompts)} done", flush=True)
        lines += [f"## {model}", "", f"{args.prompts[0]} fidelity prompts and {args.prompts[1]} SQuAD samples. "
                  "First-token KL to full prefill over all prompts; compute: token-layers computed, as a "
                  "share of a full prefill's (mean).", "",
                  "| variant | compute | KL mean | KL median |", "|---|---:|---:|---:|"]
        for name in results[0]:
            kl = [r[name][0] for r in results]
            compute = statistics.mean(r[name][1] for r in results)
            lines.append(f"| {name} | {compute:.1%} | {statistics.mean(kl):.4f} | {statistics.median(kl):.4f} |")
        curve = ["FullReuse", *(n for n in REAL if n.startswith("V deviation, r="))]
        lines += ["", "Per prompt, KL as the ratio grows (FullReuse is ratio 0):", "",
                  "| prompt | " + " | ".join(n.replace("V deviation, ", "").replace(" (paper; ragblend default)", "")
                                           for n in curve) + " | order noise |",
                  "|---|" + "---:|" * (len(curve) + 1)]
        for i, r in enumerate(results):
            label = f"fidelity {i + 1}" if i < args.prompts[0] else f"SQuAD {i + 1 - args.prompts[0]}"
            lines.append(f"| {label} | " + " | ".join(f"{r[n][0]:.4f}" for n in curve)
                         + f" | {r['order noise: full prefill, chunks reversed'][0]:.4f} |")
        lines.append("")
        print("\n".join(lines), flush=True)
        del engine
        # Written after each model, so a long run that is stopped keeps what it measured.
        write_report(args.out, "bounds-run.md", "Selection bounds", command_line("research.bounds", argv),
                     time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
