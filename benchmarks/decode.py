"""Decoding speed against transformers, and whether ragblend's decoding keeps the greedy answers.

ragblend decodes on a twin of the model whose linear layers compute a step's few rows with a
column product (``CpuLinear``), and drafts tokens by prompt lookup that one pass verifies
(``prompt_lookup_num_tokens``). Both are meant to leave greedy answers as they are; this
measures it.

Speed, on the benchmark prompt (6 chunks + question, ~3.1k tokens), medians of ``--runs``
interleaved rounds of a ``--tokens``-token greedy answer (end tokens suppressed) after the
same fused prefill:

* transformers ``generate`` (its decode only: from its first new token to its last, noted by a streamer),
* the reference decoder: the model's own layers (``F.linear``), one token per pass, as before;
* ragblend's decoding with each ``--drafts`` setting of ``prompt_lookup_num_tokens`` (0: no drafting),
* the same with each ``--decode-dtypes`` setting: ``"float16"`` (float16 weights in the decoding
  matmuls), ``"int4"`` (4-bit weights with bfloat16 activations; the LM head stays float32),
  ``"int8"`` (8-bit weights, one scale per row, bfloat16 activations; the LM head too), ``"auto"``
  (the default: 4-bit where the weights already are, 8-bit elsewhere, each kept where it
  measures faster than float32 on the host),
* with ``--every-pass``: the engine's defaults, and the same drafting every token it finds on
  every pass (what it did before :class:`~ragblend.core.decode.generate.DraftPolicy` priced a drafted
  row); ``--sets`` with no set times speed only.

Agreement, per prompt set (fused prefill with the engine's default strategy, then up to
``--tokens`` greedy tokens, stopping at the end token): answers identical to the reference
decoder's, ROUGE-L to them, the decoding time of the set, its passes per token and how many
passes a low-bit decoding ran again in float32 at a near tie; for the engine's float32 kernels
and each other decode dtype, the KL between its next-token distributions and the reference's at
every step (both fed the reference answer), and how far low-bit rounding moves the margin
between a step's top two tokens (the near-tie table, which ``NEAR_TIE`` is set from).

    python -m benchmarks.decode --models smollm2 --sets fidelity:6 squad:32
    python -m benchmarks.decode --models smollm2 qwen2.5-0.5b --kv-agreement --decode-kv-dtypes bfloat16 float16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragblend import BlendEngine, Chunk
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.decode.generate import NEAR_TIE, KVDecoder
from ragblend.core.model.adapter import ModelAdapter
from ragblend.core.model.kernels import cpu_summary
from ragblend.data import load_sample

from .common import MUSIQUE, RUNS_DIR, TokenClock, percentile, prompt_sets, report_per_model, rouge_l
from .models import MODELS, model_path

_REFERENCES: dict = {}


def transformers_reference(hf_model):
    """``hf_model``, or for a GGUF model on ragblend's own modules (no ``generate``) transformers'
    model of the same file in float32, built once."""
    if hasattr(hf_model, "generate"):
        return hf_model
    if id(hf_model) not in _REFERENCES:
        from ragblend.core.model.gguf_file import read_gguf
        from ragblend.core.model.quantized import build_quantized_model

        _REFERENCES[id(hf_model)] = build_quantized_model(read_gguf(hf_model.ragblend_source["path"]), hf_model.config,
                                                          exact=True, transformers_modules=True)
    return _REFERENCES[id(hf_model)]


def hf_decode_s(engine: BlendEngine, token_ids: list[int], tokens: int) -> float:
    """Seconds transformers ``generate`` takes from the first to the last token of a
    ``tokens``-token answer (``tokens - 1`` passes, as ragblend's decoding makes)."""
    clock = TokenClock()
    model = transformers_reference(engine.hf_model)
    with torch.inference_mode():
        model.generate(torch.tensor([token_ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, streamer=clock)
    return clock.times[-1] - clock.times[1]


def reference_answer(engine: BlendEngine, pre, tokens: int,
                     stop_at_end: bool = True) -> tuple[list[int], float, int]:
    """Greedy answer after the prefill ``pre`` on the model's own layers, one token per pass
    (what ragblend decoded with before the column product and drafting): its token ids, the
    seconds its passes took, and how many passes it made."""
    decoder = KVDecoder(ModelAdapter(engine.hf_model), pre.keys, pre.values, len(pre.token_ids) + tokens,
                        pre.key_bias)
    answer, logits, passes, t0 = [], pre.logits, 0, time.perf_counter()
    with engine.lock:
        while len(answer) < tokens:
            token = int(torch.argmax(logits))
            if stop_at_end and token in engine.answers.eos_ids:
                break
            answer.append(token)
            if len(answer) < tokens:
                logits, passes = decoder.step(token), passes + 1
    return answer, time.perf_counter() - t0, passes


def ragblend_answer(engine: BlendEngine, segments, tokens: int, drafts: int):
    """ragblend's greedy answer with ``drafts`` tokens drafted per pass: (token ids, decode s, passes)."""
    engine.prompt_lookup_num_tokens = drafts
    result = engine.generate(segments, max_new_tokens=tokens)
    return result.token_ids, engine.last_stats.decode_s, engine.last_stats.decode_steps


def teacher_forced_steps(engine: BlendEngine, pre, answer: list[int]) -> list[dict]:
    """Per step of ``answer`` fed to both, ``engine``'s decoding against the reference layers':
    the KL between their next-token distributions; ``gap``, the decoding's margin between its top
    two tokens, and ``gap_error``, how far that is from the reference's margin between the same
    two; ``differs``, whether their greedy picks differ (what :data:`~ragblend.core.decode.generate.NEAR_TIE`
    is set from)."""
    capacity = len(pre.token_ids) + len(answer)
    ref = KVDecoder(ModelAdapter(engine.hf_model), pre.keys, pre.values, capacity, pre.key_bias)
    twin = KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, capacity, pre.key_bias,
                     dtype=engine.answers.kv_dtype)
    steps = []
    with engine.lock:
        for token in answer[:-1]:
            want, got = ref.step(token), twin.step(token)
            top = got.topk(2)
            (first, second), (a, b) = top.values.tolist(), top.indices.tolist()
            steps.append({"kl": first_token_kl(want, got), "gap": first - second,
                          "gap_error": abs((first - second) - float(want[a] - want[b])),
                          "differs": int(torch.argmax(want)) != a})
    return steps


def near_tie_line(set_name: str, dtype: str, steps: list[dict]) -> str:
    """A row of the near-tie table: the gap errors' spread, the picks that differ and their largest gap."""
    errors = [s["gap_error"] for s in steps] or [0.0]
    differ = [s["gap"] for s in steps if s["differs"]]
    under = sum(s["gap"] < NEAR_TIE for s in steps)
    return (f"| {set_name} | {dtype} | {len(steps)} | {statistics.median(errors):.4f} | "
            f"{percentile(errors, 0.99):.4f} | {max(errors):.4f} | {len(differ)} | "
            f"{max(differ, default=0):.4f} | {under} ({100 * under / max(len(steps), 1):.1f}%) |")


def speed(exact: BlendEngine, others: dict[str, BlendEngine], runs: int, tokens: int, drafts: list[int],
          every_pass: BlendEngine | None = None) -> list[str]:
    sample = load_sample()
    segments = [Chunk(c) for c in sample["chunks"]] + [sample["question"]]
    exact.precompute(sample["chunks"])
    pre = exact.prefill(segments)
    ends = exact.answers.eos_ids
    engines = [exact, *others.values(), *([every_pass] if every_pass else [])]
    for engine in engines:
        engine.answers.eos_ids = frozenset()   # exactly `tokens` tokens, like transformers with min_new_tokens
    variants = {"transformers generate (decode only)": lambda: (hf_decode_s(exact, pre.token_ids, tokens), tokens - 1),
                "reference decoder (F.linear, one token a pass)":
                    lambda: reference_answer(exact, pre, tokens, stop_at_end=False)[1:]}
    for n in drafts:
        variants[f"ragblend, decode_dtype='float32', prompt_lookup_num_tokens={n}"] = lambda n=n: ragblend_answer(exact, segments, tokens, n)[1:]
    for dtype, other in others.items():
        for n in sorted({0, drafts[-1]}):
            variants[f"ragblend, {dtype}, prompt_lookup_num_tokens={n}"] = \
                lambda other=other, n=n: ragblend_answer(other, segments, tokens, n)[1:]
    if every_pass is not None:
        variants[f"ragblend, defaults, prompt_lookup_num_tokens={drafts[-1]} drafting all it finds on every pass "
                 "(before DraftPolicy)"] = lambda: ragblend_answer(every_pass, segments, tokens, drafts[-1])[1:]
    times = {name: [] for name in variants}
    passes = {}
    for _ in range(runs):
        for name, run in variants.items():
            seconds, passes[name] = run()
            times[name].append(seconds)
    for engine in engines:
        engine.answers.eos_ids = ends
    base = statistics.median(times["transformers generate (decode only)"])
    lines = [f"Decoding speed after the {len(pre.token_ids)}-token benchmark prompt, {tokens} greedy tokens, "
             f"median of {runs} interleaved rounds:", "",
             "| decoder | decode s | tokens/s | passes | speed-up vs transformers |", "|---|---:|---:|---:|---:|"]
    for name, values in times.items():
        seconds = statistics.median(values)
        lines.append(f"| {name} | {seconds:.3f} | {(tokens - 1) / seconds:.1f} | {passes[name]} | {base / seconds:.2f}x |")
    return lines


def agreement(exact: BlendEngine, others: dict[str, BlendEngine], sets: dict, tokens: int,
              drafts: list[int]) -> list[str]:
    if not any(sets.values()):
        return []
    variants = [(f"decode_dtype='float32', prompt_lookup_num_tokens={n}", exact, n) for n in drafts]
    variants += [(f"{dtype}, prompt_lookup_num_tokens={drafts[-1]}", other, drafts[-1])
                 for dtype, other in others.items()]
    dtypes = {"float32 (the engine's kernels)": exact, **others}
    lines = ["", f"Against the reference decoder (up to {tokens} greedy tokens after the same fused prefill; "
             "decode s and passes per token summed over the set):", "",
             "| set | prompts | decoding | identical answers | ROUGE-L mean | decode s | passes per token | "
             "passes made again in float32 (near ties) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    kl_lines, tie_lines = [], []
    for set_name, prompts in sets.items():
        if not prompts:
            continue
        same = {name: 0 for name, _, _ in variants}
        rouges = {name: [] for name, _, _ in variants}
        names = ["reference", *same]
        seconds, passes = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        rechecks = dict.fromkeys(names, 0)
        produced, kls, ties = 0, {dtype: [] for dtype in dtypes}, {dtype: [] for dtype in dtypes}
        for prompt in prompts:
            exact.precompute(prompt.chunks)
            segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
            pre = exact.prefill(segments)
            ref, ref_s, ref_passes = reference_answer(exact, pre, tokens)
            ref_text = exact.tokenizer.decode(ref, skip_special_tokens=True)
            seconds["reference"] += ref_s
            passes["reference"] += ref_passes
            produced += len(ref)
            for dtype, engine in dtypes.items():
                steps = teacher_forced_steps(engine, pre, ref)
                kls[dtype] += [step["kl"] for step in steps]
                ties[dtype] += steps
            for name, engine, n in variants:
                ids, decode_s, steps = ragblend_answer(engine, segments, tokens, n)
                same[name] += ids == ref
                rouges[name].append(rouge_l(engine.tokenizer.decode(ids, skip_special_tokens=True), ref_text))
                seconds[name] += decode_s
                passes[name] += steps
                rechecks[name] += engine.last_stats.decode_rechecks
        per_token = max(produced, 1)
        lines.append(f"| {set_name} | {len(prompts)} | reference | - | - | {seconds['reference']:.2f} | "
                     f"{passes['reference'] / per_token:.2f} | - |")
        for name, _, _ in variants:
            lines.append(f"| {set_name} | {len(prompts)} | {name} | {same[name]}/{len(prompts)} | "
                         f"{statistics.mean(rouges[name]):.3f} | {seconds[name]:.2f} | {passes[name] / per_token:.2f} | "
                         f"{rechecks[name]} of {passes[name]} |")
        for dtype, values in kls.items():
            kl_lines.append(f"| {set_name} | {dtype} | {len(values)} | {statistics.mean(values) if values else 0:.2e} | "
                            f"{statistics.median(values) if values else 0:.2e} | {max(values, default=0):.2e} |")
        tie_lines += [near_tie_line(set_name, dtype, steps) for dtype, steps in ties.items()]
    return [*lines, "", "Step KL against the reference layers (float32 F.linear, fed the reference answer):", "",
            "| set | decoding | steps | KL mean | KL median | KL max |", "|---|---|---:|---:|---:|---:|", *kl_lines,
            "", "Near ties, fed the reference answer: how far each step's margin between the decoding's top two "
            "tokens is from the reference layers' margin between the same two (gap error), the steps whose "
            f"greedy picks differ and the largest margin among them, and the steps with a margin under NEAR_TIE "
            f"({NEAR_TIE}), which a low-bit decoding runs again in float32:", "",
            "| set | decoding | steps | gap error median | 99th percentile | max | picks that differ | "
            "their largest margin | margins under NEAR_TIE |", "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *tie_lines]


def kv_agreement(model: str, kv_dtypes: list[str], sets: dict, tokens: int) -> list[str]:
    """The default decoding with each ``decode_kv_dtype`` against the same with float32 K/V: identical
    greedy answers (``tokens`` at most, drafts on), and per step the KL of its next-token distribution
    from the float32 K/V's, both fed the float32 K/V's answer."""
    base = BlendEngine.from_pretrained(model_path(model), kv_dir=False, decode_kv_dtype="float32")
    others = {kv: BlendEngine(base.hf_model, base.tokenizer, store=base.store, decode_kv_dtype=kv) for kv in kv_dtypes}
    lines = [f"Decoding K/V dtypes against float32 K/V (decode_dtype='auto': "
             f"{', '.join(f'{n} {kind}' for kind, n in base.decode_weights.layer_counts().items())}; "
             f"up to {tokens} greedy tokens, prompt lookup on):", "",
             "| set | prompts | decode_kv_dtype | identical answers | ROUGE-L mean | step KL mean | median | max |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for set_name, prompts in sets.items():
        same, rouges, kls = ({kv: [] for kv in kv_dtypes} for _ in range(3))
        for prompt in prompts:
            base.precompute(prompt.chunks)
            segments = [Chunk(c) for c in prompt.chunks] + [prompt.question]
            ref = base.generate(segments, max_new_tokens=tokens)
            pre = base.prefill(segments)
            capacity = len(pre.token_ids) + len(ref.token_ids)
            for kv, engine in others.items():
                out = engine.generate(segments, max_new_tokens=tokens)
                same[kv].append(out.token_ids == ref.token_ids)
                rouges[kv].append(rouge_l(out.text, ref.text))
                exact = KVDecoder(base.decoding_adapter(), pre.keys, pre.values, capacity, pre.key_bias)
                other = KVDecoder(engine.decoding_adapter(), pre.keys, pre.values, capacity, pre.key_bias,
                                  dtype=engine.answers.kv_dtype)
                with base.lock:
                    kls[kv] += [first_token_kl(exact.step(t), other.step(t)) for t in ref.token_ids[:-1]]
        for kv in kv_dtypes:
            values = kls[kv] or [0.0]
            lines.append(f"| {set_name} | {len(prompts)} | {kv} | {sum(same[kv])}/{len(prompts)} | "
                         f"{statistics.mean(rouges[kv]):.3f} | {statistics.mean(values):.2e} | "
                         f"{statistics.median(values):.2e} | {max(values):.2e} |")
            print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=MODELS)
    parser.add_argument("--sets", nargs="*", default=["fidelity:3", "squad:32"],
                        help="prompt sets for the agreement (none: speed only)")
    parser.add_argument("--every-pass", action="store_true",
                        help="also time the default engine, and the same drafting all it finds on every pass "
                             "(as before DraftPolicy)")
    parser.add_argument("--runs", type=int, default=5, help="speed rounds (0: agreement only)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--drafts", nargs="+", type=int, default=[0, 3],
                        help="prompt_lookup_num_tokens settings to time (the last also runs with --decode-dtypes)")
    parser.add_argument("--decode-dtypes", nargs="*", default=["int4"], choices=["auto", "float16", "int4", "int8"])
    parser.add_argument("--decode-kv-dtypes", nargs="*", default=[], choices=["float32", "bfloat16", "float16"],
                        help="also decode_dtype='auto' with each of these decode_kv_dtype settings")
    parser.add_argument("--kv-agreement", action="store_true",
                        help="only compare --decode-kv-dtypes against float32 K/V on --sets (no speed, no reference)")
    parser.add_argument("--out", default=RUNS_DIR)
    args = parser.parse_args(argv)

    if args.kv_agreement:
        report_per_model(args.models, lambda model: [f"## {model}", "", f"Host: {cpu_summary()}", "", *kv_agreement(
            model, args.decode_kv_dtypes, prompt_sets(args.sets, MUSIQUE), args.tokens), ""],
            args.out, "decode-kv-run.md", "Decoding K/V dtypes", "benchmarks.decode", argv)
        return

    def measure(model: str) -> list[str]:
        exact = BlendEngine.from_pretrained(model_path(model), kv_dir=False, decode_dtype="float32")
        others = {f"decode_dtype={dtype!r}": BlendEngine(exact.hf_model, exact.tokenizer, store=exact.store,
                                                         decode_dtype=dtype, decode_kv_dtype="float32")
                  for dtype in args.decode_dtypes}
        others.update({f"decode_dtype='auto', decode_kv_dtype={kv!r}": BlendEngine(
            exact.hf_model, exact.tokenizer, store=exact.store, decode_dtype="auto", decode_kv_dtype=kv)
            for kv in args.decode_kv_dtypes})
        every_pass = None
        if args.every_pass and args.runs:   # the defaults, and the defaults drafting whatever they find
            others["defaults (decode_dtype='auto', decode_kv_dtype='auto')"] = BlendEngine(
                exact.hf_model, exact.tokenizer, store=exact.store)
            every_pass = BlendEngine(exact.hf_model, exact.tokenizer, store=exact.store)
            every_pass.answers.draft_row_cost = 0.0   # a free row: DraftPolicy drafts all it finds, as before it
        timed = speed(exact, others, args.runs, args.tokens, args.drafts, every_pass) if args.runs else []
        return [f"## {model}", "", f"Host: {cpu_summary()}", "", *timed,
                *agreement(exact, others, prompt_sets(args.sets, MUSIQUE), args.tokens, args.drafts), ""]

    report_per_model(args.models, measure, args.out, "decode-run.md", "Decoding", "benchmarks.decode", argv)


if __name__ == "__main__":
    main()
