"""ChunkKV: what is stored for one chunk, and how its key is made."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch

# Bump when what a stored entry means changes (layout, sink handling, pre/post RoPE...):
# old entries then simply stop matching.
# v2: the storage dtype joined the key.
# v3: text is tokenized as text (control-token strings in a chunk no longer become control
#     tokens, core/prompt.py), so ids stored under v2 must not be found in new prompts.
KV_FORMAT_VERSION = 3


# Where ingestion hooks record a chunk's key in its document's metadata (LlamaIndex nodes,
# LangChain documents); excluded from what the LLM and the embedder see.
KV_METADATA_KEY = "ragblend_kv_key"


# A namespace is a label (a server's tenants get hex digests): no quotes or brackets, so that a
# header recording it stays a flat object (store._header_shaped).
_NAMESPACE = re.compile(r"[A-Za-z0-9._:-]{0,128}")
PIECE_NAMESPACE_PREFIX = "turns:"   # the engine's own: a namespace's history pieces (core.store.pieces.piece_namespace)


def check_namespace(namespace) -> str:
    """``namespace`` if it is a valid namespace label ("" is the shared one); a clear error otherwise."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        from ..errors import InvalidInputError

        raise InvalidInputError(f"namespace must be a string of at most 128 letters, digits, '.', '_', ':' or '-', "
                                f"got {str(namespace)[:40]!r}.")
    if namespace.startswith(PIECE_NAMESPACE_PREFIX):
        from ..errors import InvalidInputError

        raise InvalidInputError(f"namespaces starting with {PIECE_NAMESPACE_PREFIX!r} hold a conversation's "
                                "history pieces (core.store.pieces); choose another name.")
    return namespace


def chunk_key(fingerprint: str, sink_ids: list[int], token_ids: list[int], storage_dtype: str,
              namespace: str = "") -> str:
    """Content key of a chunk's KV: everything that changes its bytes, i.e. the model
    fingerprint, sink prefix, chunk tokens, storage dtype and format version, and the
    namespace it was stored for.

    A KV entry can therefore never be used for another model, tokenizer, compute dtype,
    storage dtype or sink prefix: any of those changes the key. ``namespace`` ("": the shared
    one, whose keys are those ragblend always made) keeps what one server tenant stores out of
    every other's reach: the same text stored by two tenants is two entries.
    """
    kind = storage_dtype if not namespace else f"{storage_dtype}|namespace={namespace}"
    return _key(KV_FORMAT_VERSION, fingerprint, kind, sink_ids, token_ids)


def key_matches(key: str, *, fingerprint: str, sink_ids, lead_sink_ids, token_ids: list[int], dtype: str,
                namespace: str = "") -> bool:
    """Whether ``key`` is what an entry whose header says these things is stored under: the chunk's
    own key or its lead entry's, for the header's storage dtype (``dtype``: "float16"...) or, for
    a float32 entry, any storage dtype (values out of a storage dtype's range are kept in float32
    under the key naming that dtype: see Ingestion.storage_entry). A header edited to say another
    dtype, namespace or token ids than its key was made from fails."""
    dtypes = [dtype] + ([d for d in ("float16", "bfloat16", "int8", "uint4") if d != dtype] if dtype == "float32" else [])
    for name in dtypes:
        own = chunk_key(fingerprint, list(sink_ids), list(token_ids), f"torch.{name}", namespace)
        if key == own or (lead_sink_ids is not None and key == lead_key(own, list(lead_sink_ids))):
            return True
    return False


def lead_key(own_key: str, lead_sink_ids: list[int]) -> str:
    """The key of a chunk's lead entry (its KV computed right after ``lead_sink_ids``, see
    :mod:`ragblend.core.fusion.ingest`), made from the chunk's own key, so that it is found (and deleted) from that
    key alone, without the chunk's token ids."""
    return _key(KV_FORMAT_VERSION, own_key, "lead", lead_sink_ids, [])


def calibration_key(fingerprint: str, sink_ids: list[int], lead_sink_ids: list[int] | None = None) -> str:
    """What a calibration is stored under: the model fingerprint and sink prefix, and the lead
    sink where the engine keeps lead entries (a prompt's first chunk is then fused from another
    entry: see :mod:`ragblend.core.fusion.ingest`).

    A calibration measures the model with the sink, not the KV format, so its key keeps the
    format version it was first made with (2): bumping :data:`KV_FORMAT_VERSION` must not
    orphan the calibrations shipped in ``ragblend/data/calibration``.
    """
    if lead_sink_ids is None:
        return _key(2, fingerprint, "calibration", sink_ids, [])
    return _key(2, fingerprint, "calibration with lead entries", sink_ids, lead_sink_ids)


def _key(version: int, fingerprint: str, kind: str, sink_ids: list[int], token_ids: list[int]) -> str:
    h = hashlib.sha256()
    h.update(f"ragblend-kv-v{version}|{fingerprint}|{kind}|".encode())
    h.update(torch.tensor(sink_ids, dtype=torch.int64).numpy().tobytes())
    h.update(b"|")
    h.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


@dataclass
class ChunkKV:
    """One chunk's K (before RoPE) and V for every layer.

    ``keys`` and ``values`` are ``[layers, kv_heads, tokens, head_dim]``: layer-major, so one
    layer of many chunks is read without touching the others. K carries no position; the
    fusion rotates it to wherever the chunk lands in a prompt.

    An int8 entry (see :func:`quantize_int8`) also carries its scales: ``key_scales``
    ``[layers, kv_heads, head_dim]`` (one per channel: K's outliers sit in a few channels)
    and ``value_scales`` ``[layers, kv_heads, tokens]`` (one per token), both float16.

    A 4-bit entry (``uint4``, see :func:`quantize_uint4`) holds its codes packed two to a byte
    (``keys``/``values`` uint8 ``[layers, kv_heads, tokens, head_dim / 2]``) and each group's
    float16 step and minimum: ``key_scales`` ``[layers, kv_heads, 2, groups of tokens, head_dim]``
    and ``value_scales`` ``[layers, kv_heads, 2, tokens, groups of head_dim]``.
    """

    key: str
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = field(default=None, repr=False)
    value_scales: torch.Tensor | None = field(default=None, repr=False)
    namespace: str = ""   # who may find it in a flat prompt ("": everyone): see chunk_key

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, self.key_scales, self.value_scales]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_cpu(self) -> ChunkKV:
        scales = [None if t is None else t.cpu() for t in (self.key_scales, self.value_scales)]
        return ChunkKV(self.key, self.token_ids, self.keys.cpu(), self.values.cpu(), *scales, namespace=self.namespace)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The storage dtype the entry is in (``torch.uint4`` for packed 4-bit codes)."""
        return torch.uint4 if self.keys.dtype == PACKED_4BIT else self.keys.dtype

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of one layer, each ``[kv_heads, tokens, head_dim]``, in the storage
        dtype (float16 for int8 and uint4 entries, which are dequantized here)."""
        if self.key_scales is None:
            return self.keys[index], self.values[index]
        return dequantize(self.storage_dtype, self.keys[index], self.key_scales[index], self.values[index],
                          self.value_scales[index])


# Quantized storage dtypes: entries read back in float16 (so their values need float16's range).
QUANTIZED_DTYPES = (torch.int8, torch.uint4)
# uint4 codes are kept two to a byte in uint8 tensors (torch has no 4-bit tensors to compute with).
PACKED_4BIT = torch.uint8
# Values per group of a uint4 entry: tokens per K channel group, head_dim values per V group.
UINT4_GROUP = 32


def to_storage(entry: ChunkKV, dtype: torch.dtype) -> ChunkKV:
    """``entry`` in a storage dtype: cast, or quantized for ``torch.int8`` and ``torch.uint4``."""
    if dtype == torch.int8:
        return quantize_int8(entry)
    if dtype == torch.uint4:
        return quantize_uint4(entry)
    return ChunkKV(entry.key, entry.token_ids, entry.keys.to(dtype), entry.values.to(dtype), namespace=entry.namespace)


def quantize_int8(entry: ChunkKV) -> ChunkKV:
    """The int8 form of ``entry``: symmetric, K scaled per channel and V per token (the split
    KIVI found best), scales in float16. About half the bytes of float16."""
    keys, values = entry.keys.float(), entry.values.float()
    key_scales = _scales(keys.abs().amax(dim=2))      # [L, H, D]
    value_scales = _scales(values.abs().amax(dim=3))  # [L, H, T]
    q_keys = (keys / key_scales.float()[:, :, None, :]).round().clamp(-127, 127).to(torch.int8)
    q_values = (values / value_scales.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return ChunkKV(entry.key, entry.token_ids, q_keys, q_values, key_scales, value_scales, entry.namespace)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # Floored at float16's smallest normal number, so a tiny range does not round to a zero scale.
    scales = (amax / 127).clamp_min(torch.finfo(torch.float16).tiny).half()
    return torch.where(amax > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale


def dequantize_int8(q_keys: torch.Tensor, key_scales: torch.Tensor, q_values: torch.Tensor,
                    value_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's float16 ``(K, V)`` from its int8 values and scales (see :func:`quantize_int8`)."""
    keys = q_keys.to(torch.float16) * key_scales[:, None, :]
    values = q_values.to(torch.float16) * value_scales[:, :, None]
    return keys, values


def dequantize(dtype: torch.dtype, q_keys, key_scales, q_values, value_scales) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's float16 ``(K, V)`` from a quantized entry's codes and scales."""
    unpack = dequantize_uint4 if dtype == torch.uint4 else dequantize_int8
    return unpack(q_keys, key_scales, q_values, value_scales)


def value_group(head_dim: int) -> int:
    """How many of a token's head_dim values share one step and minimum in a uint4 entry."""
    return UINT4_GROUP if head_dim % UINT4_GROUP == 0 else head_dim


def check_uint4_shape(head_dim: int) -> None:
    """uint4 packs two codes a byte along head_dim: an odd head_dim cannot be stored so."""
    if head_dim % 2:
        from ..errors import InvalidInputError

        raise InvalidInputError(f"kv_dtype='uint4' needs an even head_dim (two 4-bit codes a byte); this model's is "
                                f"{head_dim}: use kv_dtype='int8' or 'float16'.")


def quantize_uint4(entry: ChunkKV) -> ChunkKV:
    """The 4-bit form of ``entry``: asymmetric (a float16 step and minimum per group, codes 0..15),
    K grouped per channel over runs of :data:`UINT4_GROUP` tokens and V per token over groups of
    :data:`UINT4_GROUP` head_dim values (KIVI's split: K's outliers sit in a few channels, V's
    error is spread over tokens). About 31% of float16's bytes at head_dim 64 and up."""
    keys, values = entry.keys.float(), entry.values.float()
    layers, heads, tokens, head_dim = keys.shape
    check_uint4_shape(head_dim)
    # K: groups of tokens per channel. The last group is padded with its last token (which moves
    # neither its minimum nor its maximum).
    pad = -tokens % UINT4_GROUP
    padded = torch.cat([keys, keys[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else keys
    grouped = padded.view(layers, heads, -1, UINT4_GROUP, head_dim)
    key_step, key_min = _steps(grouped.amin(dim=3), grouped.amax(dim=3))          # [L, H, groups, D]
    step, low = (t.float().repeat_interleave(UINT4_GROUP, dim=2)[:, :, :tokens] for t in (key_step, key_min))
    q_keys = _codes(keys, step, low)
    # V: groups along head_dim per token.
    group = value_group(head_dim)
    grouped = values.view(layers, heads, tokens, head_dim // group, group)
    value_step, value_min = _steps(grouped.amin(dim=4), grouped.amax(dim=4))      # [L, H, T, groups]
    q_values = _codes(grouped, value_step.float()[..., None], value_min.float()[..., None]).view(values.shape)
    key_scales = torch.stack([key_step, key_min], dim=2)
    value_scales = torch.stack([value_step, value_min], dim=2)
    return ChunkKV(entry.key, entry.token_ids, _pack(q_keys), _pack(q_values), key_scales, value_scales,
                   entry.namespace)


def _steps(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 step and minimum of groups spanning ``[low, high]`` in 15 steps."""
    # A step floored at float16's smallest normal number: a flat group does not get a zero step.
    step = ((high - low) / 15).clamp_min(torch.finfo(torch.float16).tiny).half()
    return step, low.half()


def _codes(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    # From the float16 step and minimum as stored, so that rounding is to the grid read back.
    return ((x - low) / step).round_().clamp_(0, 15).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) two to a byte along the last dim: even index low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def dequantize_uint4(q_keys: torch.Tensor, key_scales: torch.Tensor, q_values: torch.Tensor,
                     value_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's float16 ``(K, V)`` from its packed 4-bit codes, steps and minimums (see
    :func:`quantize_uint4`). Computed in float32 with the steps broadcast over their groups (no
    expanded copies; measured ~1.5x faster than float16 arithmetic on a CPU), rounded once."""
    heads, tokens, half = q_keys.shape
    head_dim, groups = 2 * half, key_scales.shape[2]
    codes = _unpack(q_keys)
    if groups * UINT4_GROUP > tokens:   # the last group is short: pad its codes to a whole group
        codes = torch.cat([codes, codes.new_zeros(heads, groups * UINT4_GROUP - tokens, head_dim)], dim=1)
    steps = key_scales.float()[:, :, :, None, :]   # [H, 2, groups, 1, D]
    keys = torch.addcmul(steps[:, 1], codes.view(heads, groups, UINT4_GROUP, head_dim).float(), steps[:, 0])
    keys = keys.view(heads, -1, head_dim)[:, :tokens].half()
    group = value_group(head_dim)
    steps = value_scales.float()[..., None]        # [H, 2, T, groups, 1]
    values = torch.addcmul(steps[:, 1], _unpack(q_values).view(heads, tokens, head_dim // group, group).float(),
                           steps[:, 0])
    return keys, values.view(heads, tokens, head_dim).half()


@dataclass(frozen=True)
class ChunkRef:
    """What :meth:`BlendEngine.precompute` returns for each chunk."""

    key: str
    num_tokens: int
    stored: bool = True   # False when the KV store failed to keep it (it is then computed per query)
