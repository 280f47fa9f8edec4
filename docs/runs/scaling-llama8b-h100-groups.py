"""Scratch script behind scaling-llama8b-h100-groups.log (H100, session 28, before the pinned read-ahead):
the fused prefill with the masked attention in groups of 64, 256, 1,024 rows or one group, KV in host
memory and moved to the GPU. Fastest of 3 runs. Run from the repository root on a CUDA machine:
PYTHONPATH=. python3 docs/runs/scaling-llama8b-h100-groups.py"""
import torch
from dataclasses import replace
import benchmarks.scaling as S
import ragblend.core.masks as M
from ragblend import Chunk
from ragblend.data import load_sample
eng = S.random_engine("llama-8b", "cuda", 0.15)
now = S.synced(eng.adapter.device)
passages = load_sample()["chunks"]
for size in (4096, 16384):
    eng.store = type(eng.store)(32 << 30)
    chunks, tokens = [], 0
    while tokens < size - 256:
        chunks.append(f"Part {len(chunks) + 1}.\n{passages[len(chunks) % len(passages)]}")
        tokens += len(eng.prompts.tokenize(chunks[-1]))
    segs = [Chunk(c) for c in chunks] + [S.QUESTION]
    eng.precompute(chunks)
    ids = torch.tensor([eng.build_prompt(segs).token_ids], device="cuda")
    def fwd():
        t0 = now()
        with torch.inference_mode():
            eng.hf_model(ids, logits_to_keep=1)
        return now() - t0
    def fused():
        t0 = now(); eng.prefill(segs); return now() - t0
    fwd(); fused()
    print(size, "forward", f"{min(fwd() for _ in range(3)):.3f}", flush=True)
    for where in ("host", "gpu"):
        if where == "gpu":
            for k, e in list(eng.store._entries.items()):
                eng.store._entries[k] = replace(e, keys=e.keys.cuda(), values=e.values.cuda())
        for rows in (64, 256, 1024, 100000):
            M.attention_plan.__defaults__ = (rows, None)
            fused()
            print(size, where, rows, f"{min(fused() for _ in range(3)):.3f}", flush=True)
    M.attention_plan.__defaults__ = (64, None)
