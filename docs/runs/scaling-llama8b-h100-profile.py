"""Scratch script behind scaling-llama8b-h100-profile.log (H100, session 28, before the two GPU changes):
the fused prefill's Stats with the KV in host memory and moved to the GPU, and a torch.profiler table.
Fastest of 3 runs. Run from the repository root on a CUDA machine: PYTHONPATH=. python3 docs/runs/scaling-llama8b-h100-profile.py"""
import torch
from dataclasses import replace
import benchmarks.scaling as S
from ragblend import Chunk, FullRecompute
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
    refs = eng.precompute(chunks)
    def timed(strategy=None):
        t0 = now(); eng.prefill(segs, strategy=strategy); t = now() - t0
        st = eng.last_stats
        return t, st
    timed(); timed(FullRecompute())
    for label, strat in (("fused, host KV", None), ("engine full prefill", FullRecompute())):
        t, st = min((timed(strat) for _ in range(3)), key=lambda x: x[0])
        print(size, label, f"wall {t:.3f} ttft {st.ttft_s:.3f} compute {st.compute_s:.3f} load {st.load_s:.3f} wait {st.load_wait_s:.3f} frac {st.compute_fraction:.3f}", flush=True)
    # every stored entry moved to the GPU: no host-to-device copy left
    for k, e in list(eng.store._entries.items()):
        eng.store._entries[k] = replace(e, keys=e.keys.cuda(), values=e.values.cuda())
    timed()
    t, st = min((timed() for _ in range(3)), key=lambda x: x[0])
    print(size, "fused, KV on GPU", f"wall {t:.3f} compute {st.compute_s:.3f} load {st.load_s:.3f} wait {st.load_wait_s:.3f}", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
