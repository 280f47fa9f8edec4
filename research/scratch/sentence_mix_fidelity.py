# PYTHONPATH=. python3 research/scratch/sentence_mix_fidelity.py MIX <benchmarks.fidelity arguments>  (session 32)
"""benchmarks.fidelity with QueryAware(sentence_runs=True)'s claim mixed with single tokens: a
reused token's claim is its sentence's mean question attention plus MIX x its own (whole
sentences alone: MIX 1e-4; the library's default since session 33: 0.25). Its "sentence runs"
rows are this mix."""
import sys

from ragblend.core.fusion import selection

# Session 32 patched by_sentence to add MIX x claims to the library's 1e-4; since session 33 the
# share is the library's SENTENCE_OWN_SHARE (0.25), set here: the same claims to 1e-4.
selection.SENTENCE_OWN_SHARE = float(sys.argv[1])

from benchmarks import fidelity  # noqa: E402

fidelity.main(sys.argv[2:])
