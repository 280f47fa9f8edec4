"""Sample texts written for ragblend: six ~500-token passages about the fictional coastal town
of Lowenmark, and a question answerable from one of them. Used by ``ragblend demo``, the
benchmarks and the tests."""

import json
from importlib import resources


def load_sample() -> dict:
    """``{"chunks": [...6 str...], "question": str, "answer": str}``."""
    return json.loads(resources.files(__name__).joinpath("lowenmark.json").read_text(encoding="utf-8"))
