# PYTHONPATH=. python3 research/scratch/near_tie_margins.py smollm2 squad:16-48 out.json  (session 30, AVX2-only EPYC)
"""Teacher-forced on the reference (float32 F.linear) greedy answer: per step, the low-bit
decoder's top-2 margin and the reference's, and where the argmax differs."""
import json
import sys

import torch

from benchmarks.common import MUSIQUE, prompt_sets
from benchmarks.decode import reference_answer
from benchmarks.models import model_path
from ragblend import BlendEngine, Chunk
from ragblend.core.decode.generate import KVDecoder
from ragblend.core.model.adapter import ModelAdapter

model, spec, out = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
exact = BlendEngine.from_pretrained(model_path(model), kv_dir=False, decode_dtype="float32")
auto = BlendEngine(exact.hf_model, exact.tokenizer, store=exact.store, decode_dtype="auto", decode_kv_dtype="float32")
rows = []
for set_name, prompts in prompt_sets(spec, MUSIQUE).items():
    for i, prompt in enumerate(prompts):
        exact.precompute(prompt.chunks)
        segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
        pre = exact.prefill(segments)
        ref, _, _ = reference_answer(exact, pre, 32)
        cap = len(pre.token_ids) + len(ref) + 1
        r = KVDecoder(ModelAdapter(exact.hf_model), pre.keys, pre.values, cap, pre.key_bias)
        a = KVDecoder(auto.decoding_adapter(), pre.keys, pre.values, cap, pre.key_bias, dtype=torch.float32)
        with torch.inference_mode():
            for step, t in enumerate(ref[:-1]):
                lr, la = r.step(t), a.step(t)
                top_a = la.topk(2)
                top_r = lr.topk(2)
                ia, ib = top_a.indices.tolist()
                gap_a = float(top_a.values[0] - top_a.values[1])
                gap_r_same = float(lr[ia] - lr[ib])
                rows.append(dict(set=set_name, prompt=i, step=step + 1, gap_low=gap_a, gap_ref=float(top_r.values[0] - top_r.values[1]),
                                 err=abs(gap_a - gap_r_same), flip=int(top_r.indices[0]) != ia,
                                 maxdiff=float((lr - la).abs().max())))
        flips = [x for x in rows if x["set"] == set_name and x["prompt"] == i and x["flip"]]
        print(set_name, i, len(ref), "flips", [(f["step"], round(f["gap_low"], 4)) for f in flips], flush=True)
json.dump(rows, open(out, "w"))
errs = sorted(x["err"] for x in rows)
n = len(errs)
print("steps", n, "err p50 %.4f p90 %.4f p99 %.4f max %.4f" % (errs[n // 2], errs[int(n * .9)], errs[int(n * .99)], errs[-1]))
for th in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5):
    print("threshold", th, "fires on %.1f%% of steps" % (100 * sum(x["gap_low"] < th for x in rows) / n),
          "catches flips", sum(x["flip"] and x["gap_low"] < th for x in rows), "of", sum(x["flip"] for x in rows))
