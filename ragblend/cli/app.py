"""`ragblend app`: the Streamlit demo app."""

from __future__ import annotations

import os
import sys

from ragblend.core.errors import InvalidInputError
from ragblend.core.net import is_loopback

from .args import add_engine_options, add_index


def run(args) -> int:
    """Start the Streamlit demo app (apps/streamlit_app.py of the source checkout)."""
    import subprocess
    from pathlib import Path

    from ragblend.core.extras import require
    from ragblend.core.model.loading import local_model_path

    # Each a clear error now, not a traceback from inside Streamlit later.
    require("app", "ragblend app")
    require("llamaindex", "ragblend app")
    app = Path(__file__).resolve().parents[2] / "apps" / "streamlit_app.py"
    if not app.exists():
        print(f"ragblend: error: the app is not in this installation ({app}); run it from a source checkout.",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.model:   # the app reads its model from RAGBLEND_MODEL
        env["RAGBLEND_MODEL"] = str(local_model_path(args.model).resolve())
    elif env.get("RAGBLEND_MODEL"):
        local_model_path(env["RAGBLEND_MODEL"])
    if args.index:
        env["RAGBLEND_INDEX_DIR"] = args.index
    if args.chroma_url:
        env["RAGBLEND_CHROMA_URL"] = args.chroma_url
    env["RAGBLEND_CHROMA_COLLECTION"] = args.collection
    env.pop("RAGBLEND_FILES_ROOT", None)
    if args.files_root:
        root = Path(args.files_root).expanduser()
        if not root.is_dir():
            raise InvalidInputError(f"--files-root {args.files_root} is not a folder.")
        env["RAGBLEND_FILES_ROOT"] = str(root.resolve())
    if not is_loopback(args.host):
        print(f"ragblend: warning: the app listens on {args.host}:{args.port} without authentication: anyone who "
              "can reach it can upload documents, ask questions" + (f" and ingest files under {args.files_root}"
                                                                     if args.files_root else "")
              + ". Use --host 127.0.0.1 (the default) unless this network is trusted.", file=sys.stderr)
    command = [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", args.host,
               "--server.port", str(args.port), "--browser.gatherUsageStats", "false"]
    if os.name == "posix":   # become Streamlit: a SIGTERM (kill, a service manager) then stops the app itself
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, env)
    return subprocess.call(command, env=env)


def add_parser(sub) -> None:
    app = sub.add_parser("app", help="start the Streamlit demo app (its model: --model, else $RAGBLEND_MODEL, "
                                     "else the embedded SmolLM2)")
    app.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only; the app has no login)")
    app.add_argument("--port", type=int, default=8501)
    app.add_argument("--files-root", default=os.environ.get("RAGBLEND_FILES_ROOT") or None,
                     help="let the app's path box ingest files and folders under this folder (default: "
                          "$RAGBLEND_FILES_ROOT; unset: the box is off and only uploads are ingested)")
    add_engine_options(app, "model")
    add_index(app, default="<user cache>/ragblend/app-index")
    app.set_defaults(func=run)
