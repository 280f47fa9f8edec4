"""docs/integrations.md's recipe for reading cache_read from a chain that returns a string
(LangChain's get_usage_metadata_callback), run on a tiny model: the counts it prints are the
engine's."""

import re
from pathlib import Path

import pytest

pytest.importorskip("langchain_classic")

from ragblend.serving.protocol import cached_tokens  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def usage_recipe() -> str:
    """The block docs/integrations.md marks as the usage recipe."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    (block,) = re.findall(r"<!-- usage recipe -->\n```python\n(.*?)```", text, flags=re.S)
    return block


def test_the_usage_recipe_reports_the_engines_cache_read(tokenizer, capsys):
    from langchain_core.embeddings import DeterministicFakeEmbedding

    engine = make_tiny_engine("llama", tokenizer)
    code = usage_recipe()
    # the tiny model and a stand-in embedding instead of the real ones (tests/integration runs it as written)
    for real, stand_in in (("BlendEngine.from_pretrained()", "TINY_ENGINE"), ("MiniLMEmbeddings()", "EMBEDDINGS")):
        assert code.count(real) == 1
        code = code.replace(real, stand_in)
    names = {"TINY_ENGINE": engine, "EMBEDDINGS": DeterministicFakeEmbedding(size=16)}
    exec(compile(code, "docs/integrations.md", "exec"), names)
    (counts,) = names["usage"].usage_metadata.values()   # one model, one call
    assert counts["input_tokens"] == engine.last_stats.prompt_tokens
    assert counts["input_token_details"]["cache_read"] == cached_tokens(engine.last_stats) > 0
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.endswith(f"{counts['input_tokens']} prompt tokens, {cached_tokens(engine.last_stats)} of them "
                            "from the KV store")
