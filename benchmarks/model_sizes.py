"""ragblend and llama-cpp-python on the same GGUF file, at the model sizes people run (1.5-7B).

No 1-8B weights can be downloaded here: the files are random-weight GGUFs of Qwen2.5 1.5B, 3B
and 7B's exact shapes with the real Qwen2.5 tokenizer (:mod:`benchmarks.random_gguf`), Q4_0.
Timings, memory and KV sizes are those of the real model; the answers are noise, so no quality
is reported (fidelity on quantized weights is measured on real models: ``benchmarks.quantized``).

Each shape runs in a process of its own (so that one shape's memory is not counted in the
next's), which prints, in one run:

* the file's size; ragblend's load time and resident memory: the whole process's RSS after the
  load, and the engine's own (RSS after minus before, same process), split into transformers'
  modeling code that the load imports, the weights held (quantized) and the rest (tokenizer,
  buffers); the peak; the chunks' precompute time and the KV bytes stored per token (float16);
* llama-cpp-python's load time and resident memory on the same file (mmap, its default);
* TTFT of the ~3k-token 6-chunk benchmark prompt (``ragblend.data.load_sample``) with the chunks
  in a new order every round (prefix caches hit only the system prompt): ragblend's default
  strategy over the precomputed chunks, ragblend's full prefill, and llama.cpp (its RAM
  prompt cache on); then decoding tokens/s over ``--tokens`` forced greedy tokens (end of
  sequence suppressed). Medians of ``--runs`` interleaved rounds after one warm-up round.
* with ``--ratios``, in the same rounds, ragblend's fused TTFT at each QueryAware ratio (the
  engine's default is uncalibrated: random weights cannot be calibrated), the rows each computed
  and llama.cpp's TTFT over it.

    python -m benchmarks.model_sizes --shapes qwen2.5-1.5b qwen2.5-3b --runs 2
    python -m benchmarks.model_sizes --shapes qwen2.5-7b --runs 1 --no-full-prefill
    python -m benchmarks.model_sizes --shapes qwen2.5-1.5b --runs 1 --fast-prefill   # both prefill plans
    python -m benchmarks.model_sizes --shapes qwen2.5-1.5b --runs 1 --ratios 0.3 0.1 # at QueryAware ratios
    python -m benchmarks.model_sizes --shapes qwen2.5-7b --memory-only --tokens 8    # load + a short prompt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from .common import RUNS_DIR, command_line, write_report
from .random_gguf import SHAPES, write_random_gguf


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Start :func:`peak_since_reset` over (Linux: writing 5 to clear_refs resets VmHWM); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_since_reset() -> int:
    """This process's peak RSS (VmHWM) since :func:`reset_peak`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure_shape(name: str, runs: int, tokens: int, full_prefill: bool, fast_prefill: bool = False,
                  ratios: list[float] | None = None) -> dict:
    """One shape's figures (run in a process of its own); ``ratios``: QueryAware ratios timed
    besides the engine's default (on both plans with ``fast_prefill``)."""
    import torch

    from ragblend import FullRecompute

    path = str(write_random_gguf(name))
    result = {"shape": name, "file_bytes": os.path.getsize(path), "threads": torch.get_num_threads()}
    try:
        import llama_cpp  # noqa: F401  (imported before measuring, so its code is not counted as ragblend's)
    except ImportError:
        pass
    engine, ragblend, sample = load_ragblend(path, tokens, result)
    result["default_ratio"] = engine.resolve().ratio   # uncalibrated: random weights cannot be calibrated
    result["ratios"] = sorted({result["default_ratio"], *(ratios or [])}, reverse=True)
    peers = {"ragblend default": ragblend, **ratio_peers(engine, "ragblend", result, tokens)}
    if full_prefill:
        peers["ragblend full prefill"] = StrategyPeer(engine, tokens, FullRecompute())
    if fast_prefill:
        from ragblend.core.model.quantized import long_pass_plan

        from .peers import RagblendPeer

        fast = fast_prefill_engine(engine)
        result["fast_long_pass"] = long_pass_plan(fast.hf_model)   # the attribute is unset where none was measured
        t0 = time.perf_counter()
        peers["ragblend fast default"] = RagblendPeer(fast, sample["chunks"], tokens)
        result["fast_precompute_s"] = time.perf_counter() - t0
        peers.update(ratio_peers(fast, "ragblend fast", result, tokens))
        if full_prefill:
            peers["ragblend fast full prefill"] = StrategyPeer(fast, tokens, FullRecompute())
    peers.update(load_llama(path, tokens, result))
    times, result["rows"] = timed_rounds(name, engine, peers, sample, runs)
    result["ttft_s"] = {p: statistics.median(t for t, _, _ in v) for p, v in times.items()}
    result["decode_tps"] = {p: statistics.median((tokens - 1) / max(a - t, 1e-9) for t, a, _ in v)
                            for p, v in times.items()}
    result["ragblend_peak"] = max(result["ragblend_peak"], peak_rss_bytes())
    return result


def load_ragblend(path: str, tokens: int, result: dict):
    """``(engine, its peer with the sample's chunks precomputed, the sample)``; load time,
    resident memory and KV bytes into ``result``."""
    from ragblend import Chunk
    from ragblend.core.store.kv_budget import bytes_per_token
    from ragblend.data import load_sample

    from .peers import RagblendPeer

    engine, before = load_measured(path, result)
    sample = load_sample()
    reset = reset_peak()
    t0 = time.perf_counter()
    ragblend = RagblendPeer(engine, sample["chunks"], tokens)
    result["precompute_s"] = time.perf_counter() - t0
    if reset:   # the process's peak while precomputing, the prefill's working memory included
        result["precompute_peak"] = peak_since_reset()
    result["prompt_tokens"] = len(engine.build_prompt([Chunk(c) for c in sample["chunks"]] + [sample["question"]]).token_ids)
    result["kv_bytes_per_token"] = bytes_per_token(engine.kv_shape, "float16")   # as stored, headers included
    result["ragblend_rss_with_kv"] = rss_bytes() - before
    result["ragblend_peak"] = peak_rss_bytes()
    from ragblend.core.model.quantized import fast_prefill, long_pass_plan

    result["long_pass"] = long_pass_plan(engine.hf_model)   # remembered on the model, or forced by the environment
    result["prefill"] = "fast plan" if fast_prefill(engine.hf_model)[0] else "float32"
    return engine, ragblend, sample


def load_measured(path: str, result: dict):
    """``(engine, the process's RSS before the load)``, with the load's time and memory in
    ``result``: the whole process's RSS after it (interpreter, torch, the engine); the engine's
    own (RSS after minus before, in this process), and of that transformers' modeling code where
    the load imported it (a GGUF held on the CPU is built of ragblend's own modules and does not;
    where it does, its size is measured in a fresh process: code any transformers program holds,
    not the model's), and the weights held (the rest: tokenizer, modules, buffers)."""
    from ragblend import BlendEngine
    from ragblend.core.model.quantized import quantized_bytes

    before = rss_bytes()
    t0 = time.perf_counter()
    # No prompt-lookup drafts: random weights repeat themselves, which drafts would turn into a
    # decoding speed real answers do not get (llama.cpp drafts nothing either).
    engine = BlendEngine.from_pretrained(path, kv_dir=False, prompt_lookup_num_tokens=0)
    result["load_s"] = time.perf_counter() - t0
    result["process_rss"] = rss_bytes()
    result["ragblend_rss"] = result["process_rss"] - before
    result["weights_bytes"] = quantized_bytes(engine.hf_model)
    result["library_rss"] = modeling_code_rss() if "transformers.modeling_utils" in sys.modules else 0
    return engine, before


def modeling_code_rss() -> int:
    """The RSS ``transformers.modeling_utils`` adds to a process that has torch and transformers."""
    code = ("import os, torch, transformers\n"
            "def rss():\n    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
            "before = rss()\nimport transformers.modeling_utils\nprint(rss() - before)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def measure_memory(name: str, tokens: int) -> dict:
    """One shape's memory alone (``--memory-only``): load, then a short prompt answered in
    ``tokens`` tokens (its KV in memory); no llama.cpp, no timed rounds."""
    import torch

    path = str(write_random_gguf(name))
    result = {"shape": name, "file_bytes": os.path.getsize(path), "threads": torch.get_num_threads()}
    engine, before = load_measured(path, result)
    t0 = time.perf_counter()
    out = engine.generate(["Which city is the capital of France?"], max_new_tokens=tokens)
    result["short_prompt_s"] = time.perf_counter() - t0
    result["prompt_tokens"] = out.stats.prompt_tokens
    result["ragblend_rss_with_kv"] = rss_bytes() - before
    result["ragblend_peak"] = peak_rss_bytes()
    return result


def fast_prefill_engine(engine):
    """A second engine on ``engine``'s weights (shared, not copied) that prefills on the fast plan
    (``RAGBLEND_QUANTIZED_PREFILL=fast``: bfloat16 matmuls where measured faster), so that one run
    times both prefills under the same load."""
    from ragblend import BlendEngine

    saved = os.environ.get("RAGBLEND_QUANTIZED_PREFILL")
    os.environ["RAGBLEND_QUANTIZED_PREFILL"] = "fast"
    try:
        return BlendEngine(engine.hf_model, engine.tokenizer, prompt_lookup_num_tokens=0)
    finally:
        if saved is None:
            del os.environ["RAGBLEND_QUANTIZED_PREFILL"]
        else:
            os.environ["RAGBLEND_QUANTIZED_PREFILL"] = saved


def load_llama(path: str, tokens: int, result: dict) -> dict:
    """``{"llama-cpp-python": peer}`` on the same file (empty when it is not installed)."""
    from .peers import LlamaCppPeer

    try:
        before = rss_bytes()
        t0 = time.perf_counter()
        llama = LlamaCppPeer(path, tokens, n_ctx=1 << (result["prompt_tokens"] + tokens).bit_length())
    except ImportError:
        result["llama_skipped"] = "llama-cpp-python is not installed (make bench-peers builds it)"
        return {}
    result["llama_load_s"] = time.perf_counter() - t0
    result["llama_rss"] = rss_bytes() - before
    return {"llama-cpp-python": llama}


def timed_rounds(name: str, engine, peers: dict, sample: dict, runs: int) -> tuple[dict[str, list], dict]:
    """``({peer: [(TTFT s, answer s, round)]}, {ragblend peer: its last round's rows (prefill_rows)})``
    over ``runs`` rounds after a warm-up, the chunks in a new order each round, the peers interleaved."""
    from ragblend import Chunk

    chunks, question = sample["chunks"], sample["question"]
    rng = random.Random(0)
    times, rows = {peer: [] for peer in peers}, {}
    for round_ in range(runs + 1):                      # round 0 warms every peer up
        order = chunks[:]
        while order[0] == chunks[0]:
            rng.shuffle(order)
        segments = [Chunk(c) for c in order] + [question]
        token_ids = engine.build_prompt(segments).token_ids
        for peer_name, peer in peers.items():
            ttft, total = peer.answer(token_ids if peer_name == "llama-cpp-python" else segments)
            print(f"{name} round {round_} {peer_name:24} TTFT {ttft:7.2f} s, answer {total:7.2f} s",
                  file=sys.stderr, flush=True)   # progress: stdout carries the result
            if round_:
                times[peer_name].append((ttft, total, round_))
                if hasattr(peer, "engine"):
                    rows[peer_name] = prefill_rows(peer.engine.last_stats)
    return times, rows


class StrategyPeer:
    """ragblend with a strategy of the caller's over the chunks precomputed on ``engine``
    (FullRecompute: its exact full prefill, the chunks' KV unused)."""

    def __init__(self, engine, tokens: int, strategy):
        self.engine, self.tokens, self.strategy = engine, tokens, strategy

    def answer(self, segments) -> tuple[float, float]:
        t0, first = time.perf_counter(), None
        for _ in self.engine.stream(segments, strategy=self.strategy, max_new_tokens=self.tokens):
            first = first or time.perf_counter()
        return first - t0, time.perf_counter() - t0


def ratio_peers(engine, prefix: str, result: dict, tokens: int) -> dict:
    """``{"<prefix> QueryAware <ratio>": peer}`` for each of ``result["ratios"]`` but the engine's
    default (its peer is ``"<prefix> default"``), on the chunks precomputed on ``engine``."""
    from ragblend import QueryAware

    return {ratio_peer_name(prefix, r, result["default_ratio"]): StrategyPeer(engine, tokens, QueryAware(r))
            for r in result["ratios"] if r != result["default_ratio"]}


def ratio_peer_name(prefix: str, ratio: float, default_ratio: float) -> str:
    return f"{prefix} default" if ratio == default_ratio else f"{prefix} QueryAware {ratio:.2f}"


def prefill_rows(stats) -> dict:
    """What one fused prefill computed: the tokens recomputed through every layer (the prompt's
    uncached tokens among them), the uncached tokens alone (QueryAware's question pass runs them
    once more before choosing), and whether the full prefill ran instead."""
    return {"prompt": stats.prompt_tokens, "recomputed": stats.recomputed_tokens,
            "uncached": stats.prompt_tokens - stats.cache_hit_tokens, "skipped": stats.fusion_skipped}


def report(results: list[dict], tokens: int, runs: int) -> list[str]:
    timed = [r for r in results if "ttft_s" in r]
    lines = memory_table(results)
    if timed:
        lines += ["", "Random weights in real shapes (Q4_0): answers are noise, so only time and memory are "
                  f"reported. TTFT: the ~3k-token 6-chunk prompt, chunks in a new order each round; decoding: "
                  f"{tokens} forced greedy tokens; medians of {runs} interleaved rounds after a warm-up.", ""]
        lines += timing_table(timed)
    lines += fast_plan_table([r for r in timed if "ragblend fast default" in r["ttft_s"]])
    lines += ratio_table([r for r in timed if r.get("rows")])
    lines += ["", "Prompt tokens, peak memory and settings:", ""]
    for r in results:
        lines.append(f"- {r['shape']}: {r['prompt_tokens']} prompt tokens; peak RSS of the whole process over the run "
                     f"{r['ragblend_peak'] / 1e9:.2f} GB"
                     + (f", while precomputing the chunks {r['precompute_peak'] / 1e9:.2f} GB" if "precompute_peak" in r else "")
                     + f"; {r['threads']} torch threads"
                     + (f"; prefill matmuls {r.get('long_pass')}, default prefill {r.get('prefill')}" if r in timed
                        else f"; a short prompt answered in {r['short_prompt_s']:.1f} s")
                     + (f"; llama.cpp: {r['llama_skipped']}" if "llama_skipped" in r else
                        f"; llama.cpp load {r['llama_load_s']:.1f} s" if "llama_load_s" in r else ""))
    return lines


def memory_table(results: list[dict]) -> list[str]:
    """Resident memory after the load, whole and in parts (see :func:`load_measured`), each x the file."""
    def gb(value, file_bytes):
        return "-" if value is None else f"{value / 1e9:.2f} ({value / file_bytes:.2f}x)"

    lines = ["Resident memory after the load (RSS, GB, and x the file): the whole process; the engine's own "
             "(RSS after the load minus before it, same process); of that, transformers' modeling code the load "
             "imports; the engine without that code; the weights held. Then the engine's own with the KV of the "
             "prompts it ran in memory, and llama.cpp's RSS growth on the same file (mmap).", "",
             "| shape | file GB | whole process | engine's own | transformers' code | engine without it | "
             "weights held | engine with KV | llama.cpp |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        size = r["file_bytes"]
        lines.append(f"| {r['shape']} | {size / 1e9:.2f} | {gb(r['process_rss'], size)} | {gb(r['ragblend_rss'], size)} | "
                     f"{r['library_rss'] / 1e9:.2f} | {gb(r['ragblend_rss'] - r['library_rss'], size)} | "
                     f"{gb(r['weights_bytes'], size)} | {gb(r['ragblend_rss_with_kv'], size)} | "
                     f"{gb(r.get('llama_rss'), size)} |")
    return lines


def timing_table(results: list[dict]) -> list[str]:
    lines = ["| shape | file GB | ragblend load s | KV KiB/token | precompute s | TTFT ragblend s | TTFT full prefill s | "
             "TTFT llama.cpp s | TTFT llama.cpp / ragblend | decode ragblend tok/s | decode llama.cpp tok/s | "
             "decode ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ttft, tps = r["ttft_s"], r["decode_tps"]
        fused, full, llama = (ttft.get(k) for k in ("ragblend default", "ragblend full prefill", "llama-cpp-python"))
        r_tps, l_tps = tps.get("ragblend default"), tps.get("llama-cpp-python")

        def fmt(value, spec=".2f"):
            return "-" if value is None else format(value, spec)

        lines.append(
            f"| {r['shape']} | {r['file_bytes'] / 1e9:.2f} | {r['load_s']:.1f} | {r['kv_bytes_per_token'] / 1024:.0f} | "
            f"{r['precompute_s']:.1f} | {fmt(fused)} | {fmt(full)} | {fmt(llama)} | "
            f"{fmt(llama and fused and llama / fused, '.1f')}x | {fmt(r_tps, '.1f')} | {fmt(l_tps, '.1f')} | "
            f"{fmt(l_tps and r_tps / l_tps)}x |")
    return lines


def fast_plan_table(fast: list[dict]) -> list[str]:
    if not fast:
        return []
    lines = ["", "The fast prefill plan (RAGBLEND_QUANTIZED_PREFILL=fast) on the same weights, in the same rounds:",
             "", "| shape | plan | precompute s | TTFT fused s | TTFT full prefill s | TTFT llama.cpp / fused | "
             "llama.cpp / full prefill |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in fast:
        ttft = r["ttft_s"]
        fused, full, llama = (ttft.get(k) for k in ("ragblend fast default", "ragblend fast full prefill",
                                                    "llama-cpp-python"))
        lines.append(f"| {r['shape']} | {r['fast_long_pass']} | {r['fast_precompute_s']:.1f} | {fused:.2f} | "
                     f"{'-' if full is None else format(full, '.2f')} | "
                     f"{'-' if llama is None else format(llama / fused, '.1f')}x | "
                     f"{'-' if llama is None or full is None else format(llama / full, '.2f')}x |")
    return lines


# Why a ratio is timed: the default is what a random-weight model runs, as it cannot be calibrated.
RATIO_NOTES = {0.1: "the ratio SmolLM2 calibrates to; random weights cannot be calibrated, so this is what a "
                    "model calibrated there would run"}


def ratio_table(results: list[dict]) -> list[str]:
    """Per QueryAware ratio and prefill plan: the rows the fused prefill computed and its TTFT
    against llama.cpp's full prefill, in the same rounds."""
    if not results:
        return []
    lines = ["", "QueryAware's recompute ratio, in the same rounds. Rows: the prompt tokens the fused prefill "
             "computed through every layer (recomputed), of them the uncached ones (question, template), which "
             "the question pass computes once more; a row's cost is llama.cpp's at best, so its full prefill over "
             "the rows computed bounds the ratio. Ratios:", ""]
    default = results[0]["default_ratio"]
    lines += [f"- {r:.2f}: " + ("the engine's default, uncalibrated (random weights cannot be calibrated)"
                                if r == default else RATIO_NOTES.get(r, "given with --ratios"))
              for r in results[0]["ratios"]]
    lines += ["", "| shape | plan | ratio | prompt tokens | recomputed | of them uncached | rows computed "
              "(+ question pass) | llama.cpp prompt / rows computed | TTFT fused s | TTFT llama.cpp / fused |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        llama = r["ttft_s"].get("llama-cpp-python")
        for plan, prefix in (("default", "ragblend"), ("fast", "ragblend fast")):
            for ratio in r["ratios"]:
                peer = ratio_peer_name(prefix, ratio, r["default_ratio"])
                if peer in r["rows"]:
                    lines.append(ratio_row(r, plan, ratio, r["rows"][peer], r["ttft_s"][peer], llama))
    return lines


def ratio_row(r: dict, plan: str, ratio: float, rows: dict, ttft: float, llama: float | None) -> str:
    computed = rows["recomputed"] + rows["uncached"]
    skipped = " (fusion skipped: full prefill ran)" if rows["skipped"] else ""
    return (f"| {r['shape']} | {plan} | {ratio:.2f}{skipped} | {rows['prompt']} | {rows['recomputed']} | "
            f"{rows['uncached']} | {computed} | {rows['prompt'] / computed:.1f}x | {ttft:.2f} | "
            f"{'-' if llama is None else format(llama / ttft, '.1f')}x |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-3b"], choices=sorted(SHAPES))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="forced greedy tokens decoded per answer")
    parser.add_argument("--no-full-prefill", action="store_true", help="skip ragblend's full prefill (the 7B's is minutes)")
    parser.add_argument("--fast-prefill", action="store_true",
                        help="also time a second engine on the fast prefill plan (RAGBLEND_QUANTIZED_PREFILL=fast)")
    parser.add_argument("--ratios", nargs="+", type=float, default=[], metavar="R",
                        help="also time ragblend's fused TTFT at these QueryAware ratios (default: the engine's own only)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only load each shape and answer a short prompt: memory, no llama.cpp, no TTFT")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # the per-shape child process
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)
    if args.one:
        result = measure_memory(args.one, args.tokens) if args.memory_only else \
            measure_shape(args.one, args.runs, args.tokens, not args.no_full_prefill, args.fast_prefill, args.ratios)
        print("RESULT " + json.dumps(result))
        return
    started, results = time.perf_counter(), []
    for shape in args.shapes:
        write_random_gguf(shape)
        child = [sys.executable, "-m", "benchmarks.model_sizes", "--one", shape, "--runs", str(args.runs),
                 "--tokens", str(args.tokens)] + (["--no-full-prefill"] if args.no_full_prefill else []) \
            + (["--fast-prefill"] if args.fast_prefill else []) + (["--memory-only"] if args.memory_only else []) \
            + (["--ratios", *map(str, args.ratios)] if args.ratios else [])
        out = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=True).stdout
        results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    lines = report(results, args.tokens, args.runs)
    print("\n".join(lines))
    write_report(args.out, "model-sizes-run.md", "Model sizes", command_line("benchmarks.model_sizes", argv),
                 time.perf_counter() - started, lines)


if __name__ == "__main__":
    main()
