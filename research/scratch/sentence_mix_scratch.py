# PYTHONPATH=. python3 research/scratch/sentence_mix_scratch.py qwen2.5-0.5b 0.20 0.25,1,4  (session 32, AVX2-only EPYC)
"""Whole sentences mixed with single tokens: a reused token's claim is its sentence's mean
question attention plus `mix` x its own (QueryAware(sentence_runs=True) was mix 1e-4 then; 0.25 since session 33). First-token
KL against full prefill on the calibration's 8 built-in prompts (the bar: half the order noise in
mean and median) and on SQuAD prompts 1, 10, 11 (where sentences moved the first token most),
and the answer-level KL (teacher-forced on full prefill's 32-token greedy answer) on passage 3
(the answer-level outlier; the 3x bound: 0.087)."""
import statistics
import sys

import torch

from benchmarks.common import MUSIQUE, SYSTEM, prompt_sets
from benchmarks.models import model_path
from ragblend import BlendEngine, Chunk, FullRecompute, QueryAware
from ragblend.core.calibration.metrics import answer_kl, answer_logits, first_token_kl
from ragblend.core.calibration.search import builtin_prompts
from ragblend.core.fusion import selection

torch.set_num_threads(2)
model, ratio, mixes = sys.argv[1], float(sys.argv[2]), [float(m) for m in sys.argv[3].split(",")]
# (session 32 patched by_sentence to add the mix to the library's 1e-4; since session 33 the share
# is the library's SENTENCE_OWN_SHARE, set in prefill below: the same claims to 1e-4)
engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
variants = {"tokens": (QueryAware(ratio), 0.0), "sentences": (QueryAware(ratio, sentence_runs=True), 1e-4),
            **{f"mix {m:g}": (QueryAware(ratio, sentence_runs=True), m) for m in mixes}}


def prefill(segments, system, strategy, mix):
    selection.SENTENCE_OWN_SHARE = mix
    return engine.prefill(segments, system=system, strategy=strategy)


def first_tokens(prompts, system):
    kls = {name: [] for name in [*variants, "noise"]}
    for chunks, question in prompts:
        engine.precompute(chunks)
        segments = [Chunk(c) for c in chunks] + [question]
        full = prefill(segments, system, FullRecompute(), 0.0)
        kls["noise"].append(first_token_kl(full.logits, prefill([Chunk(c) for c in reversed(chunks)] + [question],
                                                                   system, FullRecompute(), 0.0).logits))
        for name, (strategy, mix) in variants.items():
            kls[name].append(first_token_kl(full.logits, prefill(segments, system, strategy, mix).logits))
        print({k: round(v[-1], 4) for k, v in kls.items()}, flush=True)
    return kls


print("## built-in calibration prompts, first-token KL mean / median")
kls = first_tokens(builtin_prompts(), None)
noise = kls.pop("noise")
print(f"bar (half the noise): {statistics.mean(noise) / 2:.4f} / {statistics.median(noise) / 2:.4f}")
for name, values in kls.items():
    print(f"{name}: {statistics.mean(values):.4f} / {statistics.median(values):.4f}", flush=True)
sets = prompt_sets(["squad:11", "fidelity:3"], MUSIQUE)
print("## SQuAD 1, 10, 11, first-token KL")
first_tokens([(p.chunks, p.question) for i, p in enumerate(sets["squad"]) if i in (0, 9, 10)], SYSTEM)
print("## passage 3, answer-level KL")
p = sets["fidelity"][2]
engine.precompute(p.chunks)
segments = [Chunk(c) for c in p.chunks] + [p.question]
answer = engine.generate(segments, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=32).token_ids
reference = answer_logits(engine, prefill(segments, SYSTEM, FullRecompute(), 0.0), answer)
for name, (strategy, mix) in variants.items():
    print(name, round(answer_kl(reference, answer_logits(engine, prefill(segments, SYSTEM, strategy, mix), answer)), 4),
          flush=True)
