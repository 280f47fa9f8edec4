# PYTHONPATH=. python3 research/scratch/chunk_exact_oracle.py qwen2.5-0.5b fidelity:2-3 0.20  (session 31, AVX2-only EPYC)
"""Which chunk's cached K/V moves an answer: the fused prefill's K/V of one chunk at a time replaced by full
prefill's (and its attention bias removed), then the answer KL."""

import dataclasses
import sys

import torch

from benchmarks.common import MUSIQUE, SYSTEM, prompt_sets
from benchmarks.models import model_path
from ragblend import BlendEngine, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import answer_kl_steps, answer_logits

torch.set_num_threads(2)
model, spec, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
for name, ps in prompt_sets([spec], MUSIQUE).items():
    for p in ps:
        engine.precompute(p.chunks)
        segs = [Chunk(c) for c in p.chunks] + [p.question]
        ref = engine.generate(segs, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=32)
        ids = ref.token_ids
        full = engine.prefill(segs, system=SYSTEM, strategy=FullRecompute())
        refl = answer_logits(engine, full, ids)
        fused = engine.prefill(segs, system=SYSTEM, strategy=QueryAware(ratio))

        def kl(pre):
            s = answer_kl_steps(refl, answer_logits(engine, pre, ids, decoding_bias=False))
            return round(float(s.mean()), 4), round(float(s.max()), 3)

        print("shipped", kl(fused))
        spans = fused.layout.chunk_spans
        for j, sp in enumerate(spans):
            keys = [k.clone() for k in fused.keys]
            vals = [v.clone() for v in fused.values]
            for k, fk in zip(keys, full.keys):
                k[:, sp.start : sp.end] = fk[:, sp.start : sp.end]
            for v, fv in zip(vals, full.values):
                v[:, sp.start : sp.end] = fv[:, sp.start : sp.end]
            bias = None
            if fused.key_bias is not None:
                bias = fused.key_bias.clone()
                bias[sp.start : sp.end] = 0
            pre = dataclasses.replace(fused, keys=keys, values=vals, key_bias=bias)
            rec = fused.recomputed[sp.start : sp.end].float().mean().item()
            print(f"chunk {j} exact (recomputed {rec:.2f}, {sp.end - sp.start} tokens):", kl(pre))
        # only the recomputed tokens replaced by reuse? i.e. the fused with selected tokens kept cached -> FullReuse
        print("reuse", kl(engine.prefill(segs, system=SYSTEM, strategy=FullReuse())))
