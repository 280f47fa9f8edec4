"""Sample documents written for ragblend: six ~500-token passages about the fictional coastal
town of Lowenmark (``lowenmark/*.md``), with questions a reader can check against them.
Used by ``ragblend demo``, the benchmarks and the tests."""

import json
from importlib import resources
from pathlib import Path


def sample_dir() -> Path:
    """Folder of the sample markdown documents (ingest it with ``ragblend ingest``)."""
    return Path(str(resources.files(__name__).joinpath("lowenmark")))


def load_sample() -> dict:
    """``{"chunks": [6 str], "question": str, "answer": str, "demo": [{"question", "answer"}...]}``:
    the documents' texts in file order, the benchmark question, and the demo questions."""
    folder = sample_dir()
    chunks = [p.read_text(encoding="utf-8").strip() for p in sorted(folder.glob("*.md"))]
    questions = json.loads((folder.parent / "lowenmark_questions.json").read_text(encoding="utf-8"))
    return {"chunks": chunks, **questions["benchmark"], "demo": questions["demo"]}
