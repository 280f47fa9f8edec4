"""Step 1 of issue 55's split-bfloat16 idea: is an exact-ish prefill matmul on AMX faster than float32?

    PYTHONPATH=. python3 research/scratch/split_bf16_gemm.py [ROWS,...]

One Qwen2.5-1.5B decoder layer's seven matrices as random Q4_0 QuantLinear layers (the held form a
prefill dequantizes), each pass timed as the prefill would run it (dequantize into the scratch,
then the GEMMs), alternated rounds, one process:

* float32: the default plan (dequantize to float32, F.linear).
* bf16: the fast plan (weights rounded once to bfloat16, activations too, output rounded).
* split3: W = Wh + Wl and x = xh + xl, each part bfloat16-exact, y = xh.Wh + xl.Wh + xh.Wl in
  oneDNN's bf16 fpmath mode on float32 tensors (torch.backends.mkldnn.matmul.fp32_precision =
  "bf16": bfloat16 inputs, float32 accumulation and output); xh and xl stacked into one GEMM on Wh.
* split2: x = xh + xl, W rounded once to bfloat16, y = xh.W + xl.W (one GEMM of twice the rows) in that
  mode: not exact (the weights' rounding), the activations' and the output's rounding gone.
* bf32: one GEMM in that mode (x and W rounded to bfloat16, output float32): the floor.

Errors: max |y - y64| / max |y64| against float64 on the same float32 weights, and the mean.
"""

import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from ragblend.core.model.quantized import QuantLinear, scratch

SHAPES = {"q": (1536, 1536), "k": (256, 1536), "v": (256, 1536), "o": (1536, 1536),
          "gate": (8960, 1536), "up": (8960, 1536), "down": (1536, 8960)}


def q4_0_layer(rows: int, cols: int, rng) -> QuantLinear:
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scales = torch.from_numpy(rng.uniform(0.001, 0.004, (rows, cols // 32)).astype(np.float16).astype(np.float32))
    return QuantLinear.int4(codes, scales, -8 * scales, source_type="Q4_0")


def bf32(on: bool) -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if on else "ieee"


HIGH_BITS = -65536   # 0xFFFF0000 as int32: a float32's sign, exponent and top 7 mantissa bits


def split_into(values: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None:
    """high = values truncated to bfloat16, low = values - high (exact: float32 minus its own top
    bits); both float32 tensors of bfloat16-exact values, so oneDNN's bf16 mode rounds neither.
    low is bfloat16-exact where values have <= 16 significant bits (Q4_0's: an 11-bit float16 scale
    times a 4-bit code); else (Q8_0's 18 bits, Q4_1's sums) the GEMM rounds it to its top 8 bits
    (an error ~2^-16 of the value)."""
    torch.bitwise_and(values.view(torch.int32), HIGH_BITS, out=high.view(torch.int32))
    torch.sub(values, high, out=low)


def split3(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """y = xh.Wh + xl.Wh + xh.Wl in oneDNN's bf16 mode: float32 accumulation and output."""
    w = layer.dequantize()
    high = scratch(2 * w.numel(), torch.float32)[w.numel():].view_as(w)   # past the dequantized weights
    low = torch.empty_like(w)
    split_into(w, high, low)
    rows = x.shape[0]
    both = torch.empty(2 * rows, x.shape[1])
    both[:rows] = x.bfloat16()   # rounded to nearest, not truncated: a truncated x's low part
    torch.sub(x, both[:rows], out=both[rows:])   # (16 bits, rounded again in the GEMM) biased the sums
    bf32(True)
    try:
        hl = F.linear(both, high)
        out = torch.add(hl[:rows], hl[rows:])
        out += F.linear(both[:rows], low)
    finally:
        bf32(False)
    return out


def bf32_once(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    bf32(True)
    try:
        return F.linear(x, layer.dequantize())
    finally:
        bf32(False)


def split2(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """y = xh.Wb + xl.Wb in oneDNN's bf16 mode (one GEMM of twice the rows): the activations to
    ~16 bits, the weights rounded once to bfloat16 (as oneDNN rounds them), float32 output."""
    w = layer.dequantize()
    rows = x.shape[0]
    both = torch.empty(2 * rows, x.shape[1])
    both[:rows] = x.bfloat16()
    torch.sub(x, both[:rows], out=both[rows:])
    bf32(True)
    try:
        hl = F.linear(both, w)
    finally:
        bf32(False)
    return torch.add(hl[:rows], hl[rows:])


def gemms_only(layers, x):
    """The GEMMs alone, on weights dequantized and split once (the ceiling of any split plan)."""
    weights = [m.dequantize().clone() for m in layers]
    parts = []
    for w in weights:
        high, low = torch.empty_like(w), torch.empty_like(w)
        split_into(w, high, low)
        parts.append((high, low))

    def f32():
        return [F.linear(x[w.shape[1]], w) for w in weights]

    def one():
        bf32(True)
        try:
            return [F.linear(x[w.shape[1]], w) for w in weights]
        finally:
            bf32(False)

    def three():
        bf32(True)
        try:
            outs = []
            for h, lo in parts:
                xi = x[h.shape[1]]
                hl = F.linear(torch.cat([xi, xi]), h)
                outs.append(hl[:xi.shape[0]] + hl[xi.shape[0]:] + F.linear(xi, lo))
            return outs
        finally:
            bf32(False)

    native = [w.bfloat16() for w in weights]

    def bf16_native():
        return [F.linear(x[w.shape[1]].bfloat16(), w) for w in native]

    return {"GEMM float32": f32, "GEMM bf32": one, "GEMMs split3": three, "GEMM bf16 native": bf16_native}


def passes(layers, x):
    def float32():
        return [F.linear(x[m.in_features], m.dequantize()) for m in layers]

    def bf16():
        return [F.linear(x[m.in_features].bfloat16(), m.dequantize(dtype=torch.bfloat16)).float() for m in layers]

    def split():
        return [split3(m, x[m.in_features]) for m in layers]

    def two():
        return [split2(m, x[m.in_features]) for m in layers]

    def one_bf32():
        bf32(True)
        try:
            return [F.linear(x[m.in_features], m.dequantize()) for m in layers]
        finally:
            bf32(False)

    def dequant_only():
        return [m.dequantize() for m in layers]

    return {"float32": float32, "bf16": bf16, "split3": split, "split2": two, "bf32": one_bf32, "dequantize only": dequant_only}


def errors(layers, x, work):
    worst, mean = 0.0, []
    for m in layers:
        w = m.dequantize().double().clone()
        ref = x[m.in_features].double() @ w.T
        got = work(m).double()
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        mean.append(((got - ref).abs().mean() / ref.abs().mean()).item())
    return worst, sum(mean) / len(mean)


def main():
    rng = np.random.default_rng(0)
    layers = [q4_0_layer(*shape, rng) for shape in SHAPES.values()]
    torch.set_num_threads(2)
    for rows in [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "256,1024").split(",")]:
        x = {w: torch.randn(rows, w) for w in {m.in_features for m in layers}}
        work = passes(layers, x) | gemms_only(layers, x)
        for f in work.values():
            f()
        times = {name: [] for name in work}
        for _ in range(5):
            for name, f in work.items():
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
        best = {name: min(t) for name, t in times.items()}
        print(f"rows {rows}: " + " | ".join(f"{n} {t * 1e3:.1f} ms ({best['float32'] / t:.2f}x)" for n, t in best.items()))
        single = {"float32": lambda m: F.linear(x[m.in_features], m.dequantize()),
                  "bf16": lambda m: F.linear(x[m.in_features].bfloat16(), m.dequantize(dtype=torch.bfloat16)).float(),
                  "split3": lambda m: split3(m, x[m.in_features]),
                  "split2": lambda m: split2(m, x[m.in_features]),
                  "bf32": lambda m: bf32_once(m, x[m.in_features])}
        for name, f in single.items():
            worst, mean = errors(layers, x, f)
            print(f"  error {name}: max {worst:.2e}, mean {mean:.2e}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
