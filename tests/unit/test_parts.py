"""The engine's parts work without the engine: ingestion, the chunk index, the strategy plan
and the prefill runner wired by hand give what BlendEngine.prefill gives."""

import threading

import torch

from ragblend.core.chunk_index import ChunkIndex
from ragblend.core.ingest import Ingestion
from ragblend.core.model import ModelAdapter
from ragblend.core.plan import resolve_strategy
from ragblend.core.prompt import PromptBuilder
from ragblend.core.runner import PrefillRunner
from ragblend.core.store import MemoryStore
from ragblend.core.strategies import CacheBlend
from tests.conftest import make_tiny_engine, tiny_model

PASSAGE = ("The lighthouse on the northern cape was first lit in 1871 and guided ships past the reef "
           "for more than a century before an automatic beacon replaced its keepers.")


def test_parts_wired_by_hand_prefill_as_the_engine_does(tokenizer):
    adapter, prompts, lock = ModelAdapter(tiny_model("llama")), PromptBuilder(tokenizer), threading.RLock()
    index, store = ChunkIndex(), MemoryStore()
    sink = prompts.chunk_sink(None, "")
    ingestion = Ingestion(adapter, prompts, sink, adapter.fingerprint(tokenizer), torch.float32, lock, index)
    refs = ingestion.precompute([PASSAGE], store, batch_tokens=0)
    assert refs[0].stored and refs[0].key in store

    prompt = prompts.build([PASSAGE + "\n\nWhen was the lighthouse first lit?"], None).token_ids
    layout = index.mark(prompt, store)
    assert len(layout.chunk_spans) == 1
    plan = resolve_strategy(CacheBlend(0.3), engine_strategy=None, engine_chose=False, calibration=None,
                            num_layers=adapter.shape.num_layers)
    runner = PrefillRunner(adapter, ingestion, index, lock, loading=None)
    pre, trace = runner.run(layout, plan, store, prefetch=False, write_back=True, t0=0.0)
    assert pre.stats.reused_tokens > 0 and pre.stats.chunks_reused == 1

    engine = make_tiny_engine("llama", tokenizer, chunk_context="", kv_dtype="float32", precompute_batch_tokens=0)
    engine.precompute([PASSAGE])
    # The engine runs the same weights through its CPU kernels: equal up to float rounding.
    expected = engine.prefill(engine.find_chunks(PASSAGE + "\n\nWhen was the lighthouse first lit?"),
                              strategy=CacheBlend(0.3))
    assert expected.token_ids == pre.token_ids and expected.stats.reused_tokens == pre.stats.reused_tokens
    assert torch.allclose(expected.logits, pre.logits, atol=1e-3)
