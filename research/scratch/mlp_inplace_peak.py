"""The prefill's peak memory with the MLP's SiLU and gate-up product in place (issue 55, step 2),
against the former out-of-place MLP, alternated in one process on one engine: the full prefill
of the 3.1k-token sample prompt (chunks in a new order each round), its time and the process's
peak RSS (VmHWM, reset before each pass) above the RSS it started from.

    python research/scratch/mlp_inplace_peak.py qwen2.5-1.5b    # a benchmarks.random_gguf shape
"""

import random
import sys
import time

import torch

from benchmarks.random_gguf import write_random_gguf
from ragblend import BlendEngine, Chunk, FullRecompute
from ragblend.core.model import adapter
from ragblend.data import load_sample


def status(key: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM) in GB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith(key + ":"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def out_of_place(steps, x):
    """The MLP as it was: act(gate) and the product as new tensors."""
    gate, up = (steps.gate_proj(x), steps.up_proj(x)) if steps.fused_gate_up is None else steps.fused_gate_up(x)
    return steps.down_proj(torch.nn.functional.silu(gate) * up)


def main(shape: str, rounds: int = 2) -> None:
    engine = BlendEngine.from_pretrained(str(write_random_gguf(shape)), kv_dir=False, prompt_lookup_num_tokens=0)
    sample = load_sample()
    chunks = sample["chunks"][:]
    variants = {"out of place": out_of_place, "in place": adapter.ModelAdapter._mlp}
    for round_ in range(rounds):
        for name, mlp in variants.items():
            adapter.ModelAdapter._mlp = staticmethod(mlp)
            random.Random(round_).shuffle(chunks)
            segments = [Chunk(c) for c in chunks] + [sample["question"]]
            start = status("VmRSS")
            reset_peak()
            t0 = time.perf_counter()
            for _ in engine.stream(segments, strategy=FullRecompute(), max_new_tokens=1):
                pass
            peak = status("VmHWM")
            print(f"round {round_} {name}: full prefill {time.perf_counter() - t0:.1f} s, RSS before {start:.2f} GB, "
                  f"peak {peak:.2f} GB (+{peak - start:.2f})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b")
