"""`ragblend ingest PATH...`: files or folders into the index, searchable first, then KV."""

from __future__ import annotations

import os
import sys

from ragblend.core.errors import InvalidInputError
from ragblend.core.options import field_default

from .args import add_engine_options, add_index, check_model, index_option, open_index


def run(args) -> int:
    from pathlib import Path

    from ragblend.core.extras import require
    from ragblend.integrations.local_index import SUPPORTED_SUFFIXES, ReadLimits, printable, read_text_files

    # Everything that can fail without the model fails before spending seconds loading it.
    require("llamaindex", "ragblend ingest")
    check_model(args)
    missing = [p for p in args.paths if not os.path.lexists(Path(p).expanduser())]
    if missing:
        raise InvalidInputError(f"no such file or folder: {', '.join(printable(p) for p in missing)}")
    if not args.max_file_mb > 0:
        raise InvalidInputError(f"--max-file-mb must be a number > 0, got {args.max_file_mb:g}.")
    limits = ReadLimits.parse(args.read_limit)
    documents, report = read_text_files(args.paths, follow_links=args.follow_links, max_file_mb=args.max_file_mb,
                                        read_limits=limits)
    if not documents:
        _print_skipped(report)
        print(f"Nothing to ingest in {', '.join(printable(p) for p in args.paths)}: ragblend ingests "
              f"{', '.join(sorted(SUPPORTED_SUFFIXES))} files, searching folders recursively.", file=sys.stderr)
        return 1
    with NewIndex(args) as new_index:   # a new index that ends up holding nothing is removed again
        rag = new_index.rag = open_index(args)
        rag.lock_wait_s, rag.read_limits = args.wait, limits
        # The projection is printed below in this command's flags; the library's own warning would say it twice.
        rag.engine.budget.warned.add("index")
        if args.rebuild:
            rag.rebuild()
            print(f"Emptied the index at {rag.path} (the KV store is kept); ingesting again.", file=sys.stderr)
        # First the chunks and their embeddings (searchable), then the KV (faster answers).
        report = rag.ingest_documents(documents, report, kv="skip")
        print_ingest_report(report, rag)
        if new_index.remove_if_empty():
            return 1
    print(rag.kv_projection(warn=False).describe(flags=True))
    return _ingest_kv(args, rag)


class NewIndex:
    """The index folder an ingest creates, removed again when the ingest leaves no chunk in it
    (it failed, was interrupted, or every document was dropped): otherwise the next `ragblend
    ask --index NEW` would find an empty index instead of saying there is none. Only what this
    command created goes: nothing of an index folder (or a Chroma server) that was there before.
    Set :attr:`rag` once the index is open."""

    def __init__(self, args):
        from ragblend.integrations.local_index import index_folder

        folder = index_folder(args.index).absolute()
        # The index folder if it is missing now, and the folders above it that are (`--index new/idx`
        # creates `new` too): those go only if empty then (the default index's cache folder may hold
        # a converted model by then).
        self.created = None if os.path.lexists(folder) or args.chroma_url else folder
        self.parents = [p for p in folder.parents if not os.path.lexists(p)]
        self.rag = None

    def __enter__(self) -> "NewIndex":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None:
            self.remove_if_empty()
        return False   # the error goes on to the CLI's handler

    def remove_if_empty(self) -> bool:
        """Remove the created folder if the index holds no chunk; True if it was removed."""
        import shutil

        if self.created is None or not os.path.isdir(self.created) or self._chunks():
            return False
        if self.rag is not None:   # Chroma keeps one client per folder in a process: let it go first
            try:
                self.rag.client.close()
            except Exception:   # the folder goes all the same; this process ends here
                pass
        shutil.rmtree(self.created, ignore_errors=True)
        for parent in self.parents:   # innermost first
            try:
                parent.rmdir()
            except OSError:   # not empty (or not there): kept
                break
        print(f"ragblend: no chunk was ingested; removed the index folder {self.created} this command had "
              "created.", file=sys.stderr)
        return True

    def _chunks(self) -> int:
        try:
            return 0 if self.rag is None else len(self.rag)
        except Exception:   # an index that cannot even count its chunks holds none this command can use
            return 0


def _ingest_kv(args, rag) -> int:
    """The KV phase of `ragblend ingest`, after the chunks are searchable."""
    from ragblend.integrations.kv_fill import KVFillBusyError

    coverage = rag.kv_coverage()
    fill = f"`ragblend cache fill{index_option(args)}`"
    if not coverage.to_compute:
        print(f"Searchable now, {coverage.describe()}.")
        return 0
    if args.kv == "skip":
        print(f"Searchable now; {coverage.describe()}: each question computes the KV of the chunks it uses (and "
              f"stores it), {fill} computes the rest.")
        return 0
    if args.kv == "background":
        pid, log_file = _spawn_fill(args, rag)
        print(f"Searchable now: `ragblend ask` answers already. The KV of {coverage.to_compute:,} chunk(s) is computed "
              f"in the background by process {pid} (log: {log_file}); `ragblend cache stats{index_option(args)}` "
              "shows the coverage.")
        return 0
    print(f"Searchable now: `ragblend ask` answers already (e.g. from another terminal). Computing the KV of "
          f"{coverage.to_compute:,} chunk(s) for faster answers; Ctrl-C stops safely, {fill} resumes.", flush=True)
    try:
        rag.kv.run(progress=True)
    except KVFillBusyError as err:
        print(f"ragblend: {err}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print(f"\nragblend: interrupted. The index is searchable; {rag.kv_coverage().describe()}. {fill} computes "
              "the rest.", file=sys.stderr)
        return 130
    print(f"Done: {rag.kv_coverage().describe()}.")
    return 0


def _spawn_fill(args, rag) -> tuple[int, str]:
    """Start `ragblend cache fill` for this index in its own session (so Ctrl-C here or
    closing the terminal does not stop it), logging to the index folder."""
    import subprocess

    command = [sys.executable, "-m", "ragblend.cli", "cache", "fill", "--index", str(rag.path)]
    if rag.chroma_url:
        command += ["--chroma-url", rag.chroma_url]
    command += ["--collection", rag.collection_name]
    if args.model:
        command += ["--model", args.model]
    if getattr(args, "dtype", None):
        command += ["--dtype", args.dtype]
    for name in ("kv_dtype", "disk_bytes"):   # the fill must store what this command's engine would
        if getattr(args, name) != field_default(name):
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    log_file = rag.path / "kv-fill.log"
    with open(log_file, "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)
    return process.pid, str(log_file)


def _print_skipped(report) -> None:
    from ragblend.integrations.local_index import printable

    for path, reason in report.skipped:   # names escaped: a file name must not write to the terminal
        print(f"skipped {printable(path)}: {printable(reason)}", file=sys.stderr)


def print_ingest_report(report, rag) -> None:
    _print_skipped(report)
    changed = len(report.files) - report.unchanged
    skipped = f"; {report.unchanged} file(s) already in the index unchanged were skipped" if report.unchanged else ""
    print(f"Ingested {changed} new or changed file(s) as {report.nodes} chunk(s){skipped}. "
          f"The index at {rag.path} holds {len(rag)} chunk(s).")
    if report.without_kv:
        print(f"{report.without_kv} chunk(s) got no stored KV: shorter than {rag.engine.min_chunk_tokens} tokens "
              "(too short to find in a prompt) or longer than the model's window. They are read as plain text.")
    if report.searchable_s:
        print(f"Indexed in {report.searchable_s:.1f} s.")


def add_parser(sub) -> None:
    ingest = sub.add_parser("ingest", help="add files or folders (text, markdown, CSV/JSON, HTML, PDF, DOCX) to "
                                           "the index")
    ingest.add_argument("paths", nargs="+", help="files or folders (searched recursively)")
    ingest.add_argument("--follow-links", action="store_true",
                        help="follow symbolic links that point outside the folders given (default: skip them)")
    ingest.add_argument("--max-file-mb", type=float, default=10.0,
                        help="skip files larger than this, with a message (default: 10)")
    ingest.add_argument("--read-limit", action="append", default=[], metavar="NAME=VALUE",
                        help="raise or lower what reading one file may cost; a file over a limit is skipped with "
                             "its reason (a PDF page over page_mb: that page only). NAME: expanded_mb (what a "
                             "DOCX's XML or a PDF's page contents expand to; default 64), page_mb (one PDF page's "
                             "content; 4), pages (2000), chars (16000000), seconds (60), memory_mb (1024). "
                             "Repeatable")
    ingest.add_argument("--rebuild", action="store_true",
                        help="empty the index first (its chunks and its docstore, e.g. a damaged one), then "
                             "ingest PATHS; the KV store is kept, so known chunks are not recomputed")
    ingest.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for another ingest into the same index to finish (default: 10)")
    ingest.add_argument("--kv", choices=["now", "background", "skip"], default="now",
                        help="when to compute the chunks' KV once they are searchable: now (default: with a "
                             "progress bar; Ctrl-C stops safely and `ragblend cache fill` resumes), background "
                             "(a `ragblend cache fill` process; this command returns at once) or skip (questions "
                             "compute the KV of the chunks they use)")
    add_engine_options(ingest, "model", "dtype", "kv_dtype", "disk_bytes", "memory_bytes")
    add_index(ingest)
    ingest.set_defaults(func=run)
