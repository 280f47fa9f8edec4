"""docs/integrations.md's recipe for reading cache_read from a chain that returns a string
(LangChain's get_usage_metadata_callback), run on a tiny model: the counts it prints are the
engine's."""

import re
import warnings
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


def test_the_history_recipe_reuses_the_earlier_turns(tokenizer, monkeypatch, capsys):
    """docs/integrations.md's conversation recipe (MessagesPlaceholder): its second turn reuses the
    first turn's prompt and answer, and the cache_read it prints is the engine's."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    (code,) = re.findall(r"<!-- history recipe -->\n```python\n(.*?)```", text, flags=re.S)
    engine = make_tiny_engine("qwen2", tokenizer, history_pieces=True)
    # a first turn is kept by a background pass; run it at once so the second turn surely finds it
    monkeypatch.setattr(engine.runner.background, "submit", lambda fn, *args: fn(*args))
    assert code.count("BlendEngine.from_pretrained()") == 1
    names = {"TINY_ENGINE": engine}
    from langchain_core._api.deprecation import LangChainDeprecationWarning

    with warnings.catch_warnings():   # nothing deprecated (RunnableWithMessageHistory is, since langchain-core 1.3.3)
        warnings.simplefilter("error", LangChainDeprecationWarning)
        exec(compile(code.replace("BlendEngine.from_pretrained()", "TINY_ENGINE"), "docs/integrations.md", "exec"),
             names)
    first, second = capsys.readouterr().out.splitlines()[-2:]
    stats = engine.last_stats
    assert stats.prefix_tokens + stats.history_tokens > 0
    assert second.endswith(f"| {cached_tokens(stats)} of {stats.prompt_tokens} prompt tokens reused")
    assert int(second.split("|")[-1].split()[0]) > int(first.split("|")[-1].split()[0])
    assert [type(m).__name__ for m in names["history"]] == ["HumanMessage", "AIMessage"] * 2
