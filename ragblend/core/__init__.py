"""The fusion engine. Imports torch and transformers only."""

import os as _os
import sys as _sys

# OpenMP workers (libgomp) spin 300,000 rounds (~3 ms) waiting for the next kernel, until the
# process holds more of them than cores; then 100. Every ragblend process gets there at its
# first answer read from disk (the prefetch and write-back threads' teams), so its first answer
# ran otherwise than the later ones: on a busy host the spinning workers took the CPU the
# computing thread needed, and a first fused answer cost 14 CPU-s against 1.3 for the second
# (issue 59; docs/notes/threads.md). 1,000 rounds (~10 us) from the start: every answer runs
# alike. Set before torch loads libgomp, which reads it once; a user's own setting stays.
if "torch" not in _sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ):
    _os.environ["GOMP_SPINCOUNT"] = "1000"
