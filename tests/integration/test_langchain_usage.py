"""docs/integrations.md's usage recipe run as written (its KV store in a temporary folder) on the
real default model: a retrieval chain's cache_read, read with get_usage_metadata_callback."""

import pytest

pytest.importorskip("langchain_classic")

from ragblend.serving.protocol import cached_tokens  # noqa: E402

from ..unit.test_langchain_usage import usage_recipe  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_usage_recipe_runs_as_written_and_reads_cache_read(tmp_path):
    code = usage_recipe()
    assert code.count("BlendEngine.from_pretrained()") == 1
    code = code.replace("BlendEngine.from_pretrained()", f"BlendEngine.from_pretrained(kv_dir={str(tmp_path)!r})")
    names: dict = {}
    exec(compile(code, "docs/integrations.md", "exec"), names)
    engine, (counts,) = names["engine"], names["usage"].usage_metadata.values()
    assert names["result"]["answer"].strip()
    assert counts["input_token_details"]["cache_read"] == cached_tokens(engine.last_stats) > 0
    assert engine.last_stats.chunks_missing == 0   # the retrieved texts' KV was precomputed by add_texts
