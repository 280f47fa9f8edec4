"""Fusion against a full prefill as the CLI, the demo and the app show it: the ratio worded the
right way round (one function for all three), and `ragblend ask --compare` timing each path
only after an untimed warm-up on it. Real Chroma on disk, the real embedding model, a tiny
random LLM."""

import re

import pytest

from ragblend.core.results import Stats
from ragblend.integrations.compare import SpeedRatio, compare, compare_line, speed_ratio, warm_up_note

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def test_a_speed_up_is_worded_as_one():
    speed = speed_ratio(1.0, 2.1)
    assert speed.text == "fused 2.1x faster than full prefill" and speed.direction == "faster"
    assert speed.short == "2.1x faster"   # the app's metric, under "TTFT with fusion"
    # in the app's metric: the TTFT went down, which Streamlit's "inverse" colours green
    assert speed.ttft_change == "-1.10 s" and speed.metric_color == "inverse"


def test_a_slowdown_is_never_worded_or_coloured_as_a_gain():
    speed = speed_ratio(1.25, 1.0)   # the app's first answer before warm-ups: "0.8x faster", green
    assert speed.text == "fused 0.8x: slower than full prefill" and speed.direction == "slower"
    assert "faster" not in speed.text and speed.short == "0.8x: slower"
    # a plus: Streamlit draws an up arrow, red under "inverse"
    assert speed.ttft_change == "+0.25 s" and speed.metric_color == "inverse"


def test_the_direction_follows_the_ratio_as_printed():
    assert speed_ratio(1.0, 1.04).text == "fused 1.0x: as fast as full prefill"
    assert speed_ratio(1.0, 0.96).text == "fused 1.0x: as fast as full prefill"
    assert speed_ratio(1.0, 1.04).metric_color == "off"   # grey: neither a gain nor a loss
    assert speed_ratio(1.0, 1.06).text == "fused 1.1x faster than full prefill"
    assert speed_ratio(1.0, 0.94).text == "fused 0.9x: slower than full prefill"
    assert speed_ratio(1.0, 0.04).text == "fused 0.04x: slower than full prefill"   # not "0.0x"
    assert SpeedRatio.of(3.0).text == "fused 3.0x faster than full prefill"        # a median, no TTFTs


def test_no_ratio_without_two_positive_times():
    assert speed_ratio(0.0, 1.0) is None and speed_ratio(1.0, 0.0) is None
    assert compare(None, Stats(ttft_s=1.0)) is None


@given(st.floats(0.001, 1000.0), st.floats(0.001, 1000.0))
def test_the_wording_agrees_with_the_times(fused_s, full_s):
    speed = speed_ratio(fused_s, full_s)
    if speed.direction == "faster":
        assert fused_s < full_s and "faster" in speed.text and speed.ttft_change.startswith("-")
    elif speed.direction == "slower":
        assert fused_s > full_s and "slower" in speed.text and speed.ttft_change.startswith("+")
        assert "faster" not in speed.text + speed.short
    else:
        assert speed.shown == "1.0" and speed.metric_color == "off"


def test_the_compare_line_and_the_warm_up_note():
    assert compare_line(speed_ratio(0.5, 1.5)) == "=> fused 3.0x faster than full prefill (TTFT 0.50 s against 1.50 s)"
    assert warm_up_note({}) == ""
    note = warm_up_note({"default": Stats(ttft_s=14.2, chunks_computed=2), "full_recompute": Stats(ttft_s=25.6)})
    assert "fused 14.20 s, full prefill 25.60 s" in note and "2 chunk(s) the store lacked" in note


# ---------------------------------------------------------------------------- ragblend ask --compare


@pytest.fixture
def tiny_models(monkeypatch, tokenizer):
    """Every engine the CLI loads is a fresh tiny random one on its index's KV folder (a process
    of its own: nothing warmed); every prefill's stats are recorded, in order, by engine."""
    pytest.importorskip("llama_index.core")
    pytest.importorskip("chromadb")
    from ragblend import BlendEngine
    from ragblend.core.store.tiers import open_store

    from ..conftest import make_tiny_engine

    prefills = {}

    def tiny(cls, model=None, *, kv_dir=None, **keywords):
        engine = make_tiny_engine("llama", tokenizer)
        engine.store = open_store(kv_dir, engine.entry_spec)
        prefills[engine] = []
        return engine

    prefill = BlendEngine.prefill

    def recording(self, *args, **kwargs):
        pre = prefill(self, *args, **kwargs)
        prefills[self].append(pre.stats)
        return pre

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(tiny))
    monkeypatch.setattr(BlendEngine, "prefill", recording)
    return prefills


def test_ask_compare_times_each_path_after_an_untimed_warm_up(tiny_models, tmp_path, capsys):
    from ragblend.cli import main
    from ragblend.data import sample_dir

    index = str(tmp_path / "index")
    assert main(["ingest", str(sample_dir()), "--index", index]) == 0
    capsys.readouterr()
    assert main(["ask", "When did the kite festival begin?", "--compare", "--max-new-tokens", "4",
                 "--index", index]) == 0
    out = capsys.readouterr().out
    (engine, calls), = [(e, c) for e, c in tiny_models.items() if c]   # the ask's engine
    # one untimed prefill on each path, then the two timed ones: the timed fused answer is not
    # the process's first fused prefill, nor the timed full prefill its first full one
    assert [s.strategy for s in calls] == ["query_aware", "full_recompute", "query_aware", "full_recompute"]
    warm_fused, warm_full, fused, full = calls
    assert fused.chunks_reused > 0 and fused.chunks_computed == 0   # from the store, nothing computed now
    # the printed TTFTs are the timed calls', not the warm-ups'
    assert f"[default] TTFT {fused.ttft_s:.2f} s" in out and f"[full prefill] TTFT {full.ttft_s:.2f} s" in out
    assert f"fused {warm_fused.ttft_s:.2f} s, full prefill {warm_full.ttft_s:.2f} s." in out
    assert out.index("Warm-up, untimed") < out.index("[default] TTFT") < out.index("[full prefill] TTFT")
    expected = speed_ratio(fused.ttft_s, full.ttft_s).text   # worded from the timed calls' TTFTs
    assert f"=> {expected} (TTFT {fused.ttft_s:.2f} s against {full.ttft_s:.2f} s)" in out
    assert re.search(r"chunks from the KV store: (disk|memory) \d", out)   # the tiers it read from

    # without --compare: one prefill, no warm-up (its TTFT is what a process's first answer costs)
    assert main(["ask", "When did the kite festival begin?", "--max-new-tokens", "4", "--index", index]) == 0
    assert [len(calls) for calls in tiny_models.values() if calls] == [4, 1]
    assert "Warm-up" not in capsys.readouterr().out
