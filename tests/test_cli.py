"""`ragblend demo` end to end on the real default model."""

import pytest

from ragblend.cli import main

pytestmark = pytest.mark.slow


def test_demo_prints_both_answers_and_ttfts(capsys):
    assert main(["demo", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "[CacheBlend(ratio=0.15)] TTFT" in out and "[full prefill] TTFT" in out
    assert out.count("Sanderling") >= 2  # both answers name the ferry from passage 4
    assert "reused" in out and "recomputed" in out


def test_cli_reports_bad_input_as_an_error(capsys):
    assert main(["demo", "--ratio", "2", "--max-new-tokens", "4"]) == 2
    assert "ratio must be a number in (0, 1]" in capsys.readouterr().err
