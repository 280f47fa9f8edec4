"""CPU kernels chosen by measurement (core.model.kernels) and 4-bit decoding (model.Int4Linear).

The choice is driven here by a fake timer, so these tests say what is chosen for given
timings, never how fast this machine is."""

import json
import logging
import os
import re

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kernels import compare_kernels
from ragblend.core.errors import InvalidInputError
from ragblend.core.model import kernels
from ragblend.core.model.kernels import BUCKETS, KERNELS, SHORT_PASS_ROWS, KernelPlan, plan_for
from ragblend.core.model.linear import INT4_GROUP, CpuLinear, Int4Linear, quantize_int4

from ..conftest import make_tiny_engine

NAME_OF = {fn: name for name, fn in KERNELS.items()}


def layers(n_layers=2):
    torch.manual_seed(0)
    return [[torch.nn.Linear(64, 96), torch.nn.Linear(96, 64, bias=False)] for _ in range(n_layers)]


def fake_timer(table, calls=None):
    """A timer returning ``table[kernel][rows]`` (default 1.0) instead of measuring."""
    def timer(kernel, inputs, layer_list):
        rows = next(iter(inputs.values())).shape[0]
        if calls is not None:
            calls.append((NAME_OF[kernel], rows))
        return table.get(NAME_OF[kernel], {}).get(rows, 1.0)
    return timer


def rows_of(bucket_name):
    return next(b.sample_rows for b in BUCKETS if b.name == bucket_name)


def test_the_fastest_kernel_is_chosen_per_bucket(tmp_path):
    table = {"column": {1: 0.5, 4: 0.97}, "onednn": {rows_of(">1024"): 0.6, rows_of("9-256"): 2.0}}
    plan = plan_for(layers(), directory=tmp_path, timer=fake_timer(table))
    chosen = {name: c.kernel for name, c in plan.choices.items()}
    assert chosen["1"] == "column"            # 2x faster
    assert chosen["2-8"] == "linear"          # 3% faster is within the noise: F.linear stays
    assert chosen["9-256"] == "linear"        # slower than F.linear: never chosen
    assert chosen[">1024"] == ("onednn" if "onednn" in KERNELS else "linear")
    assert plan.source == "measured"
    assert plan.kernel_for(1) == "column" and plan.kernel_for(8) == "linear" and plan.kernel_for(5000) == chosen[">1024"]


def test_a_later_process_reuses_the_choice_without_measuring(tmp_path):
    plan_for(layers(), directory=tmp_path, timer=fake_timer({"column": {1: 0.1}}))
    calls = []
    again = plan_for(layers(), directory=tmp_path, timer=fake_timer({}, calls))
    assert again.source == "cache" and calls == []
    assert again.choices["1"].kernel == "column"
    assert any("GFLOPS" in line for line in again.describe())


@pytest.mark.parametrize("damage", ["garbage", "nested", "other-host", "unknown-kernel", "negative-time", "symlink",
                                    "format"])
def test_a_corrupt_or_foreign_cache_is_measured_again(tmp_path, damage, caplog):
    plan_for(layers(), directory=tmp_path, timer=fake_timer({"column": {1: 0.1}}))
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "nested":   # under 1 MiB, but deeper than json's recursion allows
        path.write_text("[" * 200_000)
    elif damage == "other-host":   # copied from another machine under this file's name
        data["key"]["cpu"] = "Some Other CPU"
        path.write_text(json.dumps(data))
    elif damage == "unknown-kernel":
        data["choices"]["1"]["kernel"] = "os.system"
        path.write_text(json.dumps(data))
    elif damage == "negative-time":
        data["choices"]["1"]["seconds"]["column"] = -1
        path.write_text(json.dumps(data))
    elif damage == "format":
        data["version"] = 99
        path.write_text(json.dumps(data))
    else:
        elsewhere = tmp_path / "elsewhere.txt"
        elsewhere.write_text(json.dumps(data))
        path.unlink()
        os.symlink(elsewhere, path)
    calls = []
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        plan = plan_for(layers(), directory=tmp_path, timer=fake_timer({"onednn": {1: 0.1}, "column": {1: 0.9}}, calls))
    assert plan.source == "measured" and calls                       # measured again, not trusted
    assert plan.choices["1"].kernel == ("onednn" if "onednn" in KERNELS else "column")
    assert "ignoring the kernel cache" in caplog.text


def busy_timer(calls=None):
    """Rounds of 1 s but one in four of 5 s, as when someone else ran: a spread of 5x."""
    rounds = iter([1.0, 1.0, 1.0, 5.0] * 1000)

    def busy(kernel, inputs, layer_list):
        if calls is not None:
            calls.append(NAME_OF[kernel])
        return next(rounds)
    return busy


def test_a_measurement_disturbed_by_a_busy_machine_is_cached_with_its_spread(tmp_path):
    # Issue 59: such a measurement was not cached, so every process on a busy host measured again.
    plan = plan_for(layers(), directory=tmp_path, timer=busy_timer())
    assert plan.source == "measured" and len(list(tmp_path.glob("*.json"))) == 1
    assert {c.kernel for c in plan.choices.values()} == {"linear"}   # fastest rounds tie: F.linear stays
    assert plan.measured.spread == 5.0 and plan.measured.rounds == kernels.ROUNDS and not plan.measured.settled
    calls = []
    again = plan_for(layers(), directory=tmp_path, timer=fake_timer({}, calls))
    assert calls == [] and again.source == "cache" and again.measured == plan.measured   # used, not measured again
    assert "unsettled" in again.state() and "5.0x apart" in again.state()


def test_the_cache_key_names_host_threads_torch_and_shapes(monkeypatch):
    key = kernels.host_key([(96, 64)])
    assert {"cpu", "cpu_flags", "capability", "threads", "torch", "shapes", "kernels"} <= set(key)
    assert kernels.host_key([(96, 64)]) == key and kernels.host_key([(96, 65)]) != key
    # The same CPU with its libraries held to AVX2 code runs other kernels: its own choice.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernels.host_key([(96, 64)]) != key
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in kernels.cpu_summary()


def test_a_kernel_that_fails_while_measured_is_left_out(tmp_path, monkeypatch, caplog):
    def broken(x, weight, bias):
        raise RuntimeError("no such instruction")

    monkeypatch.setitem(KERNELS, "broken", broken)
    NAME_OF[broken] = "broken"
    with caplog.at_level(logging.INFO, logger="ragblend"):
        plan = plan_for(layers(), directory=tmp_path, timer=kernels.time_workload)
    assert all(c.kernel != "broken" and "broken" not in c.seconds for c in plan.choices.values())
    assert "does not run here" in caplog.text


def test_a_kernel_that_fails_at_run_time_falls_back_to_f_linear(monkeypatch, caplog):
    calls = []

    def flaky(x, weight, bias):
        calls.append(1)
        raise RuntimeError("illegal instruction")

    monkeypatch.setitem(KERNELS, "flaky", flaky)
    plan = KernelPlan.fixed("flaky")
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    with caplog.at_level(logging.WARNING, logger="ragblend"), torch.inference_mode():
        first, second = plan.run(x, linear.weight, linear.bias), plan.run(x, linear.weight, linear.bias)
    assert torch.allclose(first, F.linear(x, linear.weight, linear.bias)) and second.equal(first)
    assert len(calls) == 1 and caplog.text.count("failed") == 1   # one log line, then F.linear


def test_remeasure_ignores_the_cache(tmp_path):
    plan_for(layers(), directory=tmp_path, timer=fake_timer({"column": {1: 0.1}}))
    calls = []
    again = plan_for(layers(), directory=tmp_path, timer=fake_timer({}, calls), remeasure=True)
    assert calls and again.source == "measured" and again.choices["1"].kernel == "linear"
    assert plan_for(layers(), directory=tmp_path, timer=fake_timer({}, [])).choices["1"].kernel == "linear"


def test_ragblend_kernels_linear_turns_the_choice_off(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBLEND_KERNELS", "linear")
    calls = []
    plan = plan_for(layers(), directory=tmp_path, timer=fake_timer({"column": {1: 0.01}}, calls))
    assert calls == [] and {c.kernel for c in plan.choices.values()} == {"linear"}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_every_kernel_computes_the_linear_layer(kernel, rows, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        out = CpuLinear(linear, KernelPlan.fixed(kernel))(x[None])[0]
    assert out.shape == (rows, 96) and out.is_contiguous()
    assert (out - linear(x)).abs().max() <= 1e-5


def test_the_engine_measures_once_and_shares_the_plan(tokenizer):
    from ..conftest import make_tiny_engine

    a = make_tiny_engine("llama", tokenizer)
    b = make_tiny_engine("llama", tokenizer)
    assert a.kernel_plan is b.kernel_plan                                    # one measurement per process
    assert isinstance(a.adapter.hf_model.model.layers[0].mlp.up_proj, CpuLinear)
    assert a.adapter.hf_model.model.layers[0].mlp.up_proj.plan is a.kernel_plan


# ------------------------------------------------------------------------------ 4-bit weights


def q4_1_weight(out_features=96, in_features=64, seed=0):
    """A weight as a Q4_1 GGUF dequantizes to: per block of 32, ``d * q + m`` with q 0..15
    spanning the block (llama.cpp maps the block's min to 0 and max to 15), d and m float16."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // INT4_GROUP
    q = torch.randint(0, 16, (out_features, blocks, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, blocks, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(out_features, blocks, 1, generator=g) * 0.1).half().float()
    return (d * q + m).reshape(out_features, in_features), q.reshape(out_features, in_features)


def test_a_q4_1_weight_comes_back_as_its_own_blocks():
    weight, codes = q4_1_weight()
    found, scales, low = quantize_int4(weight)
    assert found.equal(codes.to(torch.int32))
    rebuilt = (scales[..., None] * found.reshape(96, 2, 32).float() + low[..., None]).reshape(96, 64)
    assert (rebuilt - weight).abs().max() < 1e-7


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
def test_int4_linear_is_close_to_the_float_layer(rows):
    weight, _ = q4_1_weight()
    linear = torch.nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(weight)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        layer = Int4Linear(linear)
        out, ref = layer(x), linear(x)
    assert layer.quantization_error < 1e-7 and out.dtype == torch.float32
    if rows > SHORT_PASS_ROWS:
        assert (out - ref).abs().max() < 1e-5      # prefill-sized passes keep the float32 weight
    else:
        assert ((out - ref).abs().max() / ref.abs().max()) < 2e-2   # bfloat16 activations


def test_an_unknown_decode_dtype_is_refused(tokenizer):
    from ..conftest import make_tiny_engine

    with pytest.raises(InvalidInputError, match="'int4'"):
        make_tiny_engine("llama", tokenizer, decode_dtype="int3")


def test_ragblend_info_prints_the_host_and_the_kernel_per_bucket(tmp_path, tokenizer, capsys):
    from ragblend.cli import main

    from ..conftest import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["info", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Host:" in out and "torch CPU capability" in out
    for bucket in BUCKETS:
        assert f"{bucket.name} rows:" in out
    assert "GFLOPS" in out and "4-bit decoding" in out
    assert re.search(r"a drafted token costs \d+% of a one-token pass", out)   # DraftPolicy's price, measured here
    assert main(["info", "--model", str(tmp_path), "--measure"]) == 0
    assert "measured just now" in capsys.readouterr().out


def test_int8_linear_rounds_each_row_to_8_bits_and_keeps_long_passes_float32():
    from ragblend.core.model.linear import Int8Linear, quantize_int8

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64)
    codes, scales = quantize_int8(linear.weight)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.equal(scales.to(torch.bfloat16).float(), scales)   # the kernel's bfloat16 scales are exact
    assert (codes.float() * scales[:, None] - linear.weight).abs().max() <= scales.max() / 2 + 1e-7
    eight = Int8Linear(linear)
    assert 0 < eight.quantization_error < 1 / 127
    with torch.no_grad():
        x = torch.randn(3, 96)
        assert torch.allclose(eight(x), linear(x), rtol=0, atol=0.02)        # a decoding pass: 8-bit
        long = torch.randn(40, 96)
        assert torch.allclose(eight(long), linear(long), atol=1e-5)         # a prefill: float32


def test_int8_head_gives_float32_logits_to_the_tokens_that_can_be_picked():
    from ragblend.core.model.linear import Int8Head

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1024, bias=False)
    eight = Int8Head(head)
    with torch.no_grad():
        x = torch.randn(3, 64)
        exact, logits = head(x), eight(x)
        best = exact.topk(8, dim=-1).indices
        assert torch.allclose(logits.gather(1, best), exact.gather(1, best), atol=1e-5)   # rescored in float32
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))
        assert (logits - exact).abs().max() > 1e-4   # the rest read 8-bit weights


def test_the_kernels_benchmark_times_the_plan_the_engine_runs(tokenizer, monkeypatch):
    """benchmarks.kernels once built CpuLinear without the engine's plan, so it timed F.linear
    against itself; its CpuLinear column must run the kernel the engine's plan picks."""
    engine = make_tiny_engine("llama", tokenizer)
    engine.kernel_plan = KernelPlan.fixed("column")
    calls = []
    column = KERNELS["column"]
    monkeypatch.setitem(kernels.KERNELS, "column", lambda *a: calls.append(1) or column(*a))
    table = compare_kernels(engine, runs=1, rows_to_time=(1, 4))
    rows = [line for line in table if re.match(r"\| [14] \|", line)]
    assert [row.split(" | ")[4] for row in rows] == ["column", "column"]
    assert calls, "CpuLinear did not run the plan's kernel"
