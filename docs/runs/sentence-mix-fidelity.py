# PYTHONPATH=. python3 docs/runs/sentence-mix-fidelity.py MIX <benchmarks.fidelity arguments>  (session 32)
"""benchmarks.fidelity with QueryAware(sentence_runs=True)'s claim mixed with single tokens: a
reused token's claim is its sentence's mean question attention plus MIX x its own (the library's
whole sentences are MIX 0). Its "sentence runs" rows are this mix."""
import sys

from ragblend.core import selection

MIX = float(sys.argv[1])
by_sentence = selection.QuestionAttention.by_sentence
selection.QuestionAttention.by_sentence = staticmethod(lambda prompt, claims: by_sentence(prompt, claims) + MIX * claims)

from benchmarks import fidelity  # noqa: E402

fidelity.main(sys.argv[2:])
