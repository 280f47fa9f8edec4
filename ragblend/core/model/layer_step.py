"""One walk over a model's layers, shared by every pass: precompute, the fused and the full
prefill, decoding and batched decoding.

Every pass does the same thing at each layer: the layer's input norm, K/V (and Q) from it,
attention over the K/V the pass assembles, then the output projection and the MLP
(:meth:`ModelAdapter.finish <ragblend.core.model.adapter.ModelAdapter.finish>`). What differs between
passes is named by the hooks of a :class:`LayerPass` (LMCache's ``process_qkv``, gpt-fast's one
``Transformer.forward``):

* :meth:`~LayerPass.process_qkv`: where this layer's K/V come from and where they are kept
  (fresh for every row and returned, cached and rotated for the rows not computed, written
  into a decoder's buffers, stored for an entry);
* :meth:`~LayerPass.narrow`: which rows go on to attention and the MLP (the fused prefill's
  selection at its check layers, and its last layer's one row that makes the logits);
* :meth:`~LayerPass.query`: the rows' Q, rotated (after narrowing: only the rows that go on pay it);
* :meth:`~LayerPass.attend`: attention of those queries over the assembled K/V (plans and
  masks built once per sliding window per pass, in the pass's object);
* :attr:`~LayerPass.stop_after_kv`: whether the last layer's K/V are all the pass needs
  (an entry stores K/V; nothing reads the last layer's output).

The passes: ``prefill.FusedLayers`` (the fused and the full prefill), ``ingest.IsolatedLayers``
and ``ingest.PackedLayers`` (precompute), ``generate.DecoderLayers`` (decoding, drafted tokens
verified in one pass), ``batching.BatchLayers`` (one token of each of several decoders).
"""

from __future__ import annotations

import torch

from ..cancel import check_cancelled
from .adapter import ModelAdapter, RopeTables


class LayerPass:
    """The hooks of one pass over the layers (see the module's docstring). An object per pass:
    it keeps what the pass assembles (K/V kept, plans, positions) between layers."""

    cancellable: bool = True     # ask check_cancelled() before each layer (a one-token decoding step: no)
    stop_after_kv: bool = False  # the last layer's K/V are all the pass needs: stop there

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter

    def process_qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """Compute this layer's K/V from the rows' attention input ``x`` and keep them where the pass
        needs them. Returns the rows' rotated Q where it came out of the same matmul (a decoding
        twin's fused Q/K/V), else None (then :meth:`query` computes it, after :meth:`narrow`)."""
        raise NotImplementedError

    def narrow(self, layer: int):
        """The rows (an index) that go on to attention and the MLP at ``layer``; None: all of them."""
        return None

    def query(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotated Q ``[heads, rows, head_dim]`` of the rows that go on (``x``: their attention input)."""
        return self.adapter.rope(self.adapter.q(layer, x), cos, sin)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention ``[rows, heads * head_dim]`` of the rows' queries over this layer's K/V."""
        raise NotImplementedError


def run_layers(adapter: ModelAdapter, ids: torch.Tensor, rope: RopeTables, step: LayerPass) -> torch.Tensor | None:
    """Embed ``ids`` (the rows computed from the first layer) and walk every layer with ``step``'s
    hooks; ``rope``: the RoPE tables the hooks are handed each layer's cos/sin of. Returns the
    last layer's output of the rows that went on (what the logits are made from), or None
    for a pass that stops after the last layer's K/V."""
    last = adapter.shape.num_layers - 1
    hidden = adapter.embed(ids)
    for layer in range(last + 1):
        if step.cancellable:
            check_cancelled()
        cos, sin = rope.layer(layer)   # each layer its own RoPE (Gemma 3: local and global bases differ)
        x = adapter.attn_input(layer, hidden)
        q = step.process_qkv(layer, x, cos, sin)
        if layer == last and step.stop_after_kv:
            return None
        rows = step.narrow(layer)
        if rows is not None:
            x, hidden = x[rows], hidden[rows]
            q = None if q is None else q[:, rows]
        if q is None:
            q = step.query(layer, x, cos, sin)
        hidden = adapter.finish(layer, hidden, step.attend(layer, q))
    return hidden
