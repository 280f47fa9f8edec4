"""CPU matmul kernels for the engine's linear layers, chosen by measurement on the running host.

Which kernel computes ``x @ W.T`` fastest depends on the host more than on anything else:
on an AMD EPYC with AVX-512, oneDNN's matmul ran prefills ~2x faster than MKL's sgemm (what
``F.linear`` calls) and a column product ``W @ x.T`` streamed weights ~2x faster for a decoding
step; on an AVX2-only EPYC both were 10-15% *slower* than ``F.linear`` (docs/benchmarks.md,
"Linear-layer kernels"). So nothing is hard-coded: the first engine on a host times every
candidate on the model's own layer shapes, for each row bucket a pass uses, keeps the fastest
(``F.linear`` unless another beats it by more than the noise), and caches the choice.

* :data:`KERNELS` -- the candidates, each ``f(x[rows, in], weight, bias) -> [rows, out]``,
  all the same float32 math (results differ by rounding, ~1e-6 relative).
* :data:`BUCKETS` -- the row counts a pass has: 1 (a decoding step), 2-8 (a step with prompt-lookup
  drafts), a chunk, a fused prefill's selected tokens, a full prefill.
* :class:`KernelPlan` -- the choice, one kernel per bucket; :func:`plan_for` measures or loads it.

The cache file (``<cache dir>/kernels/<key hash>.json``) is keyed by the CPU's model name and
flags, torch's CPU capability and the settings that hold the libraries to fewer instructions
(:data:`ISA_SETTINGS`), the thread count, the torch version and the model's layer shapes. A file that is
corrupt, of another format or of another host is ignored and the kernels are measured again;
it is never trusted blindly. ``RAGBLEND_KERNELS=linear`` turns the choice off (``F.linear``
everywhere), e.g. to compare against transformers' own kernels.

Nothing waits for a measurement (issue 59: on a busy 2-core host it took 40-70 s, in every
process). An engine starts on what the cache holds, or on ``F.linear`` everywhere (what the
model runs without ragblend) when it holds nothing, and :func:`measure_in_background` times
the kernels on a background thread, one short workload at a time and only while no pass runs,
then swaps the new choice in between passes (:meth:`KernelPlan.adopt`). A measurement taken on
a busy machine (its rounds over ``MAX_SPREAD`` apart) is cached all the same, with its spread,
rounds, time and load average, and used by later processes; it is measured again in the
background only when the host looks quiet (:func:`host_is_quiet`), and the new one replaces it
only if its spread is smaller.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..paths import cache_dir
from .host_cache import host_is_quiet, load_average, read_record, record_path, write_record
from .omp import release_thread_pool

log = logging.getLogger("ragblend")

CACHE_FORMAT = "ragblend-kernel-choice"
CACHE_VERSION = 2   # 2: a record carries its spread, rounds, time and load average
# A candidate must beat F.linear by this much to be chosen: less is within the noise of a
# shared 2-core machine, and F.linear is what the model would run without ragblend.
MIN_GAIN = 1.05
# Rounds of one candidate further apart than this mean the machine was busy while measuring:
# the choice is cached all the same (with its spread) and measured again at a quiet moment.
MAX_SPREAD = 2.0
ROUNDS = 5
# The background measurement runs a workload only after this long without a pass through the
# plan, so that it neither slows an answer nor is disturbed by one; it gives up after
# BACKGROUND_LIMIT_S (a server busy all that time keeps the choice it has).
IDLE_S = 0.25
BACKGROUND_LIMIT_S = 900.0


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _column(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # W @ x.T streams the weight row-major; one row is doubled because a matrix-vector
    # product takes another, slower path.
    rows = x.shape[0]
    columns = (x if rows > 1 else torch.cat([x, x])).T
    out = (weight @ columns).T[:rows].contiguous()   # contiguous: SDPA slows on strided inputs
    return out if bias is None else out + bias


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _available_kernels() -> dict[str, Callable]:
    kernels = {"linear": _linear, "column": _column}
    try:
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            kernels["onednn"] = _onednn
    except (AttributeError, RuntimeError):
        pass
    return kernels


KERNELS: dict[str, Callable] = _available_kernels()


@dataclass(frozen=True)
class Bucket:
    """Passes of up to ``most_rows`` rows (and more than the bucket before), timed at ``sample_rows``."""

    name: str
    most_rows: float
    sample_rows: int


BUCKETS = (
    Bucket("1", 1, 1),                 # a decoding step
    Bucket("2-8", 8, 4),               # a decoding step verifying prompt-lookup drafts
    Bucket("9-256", 256, 160),         # a chunk's precompute
    Bucket("257-1024", 1024, 640),     # a fused prefill's selected tokens
    Bucket(">1024", math.inf, 1536),   # a full prefill
)
DRAFT_ROWS = 8   # the most rows a decoding pass has (BUCKETS' second bucket)
# The most rows a decoding twin's low-bit kernels take in one pass: a decoding pass's, and a
# conversation's next question over the K/V the prefix tier kept (core.prefix_reuse), where this
# host measures them faster than float32 at this many rows (core.model.decode_weights).
SHORT_PASS_ROWS = 16


@dataclass
class BucketChoice:
    kernel: str
    seconds: dict[str, float] = field(default_factory=dict)   # fastest round of each candidate
    flops: float = 0.0          # of one timed workload
    weight_bytes: float = 0.0   # read by one timed workload

    def rate(self, kernel: str | None = None) -> tuple[float, float]:
        """(GFLOPS, GB/s of weights) of ``kernel`` (default: the chosen one) in this bucket."""
        s = self.seconds.get(kernel or self.kernel)
        if not s:
            return 0.0, 0.0
        return self.flops / s / 1e9, self.weight_bytes / s / 1e9


@dataclass(frozen=True)
class Measurement:
    """How a choice was measured: what ``ragblend info`` shows and what decides whether it is
    measured again. ``spread``: the largest ratio of a candidate's slowest round to its fastest
    (1.0 on an idle machine); ``load_average``: the host's 1-minute load average as it began."""

    spread: float
    rounds: int
    at: float                       # time.time() when it ended
    load_average: float | None = None

    @property
    def settled(self) -> bool:
        """Whether the rounds agreed (the machine was not busy): such a choice is kept as it is."""
        return self.spread <= MAX_SPREAD

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.at))
        load = "" if self.load_average is None else f", load average {self.load_average:.1f}"
        return f"measured {when}, {self.rounds} rounds up to {self.spread:.1f}x apart{load}"


class KernelPlan:
    """One kernel per row bucket. ``source``: "measured" (by this process), "cache", "default"
    (``F.linear`` until a measurement is in) or "fixed". ``measured`` says how the choice was
    measured (None for "default" and "fixed").

    The choice may change while engines run on it (a background measurement ends): it changes
    only through :meth:`adopt`, with the lock of every engine that runs on the plan held, so a
    pass (which holds its engine's lock) runs on one choice from its first layer to its last."""

    def __init__(self, choices: dict[str, BucketChoice], source: str = "fixed", key: dict | None = None,
                 measured: Measurement | None = None):
        self.choices, self.source, self.key, self.measured = choices, source, key or {}, measured
        self.path: Path | None = None   # its cache file
        self.measuring = False          # a background measurement is running
        self.background: threading.Thread | None = None   # the last one started
        self.last_used = 0.0            # time.monotonic() of the last layer run through it
        self._failed: set[str] = set()
        self._locks: list = []          # the locks of the engines that run on it
        self._guard = threading.Lock()

    @classmethod
    def fixed(cls, kernel: str = "linear", source: str = "fixed") -> "KernelPlan":
        return cls({b.name: BucketChoice(kernel) for b in BUCKETS}, source)

    def kernel_for(self, rows: int) -> str:
        for bucket in BUCKETS:
            if rows <= bucket.most_rows:
                return self.choices[bucket.name].kernel
        return "linear"

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for 2-D ``x``, through this bucket's kernel."""
        self.last_used = time.monotonic()   # a background measurement waits while passes run
        name = self.kernel_for(x.shape[0])
        if name == "linear" or name in self._failed or (name == "onednn" and torch.is_grad_enabled()):
            return F.linear(x, weight, bias)   # oneDNN's op has no backward
        try:
            return KERNELS[name](x, weight, bias)
        except Exception as err:  # a kernel that fails on this host: F.linear from now on
            self._failed.add(name)
            log.warning("ragblend: the %r matmul kernel failed (%s: %s); using F.linear instead.",
                        name, type(err).__name__, err)
            return F.linear(x, weight, bias)

    def attach(self, lock) -> None:
        """Run :meth:`adopt` only while ``lock`` (an engine's, held for each of its passes) is free."""
        with self._guard:
            if not any(held is lock for held in self._locks):
                self._locks.append(lock)

    def engines_busy(self) -> bool:
        """Whether an engine on this plan holds its lock now (runs a pass)."""
        for lock in list(self._locks):
            if not lock.acquire(blocking=False):
                return True
            lock.release()
        return False

    def adopt(self, choices: dict[str, BucketChoice], source: str, measured: Measurement | None,
              wait_s: float = 5.0) -> bool:
        """Swap in a new choice between passes: with every attached lock held (each waited for up
        to ``wait_s``; a pass holds one for its whole length). False if one stayed held."""
        held = []
        try:
            for lock in list(self._locks):
                if not lock.acquire(timeout=wait_s):
                    return False
                held.append(lock)
            self.choices, self.source, self.measured = choices, source, measured
            return True
        finally:
            for lock in reversed(held):
                lock.release()

    def state(self) -> str:
        """Whether the choice is settled, in words (for ``ragblend info``)."""
        if self.source == "fixed":
            return "F.linear everywhere (RAGBLEND_KERNELS=linear)"
        background = "; measuring in the background now" if self.measuring else ""
        if self.measured is None:
            return "F.linear everywhere until measured" + (background or "; no measurement yet on this host")
        by = "by this process" if self.source == "measured" else "cached"
        if self.measured.settled:
            return f"settled: {self.measured.describe()} ({by})"
        return (f"unsettled: {self.measured.describe()} ({by}) on a busy machine; used as it is, measured again "
                f"at a quiet moment{background}")

    def describe(self) -> list[str]:
        """Lines for ``ragblend info``: the kernel per bucket with its measured rate."""
        lines = []
        for bucket in BUCKETS:
            choice = self.choices[bucket.name]
            line = f"{bucket.name:>9} rows: {choice.kernel:<7}"
            if choice.seconds:
                gflops, gbps = choice.rate()
                base_gflops, base_gbps = choice.rate("linear")
                line += (f" {gflops:7.1f} GFLOPS {gbps:6.1f} GB/s   (F.linear {base_gflops:.1f} GFLOPS "
                         f"{base_gbps:.1f} GB/s; timed at {bucket.sample_rows} rows)")
            lines.append(line)
        return lines


# ------------------------------------------------------------------------------- host key


# Settings that narrow which instructions the libraries use below what the CPU has (an AVX-512
# host told to run AVX2 code): a choice measured under other settings does not hold.
ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def _torch_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def _cpu_facts() -> tuple[str, str]:
    """(CPU model name, a hash of its feature flags), from /proc/cpuinfo where there is one."""
    facts: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                label, _, value = line.partition(":")
                facts.setdefault(label.strip().lower(), value.strip())
    except OSError:
        pass
    name = facts.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted((facts.get("flags") or facts.get("features") or "").split()))
    return name, hashlib.sha256(flags.encode()).hexdigest()[:16]


def cpu_summary() -> str:
    """One line naming the CPU and its widest vector extension (for reports)."""
    name, _ = _cpu_facts()
    narrowed = "".join(f", {k}={os.environ[k]}" for k in ISA_SETTINGS if k in os.environ)
    return (f"{name}, {os.cpu_count()} cores, torch CPU capability {_torch_capability()}{narrowed}, "
            f"{torch.get_num_threads()} threads")


def host_key(shapes: Sequence[tuple[int, int]]) -> dict:
    """What a kernel choice depends on. A cached choice is used only when all of it matches."""
    name, flags = _cpu_facts()
    return {"cpu": name, "cpu_flags": flags, "capability": _torch_capability(),
            "isa_settings": {k: os.environ[k] for k in ISA_SETTINGS if k in os.environ},
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernels": sorted(KERNELS), "shapes": [list(s) for s in shapes]}


def layer_shapes(linears: Sequence[torch.nn.Linear]) -> list[tuple[int, int]]:
    return [(m.out_features, m.in_features) for m in linears]


# ------------------------------------------------------------------------------- measuring


def time_workload(kernel: Callable, inputs: dict[int, torch.Tensor], layers: Sequence[torch.nn.Linear]) -> float:
    """Seconds for ``kernel`` to run every layer in ``layers`` once, in order (as a pass does)."""
    start = time.perf_counter()
    for m in layers:
        kernel(inputs[m.in_features], m.weight, m.bias)
    return time.perf_counter() - start


def measure(decoder_layers: Sequence[Sequence[torch.nn.Linear]], head: Sequence[torch.nn.Linear] = (), *,
            timer: Callable = time_workload, rounds: int = ROUNDS,
            before_each: Callable[[], None] | None = None) -> tuple[dict[str, BucketChoice], Measurement]:
    """Time every kernel in :data:`KERNELS` for every bucket and keep the fastest.

    ``decoder_layers`` holds each decoder layer's linear layers; ``head`` the LM head. Decoding
    buckets run the whole model's layers (the weights do not fit in the CPU's caches, as in a
    real step); prefill buckets one decoder layer (compute-bound, the cache does not matter).
    Rounds interleave the candidates so that a noisy neighbour slows them alike, and each
    candidate's fastest round counts (a busy machine only ever adds time). Returns the choices
    and how they were measured (the spread of the rounds says whether the machine was busy).
    ``timer(kernel, inputs, layers) -> seconds`` is replaceable (tests); ``before_each`` runs
    before every timed workload (the background measurement waits there for a quiet moment).
    """
    every = [m for layer in decoder_layers for m in layer] + list(head)
    one_layer = list(decoder_layers[0]) if decoder_layers else every
    generator = torch.Generator().manual_seed(0)
    choices, spread = {}, 1.0
    load_at_start = load_average()
    wait = before_each or (lambda: None)
    with torch.inference_mode():
        for bucket in BUCKETS:
            layers = every if bucket.sample_rows <= DRAFT_ROWS else one_layer
            rows = bucket.sample_rows
            inputs = {n: torch.randn(rows, n, generator=generator) for n in {m.in_features for m in layers}}
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for name, kernel in KERNELS.items():   # once untimed: first-call set-up, and a kernel that fails
                wait()
                try:
                    timer(kernel, inputs, layers)
                except Exception as err:
                    log.info("ragblend: the %r kernel does not run here (%s: %s)", name, type(err).__name__, err)
                    times.pop(name)
            for _ in range(rounds):
                for name in times:
                    wait()
                    times[name].append(timer(KERNELS[name], inputs, layers))
            seconds = {name: min(t) for name, t in times.items()}
            spread = max([spread] + [max(t) / min(t) for t in times.values() if min(t) > 0])
            best = min(seconds, key=seconds.get)
            if best != "linear" and seconds[best] * MIN_GAIN > seconds["linear"]:
                best = "linear"   # not faster beyond the noise
            choices[bucket.name] = BucketChoice(
                best, seconds, flops=sum(2.0 * rows * m.in_features * m.out_features for m in layers),
                weight_bytes=float(sum(m.weight.numel() * m.weight.element_size() for m in layers)))
    return choices, Measurement(round(spread, 3), rounds, time.time(), load_at_start)


def fastest_rounds(workloads: dict[str, Callable[[], object]], rounds: int = 5) -> dict[str, float]:
    """Seconds of each zero-argument workload: the fastest of ``rounds`` interleaved rounds
    (after one untimed call each), as :func:`measure` times kernels."""
    for work in workloads.values():
        work()
    times: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(rounds):
        for name, work in workloads.items():
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


# ------------------------------------------------------------------------------- the cache


def _read_cached(path: Path, key: dict) -> tuple[dict[str, BucketChoice], Measurement] | None:
    """The cached choices at ``path`` and how they were measured, if the file is a valid choice
    for ``key``; else None (logged)."""
    data, why = read_record(path, CACHE_FORMAT, CACHE_VERSION, key, max_bytes=1 << 20)
    if data is not None:
        try:
            choices = {}
            for bucket in BUCKETS:
                raw = data["choices"][bucket.name]
                kernel = raw["kernel"]
                seconds = {str(k): float(v) for k, v in raw.get("seconds", {}).items()}
                if kernel not in KERNELS or not all(math.isfinite(v) and v >= 0 for v in seconds.values()):
                    raise ValueError(f"bad entry for bucket {bucket.name}")
                choices[bucket.name] = BucketChoice(kernel, seconds, float(raw.get("flops", 0)),
                                                    float(raw.get("weight_bytes", 0)))
            raw = data["measured"]
            load = raw["load_average"]
            measured = Measurement(float(raw["spread"]), int(raw["rounds"]), float(raw["at"]),
                                   None if load is None else float(load))
            if not (math.isfinite(measured.spread) and measured.spread >= 1 and measured.rounds > 0
                    and math.isfinite(measured.at) and (load is None or math.isfinite(measured.load_average))):
                raise ValueError("bad measurement facts")
            return choices, measured
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
            why = f"unreadable ({type(err).__name__}: {err})"
    if why:
        log.warning("ragblend: ignoring the kernel cache %s (%s); measuring the kernels again.", path, why)
    return None


def _write_cache(path: Path, key: dict, choices: dict[str, BucketChoice], measured: Measurement) -> None:
    write_record(path, {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": key,
                        "measured": {"spread": measured.spread, "rounds": measured.rounds, "at": measured.at,
                                     "load_average": measured.load_average},
                        "choices": {name: {"kernel": c.kernel, "seconds": c.seconds, "flops": c.flops,
                                           "weight_bytes": c.weight_bytes} for name, c in choices.items()}})


def _better(new: Measurement, old: Measurement | None) -> bool:
    """Whether ``new`` should replace ``old``: a first one, or one whose rounds agree better."""
    return old is None or new.spread < old.spread


def _keep(path: Path, key: dict, choices: dict[str, BucketChoice], measured: Measurement, always: bool) -> None:
    """Cache ``choices`` unless the file holds a measurement at least as sound (``always``: cache them)."""
    if not always:
        cached = _read_cached(path, key) if path.exists() else None
        if cached is not None and not _better(measured, cached[1]):
            return
    _write_cache(path, key, choices, measured)


# ------------------------------------------------------------------------------- the plan


_PLANS: dict[str, KernelPlan] = {}   # per process, by key: engines over one model share a plan
# A model with fewer linear weights than this is measured at once (in well under a second on
# any host: e.g. the tests' tiny models), not in the background.
SMALL_MODEL_WEIGHTS = 2_000_000


def plan_for(decoder_layers: Sequence[Sequence[torch.nn.Linear]], head: Sequence[torch.nn.Linear] = (), *,
             directory: Path | None = None, timer: Callable = time_workload, remeasure: bool = False,
             wait: bool = True) -> KernelPlan:
    """The kernel plan for these layers on this host: from this process, the cache, or measured
    now (``remeasure``: measured now whatever is cached, e.g. ``ragblend info --measure``).
    Without ``wait``, nothing is measured here when the cache holds no choice (unless the model
    is small): the plan is ``F.linear`` everywhere (source "default") until
    :func:`measure_in_background` swaps a measured choice in."""
    if os.environ.get("RAGBLEND_KERNELS", "").strip().lower() == "linear":
        return KernelPlan.fixed("linear")
    if directory is None:
        directory = cache_dir() / "kernels"
    linears = [m for layer in decoder_layers for m in layer] + list(head)
    key = host_key(layer_shapes(linears))
    path = record_path(directory, key)
    memo = str(path)
    shared = _PLANS.get(memo) if timer is time_workload else None
    if shared is not None and not remeasure:
        return shared
    cached = None if remeasure else _read_cached(path, key)
    small = sum(m.weight.numel() for m in linears) < SMALL_MODEL_WEIGHTS
    if cached is not None:
        plan = KernelPlan(cached[0], "cache", key, cached[1])
    elif wait or remeasure or small:
        start = time.perf_counter()
        choices, measured = measure(decoder_layers, head, timer=timer)
        _log_measured(choices, measured, time.perf_counter() - start)
        _keep(path, key, choices, measured, always=remeasure)
        plan = KernelPlan(choices, "measured", key, measured)
    else:
        plan = KernelPlan.fixed("linear", source="default")
        plan.key = key
    plan.path = path
    if shared is not None:   # remeasured: engines running on the shared plan take the new choice
        shared.adopt(plan.choices, plan.source, plan.measured)
        return shared
    if timer is time_workload:
        _PLANS[memo] = plan
    return plan


def _log_measured(choices: dict[str, BucketChoice], measured: Measurement, seconds: float) -> None:
    log.info("ragblend: measured the CPU kernels for this host in %.1f s: %s", seconds,
             ", ".join(f"{name} rows {c.kernel}" for name, c in choices.items()))
    if not measured.settled:
        log.info("ragblend: the machine was busy while the kernels were measured (rounds up to %.1fx apart); the "
                 "choice is cached with its spread and measured again at a quiet moment.", measured.spread)


def needs_measuring(plan: KernelPlan) -> str | None:
    """Why ``plan`` should be measured in the background now, or None: it has no measurement, or
    one taken on a busy machine while this host is quiet now (:func:`host_is_quiet`)."""
    if plan.source == "fixed" or plan.path is None or plan.measuring:
        return None
    if plan.measured is None:
        return "no measurement yet on this host"
    if not plan.measured.settled and host_is_quiet():
        return f"the cached one was taken on a busy machine (rounds {plan.measured.spread:.1f}x apart)"
    return None


class _GaveUp(Exception):
    pass


# Set at interpreter exit: a background measurement stops before its next workload, so that a
# short process (``ragblend ask``) exits cleanly instead of tearing down a thread inside a
# PyTorch kernel ("terminate called without an active exception").
_EXITING = threading.Event()
_RUNNING: set[threading.Thread] = set()


@atexit.register
def _stop_background_measurements(wait_s: float = 30.0) -> None:   # one workload: well under that
    _EXITING.set()   # no measurement starts from now on (measure_in_background)
    deadline = time.monotonic() + wait_s
    while _RUNNING and time.monotonic() < deadline:
        for thread in list(_RUNNING):
            thread.join(max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                _RUNNING.discard(thread)


def measure_in_background(plan: KernelPlan, decoder_layers: Sequence[Sequence[torch.nn.Linear]],
                          head: Sequence[torch.nn.Linear] = (), *, timer: Callable = time_workload,
                          idle_s: float = IDLE_S, limit_s: float = BACKGROUND_LIMIT_S,
                          force: bool = False) -> threading.Thread | None:
    """Measure ``plan``'s kernels on a daemon thread if it needs it (:func:`needs_measuring`, or
    ``force``) and no measurement of it runs yet; the thread, or None.

    The thread runs one timed workload at a time, each after ``idle_s`` without a pass through
    the plan, so an answer waits for nothing and is slowed by one workload at most (~0.1 s);
    it hands its OpenMP workers back after each (see :mod:`.omp`). Within ``limit_s`` it caches
    the new choice (if sounder than the file's) and swaps it into the plan between passes
    (:meth:`KernelPlan.adopt`) if it is sounder than the plan's; past it, it gives up."""
    with plan._guard:
        why = "asked" if force and not plan.measuring and plan.path is not None else needs_measuring(plan)
        if why is None or _EXITING.is_set():
            return None
        plan.measuring = True
    plan.last_used = time.monotonic()   # the engine's start-up just ran: begin after a quiet moment
    thread = threading.Thread(target=_measure_later, args=(plan, list(decoder_layers), list(head), timer, idle_s,
                                                           limit_s, why), name="ragblend-kernels", daemon=True)
    plan.background = thread
    _RUNNING.add(thread)
    try:
        thread.start()
    except RuntimeError:   # no thread to be had (e.g. the interpreter is shutting down)
        _RUNNING.discard(thread)
        plan.measuring = False
        return None
    return thread


def _measure_later(plan: KernelPlan, decoder_layers, head, timer: Callable, idle_s: float, limit_s: float,
                   why: str) -> None:
    deadline = time.monotonic() + limit_s

    def quiet_moment():
        """Return after ``idle_s`` in which no layer ran through the plan and no engine on it held its
        lock at any look (a decoding step on low-bit weights holds the lock without using the plan)."""
        release_thread_pool()   # this thread's OpenMP workers: the answering thread's then spin as usual
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            if now > deadline or _EXITING.is_set():
                raise _GaveUp
            if plan.engines_busy():
                quiet_since = now
            if now - max(quiet_since, plan.last_used) >= idle_s:
                return
            time.sleep(min(0.01, idle_s / 4))

    try:
        log.info("ragblend: measuring the CPU kernels in the background (%s); until then the plan stays as it is.",
                 why)
        start = time.perf_counter()
        choices, measured = measure(decoder_layers, head, timer=timer, before_each=quiet_moment)
        _log_measured(choices, measured, time.perf_counter() - start)
        _keep(plan.path, plan.key, choices, measured, always=False)
        if _better(measured, plan.measured):
            while not plan.adopt(choices, "measured", measured):
                if time.monotonic() > deadline or _EXITING.is_set():
                    raise _GaveUp
    except _GaveUp:
        if not _EXITING.is_set():
            log.info("ragblend: gave up measuring the CPU kernels in the background after %.0f s (no quiet "
                     "moment); the plan stays as it is.", limit_s)
    except Exception as err:   # a measurement that fails leaves the plan as it is
        log.warning("ragblend: measuring the CPU kernels in the background failed (%s: %s); the plan stays as "
                    "it is.", type(err).__name__, err)
    finally:
        release_thread_pool()
        plan.measuring = False
        _RUNNING.discard(threading.current_thread())
