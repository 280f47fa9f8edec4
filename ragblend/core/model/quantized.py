"""Linear layers and embeddings that keep a GGUF file's quantized weights, and the loader that
builds a model of them straight from the file (no float32 copy, on disk or in memory).

Each weight is held in one form, the nearest PyTorch's CPU kernels read:

* Q4_0, Q4_1, Q4_K: the file's own 4-bit codes in groups of 32 (Q4_K's 6-bit sub-block scales
  and minimums multiplied out per group), packed for ``aten._weight_int4pack_mm_for_cpu``, with
  bfloat16 scales and zeros (the kernel's, for decoding) and the file's own scales and minimums
  (Q4_0's float16 scale as half a byte a group beside the kernel's: :func:`scale_residuals`; Q4_1's
  in float16; Q4_K's blocks' own 16 bytes of scales): what a longer pass dequantizes with, so its
  weights are the file's to float32 rounding. ~0.64 bytes a weight (Q4_1 0.75, Q4_K 0.69).
* Q5_0, Q5_1, Q5_K, Q6_K, Q8_0: 8-bit codes, one scale per output row (the nearest 8-bit form:
  the rounding is a fraction of the file's own step), for ``aten._weight_int8pack_mm``: ~1 byte.
  Those rows round the file's weights again, so for Q5_0 and Q8_0 a longer pass, an embedding
  lookup and the LM head's exact top logits read the file's own blocks (:class:`FileRows`,
  memory-mapped): exact, at no memory of their own but the file's shared pages.
* F32, F16, BF16: the file's values in their own dtype.

A pass of up to ``kernel_rows`` rows (a decoding step: ``kernels.DRAFT_ROWS``) runs the
low-bit kernel on bfloat16 activations, as the decoding twins of :mod:`.decode_weights` do. A
longer pass (a chunk's precompute, a fused or full prefill) dequantizes the layer into one reused
scratch buffer and runs ``F.linear``: at a cost of one pass over the weight per matmul, small
beside a matmul of many rows. The engine prefills on a twin (:func:`prefill_twin`): in float32,
or, where the model's architecture met the fidelity rule on it (:func:`fast_prefill`), on the
plan measured on the running host (:func:`long_pass_plan`): bfloat16 matmuls where the CPU
multiplies bfloat16 natively and that measures clearly faster (weights dequantized in float32
and rounded once), else float32; the low-bit kernel up to the rows where it still beats the
dequantized matmul. A near-tied greedy pick is checked again on the float32 twin (:func:`exact_twin`).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_file import EIGHT_BIT, FOUR_BIT, GGUFFile, TensorForm, TensorInfo
from .kernels import DRAFT_ROWS, fastest_rounds
from .linear import quantize_int8

log = logging.getLogger("ragblend")

GROUP = 32                      # weights per 4-bit scale and zero
HELD_FORM_VERSION = 2           # 2: long passes on the file's own 4-bit scales and Q5_0/Q8_0 blocks
SCRATCH_WEIGHTS = 16 << 20      # a longer pass dequantizes at most this many weights at a time (64 MiB float32)
# A 16-bit dequantization goes through float32 this many weights at a time (16 MiB): a 1.5B MLP matrix
# in 4 slices took 9.4 ms, in 52 L2-sized ones 12.7 ms; and fewer ops wait less on a busy host's
# threads (in one burst a 1.1k-token 1.5B prefill took 152 s on 256K-weight slices, 44 s on these).
SLICE_WEIGHTS = 1 << 22
_scratch = threading.local()    # per thread: engines on other threads may run passes at once


def scratch(count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of at least ``count`` values of ``dtype``, reused by every layer of this thread."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < count:
        with torch.inference_mode(False):   # a normal tensor: passes in and out of inference mode write it
            buffer = buffers[dtype] = torch.empty(count, dtype=dtype)
    return buffer[:count]


# ------------------------------------------------------------------------------ GGUF blocks -> codes


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 ``[rows, blocks]``."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def four_bit_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """``(codes [rows, cols] uint8 0..15, scales, minimums [rows, cols / 32] float32)`` of a Q4_0,
    Q4_1 or Q4_K tensor's blocks ``raw [rows, blocks, bytes]``: weight = scale * code + minimum."""
    rows = raw.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        qs = raw[..., 2 if type_name == "Q4_0" else 4:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)          # elements 0-15 low nibbles, 16-31 high
        scales = _f16(raw, 0)
        low = -8 * scales if type_name == "Q4_0" else _f16(raw, 2)
        return codes.reshape(rows, -1), torch.from_numpy(scales), torch.from_numpy(low)
    # Q4_K: codes 64 at a time, low nibbles first, after each block's 16 bytes of scales.
    qs = raw[..., 16:144].reshape(rows, -1, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3)               # [rows, blocks, 4, 2, 32]
    return (codes.reshape(rows, -1), *q4_k_scales(raw[..., :Q4_K_HEAD]))


Q4_K_HEAD = 16   # bytes of scales at the start of a Q4_K block: float16 d and dmin, 8 x 6-bit scales and minimums


def q4_k_scales(heads: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(scales, minimums) [rows, blocks * 8]`` of Q4_K blocks' first 16 bytes ``heads
    [rows, blocks, 16]``: 256 weights = 8 groups of 32, each with a 6-bit scale and minimum
    multiplying the block's float16 d and dmin (ggml's get_scale_min_k4; the products are exact)."""
    rows = heads.shape[0]
    d, dmin = _f16(heads, 0), _f16(heads, 2)
    s = heads[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scales = (d[..., None] * sc.astype(np.float32)).reshape(rows, -1)
    low = -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)
    return torch.from_numpy(scales), torch.from_numpy(low)


def pack_int4(codes: np.ndarray) -> torch.Tensor:
    """``codes [rows, cols]`` (uint8 0..15, rows in 64s) in the layout of
    ``aten._convert_weight_to_int4pack_for_cpu``: per block of ``B`` rows (:func:`int4_block_rows`:
    64 where PyTorch's kernel was built for AVX-512, 32 for AVX2), ``cols`` runs of ``B / 2`` bytes,
    byte ``i`` holding row ``i``'s code in its low nibble and row ``i + B / 2``'s in its high
    (:func:`unpack_int4` reverses it). Made here from uint8 codes, without the op's int32 copy;
    called only where the layout is known (:func:`int4_packable`)."""
    return torch.from_numpy(_packed(codes, int4_block_rows()))


def _packed(codes: np.ndarray, block: int) -> np.ndarray:
    rows, cols = codes.shape
    halves = codes.reshape(rows // block, 2, block // 2, cols)
    return np.ascontiguousarray((halves[:, 0] | (halves[:, 1] << 4)).transpose(0, 2, 1)).reshape(rows, cols // 2)


_LAYOUT: list[int] = []


def int4_block_rows() -> int:
    """The rows of one block of this torch's int4 packing (64: AVX-512 kernels; 32: AVX2), checked
    once against the op; 0 where it is neither layout (4-bit weights then stay unused here:
    :func:`int4_packable`)."""
    if not _LAYOUT:
        codes = np.random.default_rng(0).integers(0, 16, (128, 64), dtype=np.uint8)
        expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes).int(), 2)
        _LAYOUT.append(next((block for block in (64, 32) if torch.equal(expected, torch.from_numpy(_packed(codes, block)))), 0))
    return _LAYOUT[0]


def dequantized_rows(gguf: GGUFFile, info: TensorInfo, rows: slice | torch.Tensor) -> np.ndarray:
    """float32 ``[rows, cols]`` of some rows of a tensor: bit for bit gguf's reference dequantizer
    (as transformers loads a GGUF), in PyTorch for the block types a start-up meets most."""
    from gguf import GGMLQuantizationType, dequantize

    raw = np.array(gguf.blocks(info)[rows])   # a copy: torch wants writable memory
    fast = _SIMPLE_BLOCKS.get(info.type_name)
    if fast is not None:
        return fast(torch.from_numpy(raw)).reshape(raw.shape[0], -1).numpy()
    return dequantize(raw, GGMLQuantizationType(info.type_id)).reshape(raw.shape[0], -1)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as float32 ``[..., 1]``."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """A block's 4-bit codes in element order: the low nibbles, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], -1, 18)
    return _half(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], -1, 20)
    return _half(blocks, 0) * _nibbles(blocks[..., 4:]) + _half(blocks, 2)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], -1, 34)
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(raw.shape[0], -1, 22)
    high = blocks[..., 2:6].contiguous().view(torch.int32)   # bit i: element i's fifth bit
    fifth = (high >> torch.arange(32, dtype=torch.int32)) & 1
    return _half(blocks, 0) * ((_nibbles(blocks[..., 6:]) + 16 * fifth.float()) - 16)


# The same arithmetic as gguf's reference (float32 products and sums, in its order), so the
# weights are identical: tests/unit/test_quantized.py compares them on every type.
_SIMPLE_BLOCKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0}


class FileRows:
    """Exact float32 rows of one weight read from its GGUF file's memory-mapped blocks (the map
    made once, kept with the layer): what a longer pass and an embedding lookup of an 8-bit layer
    read, where its 8-bit-a-row codes (the decoding kernel's) would round the file's weights
    again. No copy in memory: the file's pages, shared and dropped under pressure by the OS."""

    def __init__(self, gguf: GGUFFile, info: TensorInfo, row_order: torch.Tensor | None):
        self.blocks, self.type_name = gguf.blocks(info), info.type_name
        self.order = None if row_order is None else row_order.numpy()

    def __deepcopy__(self, memo) -> "FileRows":   # a twin shares the map
        return self

    def rows(self, index: slice | np.ndarray) -> torch.Tensor:
        """float32 ``[rows, cols]`` of the layer's rows ``index`` (in the layer's row order)."""
        if self.order is not None:
            index = self.order[index]
        raw = torch.from_numpy(np.array(self.blocks[index]))   # a copy: torch wants writable memory
        return _SIMPLE_BLOCKS[self.type_name](raw).reshape(raw.shape[0], -1)


# ------------------------------------------------------------------------------ the layers


class QuantLinear(torch.nn.Module):
    """A linear layer over one quantized weight (see the module's docstring). ``kind``: "int4",
    "int8" or "float"; ``source_type``: the GGUF type it was read from."""

    def __init__(self, out_features: int, in_features: int, kind: str, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None, source_type: str = ""):
        super().__init__()
        self.out_features, self.in_features, self.kind, self.source_type = out_features, in_features, kind, source_type
        self.kernel_rows = DRAFT_ROWS   # passes of at most this many rows run the low-bit kernel (0: none)
        self.long_pass_dtype = torch.float32   # what a longer pass dequantizes to and multiplies in
        self.file_rows: FileRows | None = None   # an 8-bit layer's exact weights, from its file
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else torch.nn.Parameter(bias.float(), requires_grad=False)

    # -- building from a file's tensor

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, info: TensorInfo, row_order: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, exact: bool = False) -> "QuantLinear":
        """The layer of ``info``'s weight (its rows in ``row_order``); ``exact``: dequantized to float32."""
        rows, cols = info.shape
        raw = gguf.blocks(info)
        if row_order is not None:
            raw = raw[row_order.numpy()]
        name = info.type_name
        if exact:
            order = np.arange(rows) if row_order is None else row_order.numpy()
            weight = torch.from_numpy(dequantized_rows(gguf, info, order).astype(np.float32, copy=False))
            return cls(rows, cols, "float", {"weight": weight}, bias, name)
        if name in FOUR_BIT and int4_packable(rows, cols):
            per_block = 32 if name != "Q4_K" else 256
            blocks = np.asarray(raw).reshape(rows, cols // per_block, -1)
            heads = blocks[..., :Q4_K_HEAD] if name == "Q4_K" else None
            return cls.int4(*four_bit_groups(blocks, name), bias, name, q4_k_heads=heads)
        if name in FOUR_BIT or name in EIGHT_BIT:
            codes, row_scales = [], []
            step = max(1, SCRATCH_WEIGHTS // cols)
            for start in range(0, rows, step):   # a slice of rows at a time: no whole float32 copy
                order = slice(start, start + step) if row_order is None else row_order[start:start + step]
                c, s = quantize_int8(torch.from_numpy(dequantized_rows(gguf, info, order)))
                codes.append(c)
                row_scales.append(s)
            layer = cls(rows, cols, "int8", {"codes": torch.cat(codes), "scales": torch.cat(row_scales)}, bias, name)
            if name in _SIMPLE_BLOCKS:
                layer.file_rows = FileRows(gguf, info, row_order)
            return layer
        weight = torch.from_numpy(np.ascontiguousarray(raw).view({"F32": np.float32, "F16": np.float16}.get(name, np.int16)))
        if name == "BF16":
            weight = weight.view(torch.bfloat16)
        return cls(rows, cols, "float", {"weight": weight.reshape(rows, cols).clone()}, bias, name)

    @classmethod
    def int4(cls, codes: np.ndarray, scales: torch.Tensor, low: torch.Tensor, bias=None, source_type="",
             q4_k_heads: np.ndarray | None = None) -> "QuantLinear":
        rows, cols = codes.shape
        packed = pack_int4(codes)
        # The kernel computes (code - 8) * scale + zero, so zero = minimum + 8 * scale.
        scales_and_zeros = torch.stack([scales.T, (low + 8 * scales).T], dim=-1).to(torch.bfloat16).contiguous()
        tensors = {"packed": packed, "scales_and_zeros": scales_and_zeros}
        # The kernel's bfloat16 scales round the file's (float16, or Q4_K's float32 products) to 8
        # bits: enough for a decoding step, but a prefill on them parted from the float32 file's
        # answers (docs/benchmarks.md). The dequantized long pass reads the file's own scales and
        # minimums: for Q4_0 (minimum = -8 x scale) the float16 scale as its distance from the
        # kernel's, +half a byte a group; for Q4_K the file's 16 bytes of scales a block (their products
        # would take 8 bytes a group in float32); else both, in float16 where that holds them (Q4_1).
        if q4_k_heads is not None:
            tensors["q4_k_heads"] = torch.from_numpy(np.ascontiguousarray(q4_k_heads))
        elif torch.equal(low, -8 * scales) and torch.equal(scales.half().float(), scales):
            tensors["scale_residual_nibbles"] = pack_nibbles(scale_residuals(scales, scales_and_zeros[..., 0].T))
        else:
            exact_scales = torch.stack([scales, low], dim=-1)
            if torch.equal(exact_scales.half().float(), exact_scales):
                exact_scales = exact_scales.half()
            tensors["exact_scales"] = exact_scales.contiguous()
        return cls(rows, cols, "int4", tensors, bias, source_type)

    def file_scales(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(scales, minimums)``, each ``[stop - start, groups]``: the file's of each group of
        rows ``start:stop``, bit for bit (what :meth:`dequantize` multiplies the 4-bit codes by)."""
        heads = getattr(self, "q4_k_heads", None)
        if heads is not None:
            return q4_k_scales(heads[start:stop].numpy())
        nibbles = getattr(self, "scale_residual_nibbles", None)
        if nibbles is None:
            exact = self.exact_scales[start:stop].float()
            return exact[..., 0], exact[..., 1]
        kernel_scales = self.scales_and_zeros[:, start:stop, 0].T
        scales = exact_from_residuals(kernel_scales, unpack_nibbles(nibbles[start:stop], kernel_scales.shape[1]))
        return scales, -8 * scales

    # -- computing

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.rows(flat.float())
        return out.reshape(*x.shape[:-1], self.out_features)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``[tokens, out]`` float32 for ``[tokens, in]`` float32."""
        if flat.shape[0] <= self.kernel_rows and self.kind != "float":
            x = flat.to(torch.bfloat16)
            if self.kind == "int4":
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)
            else:
                out = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales.to(torch.bfloat16))
            return out.float() if self.bias is None else out.float() + self.bias
        step, dtype = self.rows_per_slice(), self.long_pass_dtype
        x = flat.to(dtype)
        outs = [F.linear(x, self.dequantize(start, min(start + step, self.out_features), dtype)).float()
                for start in range(0, self.out_features, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias

    def rows_per_slice(self) -> int:
        """Output rows dequantized at a time: all of them up to SCRATCH_WEIGHTS (a whole LM head
        of a large vocabulary would be ~0.5 GB in float32), in whole 64-row blocks for int4."""
        step = max(64, SCRATCH_WEIGHTS // self.in_features // 64 * 64)
        return self.out_features if step >= self.out_features else step

    def dequantize(self, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Weight rows ``start:stop`` in ``dtype`` (float32 or bfloat16), in this thread's scratch
        buffer (valid until the next call)."""
        stop = self.out_features if stop is None else stop
        count = stop - start
        out = scratch(count * self.in_features, dtype).view(count, self.in_features)
        if dtype != torch.float32 and self.kind != "float":
            # In float32 a slice at a time, each rounded once into the buffer: bit for bit the
            # float32 weights rounded to dtype, and ~3x faster than the arithmetic in bfloat16.
            step = max(64, SLICE_WEIGHTS // self.in_features // 64 * 64)
            for first in range(start, stop, step):
                last = min(first + step, stop)
                out[first - start:last - start].copy_(self.dequantize(first, last))
            return out
        if self.kind == "float":
            if self.weight.dtype == dtype:
                return self.weight[start:stop]
            return out.copy_(self.weight[start:stop])
        if self.kind == "int8" and self.file_rows is not None:   # a slice at a time: small temporaries
            step = max(1, SLICE_WEIGHTS // self.in_features)
            for first in range(start, stop, step):
                last = min(first + step, stop)
                out[first - start:last - start].copy_(self.file_rows.rows(slice(first, last)))
            return out
        if self.kind == "int8":
            return torch.mul(self.codes[start:stop], self.scales[start:stop, None].to(dtype), out=out)
        # The codes go straight into the buffer (each nibble half of a packed block, converted in one
        # copy), then weight = code * scale + (zero - 8 * scale) in one fused pass: three passes over
        # the buffer in all, where unpacking first took ten.
        block = int4_block_rows()   # 64 or 32 rows, dividing the 64-row-aligned slices asked for
        blocks = self.packed[start:stop].view(count // block, self.in_features, block // 2)
        halves = out.view(count // block, 2, block // 2, self.in_features)
        halves[:, 0].copy_((blocks & 15).transpose(1, 2))
        halves[:, 1].copy_((blocks >> 4).transpose(1, 2))
        scales, minimums = self.file_scales(start, stop)   # [rows, groups] each
        groups = out.view(count, -1, GROUP)
        torch.addcmul(minimums[..., None], groups, scales[..., None], out=groups)   # code * scale + minimum, as gguf's
        return out


# A float16 value in float32 leaves the low 13 bits of the mantissa zero, and rounding it to
# bfloat16 (the kernel's scale) moves it by at most half a bfloat16 step, 2^15 in float32 bits:
# so the float16 scale is the bfloat16 one plus a small multiple (-4..4) of 2^13 in its bits.
RESIDUAL_SHIFT = 13


def scale_residuals(scales: torch.Tensor, kernel_scales: torch.Tensor) -> torch.Tensor:
    """int8, in the shape of ``scales``: how far each float16-exact float32 scale lies from its
    bfloat16 rounding ``kernel_scales``, in units of 2^13 of their float32 bits (same sign, so the
    difference of their bit patterns is that of their magnitudes)."""
    difference = scales.contiguous().view(torch.int32) - kernel_scales.float().contiguous().view(torch.int32)
    return (difference >> RESIDUAL_SHIFT).to(torch.int8).contiguous()


def pack_nibbles(residuals: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, ceil(groups / 2)]``: the residuals ``[rows, groups]`` (-4..4, :func:`scale_residuals`)
    as 4-bit two's complement, two groups a byte (the even one in the low nibble): half a byte a
    group, 0.024 GB of a 1.5B model's 0.048 GB as bytes."""
    rows, groups = residuals.shape
    nibbles = torch.zeros(rows, groups + groups % 2, dtype=torch.uint8)
    nibbles[:, :groups] = residuals.to(torch.uint8) & 15
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor, groups: int) -> torch.Tensor:
    """int8 ``[rows, groups]``, the residuals :func:`pack_nibbles` packed."""
    both = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)[:, :groups]
    return ((both ^ 8).to(torch.int8) - 8)   # 4-bit two's complement, sign-extended


def exact_from_residuals(kernel_scales: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """The float32 scales :func:`scale_residuals` took apart, bit for bit, contiguous."""
    bits = torch.empty(residuals.shape, dtype=torch.float32).copy_(kernel_scales).view(torch.int32)
    return bits.add_(residuals, alpha=1 << RESIDUAL_SHIFT).view(torch.float32)


def int4_packable(rows: int, cols: int) -> bool:
    """Whether a weight's 4-bit form fits the CPU kernel and :func:`unpack_int4`: inputs in groups
    of 32, outputs in whole 64-row blocks (every real model's shapes; a tiny test model's may not)."""
    return cols % GROUP == 0 and rows % 64 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") \
        and int4_block_rows() > 0


def unpack_int4(packed: torch.Tensor, rows: int, cols: int, start: int, stop: int) -> torch.Tensor:
    """Codes ``[stop - start, cols]`` (uint8) of rows ``start:stop`` (64-row aligned) of a weight
    packed by ``_convert_weight_to_int4pack_for_cpu`` (:func:`pack_int4`'s layout)."""
    block = int4_block_rows()
    blocks = packed[start:stop].reshape((stop - start) // block, cols, block // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(stop - start, cols)


class QuantEmbedding(torch.nn.Module):
    """A token embedding over a :class:`QuantLinear`'s weight (shared with a tied LM head): the
    looked-up rows are dequantized, the rest stay quantized. ``scale``: Gemma 3's sqrt(hidden)."""

    def __init__(self, table: QuantLinear, scale: float | None = None):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.scale = scale
        self.weight = torch.empty(0)   # what ModelAdapter reads the compute dtype and device from

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        table = self.table
        if table.file_rows is not None:
            rows = table.file_rows.rows(flat.numpy())
        elif table.kind == "int8":
            rows = table.codes[flat].float() * table.scales[flat, None]
        elif table.kind == "float":
            rows = table.weight[flat].float()
        else:   # 4-bit: the 64-row blocks holding the ids, dequantized, then the rows picked
            rows = torch.empty(flat.shape[0], self.embedding_dim)
            for block in flat.div(64, rounding_mode="floor").unique().tolist():
                picked = (flat // 64) == block
                rows[picked] = table.dequantize(block * 64, block * 64 + 64)[flat[picked] - block * 64]
        if self.scale is not None:
            rows = rows * torch.tensor(self.scale, dtype=torch.float32)
        return rows.reshape(*ids.shape, self.embedding_dim)


class QuantHead(torch.nn.Module):
    """The LM head on a quantized weight, with the logits that can pick the token computed in
    float32: a decoding pass ranks the vocabulary with the low-bit kernel, then recomputes the
    ``EXACT_TOP`` best candidates' logits from their dequantized rows on float32 activations
    (as :class:`~ragblend.core.model.linear.Int8Head` does), so bfloat16 rounding of the final hidden
    state cannot flip a near-tied greedy choice."""

    EXACT_TOP = 64

    def __init__(self, table: QuantLinear):
        super().__init__()
        self.table = table
        self.out_features, self.in_features = table.out_features, table.in_features
        self.weight = torch.empty(0)   # the weight is the table's (transformers' tie checks look for one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        logits = self.table.rows(flat)
        if flat.shape[0] <= self.table.kernel_rows and self.table.kind == "int8":
            top = logits.topk(min(self.EXACT_TOP, logits.shape[-1]), dim=-1).indices
            if self.table.file_rows is not None:   # the file's own weights
                rows = self.table.file_rows.rows(top.reshape(-1).numpy()).reshape(*top.shape, -1)
            else:
                rows = self.table.codes[top].float() * self.table.scales[top][..., None]   # [rows, k, in]
            logits.scatter_(-1, top, torch.einsum("rd,rkd->rk", flat, rows))
        return logits.reshape(*x.shape[:-1], self.out_features)


# ------------------------------------------------------------------------------ the loader


def _row_order(form: TensorForm, gguf_name: str, rows: int) -> torch.Tensor | None:
    """The order of a weight's rows in the model, as rows of the file (Llama's Q and K rows are
    permuted in GGUF files), or None where it keeps them (:class:`~.gguf_file.TensorForm`)."""
    order = form.row_order(gguf_name, rows)
    return None if order is None else torch.from_numpy(order.astype(np.int64))


def gguf_names(model, architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> the HF parameter's (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``),
    by gguf's own name table (transformers' helper rebuilds that table once per submodule: ~10 s)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    table = get_tensor_name_map(arch, num_layers)
    names = {}
    for hf_name, _ in model.named_parameters():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _set_linear(model, modules: dict, owner_name: str, gguf: GGUFFile, info: TensorInfo, order, bias,
                held: torch.dtype | None):
    """Put ``info``'s weight (its rows in ``order``) in the Linear ``owner_name``: dequantized, as
    parameters in ``held`` (float32, or 16-bit: a plain Linear, which the engine's CPU kernels and
    decoding twins wrap as any), or, ``held`` None, as a :class:`QuantLinear` in its place."""
    if held is not None:
        owner = modules[owner_name]
        rows = np.arange(info.shape[0]) if order is None else order.numpy()
        owner.weight = _parameter(dequantized_rows(gguf, info, rows), held)
        owner.bias = None if bias is None else _parameter(bias)
        return
    parent_name, _, child = owner_name.rpartition(".")
    setattr(modules[parent_name] if parent_name else model, child, QuantLinear.from_gguf(gguf, info, order, bias))


def _set_embedding(model, owner, gguf: GGUFFile, info: TensorInfo, config, held: torch.dtype | None):
    """The token embedding of ``info``: dequantized in ``owner``, in ``held``, else (None) a :class:`QuantEmbedding`."""
    scale = float(config.hidden_size ** 0.5) if hasattr(owner, "embed_scale") else None   # Gemma 3's
    if held is not None:
        owner.weight = _parameter(dequantized_rows(gguf, info, slice(None)), held)
        if scale is not None:
            owner.embed_scale = torch.tensor(scale)
        return
    model.model.embed_tokens = QuantEmbedding(QuantLinear.from_gguf(gguf, info), scale)


def _set_head(model, exact: bool):
    """The LM head: a tied one shares the embedding's weight (or table); a quantized one is a :class:`QuantHead`."""
    head = getattr(model, "lm_head", None)
    if exact:
        if type(head) is torch.nn.Linear and head.weight.is_meta:
            head.weight = model.model.embed_tokens.weight
    elif type(head) is torch.nn.Linear:   # tied: the embedding's table
        model.lm_head = QuantHead(model.model.embed_tokens.table)
    elif isinstance(head, QuantLinear):
        model.lm_head = QuantHead(head)


def build_quantized_model(gguf: GGUFFile, config, exact: bool = False, transformers_modules: bool = False,
                          dtype: torch.dtype = torch.float32):
    """A causal LM of ``config`` (ragblend's own modules, :mod:`.decoder`; transformers' for what
    those do not cover, or with ``transformers_modules``: a reference with ``generate``) whose linear layers and embedding hold ``gguf``'s weights in
    their quantized form (:class:`QuantLinear`, :class:`QuantEmbedding`, :class:`QuantHead`), or
    with ``exact`` dequantized to float32 (by gguf's reference dequantizer, as transformers does)
    and held in ``dtype`` (bfloat16 or float16: each tensor rounded as it is dequantized, for
    :func:`~.sixteen_bit.hold_in_16_bit`); norms, biases and rotary tables in float32. Built on the
    meta device first, so no whole model of float32 weights is ever allocated."""
    with torch.device("meta"):
        model = skeleton_of(config, transformers_modules)
    skeleton = [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]
    model.config.dtype = torch.float32   # what it computes in (its config then reads as the file's float32 model's)
    form = TensorForm(gguf.architecture, config.num_attention_heads, config.num_key_value_heads)
    hf_names = gguf_names(model, gguf.architecture, config.num_hidden_layers)
    by_hf = {hf_names[name]: info for name, info in gguf.tensors.items() if name in hf_names}
    missing = [name for name, _ in model.named_parameters() if name not in by_hf
               and not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(f"{gguf.path.name} lacks tensors the {config.model_type} model needs: "
                                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}.")
    modules = dict(model.named_modules())
    for hf_name, info in by_hf.items():
        owner_name, _, attribute = hf_name.rpartition(".")
        owner = modules[owner_name]
        if isinstance(owner, torch.nn.Linear) and attribute == "weight":
            bias_info = by_hf.get(owner_name + ".bias")
            bias = None if bias_info is None else torch.from_numpy(
                dequantized_rows(gguf, bias_info, slice(None)).reshape(-1).copy())
            _set_linear(model, modules, owner_name, gguf, info, _row_order(form, info.name, info.shape[0]), bias,
                        dtype if exact else None)
        elif isinstance(owner, torch.nn.Embedding):
            _set_embedding(model, owner, gguf, info, config, dtype if exact else None)
        elif not (isinstance(owner, torch.nn.Linear) and attribute == "bias"):   # norms: small, float32
            values = form.values(info.name, dequantized_rows(gguf, info, slice(None)).reshape(info.shape))
            setattr(owner, attribute, torch.nn.Parameter(torch.from_numpy(np.array(values, dtype=np.float32)),
                                                         requires_grad=False))
    _set_head(model, exact)
    for name, module in list(model.named_modules()):   # rotary tables were made on meta: make them here
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, child = name.rpartition(".")
            with torch.device("cpu"):
                setattr(modules[parent_name] if parent_name else model, child, type(module)(config=config))
    tied = by_hf.get("model.embed_tokens.weight")
    sources = {name: by_hf.get(name) or (tied if name == "lm_head.weight" else None) for name, _ in skeleton}
    if not exact:   # a float32 model's samples are its own weights' (model.weight_samples)
        model.gguf_weight_samples = lambda: exact_samples(gguf, form, sources, skeleton)
    model.ragblend_weights_form = "float32" if exact else "quantized"
    left = [name for name, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(f"{gguf.path.name}: these weights of the {config.model_type} model are not in "
                                    f"the file: {left[:5]}.")
    return model.eval()


def skeleton_of(config, transformers_modules: bool = False):
    """The model of ``config`` to fill: ragblend's own modules (:func:`.decoder.plain_decoder`,
    which import no modeling code), else transformers' (their import costs ~0.15 GB resident)."""
    from .decoder import plain_decoder

    model = None if transformers_modules else plain_decoder(config)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model


def _parameter(values, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    """A frozen parameter of ``values`` (a numpy array or a tensor) in ``dtype``."""
    tensor = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return torch.nn.Parameter(tensor.to(dtype), requires_grad=False)


def exact_samples(gguf: GGUFFile, form: TensorForm, sources: dict, skeleton: list):
    """``(name, shape, samples)`` as :func:`~ragblend.core.model.linear.weight_samples` gives them for the
    float32 model of ``gguf``: every ``len / 4096``-th value of each weight as transformers
    dequantizes it, from only the blocks that hold those values."""
    from gguf import GGMLQuantizationType, dequantize

    for name, shape in skeleton:
        info = sources[name]
        count = int(np.prod(shape))
        step = max(1, count // 4096)
        if info is None:
            from ..errors import UnsupportedModelError

            raise UnsupportedModelError(f"no tensor of {gguf.path.name} holds {name}")
        if info.type_name in FOUR_BIT or info.type_name in EIGHT_BIT:
            rows, cols = info.shape
            index = np.arange(0, count, step)
            row, col = index // cols, index % cols
            order = _row_order(form, info.name, rows)
            file_row = row if order is None else order.numpy()[row]
            per_block = 256 if info.type_name.endswith("_K") else 32
            blocks = gguf.blocks(info).reshape(rows, cols // per_block, -1)[file_row, col // per_block]
            values = dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType(info.type_id)).reshape(len(index), -1)
            samples = values[np.arange(len(index)), col % per_block]
        else:
            whole = form.values(info.name, dequantized_rows(gguf, info, slice(None)).reshape(info.shape))
            samples = np.asarray(whole, dtype=np.float32).reshape(-1)[::step]
        yield name, shape, np.ascontiguousarray(samples, dtype=np.float32)


def quantized_matmuls(model) -> list[QuantLinear]:
    """The :class:`QuantLinear` layers a pass multiplies by: each once, an embedding's table
    only where it is the LM head's too (tied)."""
    heads = {id(m.table) for m in model.modules() if isinstance(m, QuantHead)}
    lookups = {id(m.table) for m in model.modules() if isinstance(m, QuantEmbedding)} - heads
    found = {id(m): m for m in model.modules() if isinstance(m, QuantLinear) and id(m) not in lookups}
    return list(found.values())


def is_quantized(model) -> bool:
    """Whether ``model`` was built by :func:`build_quantized_model` (or is a twin of one)."""
    return hasattr(model, "gguf_weight_samples")


def _twin(model, kernel_rows: int, long_pass_dtype: torch.dtype):
    """A twin of a quantized model (its weights shared, not copied) whose layers run passes of
    up to ``kernel_rows`` rows on the low-bit kernels and longer ones dequantized to ``long_pass_dtype``."""
    import copy

    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    for module in twin.modules():
        if isinstance(module, QuantLinear):
            module.kernel_rows, module.long_pass_dtype = kernel_rows, long_pass_dtype
    return twin


def exact_twin(model):
    """A twin whose every pass, decoding passes included, dequantizes and runs in float32: what a
    greedy pick at a near tie is made again on (``Decoding.exact_adapter``), while decoding steps
    run ``model`` itself, on the low-bit kernels."""
    return _twin(model, 0, torch.float32)


def prefill_twin(model):
    """The twin the engine prefills with (chunk precompute, fused and full prefill): the fast
    plan :func:`long_pass_plan` measured on this host (bfloat16 matmuls where they measure
    clearly faster, the low-bit kernels up to the rows where they win) where
    :func:`fast_prefill` allows it, else every pass in float32, as :func:`exact_twin`."""
    if fast_prefill(model)[0]:
        plan = long_pass_plan(model)
        twin = _twin(model, plan["kernel_rows"], getattr(torch, plan["dtype"]))
        kept = float32_layers(model) if plan["dtype"] != "float32" else ()
        for name, module in twin.named_modules():
            if isinstance(module, QuantLinear) and any(part in name for part in kept):
                module.long_pass_dtype = torch.float32
        if plan["dtype"] != "float32" or plan["kernel_rows"]:
            # Its K/V differ from the float32 prefill's by more than float rounding: stored apart
            # (the engine's fingerprint takes the weights' form).
            twin.ragblend_weights_form = f"quantized-fast-{plan['dtype']}-{plan['kernel_rows']}" + \
                "".join(f"-{part}-float32" for part in kept)
        return twin
    # Every pass in float32, the shortest too: the last layer's single row, a short sink, and
    # decode_dtype="float32" (which decodes on this adapter) stay exact.
    return _twin(model, 0, torch.float32)


def float32_layers(model) -> tuple[str, ...]:
    """The matmuls the fast plan keeps in float32, as its architecture's verdict measured it
    (none where forced by the environment without a verdict)."""
    verdict = getattr(model, "ragblend_fast_prefill_fidelity", None)
    return getattr(verdict, "float32_layers", ()) or ()


def fast_prefill(model) -> tuple[bool, str]:
    """``(whether the prefill runs the measured fast plan, why)``. The fast plan rounds the
    activations to bfloat16, so it is the default only for an architecture whose benchmark model
    met the fidelity rule on it (``model.FAST_PREFILL_FIDELITY``, stamped on the model at load
    as ``ragblend_fast_prefill_fidelity``); ``RAGBLEND_QUANTIZED_PREFILL=fast`` (or ``bfloat16``)
    takes it and ``=float32`` refuses it whatever the verdict."""
    forced = os.environ.get("RAGBLEND_QUANTIZED_PREFILL", "").lower()
    if forced in ("fast", "bfloat16"):
        return True, f"RAGBLEND_QUANTIZED_PREFILL={forced}"
    if forced == "float32":
        return False, "RAGBLEND_QUANTIZED_PREFILL=float32"
    verdict = getattr(model, "ragblend_fast_prefill_fidelity", None)
    if verdict is None:
        return False, "its fidelity is not measured for this architecture (RAGBLEND_QUANTIZED_PREFILL=fast takes it)"
    if verdict.meets:
        return True, f"it met the fidelity rule {verdict}"
    return False, (f"it MISSED the fidelity rule {verdict}: {FAST_PLAN_MISSES} (RAGBLEND_QUANTIZED_PREFILL=fast "
                   "takes it)")


# What research/scratch/bf16_roundings.py and benchmarks.quantized found of the fast plan's misses
# (docs/benchmarks.md, "Why the fast plan misses"), for `ragblend info`.
FAST_PLAN_MISSES = ("no one part of it is the cause: its answers part from float32's only at near ties, which any "
                    "bfloat16-sized rounding flips on about 1 prompt in 16-20 (of the activations alone, or of the "
                    "outputs alone, on SmolLM2), while its KL stays near 1% of the order noise or under; on 40 prompts "
                    "Qwen2.5's full prefill kept 36 answers and its fused 34 (38 needed), SmolLM2's 40 and 39")


def scoring_twin(model):
    """The twin QueryAware's question pass runs on: it only ranks the reused tokens by the
    attention the question pays them (the answer's logits come from the float32 pass after it),
    so it takes the low-bit kernels up to the rows :func:`long_pass_plan` measured faster,
    sparing the prefill one dequantization of every weight."""
    plan = long_pass_plan(model)
    return _twin(model, plan["kernel_rows"], torch.float32)


LONG_PASS_ROWS = 256            # a long pass's rows when timing float32 against bfloat16
KERNEL_ROW_BUCKETS = (16, 32, 64, 128)
CLEARLY_FASTER = 1.3            # bfloat16 is taken only this much faster: it rounds the activations
PLAN_VERSION = 2                # 2: bfloat16 timed at all (1 never did), its weights made fast


def _bfloat16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): elsewhere
    PyTorch emulates it, slower than float32, and it is not worth timing. (torch.cpu's checks:
    the torch._C._cpu names read before have none in torch 2.13, so bfloat16 was never timed.)"""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(check() for check in checks if check is not None)
    except RuntimeError:
        return False


def long_pass_plan(model) -> dict:
    """``{"dtype": "float32" | "bfloat16", "kernel_rows": n}`` for a quantized model's prefill on
    this host, measured once on one decoder layer's matmuls and remembered for the host
    (:mod:`.host_cache`). ``RAGBLEND_QUANTIZED_PREFILL=float32`` takes the float32 path without
    measuring (the low-bit kernel only for decoding's rows); ``=bfloat16`` takes bfloat16 and the
    kernel up to 64 rows without measuring (for judging its fidelity)."""
    exact = {"dtype": "float32", "kernel_rows": DRAFT_ROWS}
    forced = os.environ.get("RAGBLEND_QUANTIZED_PREFILL", "").lower()
    if forced in ("float32", "bfloat16"):   # bfloat16 (to judge it): the low-bit kernel up to 64 rows, too
        return exact if forced == "float32" else {"dtype": "bfloat16", "kernel_rows": 64}
    cached = getattr(model, "ragblend_long_pass", None)
    if cached is not None:
        return cached
    layer = [m for m in quantized_matmuls(model) if m.kind == "int4"]
    if not layer:
        return exact
    from .host_cache import measured_twice, remembered
    from .kernels import host_key

    first = [m for m in layer if ".0." in _name_of(model, m)] or layer[:7]
    shapes = sorted({(m.out_features, m.in_features) for m in first})

    def inputs(rows: int) -> dict[int, torch.Tensor]:
        return {width: torch.randn(rows, width) for width in {m.in_features for m in first}}

    def dtype_verdict() -> str:
        if not _bfloat16_native():
            return "float32"
        x = inputs(LONG_PASS_ROWS)
        times = fastest_rounds({name: (lambda d=d: _run(first, x, d, 0)) for name, d in
                                (("float32", torch.float32), ("bfloat16", torch.bfloat16))}, rounds=3)
        return "bfloat16" if times["float32"] > CLEARLY_FASTER * times["bfloat16"] else "float32"

    def rows_verdict(dtype: str) -> int:
        rows = DRAFT_ROWS
        for bucket in KERNEL_ROW_BUCKETS:
            x = inputs(bucket)
            times = fastest_rounds({"kernel": lambda: _run(first, x, torch.float32, bucket),
                                    "long": lambda: _run(first, x, getattr(torch, dtype), 0)}, rounds=3)
            if times["kernel"] >= times["long"]:
                break
            rows = bucket
        return rows

    # Two records, so that a busy host's disagreeing row counts do not throw away a clear dtype.
    key = host_key(shapes) | {"plan": PLAN_VERSION}
    with torch.inference_mode():
        dtype = remembered("quantized-long-pass-dtype", key, lambda: measured_twice(dtype_verdict, "float32"),
                           lambda value: value in ("float32", "bfloat16"))
        rows = remembered("quantized-long-pass-rows", key | {"dtype": dtype},
                          lambda: measured_twice(lambda: rows_verdict(dtype), DRAFT_ROWS),
                          lambda value: value in (DRAFT_ROWS, *KERNEL_ROW_BUCKETS))
    # A measurement's scratch buffers (a whole 64 MiB float32 one, a bfloat16 one) would stay with
    # the loaded engine: the 1.5B and 3B loads that measured took ~0.1 GB more than those that read
    # the host's record (docs/benchmarks.md). The prefill makes what it needs again.
    _scratch.__dict__.pop("buffers", None)
    plan = {"dtype": dtype, "kernel_rows": rows}
    model.ragblend_long_pass = plan   # measured once per model (and ragblend info reads it)
    return plan


def _name_of(model, module) -> str:
    return next((name for name, m in model.named_modules() if m is module), "")


def _run(layers: list[QuantLinear], x: dict[int, torch.Tensor], dtype: torch.dtype, kernel_rows: int) -> None:
    """One pass through each of ``layers`` (``x``: an input per width) as a twin would run it."""
    for layer in layers:
        saved = layer.kernel_rows, layer.long_pass_dtype
        layer.kernel_rows, layer.long_pass_dtype = kernel_rows, dtype
        try:
            layer.rows(x[layer.in_features])
        finally:
            layer.kernel_rows, layer.long_pass_dtype = saved


def quantized_bytes(model) -> int:
    """Bytes of every weight a quantized model holds (its layers', norms' and tables')."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def describe(model) -> list[str]:
    """Lines for ``ragblend info``: how a model holds its weights (a quantized or 16-bit one's
    :class:`QuantLinear` layers by kind; any other's matrices by dtype), their bytes, and how
    they run."""
    layers = {id(m): m for m in model.modules() if isinstance(m, QuantLinear)}.values()
    kinds: dict[str, list[str]] = {}
    for module in layers:
        kinds.setdefault(module.kind, []).append(module.source_type)
    names = {"int4": "4-bit (groups of 32; the file's scales for the prefill, bfloat16 ones for decoding)", "int8": "8-bit (a scale per row) for decoding, the prefill of Q5_0/Q8_0 on the file's own blocks",
             "float": "as stored (16/32-bit)"}
    lines = [f"{len(sources)} matrices {names[kind]}, from {', '.join(sorted(set(sources)))}"
             for kind, sources in sorted(kinds.items())]
    rounded = getattr(model, "ragblend_rounded_from", None)   # held 16-bit on request: not as stored
    if rounded and list(kinds) == ["float"]:
        form = getattr(model, "ragblend_weights_form", "16-bit")
        lines = [f"{len(kinds['float'])} matrices {form}, rounded at load from {rounded}"]
    if not layers:
        dtypes: dict[str, int] = {}
        weights = {id(m.weight): m.weight for m in model.modules()
                   if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and m.weight is not None}
        for weight in weights.values():   # a tied head's weight once
            name = str(weight.dtype).split(".")[-1]
            dtypes[name] = dtypes.get(name, 0) + 1
        lines += [f"{count} matrices {name}" for name, count in dtypes.items()]
    lines.append(f"{quantized_bytes(model) / 2**20:.0f} MiB of weights in memory")
    if "int4" in kinds or "int8" in kinds:
        lines += _low_bit_passes(model)
    elif kinds:
        lines.append("every pass: each 16-bit matrix copied into one reused float32 buffer, then F.linear in float32")
    return lines


def _low_bit_passes(model) -> list[str]:
    """How a quantized model's passes run, a line a subject (``ragblend info`` wraps them)."""
    fast, why = fast_prefill(model)
    # The plan the twin took (remembered on the model, or forced by the environment: no measuring here)
    plan = long_pass_plan(model) if fast else \
        getattr(model, "ragblend_long_pass", None) or {"dtype": "float32", "kernel_rows": DRAFT_ROWS}
    lines = ["decoding: PyTorch's int4/int8 CPU kernels on bfloat16 activations (a near-tied greedy pick checked "
             "again in float32)",
             f"QueryAware's question pass: the same, up to {plan['kernel_rows']} rows (measured on this host)"]
    if fast:
        kept = "".join(f"; {part} in float32" for part in float32_layers(model) if plan["dtype"] != "float32")
        lines += [f"prefill: each matrix dequantized into one reused buffer, then F.linear in {plan['dtype']} "
                  f"(measured on this host{kept}), kernels up to {plan['kernel_rows']} rows",
                  f"  because {why}"]
    else:
        lines += ["prefill: each matrix dequantized into one reused buffer, then F.linear in float32",
                  f"  the fast plan ({plan['dtype']}, measured on this host) is not taken, because {why}"]
    return lines
