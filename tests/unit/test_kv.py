"""core.kv: a chunk's key names everything that changes its KV bytes, and an entry's int8 form
reads back close to its float values (K scaled per channel, V per token) at about half the bytes."""

import pytest
import torch

from ragblend.core import kv
from ragblend.core.kv import ChunkKV, calibration_key, chunk_key, dequantize_int8, quantize_int8, to_storage

from ..conftest import synthetic_entry

BASE = dict(fingerprint="a" * 64, sink_ids=[1, 2, 3], token_ids=[10, 11, 12], storage_dtype="torch.float16")


@pytest.mark.parametrize("change", [dict(fingerprint="b" * 64), dict(sink_ids=[1, 2]), dict(token_ids=[10, 11]),
                                    dict(token_ids=[11, 10, 12]), dict(storage_dtype="torch.int8")])
def test_the_key_changes_with_everything_that_changes_the_bytes(change):
    assert chunk_key(**BASE) == chunk_key(**BASE) and len(chunk_key(**BASE)) == 64
    assert chunk_key(**{**BASE, **change}) != chunk_key(**BASE)


def test_a_new_format_version_changes_chunk_keys_but_not_calibration_keys(monkeypatch):
    chunk, calibration = chunk_key(**BASE), calibration_key(BASE["fingerprint"], BASE["sink_ids"])
    monkeypatch.setattr(kv, "KV_FORMAT_VERSION", kv.KV_FORMAT_VERSION + 1)
    assert chunk_key(**BASE) != chunk
    assert calibration_key(BASE["fingerprint"], BASE["sink_ids"]) == calibration   # shipped calibrations stay found


def test_int8_reads_back_close_in_about_half_the_bytes_of_float16():
    entry = synthetic_entry(3, tokens=32, dtype=torch.float32)
    entry.keys[:, :, :, 5] *= 40                      # an outlier channel in K, as real models have
    half, eight = to_storage(entry, torch.float16), to_storage(entry, torch.int8)
    assert eight.keys.dtype == torch.int8 and eight.nbytes < 0.6 * half.nbytes
    # Per-channel K scales: the outlier channel does not flatten the others.
    assert (eight.key_scales[..., 5] > 10 * eight.key_scales[..., 0]).all()
    for layer in range(entry.keys.shape[0]):
        k, v = eight.layer(layer)                     # dequantized on reading, in float16
        assert k.dtype == v.dtype == torch.float16
        assert ((k.float() - entry.keys[layer]).abs() <= eight.key_scales[layer].float()[:, None, :] / 2 + 1e-3).all()
        assert ((v.float() - entry.values[layer]).abs() <= eight.value_scales[layer].float()[..., None] / 2 + 1e-3).all()


def test_an_all_zero_row_quantizes_to_zeros_not_nan():
    zeros = torch.zeros(1, 2, 4, 8)
    eight = quantize_int8(ChunkKV("0" * 64, [1, 2, 3, 4], zeros, zeros))
    k, v = dequantize_int8(eight.keys[0], eight.key_scales[0], eight.values[0], eight.value_scales[0])
    assert torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.zeros_like(v))
