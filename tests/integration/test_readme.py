"""The README's code, run as written (its KV store in a temporary folder) on the real default model:
the Quickstart, the LlamaIndex and the LangChain snippets must each reuse their passages' KV."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_code(heading: str) -> str:
    """The first python block under ``heading``."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_readme_code(heading: str, kv_dir) -> dict:
    """Run that block with its engine's KV store in ``kv_dir``; its names after the run."""
    code = readme_code(heading)
    assert "BlendEngine.from_pretrained()" in code
    code = code.replace("BlendEngine.from_pretrained()", f"BlendEngine.from_pretrained(kv_dir={str(kv_dir)!r})")
    names: dict = {}
    exec(compile(code, str(README), "exec"), names)
    return names


def test_the_quickstart_runs_and_reuses_its_passages(tmp_path):
    out = run_readme_code("## Quickstart", tmp_path)["out"]
    assert out.text and not out.stats.fusion_skipped and out.stats.reused_tokens > 0
    assert out.stats.reused_tokens > out.stats.recomputed_tokens   # the passages outweigh the rest


def test_the_llamaindex_snippet_answers_from_the_precomputed_chunks(tmp_path):
    names = run_readme_code("## With LlamaIndex", tmp_path)
    stats = names["engine"].last_stats
    assert str(names["answer"]).strip() and not stats.fusion_skipped and stats.reused_tokens > 0
    assert stats.chunks_missing == 0   # every retrieved chunk's KV was precomputed at ingestion


def test_the_langchain_snippet_answers_from_the_precomputed_chunks(tmp_path):
    names = run_readme_code("## With LangChain", tmp_path)
    reply = names["reply"]
    assert reply.content.strip() and reply.usage_metadata["input_token_details"]["cache_read"] > 0
    stats = names["engine"].last_stats
    assert stats.reused_tokens > 0 and stats.chunks_missing == 0


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
