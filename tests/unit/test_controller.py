"""core.fusion.controller: the loading controller measures compute and read speeds once (cached on
disk), and plans CacheBlend's 'auto' ratio and the cheapest tier from them."""

import json

import pytest
import torch

from ragblend import CacheBlend
from ragblend.core.fusion.controller import LoadingController, Measurements
from ragblend.core.store.tiers import DiskStore

from ..conftest import PASSAGES, SEGMENTS, make_tiny_engine


def test_controller_measures_caches_and_plans(tokenizer, tmp_path, monkeypatch):
    from ragblend.core.fusion.controller import LoadingController, Measurements

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = DiskStore(tmp_path / "kv", engine.entry_spec)
    plan = engine.loading.plan(3000, 2900)
    m = engine.loading.measurements()
    assert m.compute_s_per_token_layer > 0 and m.read_bytes_per_s["disk"] > 0
    assert m.bytes_per_token_layer == 2 * 2 * 16 * 2  # K+V, 2 kv heads, 16 dims, fp16
    assert engine.loading.cache_file.exists()
    again = LoadingController(engine.adapter, engine.entry_spec, engine.kv_dtype, tmp_path)
    assert again.measurements() == m  # read back from the cache file
    assert 0.15 <= plan.ratio <= 1.0 and plan.tier in ("disk", "memory")

    # A slow disk: it would delay the prompt, so memory is the cheapest tier without delay,
    # and with the KV on disk the ratio rises until recompute hides the load.
    engine.loading._measured = Measurements("cpu", 1e-5, 128, {"memory": 1e10, "disk": 2e7})
    slow = engine.loading.plan(3000, 2900)
    assert slow.tier == "memory"
    on_disk = engine.loading.plan(3000, 2900, tier="disk")
    assert on_disk.ratio > 0.15
    assert on_disk.recompute_s_per_layer == pytest.approx(on_disk.load_s_per_layer["disk"], rel=1e-3)
    fast = Measurements("cpu", 1e-5, 128, {"memory": 1e12, "disk": 1e11})
    engine.loading._measured = fast
    assert engine.loading.plan(3000, 2900).ratio == 0.15 and engine.loading.plan(3000, 2900).tier == "disk"


def test_cacheblend_auto_uses_the_controller(disk_engine):
    from ragblend.core.fusion.controller import Measurements

    engine = disk_engine
    engine.precompute(PASSAGES[:3])
    engine.loading._measured = Measurements("cpu", 1e-5, 128, {"memory": 1e10, "disk": 2e6})
    pre = engine.prefill(SEGMENTS, strategy=CacheBlend("auto"))
    reused = sum(s.end - s.start for s in pre.layout.chunk_spans)
    expected = engine.loading.plan(len(pre.token_ids), reused, "disk").ratio
    assert pre.stats.ratio == expected > 0.15
    assert pre.stats.recomputed_tokens >= int(expected * reused)


def test_the_plan_keeps_the_floor_without_reuse_and_never_passes_one(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    controller = LoadingController(engine.adapter, engine.entry_spec, torch.float16, tmp_path)
    controller._measured = Measurements("cpu", 1e-5, 128, {"memory": 1e10, "disk": 1e3})   # a very slow disk
    assert controller.plan(3000, 0).ratio == controller.quality_floor == 0.15     # nothing to hide
    assert controller.plan(3000, 2900, tier="disk").ratio == 1.0                  # recompute it all, no more
    assert controller.plan(3000, 2900).tier == "memory"


def test_an_unreadable_measurement_file_is_measured_again(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    engine = make_tiny_engine("llama", tokenizer)
    controller = LoadingController(engine.adapter, engine.entry_spec, torch.float16, tmp_path, probe_tokens=64)
    controller.cache_file.parent.mkdir(parents=True)
    controller.cache_file.write_text("{not json")
    m = controller.measurements()
    assert m.compute_s_per_token_layer > 0 and m.read_bytes_per_s["disk"] > 0
    assert json.loads(controller.cache_file.read_text())["device"] == "cpu"   # replaced with the new one


@pytest.mark.parametrize("damage", ["nested", "wrong-types", "zero-throughput", "no-tiers", "a-folder"])
def test_a_damaged_measurement_file_is_measured_again(tokenizer, tmp_path, monkeypatch, damage):
    """A cache file that parses but holds unusable numbers (or does not parse at all) is measured
    again: trusted, it crashed CacheBlend('auto') plans (a ZeroDivisionError, a TypeError)."""
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    engine = make_tiny_engine("llama", tokenizer)
    controller = LoadingController(engine.adapter, engine.entry_spec, torch.float16, tmp_path, probe_tokens=64)
    controller.cache_file.parent.mkdir(parents=True)
    good = {"device": "cpu", "compute_s_per_token_layer": 1e-5, "bytes_per_token_layer": 128.0,
            "read_bytes_per_s": {"memory": 1e10, "disk": 1e9}}
    if damage == "nested":
        controller.cache_file.write_text("[" * 200_000)
    elif damage == "a-folder":
        controller.cache_file.mkdir()
    else:
        bad = {"wrong-types": {"compute_s_per_token_layer": "fast"},
               "zero-throughput": {"read_bytes_per_s": {"memory": 0, "disk": 1e9}},
               "no-tiers": {"read_bytes_per_s": {}}}[damage]
        controller.cache_file.write_text(json.dumps({**good, **bad}))
    m = controller.measurements()
    assert m.compute_s_per_token_layer > 0 and m.read_bytes_per_s["disk"] > 0
    assert 0.15 <= controller.plan(3000, 2900).ratio <= 1.0


def test_measurements_hold_in_memory_when_the_cache_cannot_be_written(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path / "not-a-folder"))   # mkdir under it fails
    engine = make_tiny_engine("llama", tokenizer)
    controller = LoadingController(engine.adapter, engine.entry_spec, torch.float16, tmp_path, probe_tokens=64)
    assert controller.measurements().compute_s_per_token_layer > 0
    assert 0.15 <= controller.plan(3000, 2900).ratio <= 1.0
