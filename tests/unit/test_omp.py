"""ragblend.core.model.omp: a thread's idle OpenMP workers are handed back after its work."""

import os
import threading

import pytest
import torch

from ragblend.core.model.omp import release_thread_pool


def os_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def parallel_work() -> None:
    torch.randn(1 << 22).mul_(2.0)   # large enough for PyTorch to start its OpenMP team


needs_gomp = pytest.mark.skipif(not os.path.exists("/proc/self/maps") or torch.get_num_threads() < 2
                                or not release_thread_pool(), reason="needs Linux, libgomp and 2+ threads")


@needs_gomp
def test_a_thread_that_worked_hands_its_workers_back():
    done, go = threading.Event(), threading.Event()
    counts = {}

    def worker():
        parallel_work()
        counts["after work"] = os_threads()
        counts["released"] = release_thread_pool()
        counts["after release"] = os_threads()
        done.set()
        go.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    assert done.wait(30)
    go.set()
    thread.join()
    assert counts["released"]
    assert counts["after release"] < counts["after work"]   # its OpenMP worker thread ended


@needs_gomp
def test_an_engine_call_leaves_no_idle_workers_in_the_calling_thread(tiny_engine):
    # The count is the whole process's: another test's thread starting or ending at the same
    # moment can hide the drop once (232 threads alive in a full run), never three times.
    dropped = []
    for attempt in range(3):
        parallel_work()
        before_call = os_threads()
        tiny_engine.precompute([f"A chunk about the lighthouse keepers of the northern coast, log {attempt}."])
        dropped.append(os_threads() < before_call)   # precompute ended by releasing this thread's team
        if dropped[-1]:
            break
    assert any(dropped)


def test_releasing_is_harmless_anywhere():
    release_thread_pool()
    release_thread_pool()   # twice, with no team: still fine
    parallel_work()         # and the next kernel starts a new team
