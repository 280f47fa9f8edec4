"""Scratch script behind two logs of the H100 scaling run (docs/benchmarks.md, "Scaling with the prompt"; session 28),
run on the H100 before the two GPU changes (as two scripts; the same steps); fastest of 3 runs.
From the repository root on a CUDA machine:

    PYTHONPATH=. python3 research/scratch/scaling_llama8b_h100_diagnostics.py profile   # scaling-llama8b-h100-profile.log
    PYTHONPATH=. python3 research/scratch/scaling_llama8b_h100_diagnostics.py groups    # scaling-llama8b-h100-groups.log

profile: the fused prefill's Stats with the KV in host memory and moved to the GPU, and a
torch.profiler table; groups: the masked attention in groups of 64, 256, 1,024 rows or one group.
"""
import sys
from dataclasses import replace

import torch

import benchmarks.scaling as S
import ragblend.core.model.masks as M
from ragblend import Chunk, FullRecompute

mode = sys.argv[1]
eng = S.random_engine("llama-8b", "cuda", 0.15)
now = S.synced(eng.adapter.device)


def to_gpu():
    """Every stored entry moved to the GPU: no host-to-device copy left (the engine never does this)."""
    for key, entry in list(eng.store._entries.items()):
        eng.store._entries[key] = replace(entry, keys=entry.keys.cuda(), values=entry.values.cuda())


for size in (4096, 16384):
    eng.store = type(eng.store)(32 << 30)
    chunks = S.numbered_passages(eng, size)
    segs = [Chunk(c) for c in chunks] + [S.QUESTION]
    eng.precompute(chunks)

    def timed(strategy=None):
        t0 = now()
        eng.prefill(segs, strategy=strategy)
        return now() - t0, eng.last_stats

    if mode == "profile":
        timed(), timed(FullRecompute())
        for label, strategy in (("fused, host KV", None), ("engine full prefill", FullRecompute())):
            t, st = min((timed(strategy) for _ in range(3)), key=lambda x: x[0])
            print(size, label, f"wall {t:.3f} ttft {st.ttft_s:.3f} compute {st.compute_s:.3f} load {st.load_s:.3f} "
                  f"wait {st.load_wait_s:.3f} frac {st.compute_fraction:.3f}", flush=True)
        to_gpu()
        timed()
        t, st = min((timed() for _ in range(3)), key=lambda x: x[0])
        print(size, "fused, KV on GPU", f"wall {t:.3f} compute {st.compute_s:.3f} load {st.load_s:.3f} "
              f"wait {st.load_wait_s:.3f}", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            timed()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    else:
        ids = torch.tensor([eng.build_prompt(segs).token_ids], device="cuda")

        def forward():
            t0 = now()
            with torch.inference_mode():
                eng.hf_model(ids, logits_to_keep=1)
            return now() - t0

        forward(), timed()
        print(size, "forward", f"{min(forward() for _ in range(3)):.3f}", flush=True)
        for where in ("host", "gpu"):
            if where == "gpu":
                to_gpu()
            for rows in (64, 256, 1024, 100000):
                M.ROWS_PER_GROUP["cuda"] = rows   # (it ran before ROWS_PER_GROUP, as attention_plan's default)
                timed()
                print(size, where, rows, f"{min(timed()[0] for _ in range(3)):.3f}", flush=True)
        M.ROWS_PER_GROUP["cuda"] = 1024
