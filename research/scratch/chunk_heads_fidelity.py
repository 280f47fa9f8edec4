# PYTHONPATH=. python3 research/scratch/chunk_heads_fidelity.py 1-5  (2026-12-06, 2-core AVX-512 EPYC, SmolLM2)
"""QueryAware(0.1) plus the first 32 tokens of every chunk but the first (LegoLink's heads, Epic), which
brought back issue 59's lost ferry answer (research/scratch/userlike_ferry_loss.py), against QueryAware at
about its compute, on held-out SQuAD-shifts prompts (benchmarks.fidelity's squad set, prompts FIRST-LAST):
first-token KL and ROUGE-L of the 32-token greedy answer, beside the order noise."""

import json
import statistics
import sys

from benchmarks.common import MUSIQUE, prompt_sets
from benchmarks.fidelity import NOISE, measure
from benchmarks.models import model_path
from ragblend import BlendEngine, QueryAware
from ragblend.core.fusion.selection import QuestionAttention


class WithChunkHeads(QuestionAttention):
    def __init__(self, ratio: float, head: int):
        super().__init__(ratio, cached_attention_scale=0.7)
        self.head = head

    def first(self, prompt, probe):
        selected = super().first(prompt, probe)
        for span in prompt.spans[1:]:
            selected[span.start:span.start + min(self.head, span.num_tokens)] = True
        return selected


first, last = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1-5").split("-"))
variants = {"QueryAware(0.10)": QueryAware(0.10), "QueryAware(0.20)": QueryAware(0.20), "QueryAware(0.30)": QueryAware(0.30),
            "QueryAware(0.10) + heads of 32": WithChunkHeads(0.10, 32)}
engine = BlendEngine.from_pretrained(model_path("smollm2"), kv_dir=False)
prompts = prompt_sets([f"squad:{last}"], MUSIQUE)["squad"][first - 1:last]
rows = []
for i, prompt in enumerate(prompts, first):
    rows.append(measure(engine, prompt, variants, 32))
    print(i, json.dumps({name: {k: round(v, 4) for k, v in r.items()} for name, r in rows[-1].items()}), flush=True)
for name in [*variants, NOISE]:
    kl, rouge = [r[name]["kl"] for r in rows], [r[name]["rouge"] for r in rows]
    compute = statistics.mean(r[name]["compute"] for r in rows)
    print(f"{name}: compute {compute:.1%}, KL mean {statistics.mean(kl):.4f} median {statistics.median(kl):.4f}, "
          f"ROUGE-L {statistics.mean(rouge):.2f}")
