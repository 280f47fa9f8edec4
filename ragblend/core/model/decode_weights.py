"""The weights decoding runs on: the engine's own adapter, or a twin of the model (built once
per model and kind, shared by its engines) whose linear layers hold float16, 4-bit or 8-bit
weights, each low-bit kind kept only where a decoding step measures faster on this host."""

from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

from . import low_bit_cache
from .adapter import ModelAdapter
from .host_cache import measured_twice, remembered
from .kernels import DRAFT_ROWS, MIN_GAIN, KernelPlan, fastest_rounds, host_key
from .linear import (
    EXACT_INT4,
    CpuLinear,
    HalfLinear,
    Int4Linear,
    Int8Head,
    Int8Linear,
    LowBitLinear,
    int4_available,
    int8_available,
    on_int4_grid,
    with_linears,
)
from .loading import from_gguf
from .quantized import QuantLinear, exact_twin, is_quantized, quantized_matmuls

log = logging.getLogger("ragblend")

_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # hf_model -> {decode_dtype: ModelAdapter}
_TWINS_LOCK = threading.Lock()
_KIND_NAMES = {Int4Linear: "4-bit", Int8Linear: "8-bit", Int8Head: "8-bit", HalfLinear: "float16"}


def _parts(layer: CpuLinear | None) -> dict[str, torch.Tensor]:
    """A layer's cached form: its kind, and its tensors (:mod:`.low_bit_cache`)."""
    if layer is None:
        return {"kind": low_bit_cache.kind_tensor("none")}
    kind = {Int4Linear: "int4", Int8Linear: "int8", Int8Head: "int8head"}[type(layer)]
    return {"kind": low_bit_cache.kind_tensor(kind), **layer.parts()}


class DecodeWeights:
    """Chooses and builds the adapter decoding runs on for ``decode_dtype`` (see
    :class:`~ragblend.core.options.EngineOptions`); ``adapter`` is the engine's own."""

    def __init__(self, hf_model, adapter: ModelAdapter, kernel_plan: KernelPlan | None, decode_dtype: str, lock):
        self.hf_model, self.adapter, self.kernel_plan = hf_model, adapter, kernel_plan
        self.decode_dtype, self.lock = decode_dtype, lock
        self._adapter: ModelAdapter | None = None
        self._exact: ModelAdapter | None = None
        self._short_pass_rows: int | None = None   # fixed once the twin is built (:meth:`short_pass_rows`)

    def decoding_adapter(self) -> ModelAdapter:
        """The adapter decoding runs on: the engine's own, or a twin (built with the engine) whose
        linear layers hold float16 weights (``decode_dtype="float16"``) or 4-bit ones
        (``"int4"``; with ``"auto"`` only the layers whose weights already are 4-bit, as a Q4_0/Q4_1
        GGUF's are; the LM head stays float32, its logits pick the answer)."""
        if self._on_exact_twin:
            return self.exact_adapter()
        if self.decode_dtype == "float32" or self.adapter.dtype != torch.float32 or self.adapter.device.type != "cpu":
            return self.adapter
        with self.lock:
            if self._adapter is None:
                # Engines over one model share its decoding twin (building a 4-bit one takes seconds).
                with _TWINS_LOCK:
                    twins = _TWINS.setdefault(self.hf_model, {})
                    if self.decode_dtype not in twins:   # None: no twin, decode on the engine's own adapter
                        twins[self.decode_dtype] = self._build()
                    self._adapter = twins[self.decode_dtype] or self.adapter
        return self._adapter

    @property
    def _on_exact_twin(self) -> bool:
        """Whether decoding runs on the float32 twin: float32 decoding of a quantized model. Not on the
        prefill twin, which on the fast plan runs decoding's rows on the low-bit kernels (bfloat16
        scales and activations), so "float32" decoding would not be."""
        return self.decode_dtype == "float32" and is_quantized(self.hf_model)

    def exact_adapter(self) -> ModelAdapter:
        """The adapter a near-tied greedy pick is made again on: the engine's own, or for a
        quantized model (whose prefill twin may run bfloat16 matmuls) its float32 twin."""
        if is_quantized(self.hf_model):
            with self.lock:
                if self._exact is None:
                    self._exact = ModelAdapter(exact_twin(self.hf_model))
            return self._exact
        return self.adapter

    def layer_counts(self) -> dict[str, int]:
        """How many linear layers a decoding step runs in each weight format, e.g. ``{"4-bit": 210, "8-bit": 1}``
        (the parts of a :class:`FusedRows` count each, under its format)."""
        kinds = []
        for matmul in self.decoding_matmuls():
            if isinstance(matmul, QuantLinear):
                kinds.append("float32" if self._on_exact_twin else {"int4": "4-bit", "int8": "8-bit"}.get(matmul.kind, "float32"))
            elif isinstance(matmul, FusedRows):
                kinds += [_KIND_NAMES[type(matmul.low_bit)]] * len(matmul.sizes)
            else:
                kinds.append(_KIND_NAMES.get(type(matmul), "float32"))
        return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}

    def decoding_matmuls(self) -> list[torch.nn.Module]:
        """The matmuls a decoding pass runs: each :class:`FusedRows`, then every linear layer that
        is not a fused group's part (nor a FusedRows' own low-bit layer, which has no weight)."""
        model = self.decoding_adapter().hf_model
        fused = [module for module in model.modules() if isinstance(module, FusedRows)]
        parts = {id(weight) for group in fused for weight in group.weights}
        return fused + [module for module in model.modules()
                        if isinstance(module, (torch.nn.Linear, CpuLinear, HalfLinear))
                        and module.weight is not None and id(module.weight) not in parts] + \
            quantized_matmuls(model)

    def _build(self) -> ModelAdapter | None:
        if is_quantized(self.hf_model):   # its own layers decode on the low-bit kernels (core.model.quantized)
            return ModelAdapter(self.hf_model)
        if self.decode_dtype == "float16":
            return ModelAdapter(with_linears(self.hf_model, HalfLinear))
        low_bit = self.low_bit_layers()
        if not low_bit:
            return None
        count, kinds = len(low_bit), sorted({type(layer).__name__ for layer in low_bit.values()})
        fused = fused_groups(self.hf_model, low_bit, self.kernel_plan)   # takes the fused parts out of low_bit
        # A fused layer's parts keep only their float32 weights (shared, not copied), for passes
        # longer than a short pass: their low-bit form lives once, in the fused matmul.
        twin = with_linears(self.hf_model, lambda layer: low_bit.get(id(layer.weight)) or
                            CpuLinear(layer, self.kernel_plan))
        for owner, attribute, group in fused:
            setattr(twin.get_submodule(owner), attribute, group)
        log.info("ragblend: %d linear layer(s) decode on low-bit weights (%s; decode_dtype=%r), %d of them "
                 "in %d fused matmuls", count, ", ".join(kinds), self.decode_dtype,
                 sum(len(group.sizes) for _, _, group in fused), len(fused))
        return ModelAdapter(twin)

    def low_bit_layers(self) -> dict[int, CpuLinear]:
        """The low-bit layer to decode with, by the id of the float32 weight it replaces.

        ``"int4"``: 4-bit weights for every layer but the LM head; ``"int8"``: 8-bit weights for
        every layer. ``"auto"``: 4-bit where the weights already are 4-bit (lossless); for a model
        loaded from a GGUF file (its weights quantized already, at 5-8 bits where not 4), 8-bit
        for the others, the LM head included; each kind kept only if a decoding step over its
        layers measures faster than float32 on this host (see :meth:`keep_faster`).
        """
        wanted = self.decode_dtype
        if wanted != "auto":
            why_not = int4_available() if wanted == "int4" else int8_available()
            if why_not:
                log.warning("ragblend: decode_dtype=%r cannot run here (%s); decoding in float32.", wanted, why_not)
                return {}
        layers, skipped = self._quantized_layers(wanted)
        if wanted == "auto":
            return self.keep_faster(layers)
        if skipped:
            log.warning("ragblend: %d linear layer(s) cannot hold %s-bit weights and decode in float32: %s",
                        len(skipped), wanted[3:], "; ".join(sorted(set(skipped))))
        lossy = sum(isinstance(layer, Int4Linear) and layer.quantization_error > EXACT_INT4
                    for layer in layers.values())
        if lossy:
            log.warning("ragblend: decode_dtype='int4': %d of %d layers' weights are not 4-bit, so they were "
                        "quantized at load; answers can differ from float32 decoding (docs/benchmarks.md, "
                        "'Decoding'). decode_dtype='auto' keeps 4-bit for weights that already are.",
                        lossy, len(layers))
        return layers

    def _quantized_layers(self, wanted: str) -> tuple[dict[int, CpuLinear], list[str]]:
        """Every linear layer ``wanted`` quantizes, by weight id, and the shapes that could not be.
        ``"auto"``'s choice is cached on disk for a model read from a file (:mod:`.low_bit_cache`)."""
        path = low_bit_cache.cache_path(self.hf_model, wanted) if wanted == "auto" else None
        cached = low_bit_cache.read(path)
        if cached is not None:
            try:
                return self._cached_layers(cached), []
            except Exception as err:   # a cache: a file that does not fit is a miss
                log.warning("ragblend: the cached decoding weights %s do not fit this model (%s); building them "
                            "again.", path.name, err)
        by_name, skipped = self._built_layers(wanted)
        if path is not None:
            low_bit_cache.write(path, {f"{name}|{part}": tensor for name, layer in by_name.items()
                                       for part, tensor in _parts(layer).items()})
        return {id(layer.weight): layer for layer in by_name.values() if layer is not None}, skipped

    def _linears(self):
        """``(name, linear layer, whether it is the LM head)`` of every plain linear layer."""
        head_weight = getattr(getattr(self.hf_model, "lm_head", None), "weight", None)
        for name, module in self.hf_model.named_modules():
            if type(module) is torch.nn.Linear:
                yield name, module, module.weight is head_weight

    def _built_layers(self, wanted: str) -> tuple[dict[str, CpuLinear | None], list[str]]:
        """Each linear layer's low-bit form (None: it stays float32), by name, and the shapes that could not be."""
        runnable = {kind for kind, why_not in (("int4", int4_available()), ("int8", int8_available())) if not why_not}
        eight_bit = from_gguf(self.hf_model)   # "auto": 8-bit only for weights a GGUF file had quantized already
        layers: dict[str, CpuLinear | None] = {}
        skipped = []
        for name, module, is_head in self._linears():
            if wanted == "auto":
                kinds = ["int4"] if not is_head and on_int4_grid(module.weight) else []
                kinds += ["int8"] if eight_bit else []
            else:
                kinds = [wanted] if wanted == "int8" or not is_head else []
            layers[name] = None
            for kind in (k for k in kinds if k in runnable):
                try:
                    kind_class = Int4Linear if kind == "int4" else Int8Head if is_head else Int8Linear
                    layer = kind_class(module, self.kernel_plan)
                except (ValueError, RuntimeError) as err:   # a shape the packing does not take
                    skipped.append(f"{module.out_features}x{module.in_features} ({err})")
                    continue
                if wanted == "auto" and kind == "int4" and layer.quantization_error > EXACT_INT4:
                    continue
                layers[name] = layer
                break
        return layers, skipped

    def _cached_layers(self, cached: dict[str, torch.Tensor]) -> dict[int, CpuLinear]:
        """The layers ``cached`` holds, rebuilt over this model's float32 weights (KeyError/ValueError
        where the file does not describe every layer of this model)."""
        by_layer = low_bit_cache.by_layer(cached)
        layers = {}
        for name, module, is_head in self._linears():
            parts = by_layer.get(name, {})
            kind = low_bit_cache.kind_of(parts)
            if kind is None:
                raise KeyError(f"no entry for {name}")
            if kind == "none":
                continue
            kind_class = {"int4": Int4Linear, "int8": Int8Linear, "int8head": Int8Head}[kind]
            if (kind_class is Int8Head) != is_head:
                raise ValueError(f"{name}: a {kind} entry for a layer that is {'' if is_head else 'not '}the head")
            layers[id(module.weight)] = kind_class.from_parts(module, self.kernel_plan, parts)
        return layers

    def keep_faster(self, layers: dict[int, CpuLinear]) -> dict[int, CpuLinear]:
        """``layers`` less each kind (4-bit, 8-bit) whose decoding step -- one row through all
        its layers, as a step runs them -- is not faster than the same layers in float32 on this
        host beyond the noise (a 4-bit or 8-bit kernel can lose to float32 on some CPUs). A kind
        kept runs passes of up to its ``kernel_rows`` (``SHORT_PASS_ROWS``) on its kernel where that
        many rows measure faster than float32 too, else up to ``DRAFT_ROWS``.
        ``RAGBLEND_KERNELS=linear`` keeps float32 everywhere."""
        if os.environ.get("RAGBLEND_KERNELS", "").strip().lower() == "linear":
            return {}
        kept = {}
        with torch.inference_mode():
            for kind in (Int4Linear, Int8Linear, Int8Head):
                group = {key: layer for key, layer in layers.items() if type(layer) is kind}
                if group and _faster_here(kind, group, 1):
                    kept.update(group)
                    if kind.kernel_rows > DRAFT_ROWS and not _faster_here(kind, group, kind.kernel_rows):
                        for layer in group.values():
                            layer.kernel_rows = DRAFT_ROWS
        return kept

    def short_pass_rows(self) -> int:
        """The most rows a pass on the decoding weights runs on their low-bit kernels throughout,
        the LM head aside (a prompt's rest needs the logits of its last row only); 0: decoding
        runs on no low-bit kernel. Found once (every next question over a conversation asks)."""
        if self._short_pass_rows is None:
            adapter = self.decoding_adapter()
            model = adapter.hf_model
            head = getattr(model, "lm_head", None)   # the head every supported model has (core.model.decoder)
            self._short_pass_rows = 0 if adapter is self.adapter else min(
                (module.kernel_rows for module in model.modules()
                 if isinstance(module, (LowBitLinear, QuantLinear)) and module is not head), default=0)
        return self._short_pass_rows


def _faster_here(kind: type[LowBitLinear], group: dict[int, LowBitLinear], rows: int) -> bool:
    """Whether ``rows`` rows through ``group``'s layers run faster on their low-bit kernel than in
    float32 on this host: measured once per host, kind, shapes and rows; later processes read the
    verdict (:mod:`.host_cache`), so that they decode alike."""
    shapes = [list(layer.weight.shape) for layer in group.values()]
    key = host_key([]) | {"kind": kind.__name__, "layers": shapes} | ({"rows": rows} if rows > 1 else {})
    return remembered("low-bit-faster", key, lambda: measured_twice(lambda: _low_bit_faster(kind, group, rows), False),
                      lambda value: isinstance(value, bool))


def _low_bit_faster(kind: type[LowBitLinear], group: dict[int, LowBitLinear], rows: int) -> bool:
    """Whether ``rows`` rows through ``group``'s layers are faster in their low-bit form than in float32."""
    inputs = {n: torch.randn(rows, n) for n in {layer.weight.shape[1] for layer in group.values()}}
    seconds = fastest_rounds({
        "float32": lambda: [layer.plan.run(inputs[layer.weight.shape[1]], layer.weight, layer.bias)
                            for layer in group.values()],
        "low-bit": lambda: [layer.kernel(inputs[layer.weight.shape[1]]) for layer in group.values()],
    })
    faster = seconds["low-bit"] * MIN_GAIN < seconds["float32"]
    log.info("ragblend: %s pass of %d row(s) over %d layers: %.2f ms against %.2f ms in float32: %s",
             kind.__name__, rows, len(group), seconds["low-bit"] * 1e3, seconds["float32"] * 1e3,
             "used" if faster else "not faster here, float32 taken")
    return faster


class FusedRows(torch.nn.Module):
    """Linear layers that read the same input -- a layer's Q, K and V projections, its MLP's
    gate and up -- as one low-bit matmul over their stacked weights, for short passes (at
    most its low-bit layer's ``kernel_rows``, its parts' least). Same weights, same math, row
    for row; one kernel call and one bfloat16 rounding of the input instead of one per layer,
    which is most of what such small matmuls cost on a decoding pass. Returns the layers'
    outputs in order.

    ``weights``, ``biases``: the parts' own float32 tensors (the same, not copies), which a
    longer pass runs on through the host's kernel plan, as the parts themselves would."""

    def __init__(self, kind: type[CpuLinear], linears: list[torch.nn.Linear], plan: KernelPlan | None,
                 low_bit_parts: list[CpuLinear] | None = None):
        super().__init__()
        self.sizes = [linear.out_features for linear in linears]
        self.weights = [linear.weight for linear in linears]
        self.biases = [linear.bias for linear in linears]
        has_bias = any(bias is not None for bias in self.biases)
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(self.weights, self.biases)]) \
            if has_bias else None
        if low_bit_parts is not None and _stackable(kind, self.sizes):
            # The parts' low-bit tensors, stacked: the same bytes packing the stacked weight gives
            # (4-bit packing works in blocks of 64 rows), without quantizing the weights again.
            stacked = torch.nn.Linear(linears[0].in_features, sum(self.sizes), bias=False, device="meta")
            stacked.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            parts = [part.parts() for part in low_bit_parts]
            joined = {name: torch.cat([p[name] for p in parts], dim=1 if name == "scales_and_zeros" else 0)
                      for name in parts[0] if name != "error"}
            error = max(p["error"] for p in parts)
            self.low_bit = kind.from_parts(stacked, plan, {**joined, "error": error})
        else:
            stacked = torch.nn.utils.skip_init(torch.nn.Linear, linears[0].in_features, sum(self.sizes), bias=has_bias)
            with torch.no_grad():
                stacked.weight.copy_(torch.cat(self.weights))
                if bias is not None:
                    stacked.bias.copy_(bias)
            self.low_bit = kind(stacked, plan)
        self.low_bit.weight = None   # the stacked float32 copy: a short pass never reads it
        if low_bit_parts:   # the most rows the parts' kernels take (measured on this host)
            self.low_bit.kernel_rows = min(part.kernel_rows for part in low_bit_parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.low_bit.kernel_rows:
            outputs = self.low_bit.kernel(flat).split(self.sizes, dim=-1)
        else:   # past a short pass a low-bit layer runs on float32 weights: here the parts'
            outputs = [self.low_bit.plan.run(flat, weight, bias) for weight, bias in zip(self.weights, self.biases)]
        return tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outputs)


def _stackable(kind: type[CpuLinear], sizes: list[int]) -> bool:
    """Whether parts of ``sizes`` output rows stack by concatenating their low-bit tensors."""
    return kind is not Int4Linear or all(size % 64 == 0 for size in sizes[:-1])


FUSABLE = {"self_attn": ("fused_qkv", ("q_proj", "k_proj", "v_proj")), "mlp": ("fused_gate_up", ("gate_proj", "up_proj"))}


def fused_groups(hf_model, low_bit: dict[int, CpuLinear],
                 plan: KernelPlan | None) -> list[tuple[str, str, FusedRows]]:
    """The :class:`FusedRows` to attach to a decoding twin, as ``(owner, attribute, group)``
    (``("model.layers.3.self_attn", "fused_qkv", ...)``): one per group of :data:`FUSABLE`
    layers whose parts all decode in the same 4-bit or 8-bit format (a group with a part in
    another format, float32 included, stays unfused). Each fused part's own low-bit layer is
    taken out of ``low_bit`` as its group is built, so that at most one group's low-bit weights
    exist twice while a twin is built (Qwen2.5's fused parts hold ~230 MB in 8-bit)."""
    groups = []
    for index, block in enumerate(hf_model.model.layers):
        for owner_name, (attribute, part_names) in FUSABLE.items():
            owner = getattr(block, owner_name, None)
            parts = [getattr(owner, name, None) for name in part_names]
            if any(type(part) is not torch.nn.Linear for part in parts):
                continue
            kinds = {type(low_bit.get(id(part.weight))) for part in parts}
            if len(kinds) != 1 or not kinds <= {Int4Linear, Int8Linear}:
                continue
            try:
                groups.append((f"model.layers.{index}.{owner_name}", attribute,
                               FusedRows(kinds.pop(), parts, plan, [low_bit[id(part.weight)] for part in parts])))
            except (ValueError, RuntimeError) as err:   # a stacked shape the packing does not take
                log.info("ragblend: layer %d's %s decode unfused (%s)", index, "/".join(part_names), err)
                continue
            for part in parts:
                del low_bit[id(part.weight)]
    return groups
