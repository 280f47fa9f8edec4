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


def check_namespace(namespace) -> str:
    """``namespace`` if it is a valid namespace label ("" is the shared one); a clear error otherwise."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        from .errors import InvalidInputError

        raise InvalidInputError(f"namespace must be a string of at most 128 letters, digits, '.', '_', ':' or '-', "
                                f"got {str(namespace)[:40]!r}.")
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
    dtypes = [dtype] + ([d for d in ("float16", "bfloat16", "int8") if d != dtype] if dtype == "float32" else [])
    for name in dtypes:
        own = chunk_key(fingerprint, list(sink_ids), list(token_ids), f"torch.{name}", namespace)
        if key == own or (lead_sink_ids is not None and key == lead_key(own, list(lead_sink_ids))):
            return True
    return False


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


@dataclass(frozen=True)
class ChunkRef:
    """What :meth:`BlendEngine.precompute` returns for each chunk."""

    key: str
    num_tokens: int
    stored: bool = True   # False when the KV store failed to keep it (it is then computed per query)
