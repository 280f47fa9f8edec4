"""Layer sources: how the fusion gets layer i of every reused chunk's cached KV.

The fusion asks for layers in order (0, 1, 2, ...). :class:`SequentialSource` reads each
layer when asked; a prefetching source (reading layer i+1 while layer i is computed) plugs
in behind the same :class:`~ragblend.core.fusion.LayerSource` interface.
"""

from __future__ import annotations

import time

import torch

from .fusion import LayerSource
from .kv import ChunkKV


class SequentialSource(LayerSource):
    """Concatenates layer ``i`` of the chunks (in prompt order) on demand."""

    def __init__(self, chunks: list[ChunkKV], dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.chunks = chunks
        self.dtype = dtype
        self.device = device
        self.load_s = 0.0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        ks, vs = zip(*(chunk.layer(index) for chunk in self.chunks))
        k = torch.cat(ks, dim=1).to(self.device, self.dtype)
        v = torch.cat(vs, dim=1).to(self.device, self.dtype)
        self.load_s += time.perf_counter() - t0
        return k, v
