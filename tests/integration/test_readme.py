"""The README's Quickstart, run as written (its KV store in a temporary folder) on the real
default model: it must reuse its passages' KV, as the README says."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_code() -> str:
    section = README.read_text().split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quickstart_runs_and_reuses_its_passages(tmp_path):
    code = quickstart_code()
    assert "BlendEngine.from_pretrained()" in code
    code = code.replace("BlendEngine.from_pretrained()", f"BlendEngine.from_pretrained(kv_dir={str(tmp_path)!r})")
    names: dict = {}
    exec(compile(code, str(README), "exec"), names)
    out = names["out"]
    assert out.text and not out.stats.fusion_skipped and out.stats.reused_tokens > 0
    assert out.stats.reused_tokens > out.stats.recomputed_tokens   # the passages outweigh the rest


def test_the_quickstart_pages_api_tour_runs_as_written(tmp_path):
    """docs/quickstart.md's "Precompute, then ask" block, whole, on the real default model."""
    page = (README.parent / "docs" / "quickstart.md").read_text()
    code = re.search(r"```python\n(.*?)```", page.split("## Precompute, then ask", 1)[1], re.S).group(1)
    assert "BlendEngine.from_pretrained()" in code
    code = code.replace("BlendEngine.from_pretrained()", f"BlendEngine.from_pretrained(kv_dir={str(tmp_path)!r})")
    names: dict = {}
    exec(compile(code, "docs/quickstart.md", "exec"), names)
    refs, engine = names["refs"], names["engine"]
    assert all(ref.stored for ref in refs) and engine.key_of(names["chunk_texts"][0]) == refs[0].key
    assert engine.last_stats.reused_tokens > 0 and not engine.last_stats.fusion_skipped
