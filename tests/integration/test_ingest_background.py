"""`ragblend ingest` with the real default model: searchable first then the cache fill, and an ingest in the
background while another process asks (the library's cases on a tiny model are in
tests/unit/test_ingest_background.py)."""

import contextlib
import os
import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")

from ragblend.cli import main  # noqa: E402

# ---------------------------------------------------------------------------- the CLI, default model


@pytest.mark.slow
def test_cli_ingest_searchable_first_then_cache_fill(tmp_path, capsys):
    from ragblend.data import sample_dir

    index = str(tmp_path / "index")
    assert main(["ingest", str(sample_dir()), "--index", index, "--kv", "skip"]) == 0
    out = capsys.readouterr().out
    assert "Ingested 6 new or changed file(s)" in out and "Indexed in" in out
    assert "Searchable now; KV for 0 of" in out and f"`ragblend cache fill --index {index}` computes the rest" in out
    assert main(["cache", "stats", "--index", index]) == 0
    assert "(0.0%)" in capsys.readouterr().out
    assert main(["cache", "fill", "--index", index]) == 0
    assert "Done: KV for" in capsys.readouterr().out
    assert main(["cache", "stats", "--index", index]) == 0
    out = capsys.readouterr().out
    assert "by dtype:    float16:" in out and "(100.0%), 0 to compute" in out
    assert main(["ingest", str(sample_dir()), "--index", index]) == 0   # nothing new, nothing to compute
    assert "Searchable now, KV for" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_ingest_in_the_background_while_another_process_asks(tmp_path, capsys):
    """`--kv background` returns once searchable; a `ragblend cache fill` process fills the KV
    while this process asks a question of the same index: one KV writer, nothing lost."""
    import re

    from ragblend.data import load_sample, sample_dir

    index = str(tmp_path / "index")
    assert main(["ingest", str(sample_dir()), "--index", index, "--kv", "background"]) == 0
    out = capsys.readouterr().out
    pid = int(re.search(r"in the background by process (\d+)", out).group(1))
    item = load_sample()["demo"][0]
    assert main(["ask", item["question"], "--index", index, "--max-new-tokens", "24", "--compare"]) == 0
    assert item["answer"] in capsys.readouterr().out   # as in test_llamaindex's CLI test: by either answer
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:   # reaped: it has ended
                break
        time.sleep(1)
    log = (tmp_path / "index" / "kv-fill.log").read_text()
    assert "Done: KV for" in log and "(100.0%)" in log, log
    assert main(["cache", "stats", "--index", index]) == 0
    assert "(100.0%), 0 to compute" in capsys.readouterr().out
