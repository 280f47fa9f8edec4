"""The linear layers the engine swaps into a model: float16 (:class:`HalfLinear`), the
measured CPU kernel (:class:`CpuLinear`), 4-bit and 8-bit (:class:`Int4Linear`,
:class:`Int8Linear`, :class:`Int8Head`), and the weight samples a model's fingerprint reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import DRAFT_ROWS, SHORT_PASS_ROWS, KernelPlan, plan_for


class HalfLinear(torch.nn.Module):
    """A linear layer holding float16 weights for float32 activations: the input is rounded
    to float16 and the output returned as float32. One token at a time, such a matmul reads
    half the bytes, and on x86 CPUs (F16C) it runs ~4x faster than float32."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().half(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().half(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.half(), self.weight, self.bias).to(x.dtype)


class CpuLinear(torch.nn.Module):
    """A float32 linear layer computed by the kernel its row count's bucket chose on this host
    (:mod:`ragblend.core.model.kernels`: ``F.linear``, oneDNN's matmul or a column product). The
    weight (and bias) are the wrapped layer's, shared, not copied. Same math as ``F.linear``,
    other kernels, so results differ by float rounding (logits by ~1e-5)."""

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.plan = plan if plan is not None else KernelPlan.fixed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])   # [tokens, in] whatever the leading dimensions
        out = self.rows(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``[tokens, out]`` for ``[tokens, in]``."""
        return self.plan.run(flat, self.weight, self.bias)


class LowBitLinear(CpuLinear):
    """A :class:`CpuLinear` that also holds its weight in a low-bit form, for short passes: up
    to ``kernel_rows`` rows (a decoding pass; a conversation's next question) run on the low-bit
    kernel (:meth:`kernel`), longer ones on the float32 weight through the host's kernel plan.
    ``kernel_rows`` is lowered to ``kernels.DRAFT_ROWS`` where this host measures the kernel no
    faster than float32 at ``SHORT_PASS_ROWS`` rows (``decode_dtype="auto"``; a named decode dtype
    is not measured: :mod:`.decode_weights`)."""

    kernel_rows = SHORT_PASS_ROWS

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """``[tokens, out]`` in float32 for ``[tokens, in]``, on the low-bit weights."""
        raise NotImplementedError

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        return self.kernel(flat) if flat.shape[0] <= self.kernel_rows else super().rows(flat)


INT4_GROUP = 32   # weights per scale and minimum: a GGUF Q4_0/Q4_1 block


def int4_available() -> str | None:
    """None if this torch can run 4-bit weight matmuls on CPU, else why not."""
    for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
        if not hasattr(torch.ops.aten, name):
            return f"this torch ({torch.__version__}) has no aten.{name}"
    return None


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, minimums)`` with ``weight ~= scales * codes + minimums`` per group of
    ``group`` input weights, codes in 0..15 (asymmetric min/max quantization, as GGUF's Q4_1).

    A weight dequantized from a Q4_1 GGUF comes back as the file's own blocks: its quantizer
    maps each block's minimum to code 0 and maximum to code 15, so the min/max found here are
    the block's, and the codes are the file's codes (up to float rounding of the scale).
    """
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(-1, group)   # one row per group: reductions over rows of 32 are fast
    low, high = torch.aminmax(w, dim=1)
    scales = (high - low) / 15
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    codes = (w - low[:, None]).mul_(inverse[:, None]).round_().clamp_(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scales.reshape(out_features, -1), low.reshape(out_features, -1)


def int4_error(weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, low: torch.Tensor) -> float:
    """Largest difference between ``weight`` and its 4-bit form, relative to its largest value."""
    grid = scales[..., None] * codes.reshape(*scales.shape, INT4_GROUP).float() + low[..., None]
    error = (grid - weight.detach().float().reshape(grid.shape)).abs().max()
    return float(error / weight.detach().abs().max().clamp_min(1e-30))


def on_int4_grid(weight: torch.Tensor) -> bool:
    """Whether ``weight`` loses nothing in 4-bit groups of 32 (it was dequantized from Q4_0/Q4_1),
    judged on its first rows: a weight that is not on the grid is almost never so on them."""
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP:
        return False
    rows = weight[:8]
    return int4_error(rows, *quantize_int4(rows)) <= EXACT_INT4


EXACT_INT4 = 1e-6   # relative error below which 4-bit weights count as the weights themselves


def low_bit_from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor],
                       expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
    """A ``cls`` layer (:class:`Int4Linear`, :class:`Int8Linear`) over ``linear``'s float32 weight,
    holding ``parts`` (cached between processes: :mod:`.low_bit_cache`) as the attributes
    ``expected`` names: ValueError unless each is contiguous, of its dtype and shape, and the
    parts' ``error`` one number."""
    for name, (dtype, shape) in expected.items():
        tensor = parts[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"cached {name} {tensor.dtype} {tuple(tensor.shape)} do not fit a "
                             f"{linear.out_features}x{linear.in_features} weight's {dtype} {shape}")
    if parts["error"].numel() != 1:
        raise ValueError("a cached low-bit layer's error is not one number")
    layer = cls.__new__(cls)
    CpuLinear.__init__(layer, linear, plan)
    for name in expected:
        setattr(layer, name, parts[name])
    layer.quantization_error = float(parts["error"])
    return layer


class Int4Linear(LowBitLinear):
    """A linear layer whose short passes (:class:`LowBitLinear`) read 4-bit weights: PyTorch's
    own CPU kernel (``aten._weight_int4pack_mm_for_cpu``, group size 32),
    which runs on bfloat16 activations, so a step reads ~1/8 of the float32 weight bytes and
    rounds activations and scales to bfloat16. Longer passes use the float32 weight through
    the host's kernel plan, unchanged. The output is float32 either way.

    ``quantization_error`` is the weight's largest change, relative to its largest value: 0
    (to float rounding) for a weight dequantized from a Q4_0/Q4_1 GGUF, whose blocks come back
    exactly (see :func:`quantize_int4`).
    """

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__(linear, plan)
        if linear.in_features % INT4_GROUP or linear.out_features % 16:
            raise ValueError(f"4-bit packing needs inputs in groups of {INT4_GROUP} and outputs in 16s")
        codes, scales, low = quantize_int4(linear.weight)
        self.quantization_error = int4_error(linear.weight, codes, scales, low)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale.
        self.scales_and_zeros = torch.stack([scales.T, (low + 8 * scales).T], dim=-1).to(torch.bfloat16).contiguous()

    def parts(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_parts` rebuilds the layer from (cached between processes: :mod:`.low_bit_cache`)."""
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros,
                "error": torch.tensor(self.quantization_error)}

    @classmethod
    def from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor]):
        """The layer :meth:`parts` describes, over ``linear``'s float32 weight; ValueError if they do not fit it."""
        out_features, in_features = linear.out_features, linear.in_features
        return low_bit_from_parts(cls, linear, plan, parts, {
            "packed": (torch.uint8, (out_features, in_features // 2)),
            "scales_and_zeros": (torch.bfloat16, (in_features // INT4_GROUP, out_features, 2))})

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(torch.bfloat16), self.packed, INT4_GROUP,
                                                         self.scales_and_zeros)
        return out.float() if self.bias is None else out.float() + self.bias


def int8_available() -> str | None:
    """None if this torch can run 8-bit weight matmuls on CPU, else why not."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return f"this torch ({torch.__version__}) has no aten._weight_int8pack_mm"
    return None


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` with ``weight ~= scales[:, None] * codes``: symmetric, one scale per
    output row, codes in -127..127. Each scale is rounded *up* to a bfloat16 value before the
    codes are chosen, so the kernel's bfloat16 scales are the scales the codes were made for."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30)
    scales = _round_up_bfloat16(scales)
    codes = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales


def _round_up_bfloat16(x: torch.Tensor) -> torch.Tensor:
    rounded = x.to(torch.bfloat16).float()
    below = rounded < x
    rounded[below] = torch.nextafter(rounded[below].to(torch.bfloat16), torch.tensor(float("inf"),
                                     dtype=torch.bfloat16)).float()
    return rounded


class Int8Linear(LowBitLinear):
    """A linear layer whose short passes (:class:`LowBitLinear`) read 8-bit weights, one scale
    per output row: PyTorch's own CPU kernel (``aten._weight_int8pack_mm``)
    on bfloat16 activations, so a step reads 1/4 of the float32 weight bytes. For the weights of a
    5-, 6- or 8-bit GGUF (Qwen2.5's Q5_0/Q6_K/Q8_0 blocks) the rounding is a fraction of the
    file's own step. Longer passes use the float32 weight through the host's kernel plan.

    ``quantization_error``: the weight's largest change, relative to its largest value.
    """

    def __init__(self, linear: torch.nn.Linear, plan: KernelPlan | None = None):
        super().__init__(linear, plan)
        codes, scales = quantize_int8(linear.weight)
        weight = linear.weight.detach().float()
        error = (codes.float() * scales[:, None] - weight).abs().max()
        self.quantization_error = float(error / weight.abs().max().clamp_min(1e-30))
        self.codes, self.scales = codes, scales.to(torch.bfloat16)

    def parts(self) -> dict[str, torch.Tensor]:
        """What :meth:`from_parts` rebuilds the layer from (cached between processes: :mod:`.low_bit_cache`)."""
        return {"codes": self.codes, "scales": self.scales, "error": torch.tensor(self.quantization_error)}

    @classmethod
    def from_parts(cls, linear: torch.nn.Linear, plan: KernelPlan | None, parts: dict[str, torch.Tensor]):
        """The layer :meth:`parts` describes, over ``linear``'s float32 weight; ValueError if they do not fit it."""
        return low_bit_from_parts(cls, linear, plan, parts, {"codes": (torch.int8, tuple(linear.weight.shape)),
                                                             "scales": (torch.bfloat16, (linear.out_features,))})

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.codes, self.scales)
        return out.float() if self.bias is None else out.float() + self.bias


class Int8Head(Int8Linear):
    """The LM head on 8-bit weights, with the logits that can pick the token computed exactly.

    A decoding pass ranks the vocabulary on the 8-bit weights, then recomputes the ``EXACT_TOP``
    best candidates' logits in float32 from the float32 weight rows: greedy decoding and top-p
    sampling see float32 logits where they decide, while the pass reads ~1/4 of the head's bytes
    (the head is Qwen2.5-0.5B's largest matrix: 136M weights). Without the rescoring, bfloat16
    rounding of the final hidden state flipped near-tied greedy choices on 6 of 16 SQuAD prompts.
    """

    EXACT_TOP = 64
    # A decoding pass's rows only: the rescoring makes more rows slower than float32 (16 rows:
    # ~16 ms against ~12 on an AVX-512 EPYC), and a prompt's rest wants its last row's logits.
    kernel_rows = DRAFT_ROWS

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        logits = super().kernel(flat)
        top = logits.topk(min(self.EXACT_TOP, logits.shape[-1]), dim=-1).indices   # [rows, k]
        exact = torch.einsum("rd,rkd->rk", flat, self.weight[top])
        if self.bias is not None:
            exact = exact + self.bias[top]
        return logits.scatter_(-1, top, exact)


def with_linears(hf_model, make):
    """A twin of ``hf_model`` whose linear layers (projections, MLP, LM head) are
    ``make(layer)`` (:class:`CpuLinear`, :class:`HalfLinear`); everything else (embeddings,
    norms, rotary tables) is shared with the original, not copied."""
    import copy

    shared = {id(p): p for p in hf_model.parameters()}
    shared.update({id(b): b for b in hf_model.buffers()})
    twin = copy.deepcopy(hf_model, memo=shared)
    for name, module in list(twin.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:   # not subclasses: quantized layers pack their weights
                setattr(module, child_name, make(child))
    return twin


def kernel_layers(hf_model) -> tuple[list[list[torch.nn.Linear]], list[torch.nn.Linear]]:
    """``(each decoder layer's linear layers, [the LM head])``: what the kernel plan is measured on."""
    decoder = [[m for m in layer.modules() if type(m) is torch.nn.Linear] for layer in hf_model.model.layers]
    head = getattr(hf_model, "lm_head", None)
    return [layer for layer in decoder if layer], [head] if type(head) is torch.nn.Linear else []


def kernel_plan_for(hf_model, remeasure: bool = False, wait: bool = True) -> KernelPlan:
    """The CPU kernel per row bucket for ``hf_model``'s linear layers on this host, measured
    once and cached (:func:`ragblend.core.model.kernels.plan_for`; without ``wait``, ``F.linear``
    until :func:`ragblend.core.model.kernels.measure_in_background` has measured it)."""
    return plan_for(*kernel_layers(hf_model), remeasure=remeasure, wait=wait)


def weight_samples(hf_model):
    """``(name, shape, float32 samples)`` of every tensor of the model's state dict: every
    ``len / 4096``-th value. A model built by :mod:`.quantized` gives those of the float32
    weights its file holds (read from the file's blocks), so that it is known as the same model
    as the file dequantized (its shipped calibration applies: the two prefills differ by far less
    than the model's order noise, docs/models.md)."""
    exact = getattr(hf_model, "gguf_weight_samples", None)
    if exact is not None:
        yield from exact()
        return
    for name, param in hf_model.state_dict().items():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        yield name, tuple(param.shape), flat[::step].float().cpu().numpy()
