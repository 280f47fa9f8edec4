"""What :class:`~ragblend.core.engine.BlendEngine` is built from: the model its options name, the
adapter it computes with, and what its stored entries are computed after and keyed by.

The engine's ``__init__`` wires the parts; the decisions behind three of them live here, each
one function: :func:`load` (the model of ``from_pretrained``), :func:`fast_adapter` (the weights
the passes run on) and :func:`entry_identity` (the sinks and fingerprints its entries are keyed
by). :func:`settle` is the start-up's last step.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace

import torch

from .model.adapter import ModelAdapter
from .model.kernels import KernelPlan, measure_in_background
from .model.linear import CpuLinear, kernel_layers, kernel_plan_for, with_linears
from .model.loading import load_model, return_freed_memory
from .model.omp import release_thread_pool
from .model.quantized import HELD_FORM_VERSION, is_quantized, prefill_twin, scoring_twin
from .options import EngineOptions
from .prompt import PromptBuilder
from .store.kv import calibration_key


def load(options: EngineOptions | None, keywords: dict):
    """``(hf_model, tokenizer, options)`` for :meth:`BlendEngine.from_pretrained`, the options
    naming the model when they did not."""
    options = EngineOptions.merged(options, keywords)
    hf_model, tokenizer = load_model(options.model, dtype=options.dtype, device=options.device)
    if options.name is None:
        options = replace(options, name="SmolLM2-135M-Instruct" if options.model is None
                          else os.path.basename(str(options.model).rstrip("/")))
    return hf_model, tokenizer, options


def fast_adapter(hf_model) -> tuple[ModelAdapter, KernelPlan | None]:
    """The adapter the engine computes with, and its CPU kernel plan (None off float32 CPU)."""
    adapter = ModelAdapter(hf_model)   # checks the architecture first
    if is_quantized(hf_model):
        # Prefill on the quantized weights dequantized per layer (core.model.quantized); QueryAware's
        # question pass on the low-bit kernels up to the rows measured faster on this host; decoding
        # steps run the model itself, on the low-bit kernels (core.model.decode_weights).
        adapter = ModelAdapter(prefill_twin(hf_model))
        adapter.scoring = ModelAdapter(scoring_twin(hf_model))
        return adapter, None
    if adapter.dtype != torch.float32 or adapter.device.type != "cpu":
        return adapter, None
    # The same weights through the CPU kernels measured fastest on this host (core.model.kernels);
    # the model itself is left as it is. Nothing waits for a measurement: F.linear until one is in.
    plan = kernel_plan_for(hf_model, wait=False)
    return ModelAdapter(with_linears(hf_model, lambda layer: CpuLinear(layer, plan))), plan


@dataclass(frozen=True)
class EntryIdentity:
    """What an engine's entries are computed after and stored under."""

    sink_ids: list[int]               # what every chunk's own entry is computed after
    template_opening: list[int]       # what a lead entry is computed after
    lead_sink_ids: list[int] | None   # the template's opening where this engine keeps lead entries, else None
    model_fingerprint: str            # the model's identity: what its calibration is stored under
    weights_form: str                 # the form its weights are held in (core.model.quantized)
    fingerprint: str                  # what its KV is stored under

    @property
    def opening(self) -> tuple[int, ...] | None:
        """What lead entries are computed after, for recognising them in a store also where this
        engine keeps none (another engine on the store may); None where it is the sink itself."""
        return tuple(self.template_opening) if self.template_opening != self.sink_ids else None

    @property
    def calibration_id(self) -> str:
        """What the calibration of this model, and of what its chunks follow, is stored under."""
        return calibration_key(self.model_fingerprint, self.sink_ids, self.lead_sink_ids)


def entry_identity(adapter: ModelAdapter, tokenizer, prompts: PromptBuilder, options: EngineOptions) -> EntryIdentity:
    """The :class:`EntryIdentity` of an engine on ``adapter`` with these options."""
    sink_ids = prompts.chunk_sink(options.sink_prefix, options.chunk_context)
    # A prompt's first chunk follows the template's opening, not a passage: it is fused from a
    # second entry of each chunk, its lead entry, computed after the opening alone (see .ingest).
    opening = prompts.sink_ids()
    lead_sink = opening if options.lead_chunk_kv and options.sink_prefix is None else None
    # A model on quantized weights (core.model.quantized) is the same model as its file in float32,
    # but computes KV that differs by float rounding, so its entries are its own (and those of an
    # older held form, whose rounding differed, are not read).
    model_fingerprint, weights_form = adapter.fingerprint(tokenizer), adapter.weights_form()
    fingerprint = model_fingerprint if not weights_form.startswith("quantized") else \
        hashlib.sha256(f"{model_fingerprint}|{weights_form}|{HELD_FORM_VERSION}".encode()).hexdigest()
    return EntryIdentity(sink_ids, opening, lead_sink if lead_sink != sink_ids else None, model_fingerprint,
                         weights_form, fingerprint)


def settle(hf_model, kernel_plan: KernelPlan | None, lock) -> None:
    """The start-up's last step: hand back what its measurements held, and measure the kernels
    (``kernel_plan``) off the answering thread, between passes under ``lock``."""
    release_thread_pool()     # as every prefill, precompute and answer ends: see .omp
    return_freed_memory()     # the start-up measurements' buffers (glibc keeps freed memory otherwise)
    if kernel_plan is not None:
        kernel_plan.attach(lock)
        measure_in_background(kernel_plan, *kernel_layers(hf_model))
