"""The random-weight GGUFs of real shapes (benchmarks.random_gguf) are files ragblend reads as
the shape says, with weights of the intended spread."""

import numpy as np

from benchmarks.random_gguf import Shape, write_random_gguf
from ragblend.core.model.gguf_file import read_gguf

from .test_quantized import write_tiny_gguf


def test_a_random_gguf_has_the_shapes_types_and_spread_it_claims(tmp_path):
    import gguf

    shape = Shape(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, tied=False, vocab=512)
    path = write_random_gguf("tiny", shape=shape, target=tmp_path / "tiny.gguf",
                             tokenizer_from=write_tiny_gguf(tmp_path / "source.gguf"))
    header = read_gguf(path)   # ragblend's own checks: architecture, types, sizes
    assert header.architecture == "qwen2"
    assert header.tensors["blk.1.ffn_down.weight"].shape == (128, 256)
    assert header.tensors["output.weight"].type_name == "Q4_0"
    reader = gguf.GGUFReader(str(path))
    up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    values = gguf.dequantize(up.data, up.tensor_type)
    assert values.shape == (256, 128) and 0.015 < float(np.std(values)) < 0.025
    weights = sum(int(np.prod(t.shape)) for t in reader.tensors if t.tensor_type.name == "Q4_0")
    assert weights == shape.parameters
