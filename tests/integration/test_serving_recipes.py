"""docs/serving.md's client recipes run as written against a real `ragblend serve` (the recipes' presence
and the CLI's top level are checked in tests/unit/test_serving_recipes.py)."""

import contextlib
import io

import pytest

from ..unit.test_serving_recipes import recipes


@pytest.mark.slow
def test_the_serving_recipes_run_as_written(tmp_path):
    pytest.importorskip("fastapi")
    from ragblend import BlendEngine
    from tests.servers import RunningServer

    engine = BlendEngine.from_pretrained(kv_dir=False)
    running = RunningServer(engine)
    try:
        namespace: dict = {}
        outputs = []
        for block in recipes():
            code = block.replace("http://127.0.0.1:8000", running.url)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, "docs/serving.md", "exec"), namespace)
            assert out.getvalue().strip() or "print(" not in code, code
            outputs.append(out.getvalue())
        passage_tokens = sum(engine.count_tokens(p) for p in namespace["passages"])
        # the openai recipe asks twice: the second answer reused the passages' KV
        first, second = [int(line.split()[-1]) for line in outputs[1].strip().splitlines()]
        assert first == 0 and second >= 0.8 * passage_tokens, outputs[1]
        assert namespace["llm"].last_stats.cache_hit_tokens >= 0.8 * passage_tokens   # BlendLLM, last
    finally:
        running.stop()


# ---------------------------------------------------------------------------- the CLI's top level
