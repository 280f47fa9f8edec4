"""GGUF files of real model shapes with random weights, for timing models no one can download here.

Only PyPI is reachable from this machine, so no 1-8B weights are. A file written here has the
exact tensor shapes, quantization and metadata of Qwen2.5 1.5B, 3B or 7B Instruct (as
llama.cpp's converter writes them) and the real Qwen2.5 tokenizer: its vocabulary, merges and
chat template are copied from the Qwen2.5 GGUF that ``benchmarks.models`` assembles. The weights
are random 4-bit codes with one fixed block scale (weights of standard deviation ~0.02), so
timings, memory and KV sizes are those of the real model and its answers are noise: report no
quality from them.

Every weight matrix is Q4_0 (the embedding table too; Qwen2.5 7B's separate output matrix as
well), norms and biases F32: a file 0.59 bytes a weight, which llama.cpp and ragblend both read.

    python -m benchmarks.random_gguf qwen2.5-1.5b qwen2.5-3b qwen2.5-7b   # writes them, prints paths
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragblend.core.paths import cache_dir

from .models import gguf_path

Q4_0_BLOCK = 18            # bytes per 32 weights: a float16 scale and 16 bytes of 4-bit codes
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    """The hyper-parameters of a Qwen2 model, as its GGUF metadata names them."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    tied: bool               # output projection shares the embedding table
    vocab: int = 151936

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attention + 3 * self.hidden * self.ffn
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


# Qwen2.5-{1.5B,3B,7B}-Instruct's config.json.
SHAPES = {
    "qwen2.5-1.5b": Shape(layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, tied=True),
    "qwen2.5-3b": Shape(layers=36, hidden=2048, ffn=11008, heads=16, kv_heads=2, tied=True),
    "qwen2.5-7b": Shape(layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, tied=False),
}


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols / 32 * 18]`` bytes of Q4_0 blocks: one scale making the weights' std ~0.02
    (codes uniform over 0..15 minus 8 have std ~4.6), random codes."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, Q4_0_BLOCK), dtype=np.uint8)
    scale = np.frombuffer(np.float16(WEIGHT_STD / 4.61).tobytes(), dtype=np.uint8)
    blocks[..., 0:2] = scale
    return blocks.reshape(rows, -1)


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """``(name, (rows, cols) or (n,), kind)`` in llama.cpp's order; kind ``q4`` or ``f32``
    (``one``: a norm's weight, ones)."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out = [("token_embd.weight", (shape.vocab, shape.hidden), "q4")]
    for i in range(shape.layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (shape.hidden,), "one"),
                (f"{b}.attn_q.weight", (shape.hidden, shape.hidden), "q4"), (f"{b}.attn_q.bias", (shape.hidden,), "f32"),
                (f"{b}.attn_k.weight", (kv, shape.hidden), "q4"), (f"{b}.attn_k.bias", (kv,), "f32"),
                (f"{b}.attn_v.weight", (kv, shape.hidden), "q4"), (f"{b}.attn_v.bias", (kv,), "f32"),
                (f"{b}.attn_output.weight", (shape.hidden, shape.hidden), "q4"),
                (f"{b}.ffn_norm.weight", (shape.hidden,), "one"),
                (f"{b}.ffn_gate.weight", (shape.ffn, shape.hidden), "q4"),
                (f"{b}.ffn_up.weight", (shape.ffn, shape.hidden), "q4"),
                (f"{b}.ffn_down.weight", (shape.hidden, shape.ffn), "q4")]
    out.append(("output_norm.weight", (shape.hidden,), "one"))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, shape.hidden), "q4"))
    return out


def random_gguf_path(name: str) -> Path:
    return cache_dir() / "models" / f"random-{name}-q4_0.gguf"


def write_random_gguf(name: str, seed: int = 0, *, shape: Shape | None = None, target: Path | None = None,
                      tokenizer_from: Path | None = None) -> Path:
    """Write (once) the random-weight GGUF of shape ``name`` in the cache dir; its path.
    ``shape``, ``target``, ``tokenizer_from``: another shape, file, or GGUF to copy the tokenizer
    from (default: the Qwen2.5 GGUF of :mod:`benchmarks.models`)."""
    import gguf

    target = target or random_gguf_path(name)
    if target.exists():
        return target
    shape = shape or SHAPES[name]
    source = gguf.GGUFReader(str(tokenizer_from or gguf_path("qwen2.5-0.5b")))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "qwen2")
    writer.add_name(f"random-weight {name} (shape only)")
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    for key, field in source.fields.items():   # the real tokenizer: vocabulary, merges, ids, template
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensors = _tensors(shape)
    for tensor_name, dims, kind in tensors:
        if kind == "q4":
            rows, cols = dims
            writer.add_tensor_info(tensor_name, (rows, cols // 32 * Q4_0_BLOCK), np.dtype(np.uint8), rows * cols // 32 * Q4_0_BLOCK,
                                   raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), dims[0] * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, dims, kind in tensors:
        if kind == "q4":
            data = random_q4_0(*dims, rng)
        elif kind == "one":
            data = np.ones(dims, dtype=np.float32)
        else:
            data = (rng.standard_normal(dims) * WEIGHT_STD).astype(np.float32)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(partial, target)
    return target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write random-weight GGUFs of real model shapes (Q4_0).")
    parser.add_argument("shapes", nargs="*", default=["qwen2.5-1.5b"], choices=sorted(SHAPES))
    for name in parser.parse_args(argv).shapes:
        path = write_random_gguf(name)
        print(f"{name}: {SHAPES[name].parameters / 1e9:.2f}B parameters, {path.stat().st_size / 1e9:.2f} GB: {path}")


if __name__ == "__main__":
    main()
