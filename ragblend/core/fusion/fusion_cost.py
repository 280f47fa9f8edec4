"""Whether fusing a prompt pays on this host: the fused and the full prefill's predicted time.

Fusion saves compute in proportion to the tokens it does not recompute, but it spends some
that a full prefill does not: QueryAware's question pass runs the uncached tokens (the
template and the question) once more, every pass pays a fixed cost per layer, the selected
tokens attend through masks instead of one causal call, and every cached token is read and
rotated at every layer. On a short prompt (a few hundred tokens, a 135M-parameter model) that
outweighs the saving: fused answers came no faster than full prefill's and, on a user's
~380-token LlamaIndex prompts, were wrong more often (issue 59). So the engine's own strategy
can fuse a prompt only where it is predicted to be clearly faster (``min_fusion_speedup``, e.g.
1.3; the engine's default is 0, always fuse: on the user-like benchmark, ``benchmarks.userlike``,
SmolLM2's prompts of 300-3,200 tokens fused 1.5-3.2x faster in CPU time and the gate skipped none);
otherwise the exact full prefill runs and ``Stats.fusion_skipped`` says why.
A strategy the caller names is run as asked.

The prediction is a per-layer cost model of the two paths, in four constants of this host and
model (:class:`CostConstants`, CPU seconds of the process: on a shared host the wall clock also
counts the neighbours' work): a pass's fixed cost per layer, a token row's (projections and
MLP), a query-key pair's (attention) and a cached token's (read from the memory tier, rotated,
placed). :func:`measure_constants` times four full prefills and three fused prefills of random
tokens (QueryAware's two passes among them; a few seconds for SmolLM2 on a 2-core host) and fits
the constants to them by least squares (:func:`fit_constants`); the result is kept in the
host cache (:mod:`ragblend.core.model.host_cache`, keyed like the kernel choice plus the model), so the first
engine on a host measures, at its first prompt the decision needs them, and later ones read
it. Until then (or where the measurement fails) :func:`default_constants` scales the
constants measured for SmolLM2 on the project's host by the model's layer size. Reads from the
disk tier add their bytes at :data:`DISK_BYTES_PER_S` (the prefetch thread hides part of it:
the prediction leans towards a full prefill there).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from ..model.host_cache import FORMAT, VERSION, read_record, record_path, remembered, write_record
from ..model.kernels import host_key
from ..paths import cache_dir
from ..store.kv import ChunkKV
from ..store.tiers import MemoryReader
from .pipeline import SequentialSource
from .prefill import fused_prefill
from .selection import EveryToken, QuestionAttention, ReusedSpan, Selection, TopScoreSelection, UncachedTokens

log = logging.getLogger("ragblend")

DEFAULT_MIN_SPEEDUP = 1.3   # the speed-up asked of a prediction where none is given (engines default to 0: off)
DISK_BYTES_PER_S = 1e9       # reading cached KV from the disk tier (often the page cache): not measured
# The measurement's prompts: full prefills of four sizes (a pass's fixed cost, a row's and a
# pair's) and fused prefills of mostly cached tokens (a cached token's cost, and the fused path as it runs).
FULL_SIZES = (64, 256, 512, 768)
FUSED_FRESH, FUSED_CACHED = 48, 720
# the fused prefills timed: the fresh tokens alone, and QueryAware's two passes at two budgets
FUSED_SELECTIONS = (UncachedTokens(), QuestionAttention(0.1, cached_attention_scale=0.7),
                    QuestionAttention(0.3, cached_attention_scale=0.7))
MEASURE_VERSION = 2   # 2: fitted by least squares to full and fused prefills (1: solved from three full ones)


@dataclass(frozen=True)
class CostConstants:
    """CPU seconds of one model on one host, per layer."""

    layer_s: float    # a pass's fixed cost (norms, RoPE tables, kernel calls), whatever its size
    row_s: float      # one token row through the projections and the MLP
    pair_s: float     # one query-key pair of attention
    cached_s: float   # one cached token read from the memory tier, rotated and placed
    measured: bool    # False: scaled from the project's SmolLM2 figures (default_constants)

    def valid(self) -> bool:
        values = (self.layer_s, self.row_s, self.pair_s, self.cached_s)
        return all(isinstance(v, float) and math.isfinite(v) and 0 <= v < 1 for v in values) and self.row_s > 0


# SmolLM2-135M (30 layers, 9 heads and 3 K/V heads of 64, 3.5M weights a layer), measured with
# measure_constants on the project's 2-core AVX-512 EPYC (busy: load 2-3), float16 KV. On 2026-12-06
# the same host (at load 10) measured 10x these, in much the same proportions: the user-like benchmark's
# 1.3x break-even is ~295 tokens on both (see docs/benchmarks.md).
SMOLLM2 = CostConstants(layer_s=2.0e-4, row_s=4.0e-6, pair_s=1.5e-9, cached_s=4.0e-7, measured=False)
SMOLLM2_LAYER_WEIGHTS, SMOLLM2_ATTENTION_WIDTH, SMOLLM2_KV_WIDTH = 3_540_096, 576, 192


@dataclass(frozen=True)
class FusionVerdict:
    """The prediction for one prompt: a full prefill's time and the fusion's, in seconds."""

    full_s: float
    fused_s: float
    prompt_tokens: int
    recomputed: float     # share of the prompt's tokens the fusion computes (uncached ones and its budget)
    min_speedup: float
    measured: bool        # the constants were measured on this host (else scaled defaults)

    @property
    def speedup(self) -> float:
        return self.full_s / self.fused_s if self.fused_s > 0 else math.inf

    @property
    def pays(self) -> bool:
        return self.speedup >= self.min_speedup

    @property
    def reason(self) -> str:
        return (f"predicted {self.speedup:.1f}x: prompt {self.prompt_tokens} tokens, {self.recomputed:.0%} "
                f"recomputed")


def layer_weights(adapter) -> int:
    """Weights of one decoder layer (what a token row multiplies through)."""
    return sum(p.numel() for p in adapter.hf_model.model.layers[0].parameters())


def default_constants(adapter) -> CostConstants:
    """:data:`SMOLLM2`'s constants scaled to ``adapter``'s model: a row by its layer's weights, a
    pair by its attention width, a cached token by its K/V width (a pass's fixed cost as is)."""
    shape = adapter.shape
    return CostConstants(
        layer_s=SMOLLM2.layer_s, row_s=SMOLLM2.row_s * layer_weights(adapter) / SMOLLM2_LAYER_WEIGHTS,
        pair_s=SMOLLM2.pair_s * shape.num_heads * shape.head_dim / SMOLLM2_ATTENTION_WIDTH,
        cached_s=SMOLLM2.cached_s * shape.num_kv_heads * shape.head_dim / SMOLLM2_KV_WIDTH, measured=False)


Terms = tuple[float, float, float, float]   # what multiplies layer_s, row_s, pair_s and cached_s


def full_prefill_terms(layers: int, n: int) -> Terms:
    """A full prefill of ``n`` tokens: one pass, one causal attention call (n²/2 pairs)."""
    return (layers, layers * n, layers * n * (n + 1) / 2, 0.0)


def fused_prefill_terms(layers: int, selection: Selection, n: int, reused: int,
                        chunks: int = 1) -> tuple[Terms, int] | None:
    """``(terms, tokens computed)`` of fusing a prompt of ``n`` tokens, ``reused`` of them cached
    (in ``chunks`` chunks), as ``selection`` runs it; None for a selection this model does not know."""
    fresh = n - reused

    def masked_pass(rows: int, pass_layers: int, pairs_per_row: float = 1.0, placed: int = reused) -> Terms:
        # the selected rows attend to the keys before them through masks: about n keys each
        return (pass_layers, pass_layers * rows, pass_layers * rows * n * pairs_per_row, pass_layers * placed)

    if isinstance(selection, EveryToken):
        return full_prefill_terms(layers, n), n
    if isinstance(selection, QuestionAttention):
        budget = selection.budget(reused, chunks)
        if budget == 0:
            return masked_pass(fresh, layers), fresh
        # the question pass (its attention computed twice: once to run, once to read it), then
        # the fused pass over the cached K/V the question pass already placed
        return _add(masked_pass(fresh, layers, pairs_per_row=2.0), masked_pass(fresh + budget, layers, placed=0)), \
            fresh + budget
    if isinstance(selection, TopScoreSelection):
        check = min(selection.check_layers, default=0) + 1   # every token through the check layer
        keep = math.ceil(selection.schedule[min(selection.check_layers)] * reused - 1e-9) if check > 1 else reused
        return _add(full_prefill_terms(check, n), masked_pass(fresh + keep, layers - check)), fresh + keep
    if isinstance(selection, UncachedTokens):
        return masked_pass(fresh, layers), fresh
    return None


def _add(a: Terms, b: Terms) -> Terms:
    return tuple(x + y for x, y in zip(a, b))


def seconds(c: CostConstants, terms: Terms) -> float:
    return terms[0] * c.layer_s + terms[1] * c.row_s + terms[2] * c.pair_s + terms[3] * c.cached_s


def full_prefill_s(c: CostConstants, layers: int, n: int) -> float:
    """A full prefill of ``n`` tokens, in seconds."""
    return seconds(c, full_prefill_terms(layers, n))


def fused_prefill_s(c: CostConstants, layers: int, selection: Selection, n: int, reused: int,
                    disk_tokens: int = 0, disk_bytes_per_token_layer: float = 0.0,
                    chunks: int = 1) -> tuple[float, int] | None:
    """``(seconds, tokens computed)`` of fusing a prompt of ``n`` tokens, ``reused`` of them cached
    (``disk_tokens`` of those read from the disk tier; in ``chunks`` chunks), as ``selection`` runs
    it; None for a selection this model does not know (no prediction: it fuses)."""
    fused = fused_prefill_terms(layers, selection, n, reused, chunks)
    if fused is None:
        return None
    terms, computed = fused
    return seconds(c, terms) + layers * disk_tokens * disk_bytes_per_token_layer / DISK_BYTES_PER_S, computed


class FusionCost:
    """Predicts, per prompt, whether fusing it pays on this host, from constants measured once
    per host and model (see the module docstring). ``constants`` given: those, never measured
    (tests, or a caller who knows its host)."""

    def __init__(self, adapter, model_fingerprint: str, kv_bytes: int, constants: CostConstants | None = None):
        self.adapter, self.model_fingerprint = adapter, model_fingerprint
        shape = adapter.shape
        self.disk_bytes_per_token_layer = 2 * shape.num_kv_heads * shape.head_dim * kv_bytes
        self._constants = constants

    @property
    def cache_key(self) -> dict:
        """What the constants depend on: the host (as the kernel choice) and the model on its device."""
        return host_key([]) | {"model": self.model_fingerprint[:32], "shape": repr(self.adapter.shape),
                               "device": str(self.adapter.device), "version": MEASURE_VERSION}

    def use(self, constants: CostConstants) -> None:
        """Predict from ``constants`` from now on (a caller who knows its host, or a test)."""
        self._constants = constants

    @property
    def measured(self) -> bool:
        """Whether the constants are known already (measured here, read from the host cache or given)."""
        return self._constants is not None

    def _record_path(self):
        key = {"measure": "fusion-cost"} | self.cache_key   # as host_cache.remembered keys it
        return record_path(cache_dir() / "host", key, "fusion-cost-"), key

    def remeasure(self) -> CostConstants:
        """Measure the constants again and keep them for this host (``ragblend info --measure``)."""
        self._constants = measure_constants(self.adapter)
        path, key = self._record_path()
        write_record(path, {"format": FORMAT, "version": VERSION, "key": key, "value": asdict(self._constants)})
        return self._constants

    def known(self) -> CostConstants | None:
        """The constants if known without measuring (given, or kept in the host cache), else None."""
        if self._constants is None:
            path, key = self._record_path()
            record, _ = read_record(path, FORMAT, VERSION, key)
            if record is not None and _valid_record(record.get("value")):
                self._constants = CostConstants(**record["value"])
        return self._constants

    def break_even(self, selection: Selection, fresh: int = 45, min_speedup: float = DEFAULT_MIN_SPEEDUP,
                   constants: CostConstants | None = None) -> int | None:
        """The shortest prompt (in steps of 50 tokens, up to the context window) that fusing with
        ``selection`` is predicted to make ``min_speedup`` times faster, ``fresh`` of its tokens
        uncached (the template and the question: ~45 with SmolLM2's); None if none."""
        c, layers = constants or self.constants(), self.adapter.shape.num_layers
        for n in range(fresh + 50, self.adapter.shape.context_window + 1, 50):
            fused = fused_prefill_s(c, layers, selection, n, n - fresh)
            if fused is None:
                return None
            if full_prefill_s(c, layers, n) >= min_speedup * fused[0]:
                return n
        return None

    def constants(self) -> CostConstants:
        """This host's constants: given, else kept in the host cache, else measured now (and kept);
        the scaled defaults where measuring fails."""
        if self._constants is None:
            try:
                value = remembered("fusion-cost", self.cache_key, self._measured_twice, _valid_record)
                self._constants = CostConstants(**value)
            except (RuntimeError, ValueError, TypeError) as err:
                log.warning("ragblend: could not measure the fusion's cost on this host (%s); using the defaults.", err)
                self._constants = default_constants(self.adapter)
        return self._constants

    def _measured_twice(self) -> tuple[dict, bool]:
        """Two measurements, settled for the host only where :func:`trusted`; an untrusted pair
        gives the scaled defaults, kept unsettled (:func:`~ragblend.core.model.host_cache.remembered`: measured
        again at the first quiet start)."""
        first, second = measure_constants(self.adapter), measure_constants(self.adapter)
        if not trusted(first, second):
            log.info("ragblend: the fusion's cost measured %.3g and %.3g s a row on a busy host; using the "
                     "defaults for now.", first.row_s, second.row_s)
            return asdict(default_constants(self.adapter)), False
        return asdict(min(first, second, key=lambda c: c.row_s)), True

    def verdict(self, selection: Selection, n: int, reused: int, disk_tokens: int = 0,
                min_speedup: float = DEFAULT_MIN_SPEEDUP, chunks: int = 1) -> FusionVerdict | None:
        """The prediction for fusing a prompt of ``n`` tokens, ``reused`` of them cached
        (``disk_tokens`` of those from the disk tier), with ``selection``; None where the selection
        is not one the model knows."""
        c, layers = self.constants(), self.adapter.shape.num_layers
        fused = fused_prefill_s(c, layers, selection, n, reused, disk_tokens, self.disk_bytes_per_token_layer, chunks)
        if fused is None:
            return None
        seconds, computed = fused
        return FusionVerdict(full_prefill_s(c, layers, n), seconds, n, computed / n if n else 0.0, min_speedup,
                             c.measured)


def trusted(first: CostConstants, second: CostConstants, load: float | None = None) -> bool:
    """Whether two measurements may be kept for the host: they agree (a row's cost within 2x)
    and the host was not oversubscribed (1-minute load average at most its cores). On a host
    running several times its cores, the threads' spinning counts as CPU time: a row measured
    40x its quiet cost, which would skip fusion everywhere."""
    if load is None:
        from ..model.host_cache import load_average

        load = load_average() or 0.0   # None where the OS does not say
    rows = sorted((first.row_s, second.row_s))
    return rows[1] <= 2 * rows[0] and load <= (os.cpu_count() or 1)


def _valid_record(value) -> bool:
    try:
        return isinstance(value, dict) and CostConstants(**value).valid()
    except TypeError:
        return False


def fit_constants(timings: list[tuple[Terms, float]]) -> CostConstants:
    """The constants that best predict ``timings`` (``(terms, seconds)`` of measured prefills),
    none negative: least squares on the relative error, so that a short prefill counts as much
    as a long one. Four unknowns: every subset of them is tried and the best fit with no
    negative constant kept (exact non-negative least squares, small enough to read)."""
    a = torch.tensor([terms for terms, _ in timings], dtype=torch.float64)
    b = torch.tensor([t for _, t in timings], dtype=torch.float64)
    a, b = a / b[:, None], torch.ones_like(b)   # each row divided by its time: relative error
    scale = a.abs().amax(dim=0).clamp_min(1e-300)   # columns of like size for the solver
    best, best_error = None, math.inf
    for used in itertools.product((True, False), repeat=4):
        if not used[1]:
            continue   # a row always costs something
        columns = torch.tensor(used)
        solution = torch.zeros(4, dtype=torch.float64)
        solution[columns] = torch.linalg.lstsq(a[:, columns] / scale[columns], b[:, None]).solution[:, 0]
        if (solution < 0).any():
            continue
        error = float((a / scale @ solution - b).pow(2).sum())
        if error < best_error - 1e-12:
            best, best_error = solution / scale, error
    if best is None:
        raise ValueError("no non-negative fit of the cost constants to the timings")
    layer_s, row_s, pair_s, cached_s = best.tolist()
    return CostConstants(float(layer_s), float(row_s), float(pair_s), float(cached_s), measured=True)


@torch.inference_mode()
def measure_constants(adapter, rounds: int = 2) -> CostConstants:
    """Time full prefills of :data:`FULL_SIZES` random tokens and fused prefills of
    :data:`FUSED_FRESH` fresh and :data:`FUSED_CACHED` cached tokens as the selections of
    :data:`FUSED_SELECTIONS` run them (each the fastest of ``rounds``), and fit the cost model's
    four constants to them all (:func:`fit_constants`). Fused prefills are timed as they run,
    question pass included: a fit to full prefills alone had over-priced the fused path's
    second pass (predicted 1.04-2.68x where 1.39-3.32x was measured, docs/benchmarks.md)."""
    shape, layers = adapter.shape, adapter.shape.num_layers
    vocab = adapter.hf_model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (max(*FULL_SIZES, FUSED_FRESH + FUSED_CACHED),), generator=generator).tolist()

    def fastest(run) -> float:
        # CPU time of the process (every thread), not wall time: on a shared host the wall clock
        # counts the neighbours' work too, and CPU seconds are what a busy host has to spare
        best = math.inf
        for _ in range(rounds):
            t0 = time.process_time()
            run()
            best = min(best, time.process_time() - t0)
        return best / layers

    fused_prefill(adapter, ids[:16], [], None, EveryToken())   # warm-up
    timings = [(full_prefill_terms(1, n), fastest(lambda n=n: fused_prefill(adapter, ids[:n], [], None, EveryToken())))
               for n in FULL_SIZES]

    # Fused prefills that reuse one cached span and compute the fresh tokens around it (and, for
    # the question's selections, the reused tokens it attends to most).
    n, head = FUSED_FRESH + FUSED_CACHED, FUSED_FRESH // 2
    kv = torch.randn(layers, shape.num_kv_heads, FUSED_CACHED, shape.head_dim, generator=generator)
    entry = ChunkKV("0" * 64, ids[head:head + FUSED_CACHED], kv.half(), kv.half())
    span = [ReusedSpan(head, FUSED_CACHED)]

    def fuse(selection):
        source = SequentialSource([MemoryReader(entry, "memory")], adapter.device, windows=[slice(0, FUSED_CACHED)])
        try:
            fused_prefill(adapter, ids[:n], span, source, selection)
        finally:
            source.close()

    for selection in FUSED_SELECTIONS:
        terms, _ = fused_prefill_terms(1, selection, n, FUSED_CACHED)
        timings.append((terms, fastest(lambda selection=selection: fuse(selection))))
    constants = fit_constants(timings)
    if not constants.valid():
        raise ValueError(f"measured constants out of range: {constants}")
    return constants
