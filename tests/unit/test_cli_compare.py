"""`ragblend ask --compare` (and `ragblend demo`) count a fused answer's fallback to the exact path
(it began to loop): the full prefill it then runs comes after its first token, so the TTFT
comparison alone leaves it out (a finding of a user trial, session 49). A tiny random LLM whose
loop rule is loosened so that its fused answer loops."""

import dataclasses

from ragblend import Chunk, FullRecompute, QueryAware
from ragblend.cli.ask import fallback_line, print_comparison
from ragblend.core.decode.repeats import RepeatRule
from ragblend.core.results import Stats
from ragblend.integrations.compare import speed_ratio

from ..conftest import PASSAGES, make_tiny_engine

LOOSE = RepeatRule(1, 1, needs_letter=False)   # a tiny random model's tokens need not be words


def looping_engine(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer)
    engine.answers.repeat_rule = LOOSE
    return engine


def test_a_fallback_is_counted_in_whole_answer_times(tokenizer, capsys):
    engine = looping_engine(tokenizer)
    engine.precompute(PASSAGES)
    prompt = [Chunk(p) for p in reversed(PASSAGES)] + ["Question: who ran the ferry?"]
    fused = engine.generate(prompt, strategy=QueryAware(0.3), max_new_tokens=48).stats
    full = engine.generate(prompt, strategy=FullRecompute(), max_new_tokens=48).stats
    assert fused.fallback_tokens > fused.prompt_tokens   # it fell back: the prompt and the answer kept
    line = fallback_line(fused, full)
    fused_s, full_s = fused.ttft_s + fused.decode_s, full.ttft_s + full.decode_s
    assert f"fell back to a full prefill of {fused.fallback_tokens} tokens after its first token" in line
    assert f"whole answers: {speed_ratio(fused_s, full_s).text} ({fused_s:.2f} s against {full_s:.2f} s, " \
           f"{fused.generated_tokens} and {full.generated_tokens} tokens generated)" in line
    # no fallback, or one that failed (it computed nothing): the TTFT comparison says it all
    assert fallback_line(full, full) == ""
    assert fallback_line(dataclasses.replace(fused, fallback_tokens=0), full) == ""
    assert fallback_line(None, full) == fallback_line(fused, None) == ""
    # as `ragblend ask --compare` prints it: under the TTFT line
    speed = print_comparison(fused, full)
    assert capsys.readouterr().out == f"=> {speed.text} (TTFT {fused.ttft_s:.2f} s against {full.ttft_s:.2f} s)\n" \
                                      f"   {line}\n\n"
    print_comparison(full, full)   # no fallback: the line alone, as before
    out = capsys.readouterr().out
    assert out.startswith("=> fused 1.0x: as fast as full prefill") and out.count("\n") == 2


def test_a_slower_whole_answer_is_worded_as_one():
    fused = Stats(ttft_s=0.5, decode_s=3.0, fusion_fallback="repeating answer: ...", fallback_tokens=700,
                  generated_tokens=40)
    full = Stats(ttft_s=1.5, decode_s=1.5, generated_tokens=40)
    line = fallback_line(fused, full)
    assert "whole answers: fused 0.9x: slower than full prefill (3.50 s against 3.00 s" in line
    assert "faster" not in line
