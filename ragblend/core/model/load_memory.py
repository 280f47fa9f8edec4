"""What loading a model takes in memory at its peak, so that a load that cannot fit is refused
before anything heavy starts (instead of the kernel killing the process half-way).

The peak is the process's fixed cost of a load (tokenizer, config, imports) plus the larger of:
what is held while one tensor is unpacked (the weights before it, in file order, and the tensor's
unpacking), and the weights once all are held with what the allocator keeps of the freed
temporaries. A new user's trial (2026-12-06) measured peaks of 1.9-3.2x the held weights alone on
SmolLM2 and Gemma 3 270M, which the check compared with the memory available before; the constants
below are measured against the real peak (VmHWM) of three models (within -5% to +15%).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# What a GGUF load takes above the weights it holds: the growth of the process's peak resident
# memory (VmHWM) from where the check runs (python -m benchmarks.load_peak; docs/models.md, "The
# load's peak"), SmolLM2-135M Q4_1, Qwen2.5-Coder-0.5B Q4 and Gemma 3 270M Q4_K_M, quantized and in
# float32 (SmolLM2 and Gemma also 16-bit), AMD EPYC AVX-512 host, 2026-12-07.
# * The tokenizer, config and imports: 53 MiB plus ~1 KiB a vocabulary entry (the fast tokenizer's
#   tables: 0.1 GiB for SmolLM2's 49k, 0.3 GiB for Gemma's 262k).
# * The tensor being dequantized, above what is held before it (file order): ~10 bytes a weight
#   for gguf's reference dequantizer to float32 (its temporaries and the float32 result; Gemma's
#   262k-row embedding is its whole peak); the int4 packing 4.2 (5, trial 43); an 8-bit one 7 on one
#   slice of SCRATCH_WEIGHTS at a time (at most 6.3 in SmolLM2's quantized load; 9.6 in trial 43's
#   one-tensor test, on an Intel host), with its codes.
# * What glibc keeps of the freed temporaries once all is held, as a share of the held bytes: 0.3
#   quantized (0.25-0.33 measured), 0.8 in float32 (0.34-0.65 in one run; 0.97 for SmolLM2 in a CI run,
#   where a busy host's threads kept more: the estimate errs above), 0.1 in 16 bits (one model measured).
FIXED_BYTES = 53 << 20
BYTES_PER_VOCAB_ENTRY = 1024
# An HF directory (not measured again): the earlier 320 MiB, and transformers' modeling code (~0.15 GB).
HF_FIXED_BYTES = 480 << 20
FLOAT32_UNPACK = 10
INT4_UNPACK = 5
INT8_UNPACK = 10   # 9.6 in trial 43 on an Intel host; at most 6.3 measured here: the larger kept
RETAINED_SHARE = {"quantized": 0.3, 4: 0.8, 2: 0.1}


@dataclass(frozen=True)
class LoadMemory:
    held: int   # bytes the weights take once loaded
    peak: int   # bytes the load takes at its peak: held + transient + fixed

    def __str__(self) -> str:
        return (f"about {self.peak / 2**30:.1f} GiB of memory at the load's peak ({self.held / 2**30:.1f} GiB of "
                "weights held once loaded, plus the largest tensor being unpacked and the tokenizer)")


def quantized_tensor_bytes(info) -> int:
    """Bytes one GGUF tensor takes once loaded in its quantized form (see :mod:`.quantized`)."""
    from .gguf_file import EIGHT_BIT, FOUR_BIT

    count = int(math.prod(info.shape))
    if info.type_name in FOUR_BIT and len(info.shape) == 2 and info.shape[0] % 64 == 0:
        # packed codes, the kernel's bfloat16 scales and zeros, and the file's scales for the prefill:
        # Q4_0's half a byte a group (see quantized.scale_residuals), Q4_1's float16 pairs, Q4_K's 16 bytes a block
        return count // 2 + count // 64 * (8 + {"Q4_0": 1, "Q4_1": 8, "Q4_K": 4}[info.type_name])
    if info.type_name in FOUR_BIT or info.type_name in EIGHT_BIT:
        return count + info.shape[0] * 4
    return info.nbytes


def gguf_load_memory(gguf, weight_bytes: int | None) -> LoadMemory:
    """The load of a GGUF file in its quantized form (``weight_bytes`` None) or dequantized to
    ``weight_bytes`` a weight (4: float32, 2: 16-bit): its peak is the larger of the peak while
    one tensor is unpacked (what is held before it, in file order, and the tensor's unpacking)
    and the weights once held with what glibc keeps of the freed temporaries; plus the
    tokenizer's share (the constants above)."""
    from .gguf_file import EIGHT_BIT, FOUR_BIT
    from .quantized import SCRATCH_WEIGHTS

    def held_bytes(info) -> int:
        return quantized_tensor_bytes(info) if weight_bytes is None else int(math.prod(info.shape)) * weight_bytes

    def unpack(info) -> int:
        count = int(math.prod(info.shape))
        if weight_bytes is not None:
            return count * FLOAT32_UNPACK
        if info.type_name in FOUR_BIT and len(info.shape) == 2 and info.shape[0] % 64 == 0:
            return count * INT4_UNPACK
        if info.type_name in FOUR_BIT or info.type_name in EIGHT_BIT:
            return quantized_tensor_bytes(info) + min(count, SCRATCH_WEIGHTS) * INT8_UNPACK
        return info.nbytes * 2   # a float tensor: the mapped bytes and their copy

    held = unpacking = 0
    for info in gguf.tensors.values():   # in file order, as the loader reads them
        unpacking = max(unpacking, held + unpack(info))
        held += held_bytes(info)
    retained = held * (1 + RETAINED_SHARE["quantized" if weight_bytes is None else weight_bytes])
    return LoadMemory(held, int(max(unpacking, retained)) + FIXED_BYTES + _vocabulary(gguf) * BYTES_PER_VOCAB_ENTRY)


def _vocabulary(gguf) -> int:
    """The model's vocabulary size: its token embedding's rows."""
    embedding = gguf.tensors.get("token_embd.weight")
    return int(embedding.shape[0]) if embedding is not None and embedding.shape else 0


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_entries(folder: Path) -> list[dict]:
    """The tensor entries (``{"dtype": "BF16", "shape": [...], ...}``) of an HF directory's
    safetensors files, read from their headers only; raises OSError, ValueError or struct.error
    on a damaged header."""
    entries = []
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 100 << 20)))
        entries += [t for name, t in header.items() if name != "__metadata__"]
    return entries


def hf_load_memory(folder: Path, dtype: torch.dtype | None) -> LoadMemory | None:
    """The load of an HF directory's safetensors weights held in ``dtype`` (None: as stored,
    16-bit kept, anything else float32), from the files' headers; None where they cannot tell
    (no safetensors, a damaged header: transformers then says what is wrong)."""
    try:
        tensors = [(math.prod(t["shape"]), _SAFETENSORS_BYTES[t["dtype"]]) for t in safetensors_entries(folder)]
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    if not tensors:
        return None

    def held_size(stored: int) -> int:
        if dtype is not None:
            return torch.finfo(dtype).bits // 8
        return stored if stored == 2 else 4   # as stored: 16-bit stays, the rest is held in float32

    held = sum(count * held_size(stored) for count, stored in tensors)
    transient = max(count * (stored + held_size(stored)) for count, stored in tensors)
    return LoadMemory(held, held + transient + HF_FIXED_BYTES)


def mostly_four_bit(gguf) -> bool:
    """Whether most of a GGUF file's weights are 4-bit already (then a smaller quantization is no advice)."""
    from .gguf_file import FOUR_BIT

    counts = [(int(math.prod(t.shape)), t.type_name in FOUR_BIT) for t in gguf.tensors.values()]
    return sum(c for c, four in counts if four) * 2 >= sum(c for c, _ in counts)
