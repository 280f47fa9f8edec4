"""Where a 4-bit matrix's dequantization (a third of a 256-row float32 prefill pass at 1.5B) goes.

    PYTHONPATH=. python3 research/scratch/dequant_passes.py

One Qwen2.5-1.5B decoder layer's seven matrices as random Q4_0 QuantLinear layers: today's
QuantLinear.dequantize (codes copied nibble-half by nibble-half from the packed layout into the
float32 buffer, then code * scale + minimum in place) against codes first gathered as uint8
(a quarter of the bytes moved by the transposing copy) and one addcmul from uint8 into the
buffer; and the file's scales alone. Alternated rounds, one process; results compared bit for bit.
"""

import os
import sys
import time

import numpy as np
import torch

from ragblend.core.model.quantized import GROUP, QuantLinear, scratch

sys.path.insert(0, os.path.dirname(__file__))
from split_bf16_gemm import SHAPES, q4_0_layer  # noqa: E402  (the same layer, built once)


def uint8_first(layer: QuantLinear) -> torch.Tensor:
    count, cols = layer.out_features, layer.in_features
    out = scratch(count * cols).view(count, cols)
    codes = scratch(count * cols, torch.uint8).view(count // 64, 2, 32, cols)
    blocks = layer.packed.view(count // 64, cols, 32)
    torch.bitwise_and(blocks, 15, out=codes[:, 0].transpose(1, 2))
    torch.bitwise_right_shift(blocks, 4, out=codes[:, 1].transpose(1, 2))
    scales, minimums = layer.file_scales(0, count)
    torch.addcmul(minimums[..., None], codes.view(count, -1, GROUP), scales[..., None], out=out.view(count, -1, GROUP))
    return out


def sliced(layer: QuantLinear, weights: int) -> torch.Tensor:
    """Today's dequantization a slice of 64-row blocks at a time (about ``weights`` weights), so
    that the in-place code * scale + minimum finds the slice still in L2."""
    count, cols = layer.out_features, layer.in_features
    out = scratch(count * cols).view(count, cols)
    step = max(64, weights // cols // 64 * 64)
    for first in range(0, count, step):
        last = min(first + step, count)
        part = out[first:last]
        blocks = layer.packed[first:last].view((last - first) // 64, cols, 32)
        halves = part.view((last - first) // 64, 2, 32, cols)
        halves[:, 0].copy_((blocks & 15).transpose(1, 2))
        halves[:, 1].copy_((blocks >> 4).transpose(1, 2))
        scales, minimums = layer.file_scales(first, last)
        groups = part.view(last - first, -1, GROUP)
        torch.addcmul(minimums[..., None], groups, scales[..., None], out=groups)
    return out


def main():
    torch.set_num_threads(2)
    layers = [q4_0_layer(*shape, np.random.default_rng(0)) for shape in SHAPES.values()]
    for layer in layers:
        assert torch.equal(layer.dequantize().clone(), uint8_first(layer)), "not bit for bit"
        assert torch.equal(layer.dequantize().clone(), sliced(layer, 1 << 18)), "not bit for bit"
    work = {"dequantize (today)": lambda: [layer.dequantize() for layer in layers],
            "uint8 codes first": lambda: [uint8_first(layer) for layer in layers],
            "slices of 256K weights": lambda: [sliced(layer, 1 << 18) for layer in layers],
            "slices of 1M weights": lambda: [sliced(layer, 1 << 20) for layer in layers],
            "file scales alone": lambda: [layer.file_scales(0, layer.out_features) for layer in layers]}
    times = {name: [] for name in work}
    for _ in range(7):
        for name, f in work.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    print(" | ".join(f"{name} {min(t) * 1e3:.1f} ms" for name, t in times.items()))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
