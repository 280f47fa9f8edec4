"""What a chunk is precomputed after: its effect on fidelity, at equal recompute.

A chunk's KV is computed once, alone, after a fixed prefix (the sink), and later reused in
the middle of a prompt, after other passages. This study computes each chunk's KV after
three prefixes and runs the same fused prefills over them:

- ``none``: the template's opening only (ragblend's sink before ``chunk_context``);
- ``default``: the template's opening, then ragblend's neutral ``CHUNK_CONTEXT`` passage (the
  default: its K/V are computed once per engine, so ingestion cost barely moves);
- ``neighbour``: the template's opening, then the paragraph before the chunk in its own
  article (as FusionRAG does with similar chunks; ingestion computes that paragraph again for
  every chunk, about twice the tokens).

Prompts: SQuAD-format samples, a question's paragraph and 5 others (:func:`benchmarks.common.rag_samples`;
the run in docs/notes/chunk-context.md used SQuAD v1.1 dev, 6 paragraphs of one Wikipedia article, where a
paragraph's neighbour was the one before it in its article; in the Reddit set it is the comment before).
Reported per prefix and strategy: compute (token-layers, as a share of a full prefill's) and
first-token KL to the full prefill (mean / median), beside the model's order noise.

    python -m research.chunk_context --models smollm2 --prompts 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RUNS_DIR, SQUAD_SHIFTS, SYSTEM, command_line, rag_samples, read_data, write_report
from benchmarks.models import MODELS, model_path
from ragblend import BlendEngine, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.fusion.ingest import isolated_kv
from ragblend.core.fusion.prefill import LayerSource, fused_prefill
from ragblend.core.fusion.selection import ReusedSpan

STRATEGIES = {"FullReuse": FullReuse(), "QueryAware(0.10)": QueryAware(0.10),
              "QueryAware(0.15)": QueryAware(0.15), "QueryAware(0.30)": QueryAware(0.30)}
PREFIXES = ("none", "default", "neighbour")


class CachedLayers(LayerSource):
    """Each span's K/V from chunk entries held in memory."""

    def __init__(self, entries, windows):
        self.entries, self.windows = entries, windows

    def layer(self, index):
        return [(k[index][:, w], v[index][:, w]) for (k, v), w in zip(self.entries, self.windows)]


def neighbours() -> dict[str, str]:
    """Each SQuAD dev paragraph -> the one before it in its article (the second for the first)."""
    before = {}
    for article in read_data(SQUAD_SHIFTS[0])["data"]:
        paragraphs = [p["context"] for p in article["paragraphs"]]
        for i, text in enumerate(paragraphs):
            before[text] = paragraphs[i - 1] if i else paragraphs[min(1, len(paragraphs) - 1)]
    return before


@torch.inference_mode()
def measure(model: str, prompts: int) -> list[str]:
    engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
    adapter, prompt_builder, before = engine.adapter, engine.prompts, neighbours()
    rows: dict[str, list[tuple[float, float]]] = {}
    for sample in rag_samples(prompts):
        segments = [Chunk(c) for c in sample["chunks"]] + [f"Question: {sample['question']} Answer with a few words."]
        layout = prompt_builder.build(segments, system=SYSTEM)
        reference = engine.prefill(segments, system=SYSTEM, strategy=FullRecompute()).logits
        noise = engine.prefill(segments[-2::-1] + segments[-1:], system=SYSTEM, strategy=FullRecompute()).logits
        rows.setdefault("order noise", []).append((first_token_kl(reference, noise), 1.0))
        spans = [ReusedSpan(s.start, s.end - s.start, s.offset) for s in layout.chunk_spans]
        windows = [slice(s.offset, s.end - s.start + s.offset) for s in layout.chunk_spans]
        for prefix in PREFIXES:
            entries = []
            for text, span in zip(sample["chunks"], layout.chunk_spans):
                sink = {"none": prompt_builder.sink_ids(), "default": engine.sink_ids,
                        "neighbour": prompt_builder.sink_ids(before[text])}[prefix]
                entries.append(isolated_kv(adapter, sink, list(span.token_ids)))
            for name, strategy in STRATEGIES.items():
                fused = fused_prefill(adapter, layout.token_ids, spans, CachedLayers(entries, windows), strategy)
                compute = fused.token_layers / (len(layout.token_ids) * adapter.shape.num_layers)
                rows.setdefault(f"{prefix}, {name}", []).append((first_token_kl(reference, fused.logits), compute))
    lines = [f"## {model}: SQuAD ({prompts} prompts, 6 paragraphs each)", "",
             "| chunk precomputed after | strategy | compute | KL mean | KL median |", "|---|---|---:|---:|---:|"]
    for name, values in rows.items():
        kls, compute = [kl for kl, _ in values], [c for _, c in values]
        prefix, _, strategy = name.partition(", ")
        lines.append(f"| {prefix} | {strategy or '(full prefill, chunks reversed)'} | {statistics.mean(compute):.1%} | "
                     f"{statistics.mean(kls):.4f} | {statistics.median(kls):.4f} |")
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    started, lines = time.perf_counter(), []
    for model in args.models:
        lines += measure(model, args.prompts)
        print("\n".join(lines), flush=True)
        write_report(args.out, "chunk-context-run.md", "What chunks are precomputed after",
                     command_line("research.chunk_context", argv), time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
