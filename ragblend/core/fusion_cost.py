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
the gate at 1.3 only skipped prompts under 600 tokens that fusing answered as well and faster);
otherwise the exact full prefill runs and ``Stats.fusion_skipped`` says why.
A strategy the caller names is run as asked.

The prediction is a per-layer cost model of the two paths, in four constants of this host and
model (:class:`CostConstants`, CPU seconds of the process: on a shared host the wall clock also
counts the neighbours' work): a pass's fixed cost per layer, a token row's (projections and
MLP), a query-key pair's (attention) and a cached token's (read from the memory tier, rotated,
placed). :func:`measure_constants` times three full prefills and one fused prefill of random
tokens (~1-2 s for SmolLM2 on a 2-core host) and solves for them; the result is kept in the
host cache (:mod:`.host_cache`, keyed like the kernel choice plus the model), so the first
engine on a host measures, at its first prompt the decision needs them, and later ones read
it. Until then (or where the measurement fails) :func:`default_constants` scales the
constants measured for SmolLM2 on the project's host by the model's layer size. Reads from the
disk tier add their bytes at :data:`DISK_BYTES_PER_S` (the prefetch thread hides part of it:
the prediction leans towards a full prefill there).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from .host_cache import FORMAT, VERSION, read_record, record_path, remembered, write_record
from .kernels import host_key
from .kv import ChunkKV
from .pipeline import SequentialSource
from .prefill import fused_prefill
from .selection import EveryToken, QuestionAttention, ReusedSpan, Selection, TopScoreSelection, UncachedTokens
from .store import MemoryReader

log = logging.getLogger("ragblend")

DEFAULT_MIN_SPEEDUP = 1.3   # the speed-up asked of a prediction where none is given (engines default to 0: off)
DISK_BYTES_PER_S = 1e9       # reading cached KV from the disk tier (often the page cache): not measured
# The measurement's prompts: three full prefills (to separate a pass's fixed cost, a row's and a
# pair's) and one fused prefill of mostly cached tokens (a cached token's cost).
FULL_SIZES = (64, 256, 768)
FUSED_FRESH, FUSED_CACHED = 48, 720
MEASURE_VERSION = 1


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
# the same host measured 7-15x these, yet on the user-like benchmark these predicted fusion's
# speed-up closer (median predicted / measured 0.93-1.04 against 0.76-0.83): see docs/benchmarks.md.
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


def full_prefill_s(c: CostConstants, layers: int, n: int) -> float:
    """A full prefill of ``n`` tokens: one pass, one causal attention call (n²/2 pairs)."""
    return layers * (c.layer_s + c.row_s * n + c.pair_s * n * (n + 1) / 2)


def fused_prefill_s(c: CostConstants, layers: int, selection: Selection, n: int, reused: int,
                    disk_tokens: int = 0, disk_bytes_per_token_layer: float = 0.0) -> tuple[float, int] | None:
    """``(seconds, tokens computed)`` of fusing a prompt of ``n`` tokens, ``reused`` of them cached
    (``disk_tokens`` of those read from the disk tier), as ``selection`` runs it; None for a
    selection this model does not know (no prediction: it fuses)."""
    fresh = n - reused

    def masked_pass(rows: int, pass_layers: int, pairs_per_row: float = 1.0, placed: int = reused) -> float:
        # the selected rows attend to the keys before them through masks: about n keys each
        return pass_layers * (c.layer_s + c.row_s * rows + c.pair_s * rows * n * pairs_per_row + c.cached_s * placed)

    if isinstance(selection, EveryToken):
        seconds, computed = full_prefill_s(c, layers, n), n
    elif isinstance(selection, QuestionAttention):
        budget = selection.budget(reused)
        if budget == 0:
            seconds, computed = masked_pass(fresh, layers), fresh
        else:
            # the question pass (its attention computed twice: once to run, once to read it), then
            # the fused pass over the cached K/V the question pass already placed
            seconds = masked_pass(fresh, layers, pairs_per_row=2.0) + masked_pass(fresh + budget, layers, placed=0)
            computed = fresh + budget
    elif isinstance(selection, TopScoreSelection):
        check = min(selection.check_layers, default=0) + 1   # every token through the check layer
        keep = math.ceil(selection.schedule[min(selection.check_layers)] * reused - 1e-9) if check > 1 else reused
        seconds = full_prefill_s(c, check, n) + masked_pass(fresh + keep, layers - check)
        computed = fresh + keep
    elif isinstance(selection, UncachedTokens):
        seconds, computed = masked_pass(fresh, layers), fresh
    else:
        return None
    return seconds + layers * disk_tokens * disk_bytes_per_token_layer / DISK_BYTES_PER_S, computed


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
        from .model import cache_dir

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
        gives the scaled defaults, kept unsettled (:func:`~.host_cache.remembered`: measured
        again at the first quiet start)."""
        first, second = measure_constants(self.adapter), measure_constants(self.adapter)
        if not trusted(first, second):
            log.info("ragblend: the fusion's cost measured %.3g and %.3g s a row on a busy host; using the "
                     "defaults for now.", first.row_s, second.row_s)
            return asdict(default_constants(self.adapter)), False
        return asdict(min(first, second, key=lambda c: c.row_s)), True

    def verdict(self, selection: Selection, n: int, reused: int, disk_tokens: int = 0,
                min_speedup: float = DEFAULT_MIN_SPEEDUP) -> FusionVerdict | None:
        """The prediction for fusing a prompt of ``n`` tokens, ``reused`` of them cached
        (``disk_tokens`` of those from the disk tier), with ``selection``; None where the selection
        is not one the model knows."""
        c, layers = self.constants(), self.adapter.shape.num_layers
        fused = fused_prefill_s(c, layers, selection, n, reused, disk_tokens, self.disk_bytes_per_token_layer)
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
        from .host_cache import load_average

        load = load_average() or 0.0   # None where the OS does not say
    rows = sorted((first.row_s, second.row_s))
    return rows[1] <= 2 * rows[0] and load <= (os.cpu_count() or 1)


def _valid_record(value) -> bool:
    try:
        return isinstance(value, dict) and CostConstants(**value).valid()
    except TypeError:
        return False


@torch.inference_mode()
def measure_constants(adapter, rounds: int = 2) -> CostConstants:
    """Time full prefills of :data:`FULL_SIZES` random tokens and one fused prefill of
    :data:`FUSED_FRESH` fresh and :data:`FUSED_CACHED` cached tokens (each the fastest of
    ``rounds``), and solve the cost model for its four constants."""
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
    full = [fastest(lambda n=n: fused_prefill(adapter, ids[:n], [], None, EveryToken())) for n in FULL_SIZES]
    # Solve full(n) = layer + row n + pair n(n+1)/2 through the three sizes.
    a = torch.tensor([[1.0, n, n * (n + 1) / 2] for n in FULL_SIZES], dtype=torch.float64)
    layer_s, row_s, pair_s = torch.linalg.solve(a, torch.tensor(full, dtype=torch.float64)).tolist()
    if pair_s <= 0 or layer_s < 0:   # a disturbed timing: the two line through the ends, no attention term
        pair_s = 0.0
        row_s = (full[-1] - full[0]) / (FULL_SIZES[-1] - FULL_SIZES[0])
        layer_s = max(0.0, full[0] - row_s * FULL_SIZES[0])
    row_s = max(row_s, 1e-9)

    # A fused prefill that reuses one cached span and computes only the fresh tokens around it.
    n, head = FUSED_FRESH + FUSED_CACHED, FUSED_FRESH // 2
    kv = torch.randn(layers, shape.num_kv_heads, FUSED_CACHED, shape.head_dim, generator=generator)
    entry = ChunkKV("0" * 64, ids[head:head + FUSED_CACHED], kv.half(), kv.half())
    span = [ReusedSpan(head, FUSED_CACHED)]

    def fuse():
        source = SequentialSource([MemoryReader(entry, "memory")], adapter.device, windows=[slice(0, FUSED_CACHED)])
        try:
            fused_prefill(adapter, ids[:n], span, source, UncachedTokens())
        finally:
            source.close()

    fused = fastest(fuse)
    rest = fused - (layer_s + row_s * FUSED_FRESH + pair_s * FUSED_FRESH * n)
    cached_s = max(0.0, rest / FUSED_CACHED)
    constants = CostConstants(float(layer_s), float(row_s), float(pair_s), float(cached_s), measured=True)
    if not constants.valid():
        raise ValueError(f"measured constants out of range: {constants}")
    return constants
