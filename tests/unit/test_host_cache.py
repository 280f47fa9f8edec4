"""Host measurements kept in the cache dir (core.model.host_cache), so that processes on one host
choose alike: what a drafted token costs, the decoding K/V dtype, low-bit or float32 weights."""

import json
import logging

import pytest

from ragblend.core.model import host_cache
from ragblend.core.model.host_cache import measured_twice, remembered

from ..conftest import make_tiny_engine

KEY = {"cpu": "test CPU", "threads": 2}


def valid(value):
    return isinstance(value, float) and 0 <= value <= 1


def host_load(monkeypatch, load: float) -> None:
    """This host's 1-minute load average, as the cache sees it (the tests' host is shared)."""
    monkeypatch.setattr(host_cache, "load_average", lambda: load)


def test_a_measurement_is_stored_once_and_read_by_later_calls(tmp_path, monkeypatch):
    host_load(monkeypatch, 0.0)
    calls = []

    def measure():
        calls.append(1)
        return 0.25, True

    assert remembered("row-cost", KEY, measure, valid, directory=tmp_path) == 0.25
    assert remembered("row-cost", KEY, measure, valid, directory=tmp_path) == 0.25 and len(calls) == 1
    # another key (host, threads, model) or another measurement: measured on its own
    assert remembered("row-cost", KEY | {"threads": 1}, measure, valid, directory=tmp_path) == 0.25
    assert remembered("other", KEY, measure, valid, directory=tmp_path) == 0.25 and len(calls) == 3
    # a disturbed measurement serves its caller and, on a quiet host, is measured again
    assert remembered("busy", KEY, lambda: (0.5, False), valid, directory=tmp_path) == 0.5
    assert remembered("busy", KEY, lambda: (0.1, True), valid, directory=tmp_path) == 0.1


def test_a_disturbed_measurement_is_kept_unsettled_and_measured_again_at_a_quiet_start(tmp_path, monkeypatch):
    """Issue 59: on a busy host every process measured again (tens of seconds each)."""
    host_load(monkeypatch, 9.0)
    calls = []

    def busy():
        calls.append(1)
        return 0.5, False

    assert remembered("busy", KEY, busy, valid, directory=tmp_path) == 0.5
    (path,) = tmp_path.glob("busy-*.json")
    record = json.loads(path.read_text())
    assert record["settled"] is False and record["load_average"] == 9.0 and record["measured_at"] > 0
    # later processes on the busy host use it as it is
    assert remembered("busy", KEY, busy, valid, directory=tmp_path) == 0.5 and len(calls) == 1
    host_load(monkeypatch, 0.2)   # quiet now: measured again; a measurement no sounder changes nothing
    assert remembered("busy", KEY, busy, valid, directory=tmp_path) == 0.5 and len(calls) == 2
    assert remembered("busy", KEY, lambda: (0.25, True), valid, directory=tmp_path) == 0.25
    assert json.loads(path.read_text())["settled"] is True
    assert remembered("busy", KEY, busy, valid, directory=tmp_path) == 0.25 and len(calls) == 2   # settled: read


@pytest.mark.parametrize("damage", ["garbage", "foreign", "out of range", "symlink", "other format"])
def test_a_bad_file_is_ignored_and_measured_again(tmp_path, damage, caplog):
    remembered("row-cost", KEY, lambda: (0.25, True), valid, directory=tmp_path)
    [path] = tmp_path.glob("row-cost-*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("[" * 100_000)
    elif damage == "foreign":
        path.write_text(json.dumps(data | {"key": KEY | {"cpu": "another CPU"}}))
    elif damage == "out of range":
        path.write_text(json.dumps(data | {"value": 7.0}))
    elif damage == "other format":
        path.write_text(json.dumps(data | {"version": 99}))
    else:
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps(data | {"value": 0.9}))
        path.unlink()
        path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="ragblend"):
        assert remembered("row-cost", KEY, lambda: (0.75, True), valid, directory=tmp_path) == 0.75
    assert "ignoring the host measurement" in caplog.text


def test_an_unwritable_cache_dir_leaves_the_choice_to_the_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert remembered("row-cost", KEY, lambda: (0.25, True), valid, directory=blocker / "host") == 0.25


def test_a_later_process_drafts_as_the_first_one_measured(tokenizer, tmp_path, monkeypatch):
    """An engine's draft row cost is read from the host cache where an earlier process stored it."""
    import ragblend.core.decode.answers as answers

    monkeypatch.setenv("RAGBLEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(answers, "_ROW_COSTS", {})
    # A fixed timing: a tiny model's four-row pass can time below its one-row pass, a disturbed
    # measurement that is (rightly) not kept.
    monkeypatch.setattr(answers, "fastest_rounds", lambda work: {"1": 0.010, "4": 0.013})
    first = make_tiny_engine("llama", tokenizer)
    [path] = (tmp_path / "host").glob("draft-row-cost-*.json")
    assert json.loads(path.read_text())["value"] == first.answers.draft_row_cost == pytest.approx(0.1)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"value": 0.123}))   # a marker no timing gives
    monkeypatch.setattr(answers, "_ROW_COSTS", {})   # a new process: nothing measured in it yet
    assert make_tiny_engine("llama", tokenizer).answers.draft_row_cost == 0.123


def test_processes_measuring_at_once_take_the_first_ones_value(tmp_path):
    """Another process stores its value while this one measures: this one takes that value."""
    def measure_while_another_writes():
        remembered("row-cost", KEY, lambda: (0.125, True), valid, directory=tmp_path)   # the other process
        return 0.375, True

    assert remembered("row-cost", KEY, measure_while_another_writes, valid, directory=tmp_path) == 0.125
    assert remembered("row-cost", KEY, lambda: (0.5, True), valid, directory=tmp_path) == 0.125
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_a_choice_two_timings_disagree_on_is_kept_unsettled(tmp_path, monkeypatch):
    """A verdict from a timing is taken twice; two that disagree (a near tie, a busy machine) give
    the conservative choice, the same in every process, kept as unsettled (measured again at a
    quiet start, as here)."""
    host_load(monkeypatch, 0.0)
    verdicts = iter([True, False, True, True])

    def faster():
        return measured_twice(lambda: next(verdicts), False)

    def boolean(value):
        return isinstance(value, bool)

    assert remembered("faster", KEY, faster, boolean, directory=tmp_path) is False   # the fallback
    (path,) = tmp_path.glob("faster-*.json")
    assert json.loads(path.read_text())["settled"] is False
    assert remembered("faster", KEY, faster, boolean, directory=tmp_path) is True
    assert remembered("faster", KEY, lambda: (False, True), boolean, directory=tmp_path) is True   # read, kept
