"""Load time and resident memory of an engine over a model file, each in a fresh process.

    python -m benchmarks.loading                       # the embedded SmolLM2 (Q4_1 GGUF)
    python -m benchmarks.loading --model gemma3-270m --model qwen2.5-0.5b --dtype float32

Prints, per model and dtype: the file's size, the load time (``BlendEngine.from_pretrained``,
config and tokenizer cached), the bytes of the weights the model holds, the process's resident
memory after the load less what it held after importing ragblend, torch, transformers and the
model class's code (anonymous and file-backed pages apart; the tokenizer and the engine's
buffers are in it), its peak, and that growth as a multiple of the file's size (issue 55's
target: <= 1.3x).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import gc, json, sys, time
def rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
import torch, transformers, ragblend
from ragblend import BlendEngine
from ragblend.core.model.loading import load_model, resolve_model_dir
model, dtype = sys.argv[1] or None, {"auto": None, "quantized": "quantized", "float32": torch.float32}[sys.argv[2]]
model_dir = resolve_model_dir(model)   # config and tokenizer cached (a first load makes them once)
from transformers import AutoConfig, AutoModelForCausalLM
with torch.device("meta"):   # the model class's code imported: what any load of it takes, weights aside
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
gc.collect()
import ctypes; ctypes.CDLL("libc.so.6").malloc_trim(0)
before = rss()
start = time.perf_counter()
engine = BlendEngine.from_pretrained(model, dtype=dtype, kv_dir=False)
seconds = time.perf_counter() - start
gc.collect()
after = rss()
try:
    from ragblend.core.model.quantized import quantized_bytes
    weights = quantized_bytes(engine.hf_model)
except ImportError:
    weights = sum(p.numel() * p.element_size() for p in engine.hf_model.parameters())
print(json.dumps({"seconds": seconds, "before": before, "after": after, "weights": weights}))
"""


def model_path(name: str) -> str:
    if name == "smollm2":
        from ragblend.core.model.loading import default_gguf_path

        return str(default_gguf_path())
    if name.endswith(".gguf") or "/" in name:
        return name
    from benchmarks.models import gguf_path

    return str(gguf_path(name))


def measure(name: str, dtype: str) -> dict:
    import os

    path = model_path(name)
    out = subprocess.run([sys.executable, "-c", CHILD, path, dtype], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"loading {name} ({dtype}) failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["file_bytes"] = os.path.getsize(path)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="smollm2, gemma3-270m, qwen2.5-0.5b or a .gguf path")
    parser.add_argument("--dtype", action="append", choices=("auto", "quantized", "float32"),
                        help="auto: the engine's default (float32 for a small model, else quantized); quantized: the "
                             "file's quantized form; float32: dequantized")
    args = parser.parse_args(argv)
    print(f"{'model':<16} {'dtype':<8} {'file MB':>8} {'load s':>7} {'weights':>8} {'RSS+ MB':>8} {'anon+':>7} "
          f"{'file+':>7} {'peak MB':>8} {'x file':>7}")
    for name in args.model or ["smollm2"]:
        for dtype in args.dtype or ["auto"]:
            r = measure(name, dtype)
            grown = {k: (r["after"][k] - r["before"][k]) / 2**20 for k in ("VmRSS", "RssAnon", "RssFile")}
            print(f"{name:<16} {dtype:<8} {r['file_bytes'] / 2**20:8.1f} {r['seconds']:7.2f} "
                  f"{r['weights'] / 2**20:8.1f} {grown['VmRSS']:8.1f} "
                  f"{grown['RssAnon']:7.1f} {grown['RssFile']:7.1f} {r['after']['VmHWM'] / 2**20:8.1f} "
                  f"{grown['VmRSS'] * 2**20 / r['file_bytes']:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
