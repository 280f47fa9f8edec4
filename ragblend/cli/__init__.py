"""Command line.

    ragblend ingest PATH...          add files or folders (text, markdown, CSV/JSON, HTML, PDF, DOCX) to the
                                     default index: searchable first, then KV (--kv now|background|skip;
                                     --rebuild: start the index over; --follow-links, --max-file-mb)
    ragblend ask "question"          answer from the index with BlendLLM (--compare: also full prefill)
    ragblend demo                    ingest the sample documents, ask the sample questions both ways
    ragblend calibrate               measure the model's cheapest safe recompute ratio, once
    ragblend app                     the Streamlit demo app (127.0.0.1 unless --host; --files-root DIR)
    ragblend info                    the host, and what the engine is (model, weights, kernels, KV, fusion)
    ragblend serve                   an OpenAI-compatible HTTP server over the model
    ragblend cache stats|fill|clear|verify

The default index (Chroma + KV store) lives under ``<user cache>/ragblend/index``; ``--index``
points elsewhere. Each command is a module of this package (``ingest.py``, ``ask.py``...);
``args.py`` holds the argument types and the flags several commands share.
"""

from __future__ import annotations

import argparse
import sys

from ragblend.core.errors import RagblendError

from . import app, ask, cache, calibrate, demo, info, ingest, serve

# What tests and scripts import from ragblend.cli, from when it was one module.
from .args import index_option as _index_option  # noqa: F401
from .args import number_in, positive_int, ratio_value, whole_number, whole_number_from  # noqa: F401
from .info import print_fusion_cost as _print_fusion_cost  # noqa: F401
from .info import print_stored_kv as _print_stored_kv  # noqa: F401
from .ingest import print_ingest_report as _print_ingest_report  # noqa: F401
from .serve import serve_keys as _serve_keys  # noqa: F401

# Each command is a module with ``add_parser(subparsers)`` and ``run(args) -> exit status``;
# `ragblend --help` lists them in this order.
COMMANDS = (ingest, ask, demo, calibrate, info, app, serve, cache)


def build_parser() -> argparse.ArgumentParser:
    from ragblend import __version__

    parser = argparse.ArgumentParser(prog="ragblend", description="Fast RAG on local models (CacheBlend).")
    parser.add_argument("--version", action="version", version=f"ragblend {__version__}")
    # Not required: `ragblend` alone prints this help, its commands listed (main).
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:   # `ragblend` alone: what it can do
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (RagblendError, ValueError) as err:
        print(f"ragblend: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:   # an optional extra (LlamaIndex, LangChain...) is not installed
        from ragblend.core.extras import missing_extra

        hint = missing_extra(err.name, f"ragblend {args.command}")
        if hint is None:
            raise
        print(f"ragblend: error: {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = (" What was ingested before is kept; run the same command again to go on." if args.func is ingest.run
                else "")   # (an interrupt in ingest's KV phase is reported by ingest itself)
        print(f"\nragblend: interrupted.{hint}", file=sys.stderr)
        return 130
