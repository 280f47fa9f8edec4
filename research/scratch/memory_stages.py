"""Where a quantized GGUF engine's resident memory goes, step by step (issue 55; the stage table
in docs/benchmarks.md, "At 1.5-7B beside llama.cpp"): the RSS after each step of the load, with
gc and glibc's malloc_trim between steps, so that each step's figure is what it keeps.

    python research/scratch/memory_stages.py qwen2.5-1.5b    # a benchmarks.random_gguf shape
"""

import ctypes
import gc
import sys

last = {}


def rss() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def show(stage: str) -> None:
    global last
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    now = rss()
    added = now["VmRSS"] - last.get("VmRSS", 0)
    print(f"{stage:34} RSS {now['VmRSS'] / 1e6:7.1f} MB (+{added / 1e6:7.1f}) anon {now['RssAnon'] / 1e6:7.1f} "
          f"file {now['RssFile'] / 1e6:6.1f}", flush=True)
    last = now


def main(shape: str) -> None:
    import torch
    show("import torch")
    from ragblend import BlendEngine
    show("import ragblend")
    from benchmarks.random_gguf import write_random_gguf
    from ragblend.core.model.loading import _load_tokenizer, _weights_form, resolve_model_dir

    path = write_random_gguf(shape)
    gguf, _ = _weights_form(path, None, "cpu")
    show("read header")
    model_dir = resolve_model_dir(path)
    tokenizer = _load_tokenizer(model_dir)
    show("tokenizer")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)
    show("transformers' modeling code")
    from ragblend.core.model.quantized import build_quantized_model, quantized_bytes

    model = build_quantized_model(gguf, config)
    show("build_quantized_model")
    held = {}
    for module in model.modules():
        for name, tensor in module.named_buffers(recurse=False):
            held[name] = held.get(name, 0) + tensor.numel() * tensor.element_size()
    print("   weights held", quantized_bytes(model) / 1e6, "MB:", {k: round(v / 1e6, 1) for k, v in held.items()})
    engine = BlendEngine(model, tokenizer, prompt_lookup_num_tokens=0)
    show("BlendEngine()")
    engine.generate(["Which city is the capital of France?"], max_new_tokens=8)
    show("a short prompt answered")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b")
