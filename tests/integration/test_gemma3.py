"""The real Gemma 3 270M (its tiny-model half, the adapter's per-layer RoPE tables and the plain layout, is
tests/unit/test_gemma3.py): full recompute and decoding equal the model's own forward, the fused prefill
matches the dense reference, and the shipped calibration runs."""


import pytest
import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, QueryAware
from ragblend.core.decode.generate import KVDecoder

from ..unit.test_gemma3 import SYSTEM

# ---------------------------------------------------------------------------- the adapter


# ---------------------------------------------------------------------------- the plain layout


# ---------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def gemma_engine():
    from benchmarks.models import assembled_path, gguf_path

    try:
        path = gguf_path("gemma3-270m", install=False)   # assembles it if its parts are installed
    except FileNotFoundError as err:
        pytest.skip(f"Gemma 3 270M is not installed ({assembled_path('gemma3-270m')} missing; {err}). "
                    "Run `python -m benchmarks.models gemma3-270m` (installs four ~60 MB packages).")
    return BlendEngine.from_pretrained(str(path), kv_dir=False, kv_dtype="float32")


@pytest.mark.slow
def test_gemma3_270m_full_recompute_and_decoding_equal_the_model_forward(gemma_engine, bench_prompt):
    engine = gemma_engine
    assert engine.adapter.arch == "gemma3_text" and engine.adapter.shape.num_layers == 18
    assert {engine.adapter.window(i) for i in range(18)} == {512, None}
    assert not engine.prompts.use_chat_template   # a base model: the plain layout
    chunks, question = bench_prompt
    # Over 512 tokens, so the sliding-window layers see only part of the prompt.
    pre = engine.prefill([Chunk(c) for c in chunks[:2]] + [question], system=SYSTEM, strategy=FullRecompute())
    assert len(pre.token_ids) > 600
    answer = engine.prompts.tokenize(" The answer is in the passages.")[:6]
    with torch.no_grad():
        ref = engine.hf_model(torch.tensor([pre.token_ids + answer])).logits[0]
    n = len(pre.token_ids)
    scale = ref.abs().max()
    assert (pre.logits - ref[n - 1]).abs().max() <= 1e-3 * scale
    decoder = KVDecoder(engine.adapter, pre.keys, pre.values, n + len(answer))
    for i, token in enumerate(answer):
        assert (decoder.step(token) - ref[n + i]).abs().max() <= 1e-3 * scale


@pytest.mark.slow
def test_gemma3_270m_fused_prefill_matches_dense_reference(gemma_engine, bench_prompt):
    from ..unit.test_reference import check_against_reference, flat_prompt

    chunks, _ = bench_prompt
    chunks = [" ".join(chunk.split()[:120]) for chunk in chunks[:4]]   # a prompt of ~700 tokens: past the window
    gemma_engine.precompute(chunks)
    for strategy in (CacheBlend(0.3), QueryAware(0.3)):
        check_against_reference(gemma_engine, flat_prompt(chunks), strategy, atol=2e-3)


@pytest.mark.slow
def test_gemma3_270m_runs_at_its_shipped_calibration(gemma_engine):
    """Its calibration ships with ragblend (ragblend/data/calibration), measured on the plain layout."""
    from ragblend.core.calibration import record

    shipped = record.SHIPPED_DIR / record.calibration_file(gemma_engine.calibration_id).name
    assert shipped.exists()
    assert gemma_engine.calibration is not None and gemma_engine.calibration.within_noise
    assert gemma_engine.strategy == gemma_engine.calibration.strategy and gemma_engine.calibration.ratio < 0.3
