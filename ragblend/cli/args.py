"""Argument types, the shared flags and the helpers every command uses."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ragblend.core import options as engine_options
from ragblend.core.errors import InvalidInputError


def open_index(args):
    """The command's index; its engine loaded as the command's engine flags say (--model...)."""
    from ragblend.integrations.local_index import LocalIndex

    print("Loading the model and the index...", file=sys.stderr, flush=True)
    return LocalIndex(args.index, chroma_url=args.chroma_url, collection=args.collection,
                      options=engine_options.from_args(args))


def check_model(args) -> None:
    """A --model that names no model fails now, not after seconds of reading files."""
    from ragblend.core.model.loading import local_model_path

    if getattr(args, "model", None) is not None:
        local_model_path(args.model)


def check_options(args) -> None:
    """Fail on bad options before spending seconds loading the model."""
    from ragblend.core.fusion.strategies import strategy_from_name

    strategy_from_name(getattr(args, "strategy", "default"), args.ratio)
    check_model(args)
    if getattr(args, "questions", 1) < 1:
        raise InvalidInputError(f"--questions must be at least 1, got {args.questions}.")


def index_option(args) -> str:
    """The options that name this command's index (and model) in a command it suggests: those
    the environment would not give the suggested command too."""
    import shlex

    options = ["--index", args.index] if args.index else []
    if getattr(args, "model", None):   # the KV of another model would be another's entries
        options += ["--model", args.model]
    if getattr(args, "dtype", None):   # another weights form keys its KV apart too
        options += ["--dtype", args.dtype]
    for name in ("kv_dtype", "disk_bytes"):   # another stored dtype is other entries; a smaller limit evicts
        if getattr(args, name, None) not in (None, engine_options.field_default(name)):
            options += ["--" + name.replace("_", "-"), getattr(args, name)]
    if args.chroma_url and args.chroma_url != os.environ.get("RAGBLEND_CHROMA_URL"):
        options += ["--chroma-url", args.chroma_url]
    if args.collection != env_collection():
        options += ["--collection", args.collection]
    return "".join(f" {shlex.quote(str(option))}" for option in options)


def ratio_value(text: str) -> float | str:
    """An argparse type: a number, or "auto" (CacheBlend's controller-chosen ratio)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'auto', got {text!r}") from None


def number_in(low: float, high: float, *, low_open: bool = False):
    """An argparse type: a number in [low, high] (``low_open``: (low, high])."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                                             f"got {text!r}")
        return value
    return parse


def whole_number_from(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value
    return parse


positive_int = whole_number_from(1)


positive_int = whole_number_from(1)
whole_number = whole_number_from(0)


# Engine options' flags come from ragblend.core.options (their type, default and choices declared
# once there); only the help of two is worded here, for a command line ('none', not False).
ENGINE_FLAG_HELP = {
    "model": "a .gguf file or a Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)",
    "kv_dir": "KV store folder (default: <user cache>/ragblend/kv; 'none': memory only)",
    "disk_bytes": "the KV store's disk tier, what later commands find: bytes or a size such as 40GiB. Saved with "
                  "the store: later commands without it keep that size (default: the saved size, 8GiB where none "
                  "was). A smaller one than the store holds evicts down to it when it stores KV, and says so",
    "memory_bytes": "the KV store's memory tier, which lasts this command only: bytes or a size such as 4GiB "
                    "(default: 2GiB)",
    "kv_dtype": "how chunk KV is stored: float16 (default), int8 (about half the bytes), uint4 (0.31x), float32, "
                "bfloat16; fidelity measured in docs/benchmarks.md ('Stored KV dtypes'). Give the same to every "
                "command on this index: KV stored in one dtype is not found by another",
    "dtype": "how the weights are held in memory: auto (default: a GGUF in float32 up to 4 GiB of it, else "
             "quantized; an HF dir as stored, bf16/fp16 staying 16-bit), float32, bfloat16, float16, or quantized "
             "(GGUF files only); see docs/models.md",
}


def add_engine_options(p: argparse.ArgumentParser, *names: str) -> None:
    engine_options.add_arguments(p, names, help=ENGINE_FLAG_HELP)


def load_engine(args, **overrides):
    """The engine the command's engine flags describe (``overrides`` over them)."""
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained(options=engine_options.from_args(args, **overrides))


def add_index(p, default="<user cache>/ragblend/index"):
    p.add_argument("--index", default=None, help=f"index folder (default: {default})")
    p.add_argument("--chroma-url", default=os.environ.get("RAGBLEND_CHROMA_URL") or None,
                   help="a Chroma server (e.g. http://127.0.0.1:8000 from `chroma run`) instead of the "
                        "Chroma database in the index folder; default: $RAGBLEND_CHROMA_URL")
    add_collection(p)


def env_collection() -> str:
    return os.environ.get("RAGBLEND_CHROMA_COLLECTION") or "ragblend"


def add_collection(p):
    p.add_argument("--collection", default=env_collection(),
                   help="the index's Chroma collection: give each index on one Chroma server its own "
                        "(default: $RAGBLEND_CHROMA_COLLECTION or ragblend)")


def add_answer_options(p):
    p.add_argument("--top-k", type=positive_int, default=4, help="chunks to retrieve (default: %(default)s)")
    p.add_argument("--ratio", type=ratio_value, default=None,
                   help="recompute ratio in (0, 1] (default: the model's calibrated one); "
                        "auto for ask --strategy cacheblend")
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="the most tokens an answer may have (default: %(default)s)")
