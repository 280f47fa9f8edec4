"""One decoder layer's long pass on quantized weights, float32 against bfloat16 (and the int4
kernel), at the model sizes people run: the choice ``quantized.long_pass_plan`` makes per host.

Random 4-bit weights in one decoder layer's real shapes (:data:`benchmarks.random_gguf.SHAPES`:
Q, K, V, O, gate, up, down), each pass dequantizing every matrix into the reused buffer and
running ``F.linear``, as the prefill does (``quantized._run``); fastest of ``--rounds``
interleaved rounds after one untimed call each.

    python -m benchmarks.long_pass --shape qwen2.5-1.5b --rows 256 1024
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ragblend.core.model.kernels import cpu_summary, fastest_rounds
from ragblend.core.model.quantized import QuantLinear, _bfloat16_native, _run

from .random_gguf import SHAPES


def layer_of(name: str, seed: int = 0) -> list[QuantLinear]:
    """One decoder layer of shape ``name``'s matrices, 4-bit with random codes and scales."""
    shape, rng = SHAPES[name], np.random.default_rng(seed)
    head_dim = shape.hidden // shape.heads
    sizes = [(shape.hidden, shape.hidden), (shape.kv_heads * head_dim, shape.hidden),
             (shape.kv_heads * head_dim, shape.hidden), (shape.hidden, shape.hidden),
             (shape.ffn, shape.hidden), (shape.ffn, shape.hidden), (shape.hidden, shape.ffn)]
    layers = []
    for rows, cols in sizes:
        scales = torch.from_numpy(rng.uniform(0.001, 0.011, (rows, cols // 32)).astype(np.float32))
        layers.append(QuantLinear.int4(rng.integers(0, 16, (rows, cols), dtype=np.uint8), scales, -8 * scales))
    return layers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    layers = layer_of(args.shape)
    print(f"{cpu_summary()}; native bfloat16: {_bfloat16_native()}")
    with torch.inference_mode():
        for rows in args.rows:
            x = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
            work = {"float32": lambda: _run(layers, x, torch.float32, 0),
                    "bfloat16": lambda: _run(layers, x, torch.bfloat16, 0),
                    "dequantize float32": lambda: [m.dequantize(dtype=torch.float32) for m in layers],
                    "dequantize bfloat16": lambda: [m.dequantize(dtype=torch.bfloat16) for m in layers]}
            if rows <= 256:
                work["int4 kernel"] = lambda: _run(layers, x, torch.float32, rows)
            times = fastest_rounds(work, rounds=args.rounds)
            print(f"{args.shape} {rows:5d} rows: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items())
                  + f"; float32 / bfloat16 {times['float32'] / times['bfloat16']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
