"""The user's path to `ragblend serve`: docs/serving.md's client recipes run as written against a
real server, and the CLI's top level (commands listed, --version, install hints before any model
loads)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipes() -> list[str]:
    """The code blocks docs/serving.md marks as recipes, in order."""
    text = (ROOT / "docs" / "serving.md").read_text()
    return re.findall(r"<!-- recipe -->\n```python\n(.*?)```", text, flags=re.S)


def test_the_docs_have_the_four_client_recipes():
    blocks = recipes()
    for client in ("from openai import OpenAI", "create_retrieval_chain", "is_chat_model=True", "BlendLLM(base_url="):
        assert any(client in b for b in blocks), client
    text = (ROOT / "docs" / "serving.md").read_text()
    assert "pip install 'ragblend[serve]'" not in text   # not on PyPI: the source-checkout command instead
    assert "pip install -e '.[serve]'" in text


# ---------------------------------------------------------------------------- the CLI's top level


def ragblend(*args: str, block: str | None = None) -> subprocess.CompletedProcess:
    """`ragblend ARGS` in a fresh interpreter; ``block`` makes that module impossible to import
    (as if its extra were not installed)."""
    setup = f"import sys; sys.modules[{block!r}] = None; " if block else "import sys; "
    code = setup + f"from ragblend.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_ragblend_alone_lists_its_commands_and_has_a_version():
    from ragblend import __version__

    alone = ragblend()
    assert alone.returncode == 0
    for command in ("ingest", "ask", "serve", "cache", "demo"):
        assert re.search(rf"^\s+{command}\s", alone.stdout, flags=re.M), command
    version = ragblend("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ragblend {__version__}"


def test_serve_without_its_extra_says_how_to_install_it_before_loading_a_model():
    result = ragblend("serve", "--model", "/nonexistent/model", block="uvicorn")
    assert result.returncode == 2
    assert "uvicorn is missing" in result.stderr and "[serve]" in result.stderr and "pip install" in result.stderr
    assert "Loading the model" not in result.stderr and "Traceback" not in result.stderr


def test_a_missing_framework_is_a_hint_not_a_module_not_found_error():
    code = ("import sys; sys.modules['llama_index'] = None\n"
            "import ragblend\n"
            "try:\n    ragblend.BlendLLM\n"
            "except ImportError as err:\n    print(type(err).__name__, err)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.stdout.startswith("MissingExtraError LlamaIndex is not installed") and "[llamaindex]" in result.stdout
    ask = ragblend("ask", "Which ferry?", block="llama_index")
    assert ask.returncode == 2 and "[llamaindex]" in ask.stderr and "Traceback" not in ask.stderr
