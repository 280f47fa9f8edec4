"""The fused prefill equals the dense reference on the real SmolLM2 and Qwen2.5 models (the reference itself
and the tiny-model cases are in tests/unit/test_reference.py)."""


import pytest

from ragblend import CacheBlend, QueryAware

from ..unit.test_reference import check_against_reference, flat_prompt


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [CacheBlend(0.05), CacheBlend(0.3), CacheBlend(0.7), QueryAware(0.3),
                                      QueryAware(0.3, cached_attention_scale=0.5)], ids=repr)
def test_fused_prefill_matches_dense_reference_smollm2(smol_engine, bench_prompt, strategy):
    chunks, _ = bench_prompt
    smol_engine.precompute(chunks[:4])
    check_against_reference(smol_engine, flat_prompt(chunks[:4]), strategy)


@pytest.mark.slow
def test_fused_prefill_matches_dense_reference_qwen(bench_prompt):
    from ragblend import BlendEngine
    from ragblend.core.paths import cache_dir

    gguf = cache_dir() / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4.gguf"
    if not gguf.exists():
        pytest.skip(f"Qwen2.5 not assembled ({gguf}); run `python -m benchmarks.models qwen2.5-0.5b`")
    engine = BlendEngine.from_pretrained(str(gguf), kv_dir=False)
    chunks, _ = bench_prompt
    # shorter chunks: the 0.5B model's dense reference was the suite's slowest step (5 min)
    chunks = [" ".join(chunk.split()[:80]) for chunk in chunks[:4]]
    engine.precompute(chunks)
    for strategy in (CacheBlend(0.05), CacheBlend(0.3), CacheBlend(0.7), QueryAware(0.3)):
        check_against_reference(engine, flat_prompt(chunks), strategy)
