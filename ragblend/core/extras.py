"""Which optional extra a missing module belongs to, and the command that installs it.

Frameworks, the server, the app and the file readers are extras (pyproject.toml); a missing one
should say what to run, not surface as a bare ``ModuleNotFoundError``, and say it before a model
loads. ragblend is not published on PyPI, so installing ``ragblend[extra]`` from an index
would install nothing (or someone else's package): the command is the source checkout's
``pip install -e 'CHECKOUT[extra]'``, or, for a copy installed from a built wheel, the
extra's own packages by name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
from pathlib import Path

from .errors import RagblendError

# Top-level module -> the extra that installs it.
EXTRAS = {
    "llama_index": "llamaindex", "chromadb": "llamaindex", "sentence_transformers": "llamaindex",
    "langchain_core": "langchain", "langchain_chroma": "langchain", "langchain": "langchain",
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve",
    "streamlit": "app",
    "pypdf": "readers", "bs4": "readers",
}
# The modules whose presence says an extra is installed.
CORE_MODULES = {"llamaindex": ("llama_index", "chromadb"), "langchain": ("langchain_core",), "serve": ("fastapi", "uvicorn"),
                "app": ("streamlit",), "readers": ("pypdf", "bs4")}
WHAT = {"llamaindex": "LlamaIndex", "langchain": "LangChain", "serve": "the server (FastAPI and uvicorn)",
        "app": "the demo app (Streamlit)", "readers": "the PDF and HTML readers (pypdf, beautifulsoup4)"}


class MissingExtraError(RagblendError, ImportError):
    """An optional dependency is not installed; the message gives the command that installs it."""


def source_checkout() -> Path | None:
    """The source checkout ragblend runs from (an editable install), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "ragblend").is_dir() else None


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``extra`` adds (from the installed package's metadata), e.g.
    ``["pypdf>=5", "beautifulsoup4>=4.12"]``; [] when the metadata is not there."""
    try:
        requires = importlib.metadata.requires("ragblend") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""\s*;\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    return [marker.sub("", line) for line in requires if marker.search(line)]


def install_command(extra: str) -> str:
    """A pip command that installs ``extra`` and works: ragblend itself is not on PyPI."""
    root = source_checkout()
    if root is not None:   # an editable install: the checkout's extra
        return f"pip install -e '{root}[{extra}]'"
    packages = extra_requirements(extra)
    if packages:   # installed from a built wheel: the extra's packages themselves
        return "pip install " + " ".join(shlex.quote(p) for p in packages)
    return f"pip install -e '.[{extra}]' in ragblend's source checkout"


def missing_extra(module: str | None, needed_for: str = "") -> MissingExtraError | None:
    """The error to raise for a missing ``module`` (a ModuleNotFoundError's ``name``), or None
    when it belongs to no extra (then the original error stands)."""
    top = (module or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    why = f" for {needed_for}" if needed_for else ""
    root = source_checkout()
    every = f" (or `make install` in {root}, which installs every extra)" if root is not None else ""
    return MissingExtraError(f"{WHAT[extra]} is not installed ({top} is missing){why}. Install it: "
                             f"{install_command(extra)}{every}")


def require(extra: str, needed_for: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` can be imported; checks
    without importing (cheap), so a command can fail before it loads a model."""
    for module in CORE_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):   # an import hook refused it; a module object without a spec
            found = False
        if not found:
            raise missing_extra(module, needed_for)
