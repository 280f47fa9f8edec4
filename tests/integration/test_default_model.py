"""The real embedded default model (SmolLM2-135M-Instruct): exactness, fidelity ordering, decoding."""

import pytest
import torch

from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute, FullReuse
from ragblend.core.calibration.metrics import first_token_kl
from ragblend.core.model.loading import converted_dir_for, default_gguf_path

from ..conftest import PASSAGES

pytestmark = pytest.mark.slow

QUESTION = "Question: In which year was the lighthouse at Cape Orrin first lit? Answer briefly."


def segs():
    return [Chunk(p) for p in PASSAGES] + [QUESTION]



def test_default_model_loads_from_its_gguf_without_a_float32_copy(smol_engine):
    """No copy of the weights on disk: the cache holds the config and tokenizer only. A model this
    small is dequantized to float32 in memory (model.gguf_in_float32); asked for, its weights stay
    in the file's 4-bit/8-bit form, within 1.3x the file."""
    from ragblend.core.model.loading import gguf_metadata_dir
    from ragblend.core.model.quantized import quantized_bytes

    folder = gguf_metadata_dir(default_gguf_path())
    assert (folder / "config.json").exists() and not list(folder.glob("*.safetensors"))
    assert not (converted_dir_for(default_gguf_path()) / "model.safetensors").exists()
    assert smol_engine.adapter.arch == "llama" and smol_engine.context_window == 8192
    assert smol_engine.weights_form == "float32"
    quantized = BlendEngine.from_pretrained(default_gguf_path(), dtype="quantized", kv_dir=False)
    # "quantized", or "quantized-fast-..." where the host's plan departs from float32 (llama met the
    # fast plan's fidelity rule: model.FAST_PREFILL_FIDELITY)
    assert quantized.weights_form.startswith("quantized")
    assert quantized_bytes(quantized.hf_model) <= 1.3 * default_gguf_path().stat().st_size


def test_quantized_and_float32_loads_are_the_same_model(smol_engine):
    """Known by the same fingerprint (the shipped calibration applies to both); KV keyed apart."""
    quantized = BlendEngine.from_pretrained(default_gguf_path(), dtype="quantized", kv_dir=False)
    assert smol_engine.weights_form == "float32"
    assert quantized.model_fingerprint == smol_engine.model_fingerprint == smol_engine.fingerprint != quantized.fingerprint
    for engine in (smol_engine, quantized):
        assert engine.calibration is not None and engine.calibration.source == "shipped"


def test_full_recompute_equals_model_forward(smol_engine):
    pre = smol_engine.prefill(segs(), system="You answer from the given passages.", strategy=FullRecompute())
    with torch.no_grad():
        ref = smol_engine.hf_model(torch.tensor([pre.token_ids])).logits[0, -1]
    assert (pre.logits - ref).abs().max() <= 1e-4


def test_greedy_generate_equals_transformers_generate(smol_engine):
    """ragblend's decoding against transformers' own model of the same weights and its ``generate``
    (the engine runs ragblend's modules, core.model.decoder, which have no ``generate``)."""
    from ragblend.core.model.gguf_file import read_gguf
    from ragblend.core.model.quantized import build_quantized_model

    out = smol_engine.generate(segs(), strategy=FullRecompute(), max_new_tokens=24)
    theirs = build_quantized_model(read_gguf(default_gguf_path()), smol_engine.hf_model.config, exact=True,
                                   transformers_modules=True)
    with torch.no_grad():
        ref = theirs.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=24,
                                            do_sample=False)[0, len(out.prompt_token_ids):].tolist()
    ref = [t for t in ref if t not in smol_engine.answers.eos_ids]  # ours never includes EOS
    assert out.token_ids == ref[:len(out.token_ids)] and len(out.token_ids) == len(ref)
    assert out.text == smol_engine.tokenizer.decode(ref, skip_special_tokens=True)
    assert "1871" in out.text
    # the answer copies the passage, so drafted tokens were accepted: fewer passes than tokens
    assert smol_engine.last_stats.decode_steps < len(out.token_ids) - 1


def test_stream_equals_generate_and_stats(smol_engine):
    smol_engine.precompute(PASSAGES)
    out = smol_engine.generate(segs(), max_new_tokens=20)
    pieces = list(smol_engine.stream(segs(), max_new_tokens=20))
    assert "".join(pieces) == out.text and len(pieces) > 1
    stats = smol_engine.last_stats
    assert stats.generated_tokens == len(out.token_ids) and stats.finish_reason in ("stop", "length")
    assert stats.reused_tokens > 0 and stats.chunks_reused == len(PASSAGES)
    assert stats.ttft_s > 0 and stats.compute_s > 0 and stats.load_s >= 0


def test_stop_strings_and_max_new_tokens(smol_engine):
    full = smol_engine.generate(segs(), max_new_tokens=24, strategy=FullRecompute())
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = smol_engine.generate(segs(), max_new_tokens=24, strategy=FullRecompute(), stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    streamed = "".join(smol_engine.stream(segs(), max_new_tokens=24, strategy=FullRecompute(), stop=[stop]))
    assert streamed == cut.text
    short = smol_engine.generate(segs(), max_new_tokens=3, strategy=FullRecompute())
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_sampling_is_seeded(smol_engine):
    kwargs = dict(max_new_tokens=16, temperature=1.2, top_p=0.95, strategy=FullRecompute())
    a = smol_engine.generate(segs(), seed=7, **kwargs)
    b = smol_engine.generate(segs(), seed=7, **kwargs)
    texts = {smol_engine.generate(segs(), seed=s, **kwargs).text for s in range(4)}
    assert a.text == b.text
    assert len(texts) > 1  # different seeds explore different answers


def test_first_token_kl_shrinks_as_ratio_grows(smol_engine, bench_prompt):
    chunks, question = bench_prompt
    smol_engine.precompute(chunks)
    segments = [Chunk(c) for c in chunks] + [question]
    ref = smol_engine.prefill(segments, strategy=FullRecompute()).logits
    kls = [first_token_kl(ref, smol_engine.prefill(segments, strategy=s).logits)
           for s in (FullReuse(), CacheBlend(0.05), CacheBlend(0.15), CacheBlend(1.0))]
    assert kls[0] > kls[1] > kls[2] > kls[3], kls
    assert kls[3] < 1e-6



def test_the_embedded_model_runs_at_its_shipped_calibration(smol_engine):
    """ragblend ships the embedded model's calibration (ragblend/data/calibration), so that
    BlendEngine.from_pretrained() runs at SmolLM2's own ratio without a calibrate() first."""
    assert smol_engine.calibration is not None and smol_engine.calibration.within_noise
    assert smol_engine.strategy == smol_engine.calibration.strategy and smol_engine.calibration.ratio < 0.3
    assert smol_engine.strategy.cached_attention_scale == 0.7   # the default attention scale, calibrated with it
    ferry = ("The ferry to Hallow Holm is the Sanderling. She leaves the north pier of Lowenmark four times "
             "a day in summer and twice a day in winter, and the crossing takes about thirty minutes.")
    gulls = ("Gulls nest on the pier from April to July. The harbour master asks visitors not to feed them, "
             "and the nesting ledges under the old crane are closed to anglers until the chicks have flown.")
    pre = smol_engine.prefill([Chunk(ferry), Chunk(gulls), "Question: which ferry goes to Hallow Holm?"])
    assert pre.stats.strategy_reason.startswith("calibrated")
