"""Which optional extra a missing module belongs to, and the command that installs it.

Frameworks and the server are extras (pyproject.toml); a missing one should say what to run,
not surface as a bare ``ModuleNotFoundError``, and say it before a model loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import RagblendError

# Top-level module -> the extra that installs it.
EXTRAS = {
    "llama_index": "llamaindex", "chromadb": "llamaindex", "sentence_transformers": "llamaindex",
    "langchain_core": "langchain", "langchain_chroma": "langchain", "langchain": "langchain",
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve",
    "streamlit": "app",
}
# The modules whose presence says an extra is installed.
CORE_MODULES = {"llamaindex": ("llama_index",), "langchain": ("langchain_core",), "serve": ("fastapi", "uvicorn"),
                "app": ("streamlit",)}
WHAT = {"llamaindex": "LlamaIndex", "langchain": "LangChain", "serve": "the server (FastAPI and uvicorn)",
        "app": "the demo app (Streamlit)"}


class MissingExtraError(RagblendError, ImportError):
    """An optional dependency is not installed; the message gives the command that installs it."""


def source_checkout() -> Path | None:
    """The source checkout ragblend runs from (an editable install), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "ragblend").is_dir() else None


def install_command(extra: str) -> str:
    root = source_checkout()
    if root is not None:   # the package is not on PyPI under this name: install from the checkout
        return f"pip install -e '{root}[{extra}]'   (or `make install` in {root}, which installs every extra)"
    return f"pip install 'ragblend[{extra}]'"


def missing_extra(module: str | None, needed_for: str = "") -> MissingExtraError | None:
    """The error to raise for a missing ``module`` (a ModuleNotFoundError's ``name``), or None
    when it belongs to no extra (then the original error stands)."""
    top = (module or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    why = f" for {needed_for}" if needed_for else ""
    return MissingExtraError(f"{WHAT[extra]} is not installed ({top} is missing){why}. Install it: "
                             f"{install_command(extra)}")


def require(extra: str, needed_for: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` can be imported; checks
    without importing (cheap), so a command can fail before it loads a model."""
    for module in CORE_MODULES[extra]:
        if importlib.util.find_spec(module) is None:
            raise missing_extra(module, needed_for)
