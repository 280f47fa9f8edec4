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
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .host_cache import read_record, record_path, write_record

log = logging.getLogger("ragblend")

CACHE_FORMAT = "ragblend-kernel-choice"
CACHE_VERSION = 1
# A candidate must beat F.linear by this much to be chosen: less is within the noise of a
# shared 2-core machine, and F.linear is what the model would run without ragblend.
MIN_GAIN = 1.05
# Rounds of one candidate further apart than this mean the machine was busy while measuring:
# the choice then serves this process only and is measured again by the next.
MAX_SPREAD = 2.0


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


@dataclass
class KernelPlan:
    """One kernel per row bucket. ``source``: "measured", "cache" or "fixed"."""

    choices: dict[str, BucketChoice]
    source: str = "fixed"
    key: dict = field(default_factory=dict)
    _failed: set = field(default_factory=set, repr=False)

    @classmethod
    def fixed(cls, kernel: str = "linear") -> "KernelPlan":
        return cls({b.name: BucketChoice(kernel) for b in BUCKETS})

    def kernel_for(self, rows: int) -> str:
        for bucket in BUCKETS:
            if rows <= bucket.most_rows:
                return self.choices[bucket.name].kernel
        return "linear"

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for 2-D ``x``, through this bucket's kernel."""
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
            timer: Callable = time_workload, rounds: int = 5) -> tuple[dict[str, BucketChoice], bool]:
    """Time every kernel in :data:`KERNELS` for every bucket and keep the fastest.

    ``decoder_layers`` holds each decoder layer's linear layers; ``head`` the LM head. Decoding
    buckets run the whole model's layers (the weights do not fit in the CPU's caches, as in a
    real step); prefill buckets one decoder layer (compute-bound, the cache does not matter).
    Rounds interleave the candidates so that a noisy neighbour slows them alike, and each
    candidate's fastest round counts (a busy machine only ever adds time). Returns the choices
    and whether the measurement looked disturbed (a candidate's rounds over ``MAX_SPREAD`` apart).
    ``timer(kernel, inputs, layers) -> seconds`` is replaceable (tests).
    """
    every = [m for layer in decoder_layers for m in layer] + list(head)
    one_layer = list(decoder_layers[0]) if decoder_layers else every
    generator = torch.Generator().manual_seed(0)
    choices, disturbed = {}, False
    with torch.inference_mode():
        for bucket in BUCKETS:
            layers = every if bucket.sample_rows <= DRAFT_ROWS else one_layer
            rows = bucket.sample_rows
            inputs = {n: torch.randn(rows, n, generator=generator) for n in {m.in_features for m in layers}}
            times: dict[str, list[float]] = {name: [] for name in KERNELS}
            for name, kernel in KERNELS.items():   # once untimed: first-call set-up, and a kernel that fails
                try:
                    timer(kernel, inputs, layers)
                except Exception as err:
                    log.info("ragblend: the %r kernel does not run here (%s: %s)", name, type(err).__name__, err)
                    times.pop(name)
            for _ in range(rounds):
                for name in times:
                    times[name].append(timer(KERNELS[name], inputs, layers))
            seconds = {name: min(t) for name, t in times.items()}
            disturbed = disturbed or any(max(t) > MAX_SPREAD * min(t) for t in times.values())
            best = min(seconds, key=seconds.get)
            if best != "linear" and seconds[best] * MIN_GAIN > seconds["linear"]:
                best = "linear"   # not faster beyond the noise
            choices[bucket.name] = BucketChoice(
                best, seconds, flops=sum(2.0 * rows * m.in_features * m.out_features for m in layers),
                weight_bytes=float(sum(m.weight.numel() * m.weight.element_size() for m in layers)))
    return choices, disturbed


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


def _read_cached(path: Path, key: dict) -> dict[str, BucketChoice] | None:
    """The cached choices at ``path`` if the file is a valid choice for ``key``; else None (logged)."""
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
            return choices
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:
            why = f"unreadable ({type(err).__name__}: {err})"
    if why:
        log.warning("ragblend: ignoring the kernel cache %s (%s); measuring the kernels again.", path, why)
    return None


def _write_cache(path: Path, key: dict, choices: dict[str, BucketChoice]) -> None:
    write_record(path, {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": key,
                        "choices": {name: {"kernel": c.kernel, "seconds": c.seconds, "flops": c.flops,
                                           "weight_bytes": c.weight_bytes} for name, c in choices.items()}})


_PLANS: dict[str, KernelPlan] = {}   # per process, by key: engines over one model share a plan


def plan_for(decoder_layers: Sequence[Sequence[torch.nn.Linear]], head: Sequence[torch.nn.Linear] = (), *,
             directory: Path | None = None, timer: Callable = time_workload, remeasure: bool = False) -> KernelPlan:
    """The kernel plan for these layers on this host: from this process, the cache, or measured
    (``remeasure``: measured now whatever is cached, e.g. after a measurement on a busy machine)."""
    if os.environ.get("RAGBLEND_KERNELS", "").strip().lower() == "linear":
        return KernelPlan.fixed("linear")
    if directory is None:
        from .model import cache_dir

        directory = cache_dir() / "kernels"
    key = host_key(layer_shapes([m for layer in decoder_layers for m in layer] + list(head)))
    path = record_path(directory, key)
    memo = str(path)
    if memo in _PLANS and timer is time_workload and not remeasure:
        return _PLANS[memo]
    choices = None if remeasure else _read_cached(path, key)
    source = "cache"
    if choices is None:
        start = time.perf_counter()
        choices, disturbed = measure(decoder_layers, head, timer=timer)
        source = "measured"
        log.info("ragblend: measured the CPU kernels for this host in %.1f s: %s", time.perf_counter() - start,
                 ", ".join(f"{name} rows {c.kernel}" for name, c in choices.items()))
        if disturbed:
            log.info("ragblend: the machine was busy while the kernels were measured (rounds over %.0fx apart); "
                     "the choice serves this process and is not cached.", MAX_SPREAD)
        else:
            _write_cache(path, key, choices)
    plan = KernelPlan(choices, source, key)
    if timer is time_workload:
        _PLANS[memo] = plan
    return plan
