"""Decoding speed and what float16 decoding matmuls change, against transformers.

Speed, on the benchmark prompt (6 chunks + question, ~3.1k tokens), medians of ``--runs``
interleaved rounds of ``--tokens`` decoding steps after the same prompt:

* transformers ``generate`` (its decode only: from its first new token to its last, noted by a streamer),
* ragblend's decoder (:class:`~ragblend.core.generate.KVDecoder`) in float32 (exact),
* the same with ``decode_dtype="float16"`` (float16 weights in the decoding matmuls).

Fidelity of float16 decoding, per prompt (fused prefill with the engine's default strategy,
then ``--tokens`` greedy tokens): whether the greedy answer is identical to float32 decoding's,
ROUGE-L between the two, and the KL between the two decoders' next-token distributions at every
step, both fed the float32 answer's tokens.

    python -m benchmarks.decode --models smollm2 --sets fidelity:3 squad:32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragblend import BlendEngine, Chunk
from ragblend.core.calibration import first_token_kl
from ragblend.core.generate import KVDecoder

from .fidelity import MUSIQUE, prompt_sets
from .models import MODELS, model_path
from .run import load_sample, report_per_model, rouge_l


class TokenClock:
    """A transformers streamer that only notes when each token arrives (the first call
    gets the prompt, the second the first new token, after the prefill)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_tokens_per_s(engine: BlendEngine, token_ids: list[int], tokens: int) -> float:
    """transformers ``generate``'s decoding rate: from its first new token to its last."""
    clock = TokenClock()
    with torch.inference_mode():
        engine.hf_model.generate(torch.tensor([token_ids]), max_new_tokens=tokens + 1, min_new_tokens=tokens + 1,
                                 do_sample=False, streamer=clock)
    return tokens / (clock.times[-1] - clock.times[1])


def decode_steps(engine: BlendEngine, pre, tokens: list[int]) -> tuple[float, list[torch.Tensor]]:
    """Feed ``tokens`` one by one after the prefill ``pre``; seconds taken and the logits after each."""
    decoder = KVDecoder(engine._decoding_adapter(), pre.keys, pre.values, len(pre.token_ids) + len(tokens),
                        pre.key_bias)
    logits = []
    t0 = time.perf_counter()
    with engine._lock:
        for token in tokens:
            logits.append(decoder.step(token))
    return time.perf_counter() - t0, logits


def speed(exact: BlendEngine, half: BlendEngine, runs: int, tokens: int) -> list[str]:
    sample = load_sample()
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    exact.precompute(sample["chunks"])
    pre = exact.prefill(segments)
    steps = torch.randint(100, len(exact.tokenizer), (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    times = {"transformers generate (decode only)": [], "ragblend, float32 decoding": [],
             "ragblend, decode_dtype='float16'": []}
    for _ in range(runs):
        times["transformers generate (decode only)"].append(hf_decode_tokens_per_s(exact, pre.token_ids, tokens))
        times["ragblend, float32 decoding"].append(tokens / decode_steps(exact, pre, steps)[0])
        times["ragblend, decode_dtype='float16'"].append(tokens / decode_steps(half, pre, steps)[0])
    base = statistics.median(times["transformers generate (decode only)"])
    lines = [f"Decoding speed after the {len(pre.token_ids)}-token benchmark prompt, {tokens} steps, median of "
             f"{runs} interleaved rounds:", "", "| decoder | tokens/s | vs transformers |", "|---|---:|---:|"]
    for name, values in times.items():
        lines.append(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / base:.2f}x |")
    return lines


def fidelity(exact: BlendEngine, half: BlendEngine, sets: dict, tokens: int) -> list[str]:
    if not any(sets.values()):
        return []
    lines = ["", f"float16 decoding against float32 decoding ({tokens} greedy tokens after the same fused prefill):",
             "", "| set | prompts | identical answers | ROUGE-L mean | step KL mean | step KL max |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, prompts in sets.items():
        same, rouges, kls = 0, [], []
        for prompt in prompts:
            exact.precompute(prompt.chunks)
            segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
            a = exact.generate(segments, max_new_tokens=tokens)
            b = half.generate(segments, max_new_tokens=tokens)
            same += a.token_ids == b.token_ids
            rouges.append(rouge_l(b.text, a.text))
            pre = exact.prefill(segments)
            fed = a.token_ids[:-1]
            _, exact_logits = decode_steps(exact, pre, fed)
            _, half_logits = decode_steps(half, pre, fed)
            kls += [first_token_kl(x, y) for x, y in zip(exact_logits, half_logits)]
        if prompts:
            lines.append(f"| {name} | {len(prompts)} | {same}/{len(prompts)} | {statistics.mean(rouges):.3f} | "
                         f"{statistics.mean(kls) if kls else 0:.2e} | {max(kls, default=0):.2e} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sets", nargs="+", default=["fidelity:3", "squad:32"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="docs")
    args = parser.parse_args(argv)

    def measure(model: str) -> list[str]:
        exact = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
        half = BlendEngine(exact.hf_model, exact.tokenizer, store=exact.store, decode_dtype="float16")
        return [f"## {model}", "", *speed(exact, half, args.runs, args.tokens),
                *fidelity(exact, half, prompt_sets(args.sets, MUSIQUE), args.tokens), ""]

    report_per_model(args.models, measure, args.out, "decode-run.md", "Decoding", "benchmarks.decode", argv)

if __name__ == "__main__":
    main()
