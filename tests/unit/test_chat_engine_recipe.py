"""docs/integrations.md's chat engine recipe (index.as_chat_engine with BlendLLM), run on a tiny
model in both chat modes it names: a real LlamaIndex chat engine whose later turns reuse the
earlier ones, and the counts it prints are the engine's."""

import re
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from ..conftest import make_tiny_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PRINTED = re.compile(r"\| (\d+) of (\d+) prompt tokens reused, (\d+) from earlier turns$", re.M)


def chat_engine_recipe() -> str:
    """The block docs/integrations.md marks as the chat engine recipe."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    (block,) = re.findall(r"<!-- chat engine recipe -->\n```python\n(.*?)```", text, flags=re.S)
    return block


@pytest.mark.parametrize("mode, engine_class", [("condense_plus_context", "CondensePlusContextChatEngine"),
                                                ("context", "ContextChatEngine")])
def test_the_chat_engine_recipe_reuses_the_earlier_turns(tokenizer, monkeypatch, capsys, mode, engine_class):
    from llama_index.core.embeddings import MockEmbedding

    # both ways of reusing earlier turns on, as in the engine the recipe loads
    engine = make_tiny_engine("qwen2", tokenizer, history_pieces=True, prefix_cache_bytes=64 << 20)
    # a first turn is kept by a background pass; run it at once so the next turn surely finds it
    monkeypatch.setattr(engine.runner.background, "submit", lambda fn, *args: fn(*args))
    code = chat_engine_recipe()
    # the tiny model and a stand-in embedding instead of the real ones; the chat mode as asked
    for real, stand_in in (("BlendEngine.from_pretrained()", "TINY_ENGINE"), ("default_embed_model()", "EMBEDDINGS"),
                           ('chat_mode="condense_plus_context"', f'chat_mode="{mode}"')):
        assert code.count(real) == 1
        code = code.replace(real, stand_in)
    names = {"TINY_ENGINE": engine, "EMBEDDINGS": MockEmbedding(embed_dim=8)}
    exec(compile(code, "docs/integrations.md", "exec"), names)

    assert type(names["chat_engine"]).__name__ == engine_class
    turns = [tuple(map(int, numbers)) for numbers in PRINTED.findall(capsys.readouterr().out)]
    assert len(turns) == 3
    first, *later = turns
    assert first[0] > 0 and first[2] == 0   # the retrieved chunks' KV, precomputed by KVPrecompute; no earlier turn
    assert all(earlier > 0 for _, _, earlier in later)   # turns 2 and 3 reuse the conversation so far
    stats = names["llm"].last_stats
    assert turns[-1] == (stats.cache_hit_tokens, stats.prompt_tokens, stats.prefix_tokens + stats.history_tokens)
    prompt = tokenizer.decode(engine.last_prompt.token_ids)
    assert prompt.count("<|im_start|>user\n") == 3 and "Hallow Holm" in prompt   # the conversation, as turns
