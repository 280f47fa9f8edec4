"""A GGUF file's header, read and checked before anything heavy loads.

``gguf.GGUFReader`` parses every metadata array into Python objects (~6 s for SmolLM2's
49k-token vocabulary); loading needs only the architecture, the tensors' names, shapes,
types and offsets, so this reads the header directly (GGUF v2/v3: little-endian, see
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) and skips the arrays. Tensor
data is then read straight from the file, memory-mapped, one tensor at a time.

Refused here, each with what to do: a file that is not GGUF, one shorter than its header
says (truncated, inside its header or in its data: its expected and actual size), one shard
of a split GGUF, an architecture ragblend cannot run, a quantization type it cannot hold
(naming the types that load). A file that is there but unusable raises
:class:`~ragblend.core.errors.ModelFileError` (a ``ValueError``), never "not found".
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFileError, RagblendError, UnsupportedModelError

# ggml type id -> (name, weights per block, bytes per block), the types ragblend loads.
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
         7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
         14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")                  # held as 4-bit codes, groups of 32
EIGHT_BIT = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")  # held as 8-bit codes, one scale per row
# GGUF's architecture name -> transformers' model_type, for the families ragblend runs.
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # PyTorch order: (rows, columns) for a matrix (GGUF lists dimensions reversed)
    type_id: int
    offset: int              # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return TYPES[self.type_id][0]


@dataclass
class GGUFFile:
    path: Path
    size: int
    metadata: dict            # scalar and string values; arrays are kept as their length only
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        names = [t.type_name for t in self.tensors.values()]
        return {name: names.count(name) for name in sorted(set(names))}

    def blocks(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as ``[rows, bytes per row]`` uint8, memory-mapped (read on use)."""
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class _HeaderCut(Exception):
    """The header runs past the end of the file: ``needed`` bytes at least."""

    def __init__(self, needed: int):
        self.needed = needed


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the GGUF file at ``path``, checked (see the module's docstring)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"{path} is not a GGUF file (it does not start with 'GGUF'). Pass a .gguf "
                                 "model file, or a Hugging Face model directory.")
        if size < 24:
            raise _cut(path, 24, size)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            try:
                return _parse(path, size, view)
            except RagblendError:
                raise
            except _HeaderCut as cut:
                raise _cut(path, cut.needed, size) from None
            except (struct.error, IndexError, ValueError, UnicodeDecodeError, KeyError) as err:
                raise ModelFileError(f"{path} is a damaged GGUF file: its header cannot be read ({err}). "
                                     "Download or copy it again.") from None


def _cut(path: Path, needed: int, size: int) -> ModelFileError:
    return ModelFileError(f"{path} is truncated inside its header: reading the header needs at least {needed:,} "
                          f"bytes, the file has {size:,}. The download or copy was cut short; fetch the file again.")


class _Header:
    """Reads a GGUF header from a mapped file; reading past its end is a truncated file, told
    with its sizes (not struct's buffer message)."""

    def __init__(self, view, size: int):
        self.view, self.size = view, size

    def unpack(self, fmt: str, at: int) -> tuple:
        if at + struct.calcsize(fmt) > self.size:
            raise _HeaderCut(at + struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.view, at)

    def string(self, at: int) -> tuple[str, int]:
        (length,) = self.unpack("<Q", at)
        if at + 8 + length > self.size:
            raise _HeaderCut(at + 8 + length)
        return bytes(self.view[at + 8:at + 8 + length]).decode("utf-8"), at + 8 + length

    def skip(self, value_type: int, at: int, count: int) -> int:
        if value_type == _STRING:
            for _ in range(count):   # each string has its own length: walk them
                (length,) = self.unpack("<Q", at)
                at += 8 + length
            return at
        return at + count * struct.calcsize(_SCALARS[value_type])

    def metadata(self, pos: int, kv_count: int) -> tuple[dict, int]:
        metadata = {}
        for _ in range(kv_count):
            key, pos = self.string(pos)
            (value_type,) = self.unpack("<I", pos)
            pos += 4
            if value_type == _STRING:
                metadata[key], pos = self.string(pos)
            elif value_type == _ARRAY:
                element_type, count = self.unpack("<IQ", pos)
                pos = self.skip(element_type, pos + 12, count)
                metadata[key] = count
            else:
                (metadata[key],) = self.unpack(_SCALARS[value_type], pos)
                pos += struct.calcsize(_SCALARS[value_type])
        return metadata, pos

    def tensors(self, pos: int, tensor_count: int) -> tuple[list, int]:
        raw = []
        for _ in range(tensor_count):
            name, pos = self.string(pos)
            (dims,) = self.unpack("<I", pos)
            if dims > 4:   # GGML tensors have at most 4: a larger count is damage (read_gguf says so), not a short file
                raise struct.error(f"tensor {name!r} claims {dims} dimensions")
            shape = self.unpack(f"<{dims}Q", pos + 4)
            type_id, offset = self.unpack("<IQ", pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            raw.append((name, tuple(reversed(shape)), type_id, offset))
        return raw, pos


def _parse(path: Path, size: int, view) -> GGUFFile:
    header = _Header(view, size)
    version, tensor_count, kv_count = header.unpack("<IQQ", 4)
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path} is GGUF version {version}; ragblend reads versions 2 and 3.")
    metadata, pos = header.metadata(24, kv_count)
    raw, pos = header.tensors(pos, tensor_count)
    alignment = int(metadata.get("general.alignment", 32))
    if alignment < 1:
        raise UnsupportedModelError(f"{path.name}: its header gives a data alignment of {alignment}; not a valid GGUF file.")
    return _checked(path, size, metadata, raw, (pos + alignment - 1) // alignment * alignment)


def _checked(path: Path, size: int, metadata: dict, raw: list, data_start: int) -> GGUFFile:
    """The file of this header, if ragblend can run it and it is whole."""
    split = int(metadata.get("split.count", 1) or 1)
    if split > 1:   # before anything else: a shard after the first holds no config or tokenizer
        raise ModelFileError(
            f"{path.name} is shard {int(metadata.get('split.no', 0)) + 1} of {split} of a split GGUF; ragblend loads "
            "one whole file: merge the shards with `llama-gguf-split --merge "
            f"{path.name} merged.gguf` (llama.cpp) and pass merged.gguf.")
    architecture = str(metadata.get("general.architecture", ""))
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name} is a GGUF of architecture {architecture!r}, which ragblend cannot run; it runs "
            f"{', '.join(ARCHITECTURES)} (decoder-only with rotary embeddings).")
    unknown = sorted({f"type {type_id}" for _, _, type_id, _ in raw if type_id not in TYPES})
    if unknown:
        from gguf import GGMLQuantizationType

        names = sorted({GGMLQuantizationType(int(t.split()[1])).name if int(t.split()[1]) in
                        GGMLQuantizationType._value2member_map_ else t for t in unknown})
        raise UnsupportedModelError(
            f"{path.name} holds tensors in {', '.join(names)}, which ragblend cannot load; it loads "
            f"{', '.join(name for name, _, _ in TYPES.values())}. Use a Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K or Q8_0 "
            "file of the model.")
    tensors = {}
    for name, shape, type_id, offset in raw:
        _, per_block, block_bytes = TYPES[type_id]
        count = int(np.prod(shape))
        if count % per_block or shape[-1] % per_block:
            raise ModelFileError(f"{path} is a damaged GGUF file: tensor {name} of shape {shape} is not whole "
                                     f"{TYPES[type_id][0]} blocks. Download or copy it again.")
        tensors[name] = TensorInfo(name, shape, type_id, data_start + offset, count // per_block * block_bytes)
    expected = max((t.offset + t.nbytes for t in tensors.values()), default=data_start)
    if size < expected:
        raise ModelFileError(
            f"{path} is truncated: its header describes {expected:,} bytes, the file has {size:,}. "
            "The download or copy was cut short; fetch the file again.")
    return GGUFFile(path, size, metadata, tensors)


def check_tokenizer(gguf: GGUFFile | None) -> None:
    """Refuse a GGUF file without tokenizer metadata (ragblend reads the tokenizer from the file)
    before transformers fails on it with "Cannot build a tokenizer ... tokenizer None"; None (an
    HF directory) passes."""
    if gguf is not None and "tokenizer.ggml.model" not in gguf.metadata:
        raise ModelFileError(
            f"{gguf.path.name} holds no tokenizer (its metadata has no tokenizer.ggml.model), and ragblend reads the "
            "tokenizer from the GGUF file. Use a GGUF of the model converted with its tokenizer (llama.cpp's "
            "convert_hf_to_gguf.py writes it), or the model's Hugging Face directory.")


class TensorForm:
    """How a GGUF file stores some tensors otherwise than the model computes with them, undone as
    transformers' GGUF loader undoes it (its ``TENSOR_PROCESSORS``, whose import pulls in its
    modeling code): llama.cpp's converter interleaves each head's halves of a Llama model's Q and
    K rows (for its RoPE), and stores Gemma 3's norm weights plus 1."""

    def __init__(self, architecture: str, num_heads: int, num_kv_heads: int):
        self.architecture, self.num_heads, self.num_kv_heads = architecture, num_heads, num_kv_heads

    def _heads(self, name: str) -> int | None:
        """The heads a Llama Q or K weight's rows are permuted in (None: not permuted)."""
        if self.architecture != "llama":
            return None
        return self.num_heads if ".attn_q." in name else self.num_kv_heads if ".attn_k." in name else None

    def row_order(self, name: str, rows: int) -> np.ndarray | None:
        """The file's row of each of the model's rows of weight ``name`` (None where they are the same)."""
        heads = self._heads(name)
        if heads is None:
            return None
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)

    def values(self, name: str, weights: np.ndarray) -> np.ndarray:
        """A whole tensor's float32 ``weights`` as the file stores them -> as the model uses them."""
        order = self.row_order(name, weights.shape[0]) if weights.ndim else None
        if order is not None:
            weights = weights[order]
        if self.architecture == "gemma3" and "norm.weight" in name:
            weights = weights - 1
        return weights
