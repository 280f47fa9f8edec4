"""Which bfloat16 rounding of a prefill matmul parts the greedy answers from float32's.

    PYTHONPATH=. python3 research/scratch/bf16_roundings.py smollm2 16 [VARIANT,...] [SKIPPED_LAYER_PART,...]

On the float32 engine (prefix tier off, decoding in float32), every matmul of more than 16 rows
runs one variant: the fast plan's arithmetic (activations, weights and output rounded to
bfloat16), each rounding alone, activations split hi+lo, three bfloat16 GEMMs. Per variant: the
mean first-token KL as a share of the order noise (reversed chunks) and the prompts whose 12
greedy tokens equal float32's (SQuAD-shifts prompts, chunks cut to 400 characters).
docs/runs/bf16-roundings-smollm2.md holds its run (2026-12-06, Intel Xeon AMX host).
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import MUSIQUE, prompt_sets
from benchmarks.models import model_path
from benchmarks.prefill_error import answer
from ragblend import BlendEngine
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.model.linear import CpuLinear

LONG = 16   # passes of more rows than this are the prefill's


def bf(t):
    return t.bfloat16().float()


def split(x):
    hi = x.bfloat16()
    return hi, (x - hi.float()).bfloat16()


def two_x(x, w):   # activations hi + lo in bfloat16, weight bfloat16, the two outputs summed in float32
    hi, lo = split(x)
    wb = w.bfloat16()
    return F.linear(hi, wb).float() + F.linear(lo, wb).float()


def three(x, w):
    xh, xl = split(x)
    wh, wl = split(w)
    return F.linear(xh, wh).float() + F.linear(xl, wh).float() + F.linear(xh, wl).float()


VARIANTS = {
    "bf16 all (fast plan)": lambda x, w: F.linear(x.bfloat16(), w.bfloat16()).float(),
    "x bf16 only": lambda x, w: F.linear(bf(x), w),
    "W bf16 only": lambda x, w: F.linear(x, bf(w)),
    "out bf16 only": lambda x, w: bf(F.linear(x, w)),
    "x,W bf16, out fp32": lambda x, w: F.linear(bf(x), bf(w)),
    "x hi+lo, W bf16": two_x,
    "3 GEMMs": three,
}


def main():
    model, n = sys.argv[1], int(sys.argv[2])
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS)
    skip = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 and sys.argv[4] else ()
    prompts = prompt_sets([f"squad:{n}"], MUSIQUE)["squad"]
    for p in prompts:
        p.chunks = [c[:400] for c in p.chunks]
    engine = BlendEngine.from_pretrained(model_path(model), dtype=torch.float32, kv_dir=False,
                                         decode_dtype="float32", prefix_cache_bytes=0)
    layers = [(name, m) for name, m in engine.adapter.hf_model.named_modules() if isinstance(m, CpuLinear)]

    def patch(fn):
        for name, layer in layers:
            if any(part in name for part in skip):
                continue
            exact = CpuLinear.rows.__get__(layer)

            def rows(flat, exact=exact, layer=layer):
                if flat.shape[0] <= LONG:
                    return exact(flat)
                out = fn(flat, layer.weight)
                return out if layer.bias is None else out + layer.bias
            layer.rows = rows

    results, noise, started = {v: [] for v in names}, [], time.time()
    for i, prompt in enumerate(prompts):
        ref, ids = answer(engine, prompt, 12)
        noise.append(first_token_kl(ref, answer(engine, prompt, 0, reverse=True)[0]))
        line = f"{i:2d} noise {noise[-1]:.4f}"
        for name in names:
            patch(VARIANTS[name])
            try:
                logits, got = answer(engine, prompt, 12)
            finally:
                for _, layer in layers:
                    layer.__dict__.pop("rows", None)
            results[name].append((first_token_kl(ref, logits), got == ids))
            line += f" | {name}: {results[name][-1][0]:.5f} {'=' if got == ids else 'X'}"
        print(line, flush=True)
    mean_noise = statistics.mean(noise)
    print(f"{model}, {len(prompts)} prompts, float32 layers {skip}, {time.time() - started:.0f} s")
    for name in names:
        kl = statistics.mean(k for k, _ in results[name]) / mean_noise
        print(f"| {name} | {kl:.2%} | {sum(s for _, s in results[name])}/{len(results[name])} |")


if __name__ == "__main__":
    main()
