"""OpenMP worker threads and Python threads.

PyTorch's CPU kernels run on OpenMP (libgomp on Linux). Every Python thread that runs a kernel
gets its own team of OpenMP worker threads, kept after the call. Once the process holds more
such workers than it has cores, libgomp stops spinning between kernels and puts workers to
sleep, for every team: on a 2-core host, a prefill run from a second thread (a server's worker,
the background KV filler, a Streamlit script) took ~30% longer and decoding ~35% longer than the
same work on the thread that had loaded the model, whose idle team still counted
(docs/notes/threads.md).

:func:`release_thread_pool` hands the calling thread's workers back when its burst of work is
over (the engine calls it after loading, prefilling, generating and precomputing), so the
thread that works next is the only team and spins as usual. The next kernel on a released
thread starts a new team (one thread start, microseconds). Where the runtime has no such call
(another OpenMP runtime, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools

import torch  # noqa: F401  (loads the OpenMP runtime this module looks for)

_OMP_PAUSE_SOFT = 1   # omp_pause_soft: free the threads, keep what the runtime needs to restart


@functools.cache
def _pause_function():
    """libgomp's ``omp_pause_resource_all`` as loaded by torch, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths, key=lambda p: "torch" not in p):   # torch's own copy first
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers (see the module doc); True if it did.

    Safe to call at any time: inside a parallel region, or where the runtime lacks the call,
    nothing happens."""
    pause = _pause_function()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
