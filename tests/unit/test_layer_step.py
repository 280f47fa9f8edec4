"""The one layer loop (ragblend.core.model.layer_step): every pass walks the layers with run_layers,
asks for cancellation only where it may be long, and a pass's hooks are all that differ.
Tiny random models."""

import pytest
import torch

from ragblend import FullRecompute
from ragblend.core.cancel import Cancelled, cancellable
from ragblend.core.decode.batching import batch_extend
from ragblend.core.decode.generate import KVDecoder
from ragblend.core.fusion.ingest import isolated_kv, packed_isolated_kv
from ragblend.core.model import layer_step
from ragblend.core.model.layer_step import LayerPass, run_layers

from .test_engine import forward_logits, segments


class Counting:
    """A should_stop that counts its calls and never stops."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return False


def decoders(engine, count=1, extra=4):
    pre = engine.prefill(segments(), strategy=FullRecompute())
    made = [KVDecoder(engine.adapter, pre.keys, pre.values, len(pre.token_ids) + extra) for _ in range(count)]
    return pre, made


def test_every_pass_walks_the_layers_with_run_layers(tiny_engine, monkeypatch):
    """Precompute (isolated and packed), the prefill, decoding and batched decoding all go through
    run_layers, each with its own LayerPass."""
    seen = []
    walk = layer_step.run_layers

    def recording(adapter, ids, rope, step):
        seen.append(type(step).__name__)
        return walk(adapter, ids, rope, step)

    for module in ("fusion.prefill", "fusion.ingest", "decode.generate", "decode.batching"):
        monkeypatch.setattr(f"ragblend.core.{module}.run_layers", recording)
    adapter = tiny_engine.adapter
    isolated_kv(adapter, [1, 2], [5, 6, 7])
    packed_isolated_kv(adapter, [1, 2], [[5, 6, 7], [8, 9]])
    pre, (one, two) = decoders(tiny_engine, 2)
    one.step(5)
    batch_extend([one, two], [6, 7])
    assert seen == ["IsolatedLayers", "IsolatedLayers", "PackedLayers", "FusedLayers", "DecoderLayers",
                    "BatchLayers"]   # packed: the sink's own K/V first, as a chunk alone


def test_cancellation_is_asked_where_a_pass_may_be_long(tiny_engine):
    """Precompute, the prefill and a several-token decoding pass ask before each layer; a
    one-token step and a batched step do not (they are short, and asked between steps)."""
    layers = tiny_engine.adapter.shape.num_layers
    pre, (one, two) = decoders(tiny_engine, 2, extra=6)
    runs = {
        "isolated": lambda: isolated_kv(tiny_engine.adapter, [1], [5, 6, 7]),
        "prefill": lambda: tiny_engine.prefill(segments(), strategy=FullRecompute()),
        "extend": lambda: one.extend([5, 6]),
        "step": lambda: one.step(7),
        "batched": lambda: batch_extend([one, two], [8, 9]),
    }
    calls = {}
    for name, run in runs.items():
        counter = Counting()
        with cancellable(counter):
            run()
        calls[name] = counter.calls
    assert calls["isolated"] == calls["extend"] == layers
    assert calls["prefill"] >= layers
    assert calls["step"] == calls["batched"] == 0
    with cancellable(lambda: True), pytest.raises(Cancelled):
        one.extend([5, 6])


def test_a_pass_is_its_hooks(tiny_engine):
    """A plain causal prefill written as a LayerPass of a few lines gives the model's own logits:
    the loop holds everything else (norms, RoPE per layer, the MLP, narrowing to the last row)."""
    from ragblend.core.model.masks import attend, attention_plan

    class Causal(LayerPass):
        def __init__(self, adapter, n):
            super().__init__(adapter)
            self.n = n

        def process_qkv(self, layer, x, cos, sin):
            k, self.v = self.adapter.kv(layer, x)
            self.k = self.adapter.rope(k, cos, sin)
            return None

        def narrow(self, layer):
            self.rows = slice(None) if layer < self.adapter.shape.num_layers - 1 else slice(-1, None)
            return self.rows

        def query(self, layer, x, cos, sin):
            return self.adapter.rope(self.adapter.q(layer, x), cos[self.rows], sin[self.rows])

        def attend(self, layer, q):
            positions = torch.arange(self.n)[self.rows]
            plan = attention_plan(positions, self.n, self.adapter.window(layer), q.dtype)
            return attend(self.adapter, q, self.k, self.v, plan)

    token_ids = tiny_engine.prefill(segments(), strategy=FullRecompute()).token_ids
    adapter, n = tiny_engine.adapter, len(token_ids)
    with torch.inference_mode():
        hidden = run_layers(adapter, torch.tensor(token_ids), adapter.rope_tables(n), Causal(adapter, n))
        logits = adapter.logits(hidden)[0]
    ref, _ = forward_logits(tiny_engine, token_ids)
    assert hidden.shape[0] == 1
    assert (logits - ref).abs().max() <= 1e-4
