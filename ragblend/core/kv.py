"""ChunkKV: what is stored for one chunk, and how its key is made."""

from __future__ import annotations

import hashlib
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


def chunk_key(fingerprint: str, sink_ids: list[int], token_ids: list[int], storage_dtype: str) -> str:
    """Content key of a chunk's KV: everything that changes its bytes, i.e. the model
    fingerprint, sink prefix, chunk tokens, storage dtype and format version.

    A KV entry can therefore never be used for another model, tokenizer, compute dtype,
    storage dtype or sink prefix: any of those changes the key.
    """
    return _key(KV_FORMAT_VERSION, fingerprint, storage_dtype, sink_ids, token_ids)


def lead_key(own_key: str, lead_sink_ids: list[int]) -> str:
    """The key of a chunk's lead entry (its KV computed right after ``lead_sink_ids``, see
    :mod:`.ingest`), made from the chunk's own key, so that it is found (and deleted) from that
    key alone, without the chunk's token ids."""
    return _key(KV_FORMAT_VERSION, own_key, "lead", lead_sink_ids, [])


def calibration_key(fingerprint: str, sink_ids: list[int], lead_sink_ids: list[int] | None = None) -> str:
    """What a calibration is stored under: the model fingerprint and sink prefix, and the lead
    sink where the engine keeps lead entries (a prompt's first chunk is then fused from another
    entry: see :mod:`.ingest`).

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
    """

    key: str
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = field(default=None, repr=False)
    value_scales: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, self.key_scales, self.value_scales]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_cpu(self) -> ChunkKV:
        scales = [None if t is None else t.cpu() for t in (self.key_scales, self.value_scales)]
        return ChunkKV(self.key, self.token_ids, self.keys.cpu(), self.values.cpu(), *scales)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of one layer, each ``[kv_heads, tokens, head_dim]``, in the storage
        dtype (float16 for int8 entries, which are dequantized here)."""
        if self.key_scales is None:
            return self.keys[index], self.values[index]
        return dequantize_int8(self.keys[index], self.key_scales[index], self.values[index], self.value_scales[index])


def to_storage(entry: ChunkKV, dtype: torch.dtype) -> ChunkKV:
    """``entry`` in a storage dtype: cast, or quantized for ``torch.int8``."""
    if dtype == torch.int8:
        return quantize_int8(entry)
    return ChunkKV(entry.key, entry.token_ids, entry.keys.to(dtype), entry.values.to(dtype))


def quantize_int8(entry: ChunkKV) -> ChunkKV:
    """The int8 form of ``entry``: symmetric, K scaled per channel and V per token (the split
    KIVI found best), scales in float16. About half the bytes of float16."""
    keys, values = entry.keys.float(), entry.values.float()
    key_scales = _scales(keys.abs().amax(dim=2))      # [L, H, D]
    value_scales = _scales(values.abs().amax(dim=3))  # [L, H, T]
    q_keys = (keys / key_scales.float()[:, :, None, :]).round().clamp(-127, 127).to(torch.int8)
    q_values = (values / value_scales.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return ChunkKV(entry.key, entry.token_ids, q_keys, q_values, key_scales, value_scales)


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


@dataclass(frozen=True)
class ChunkRef:
    """What :meth:`BlendEngine.precompute` returns for each chunk."""

    key: str
    num_tokens: int
    stored: bool = True   # False when the KV store failed to keep it (it is then computed per query)
