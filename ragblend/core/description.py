"""What an engine is, in plain values: :meth:`BlendEngine.describe` (what ``ragblend info`` prints).

The engine's parts (adapter, kernel plan, decoding weights, answers, fusion cost, ingestion) are
read here, inside ``core``, so that nothing above the engine reaches into them to report. The
steps that measure (:func:`settle_kernels`, :func:`remeasure_fusion_cost`) are kept apart from
:func:`describe`, which only reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .fusion.fusion_cost import CostConstants, default_constants
from .model.linear import int4_available, int8_available, kernel_plan_for
from .model.quantized import describe as describe_weights
from .model.quantized import is_quantized
from .store.kv_budget import CHUNK_TOKENS, DEFAULT_KV_DTYPE_WHY, bytes_per_token, entry_bytes


@dataclass(frozen=True)
class KernelsDescription:
    """The CPU kernel plan of a float32 model on the CPU (:mod:`ragblend.core.model.kernels`)."""

    source: str                 # "measured" (by this process), "cache", "default" (not measured), "fixed"
    state: str                  # the plan's state, worded (settled or not, measuring...)
    buckets: tuple[str, ...]    # one line per pass size: its kernel and speed


@dataclass(frozen=True)
class StoredKVDescription:
    """What the engine stores a token of chunk KV in, and what it weighs."""

    dtype: str
    bytes_per_token: float
    chunk_tokens: int           # the chunk size ``chunk_bytes`` is given for
    chunk_bytes: int            # of all the entries a chunk keeps
    entries_per_chunk: int      # 2 where the engine keeps lead entries
    why: str                    # why the default dtype is what it is


@dataclass(frozen=True)
class FusionDescription:
    """Where the engine's own strategy fuses (:mod:`ragblend.core.fusion.fusion_cost`)."""

    min_speedup: float
    always: bool                       # no cost check: fuses every prompt
    break_even_tokens: int | None      # the shortest prompt predicted to pay (~45 uncached tokens); None: none
    constants: CostConstants
    constants_source: str              # "measured", "defaults" (scaled), "unmeasured" (nothing kept yet)


@dataclass(frozen=True)
class DraftsDescription:
    """Prompt-lookup drafting while decoding (:mod:`ragblend.core.decode.answers`)."""

    max_tokens: int             # prompt_lookup_num_tokens; 0: off
    can_draft: bool             # drafts are verified in float32 only
    row_cost: float             # a drafted token's cost over a one-token pass, measured at engine start


@dataclass(frozen=True)
class EngineDescription:
    """A read-only description of an engine: its model, weights, kernels, decoding and fusion."""

    name: str
    arch: str
    num_layers: int
    dtype: str                  # the computing dtype, e.g. "torch.float32"
    device: str
    weights_form: str           # how the weights are held ("float32", "bfloat16", "quantized"...)
    weights_reason: str         # why
    weights_lines: tuple[str, ...]
    quantized: bool
    kernels: KernelsDescription | None   # None off float32 CPU
    low_bit_decoding: dict[str, str | None]   # "int4"/"int8" -> None if available, else why not
    decode_dtype: str
    decode_layers: dict[str, int]        # decoding's linear layers by kind
    decode_kv_option: str
    decode_kv_dtype: str
    stored_kv: StoredKVDescription
    fusion: FusionDescription
    drafts: DraftsDescription
    prefix_tier: dict[str, int]          # the prefix tier's entries, bytes, max_bytes, hits...; {} when off
    history_pieces: dict[str, int]       # the history pieces' entries, bytes, max_bytes, evictions; {} when off


def _dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def settle_kernels(engine, remeasure: bool, say: Callable[[str], None] = print) -> None:
    """Settle the kernel choice :func:`describe` reports: wait for the engine's background
    measurement, and measure now where nothing is measured yet (or ``remeasure``), cached for
    the next engines. Says what it waits for through ``say``."""
    plan = engine.kernel_plan
    if plan is not None and plan.source != "fixed" and (remeasure or plan.measured is None or plan.measuring):
        if plan.measuring:   # progress, not the state: describe() gives that once settled
            say("Waiting for the kernel measurement running in the background (a few seconds)...")
        if plan.background is not None:   # this process's own, started as the engine loaded: finished first
            plan.background.join()
        if remeasure or plan.measured is None:
            say("Measuring the kernels now (a few seconds; best on an otherwise idle machine)...")
            kernel_plan_for(engine.hf_model, remeasure=True)   # the engine's shared plan adopts the new choice


def remeasure_fusion_cost(engine) -> None:
    """Measure the fusion's cost constants again and keep them for this host (``ragblend info --measure``)."""
    engine.fusion_cost.remeasure()


def describe(engine) -> EngineDescription:
    """:meth:`BlendEngine.describe`: reads the engine's parts, changes nothing."""
    adapter, plan = engine.adapter, engine.kernel_plan
    kernels = None if plan is None else KernelsDescription(plan.source, plan.state(), tuple(plan.describe()))
    answers = engine.answers
    return EngineDescription(
        name=engine.name, arch=adapter.arch, num_layers=adapter.shape.num_layers, dtype=str(adapter.dtype),
        device=str(adapter.device), weights_form=engine.weights_form,
        weights_reason=getattr(engine.hf_model, "ragblend_weights_reason", None) or "the model was passed in as it is",
        weights_lines=tuple(describe_weights(engine.hf_model)), quantized=is_quantized(engine.hf_model),
        kernels=kernels, low_bit_decoding={"int4": int4_available(), "int8": int8_available()},
        decode_dtype=engine.decode_dtype, decode_layers=dict(engine.decode_weights.layer_counts()),
        decode_kv_option=engine.options.decode_kv_dtype, decode_kv_dtype=_dtype_name(answers.kv_dtype),
        stored_kv=_stored_kv(engine), fusion=_fusion(engine),
        drafts=DraftsDescription(engine.options.prompt_lookup_num_tokens, answers.can_draft, answers.draft_row_cost),
        prefix_tier=engine.prefix_info(), history_pieces=engine.pieces_info())


def _stored_kv(engine) -> StoredKVDescription:
    dtype = _dtype_name(engine.kv_dtype)
    shape, entries = engine.kv_shape, len(engine.ingestion.variants)
    return StoredKVDescription(dtype, bytes_per_token(shape, dtype), CHUNK_TOKENS,
                               entries * entry_bytes(shape, CHUNK_TOKENS, dtype), entries, DEFAULT_KV_DTYPE_WHY)


def _fusion(engine) -> FusionDescription:
    cost, selection, speedup = engine.fusion_cost, engine.resolve().selection, engine.min_fusion_speedup
    constants = cost.known()
    if constants is None:
        source, constants = "unmeasured", default_constants(engine.adapter)
    else:
        source = "measured" if constants.measured else "defaults"
    always = selection is None or not speedup
    at = None if always else cost.break_even(selection, min_speedup=speedup, constants=constants)
    return FusionDescription(speedup, always, at, constants, source)
