# PYTHONPATH=. python3 research/scratch/chunk_budget_allocation.py qwen2.5-0.5b fidelity:2-3 0.20  (session 31, AVX2-only EPYC)
"""The budget shared between chunks by their question-attention mass to a power (1: about the shipped
selection, 0: the same share of each chunk), optionally capped, single tokens inside each chunk."""

import statistics
import sys

import torch

from benchmarks.common import MUSIQUE, SYSTEM, prompt_sets
from benchmarks.models import model_path
from ragblend import BlendEngine, Chunk, FullRecompute, QueryAware
from ragblend.core.calibration.metrics import answer_kl_steps, answer_logits
from ragblend.core.fusion.selection import QuestionAttention


class Allocated(QuestionAttention):
    """Per-chunk budget: share_j ∝ mass_j ** power (power 1 ~ shipped-ish, 0 uniform), optional cap."""

    def __init__(self, ratio, power=1.0, cap=None, scale=0.7):
        super().__init__(ratio, cached_attention_scale=scale)
        self.power, self.cap = power, cap

    def first(self, prompt, probe):
        budget = self.budget(prompt.num_reused)
        rel = self.scores(prompt, probe()).float()
        n = len(prompt.spans)
        sizes = torch.zeros(n).index_add_(0, prompt.chunk_of.cpu(), torch.ones_like(rel).cpu())
        mass = torch.zeros(n).index_add_(0, prompt.chunk_of.cpu(), rel.cpu())
        w = mass.clamp_min(1e-9) ** self.power
        quota = budget * w / w.sum()
        limit = sizes.clone() if self.cap is None else torch.minimum(sizes, (self.cap * self.ratio * sizes).ceil())
        # water-fill: clip to limit, redistribute
        for _ in range(10):
            quota = torch.minimum(quota, limit)
            left = budget - quota.sum()
            free = quota < limit
            if left < 1 or not free.any():
                break
            quota[free] += left * w[free] / w[free].sum()
        quota = quota.floor().long()
        chosen = torch.zeros(prompt.num_reused, dtype=torch.bool)
        for j in range(n):
            idx = (prompt.chunk_of.cpu() == j).nonzero()[:, 0]
            k = int(min(quota[j], idx.numel()))
            if k:
                chosen[idx[torch.topk(rel.cpu()[idx], k).indices]] = True
        rest = budget - int(chosen.sum())
        if rest > 0:
            r = rel.cpu().masked_fill(chosen, float("-inf"))
            chosen[torch.topk(r, rest).indices] = True
        return prompt.with_reused(prompt.reused_pos[chosen.to(prompt.reused_pos.device)])


torch.set_num_threads(2)
model, spec, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
variants = {
    "shipped": QueryAware(ratio),
    "p0.5": Allocated(ratio, 0.5),
    "p0": Allocated(ratio, 0.0),
    "cap2": Allocated(ratio, 1.0, cap=2.0),
    "p1": Allocated(ratio, 1.0),
}
engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
tot = {k: [] for k in variants}
noise = []
for name, ps in prompt_sets(spec.split(","), MUSIQUE).items():
    for p in ps:
        engine.precompute(p.chunks)
        segs = [Chunk(c) for c in p.chunks] + [p.question]
        ids = engine.generate(segs, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=32).token_ids
        refl = answer_logits(engine, engine.prefill(segs, system=SYSTEM, strategy=FullRecompute()), ids)
        out = {}
        for k, s in variants.items():
            pre = engine.prefill(segs, system=SYSTEM, strategy=s)
            st = answer_kl_steps(refl, answer_logits(engine, pre, ids, decoding_bias=False))
            rec = pre.recomputed
            sh = [round(rec[sp.start : sp.end].float().mean().item(), 2) for sp in pre.layout.chunk_spans]
            out[k] = round(float(st.mean()), 4)
            tot[k].append(float(st.mean()))
            if len(sh) <= 8:
                out[k + " shares"] = sh
        print(name, out, flush=True)

for k, v in tot.items():
    print(k, "mean", round(statistics.mean(v), 4), "median", round(statistics.median(v), 4))
