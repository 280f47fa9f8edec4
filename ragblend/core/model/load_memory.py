"""What loading a model takes in memory at its peak, so that a load that cannot fit is refused
before anything heavy starts (instead of the kernel killing the process half-way).

The peak is the weights held once loaded, plus the load's transient (the largest tensor being
unpacked at once), plus the process's fixed cost of a load (tokenizer, config, buffers). A new
user's trial (2026-12-06) measured peaks of 1.9-3.2x the held weights alone on SmolLM2 and
Gemma 3 270M, which the check compared with the memory available before.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# Tokenizer, config and the engine's first buffers: RSS after a GGUF load minus the held weights
# was 190-290 MiB on SmolLM2 and Gemma 3 270M (trial 43, Intel Xeon AMX host); with 320 MiB the
# estimated peak is at or above all four load peaks that trial measured (within 0.1 GiB but for
# Gemma's float32 load, 1.2 GiB over: its 262k-row embedding counted at FLOAT32_UNPACK).
# An HF directory also imports transformers' modeling code (~0.15 GB resident, docs/models.md).
FIXED_BYTES = 320 << 20
HF_FIXED_BYTES = FIXED_BYTES + (160 << 20)
# Peak bytes per weight of the tensor being unpacked, above the memory before it (one 8192x2048
# tensor, Intel Xeon AMX host, 2026-12-06): dequantized to float32 10.4-10.5 (gguf's numpy
# dequantizer's temporaries and the float32 result); a 4-bit tensor packed for the int4 kernel
# 4.2; an 8-bit-held one 9.6, one slice of SCRATCH_WEIGHTS at a time. Rounded up for glibc's fragments.
FLOAT32_UNPACK = 12
INT4_UNPACK = 5
INT8_UNPACK = 10


@dataclass(frozen=True)
class LoadMemory:
    held: int   # bytes the weights take once loaded
    peak: int   # bytes the load takes at its peak: held + transient + fixed

    def __str__(self) -> str:
        return (f"about {self.peak / 2**30:.1f} GiB of memory at the load's peak ({self.held / 2**30:.1f} GiB of "
                "weights held once loaded, plus the largest tensor being unpacked and the tokenizer)")


def gguf_load_memory(gguf, held: int, exact: bool) -> LoadMemory:
    """The load of a GGUF file whose weights take ``held`` bytes, in float32 (``exact``) or quantized."""
    from .gguf_file import EIGHT_BIT, FOUR_BIT
    from .quantized import SCRATCH_WEIGHTS

    def unpack(info) -> int:
        count = int(math.prod(info.shape))
        if exact:
            return count * FLOAT32_UNPACK
        if info.type_name in FOUR_BIT and len(info.shape) == 2 and info.shape[0] % 64 == 0:
            return count * INT4_UNPACK
        if info.type_name in FOUR_BIT or info.type_name in EIGHT_BIT:
            return min(count, SCRATCH_WEIGHTS) * INT8_UNPACK
        return info.nbytes * 2   # a float tensor: the mapped bytes and their copy

    transient = max((unpack(info) for info in gguf.tensors.values()), default=0)
    return LoadMemory(held, held + transient + FIXED_BYTES)


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def hf_load_memory(folder: Path, dtype: torch.dtype | None) -> LoadMemory | None:
    """The load of an HF directory's safetensors weights held in ``dtype`` (None: as stored,
    16-bit kept, anything else float32), from the files' headers; None where they cannot tell
    (no safetensors, a damaged header: transformers then says what is wrong)."""
    tensors = []   # (weights, stored bytes per weight)
    try:
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(length, 100 << 20)))
            tensors += [(math.prod(t["shape"]), _SAFETENSORS_BYTES[t["dtype"]])
                        for name, t in header.items() if name != "__metadata__"]
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
