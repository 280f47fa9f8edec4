"""ChunkKV: what is stored for one chunk, and how its key is made."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Bump when what a stored entry means changes (layout, sink handling, pre/post RoPE...):
# old entries then simply stop matching.
# v2: the storage dtype joined the key.
KV_FORMAT_VERSION = 2


# Where ingestion hooks record a chunk's key in its document's metadata (LlamaIndex nodes,
# LangChain documents); excluded from what the LLM and the embedder see.
KV_METADATA_KEY = "ragblend_kv_key"


def chunk_key(fingerprint: str, sink_ids: list[int], token_ids: list[int], storage_dtype: str) -> str:
    """Content key of a chunk's KV: everything that changes its bytes, i.e. the model
    fingerprint, sink prefix, chunk tokens, storage dtype and format version.

    A KV entry can therefore never be used for another model, tokenizer, compute dtype,
    storage dtype or sink prefix: any of those changes the key.
    """
    h = hashlib.sha256()
    h.update(f"ragblend-kv-v{KV_FORMAT_VERSION}|{fingerprint}|{storage_dtype}|".encode())
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
    """

    key: str
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of one layer, each ``[kv_heads, tokens, head_dim]``."""
        return self.keys[index], self.values[index]


@dataclass(frozen=True)
class ChunkRef:
    """What :meth:`BlendEngine.precompute` returns for each chunk."""

    key: str
    num_tokens: int
    stored: bool = True   # False when the KV store failed to keep it (it is then computed per query)
