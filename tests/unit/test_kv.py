"""core.store.kv: a chunk's key names everything that changes its KV bytes, and an entry's int8 form
reads back close to its float values (K scaled per channel, V per token) at about half the bytes;
its uint4 form within half a step of its group, at under a third."""

from dataclasses import replace

import pytest
import torch

from ragblend.core.store import kv
from ragblend.core.store.kv import (
    ChunkKV,
    calibration_key,
    chunk_key,
    dequantize_int8,
    dequantize_uint4,
    quantize_int8,
    quantize_uint4,
    to_storage,
)

from ..conftest import SPEC, synthetic_entry

BASE = dict(fingerprint="a" * 64, sink_ids=[1, 2, 3], token_ids=[10, 11, 12], storage_dtype="torch.float16")


@pytest.mark.parametrize("change", [dict(fingerprint="b" * 64), dict(sink_ids=[1, 2]), dict(token_ids=[10, 11]),
                                    dict(token_ids=[11, 10, 12]), dict(storage_dtype="torch.int8"),
                                    dict(storage_dtype="torch.uint4")])
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


@pytest.mark.parametrize("tokens", [1, 31, 32, 77])
def test_uint4_reads_back_within_half_a_step_of_its_group_in_under_a_third_of_float16s_bytes(tokens):
    entry = synthetic_entry(4, tokens=tokens, dtype=torch.float32, spec=replace(SPEC, head_dim=64))
    entry.keys[:, :, :, 5] *= 40                      # an outlier channel in K
    four = to_storage(entry, torch.uint4)
    assert four.storage_dtype == torch.uint4 and four.keys.dtype == torch.uint8
    assert four.keys.shape[-1] == 32                  # two codes a byte
    if tokens >= 32:   # the steps and minimums cost 1/4 byte per value: 0.625 bytes against float16's 2
        assert four.nbytes < 0.33 * to_storage(entry, torch.float16).nbytes
    key_step, value_step = four.key_scales[:, :, 0].float(), four.value_scales[:, :, 0].float()
    # Per-channel K groups: the outlier channel's step does not coarsen the other channels'.
    assert tokens == 1 or (key_step[..., 5] > 10 * key_step[..., 0]).all()
    for layer in range(entry.keys.shape[0]):
        k, v = four.layer(layer)                      # dequantized on reading, in float16
        assert k.dtype == v.dtype == torch.float16 and k.shape == v.shape == entry.keys[layer].shape
        k_step = key_step[layer].repeat_interleave(32, dim=1)[:, :tokens]            # [H, T, D]
        v_step = value_step[layer].repeat_interleave(32, dim=2)                      # [H, T, D]
        # half a step, plus float16's rounding of the minimum and of the result (relative 2**-11 each)
        k_exact, v_exact = entry.keys[layer], entry.values[layer]
        assert ((k.float() - k_exact).abs() <= 0.51 * k_step + 1e-3 * k_exact.abs() + 1e-4).all()
        assert ((v.float() - v_exact).abs() <= 0.51 * v_step + 1e-3 * v_exact.abs() + 1e-4).all()


def test_uint4_groups_a_head_dim_that_32_does_not_divide_whole_and_keeps_constant_groups_exact():
    entry = synthetic_entry(5, tokens=40, dtype=torch.float32)          # SPEC's head_dim 8: one V group a token
    entry.values[:, :, 3] = 0.75                                        # a token whose values are all one number
    four = quantize_uint4(entry)
    assert four.value_scales.shape == (3, 2, 2, 40, 1)
    k, v = dequantize_uint4(four.keys[0], four.key_scales[0], four.values[0], four.value_scales[0])
    assert torch.equal(v[:, 3], torch.full_like(v[:, 3], 0.75))
    zeros = torch.zeros(1, 2, 4, 8)
    k, v = quantize_uint4(ChunkKV("0" * 64, [1, 2, 3, 4], zeros, zeros)).layer(0)
    assert torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.zeros_like(v))


def test_uint4_is_refused_for_an_odd_head_dim_with_what_works():
    from ragblend.core.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="even head_dim.*int8"):
        quantize_uint4(ChunkKV("0" * 64, [1], torch.zeros(1, 1, 1, 7), torch.zeros(1, 1, 1, 7)))
