"""The load-memory check's estimated peak beside the peak a load really takes, each in a fresh process.

    python -m benchmarks.load_peak                                   # SmolLM2, quantized and float32
    python -m benchmarks.load_peak --model gemma3-270m --model qwen2.5-0.5b --dtype quantized --dtype float32 \\
        --dtype bfloat16

Per model and form: the weights held, the check's estimated peak (``core.model.load_memory``), and
the growth of the process's peak resident memory (VmHWM) from where the check runs to the end of
``load_model``, the figure the estimate is for (it is compared with the memory available then).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
import torch
from ragblend.core.model import loading
seen = {}
check = loading.check_memory
def spy(memory, what, *args, **kwargs):   # where the check runs: its estimate and the RSS then
    seen.update(held=memory.held, peak=memory.peak, rss=status()["VmRSS"])
    return check(memory, what, *args, **kwargs)
loading.check_memory = spy
dtype = {"quantized": "quantized", "float32": torch.float32, "bfloat16": torch.bfloat16}[sys.argv[2]]
start = time.perf_counter()
loading.load_model(sys.argv[1], dtype=dtype)
seconds = time.perf_counter() - start
print(json.dumps({**seen, "seconds": seconds, "grown": status()["VmHWM"] - seen["rss"]}))
"""


def measure(name: str, dtype: str) -> dict:
    from benchmarks.loading import model_path

    out = subprocess.run([sys.executable, "-c", CHILD, model_path(name), dtype], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"loading {name} ({dtype}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="smollm2, gemma3-270m, qwen2.5-0.5b or a .gguf path")
    parser.add_argument("--dtype", action="append", choices=("quantized", "float32", "bfloat16"))
    args = parser.parse_args(argv)
    print(f"{'model':<16} {'dtype':<9} {'load s':>7} {'held MiB':>9} {'estimate':>9} {'real MiB':>9} {'est/real':>9}")
    for name in args.model or ["smollm2"]:
        for dtype in args.dtype or ["quantized", "float32"]:
            r = measure(name, dtype)
            print(f"{name:<16} {dtype:<9} {r['seconds']:7.1f} {r['held'] / 2**20:9.0f} {r['peak'] / 2**20:9.0f} "
                  f"{r['grown'] / 2**20:9.0f} {r['peak'] / r['grown']:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
