"""Command line.

    ragblend ingest PATH...          add files or folders (text, markdown, CSV/JSON, HTML, PDF, DOCX) to the
                                     default index: searchable first, then KV (--kv now|background|skip;
                                     --rebuild: start the index over; --follow-links, --max-file-mb)
    ragblend ask "question"          answer from the index with BlendLLM (--compare: also full prefill)
    ragblend demo                    ingest the sample documents, ask the sample questions both ways
    ragblend calibrate               measure the model's cheapest safe recompute ratio, once
    ragblend app                     the Streamlit demo app (127.0.0.1 unless --host; --files-root DIR)
    ragblend cache stats|fill|clear|verify

The default index (Chroma + KV store) lives under ``<user cache>/ragblend/index``; ``--index``
points elsewhere.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ragblend.core import options as engine_options
from ragblend.core.errors import InvalidInputError, RagblendError, StoreUnavailableError
from ragblend.core.net import is_loopback
from ragblend.core.strategies import STRATEGY_NAMES


def _open_index(args):
    """The command's index; its engine loaded as the command's engine flags say (--model...)."""
    from ragblend.integrations.local_index import LocalIndex

    print("Loading the model and the index...", file=sys.stderr, flush=True)
    return LocalIndex(args.index, chroma_url=args.chroma_url, collection=args.collection,
                      options=engine_options.from_args(args))


def _check_model(args) -> None:
    """A --model that names no model fails now, not after seconds of reading files."""
    from ragblend.core.model import local_model_path

    if getattr(args, "model", None) is not None:
        local_model_path(args.model)


def _ingest(args) -> int:
    from pathlib import Path

    from ragblend.core.extras import require
    from ragblend.integrations.local_index import SUPPORTED_SUFFIXES, ReadLimits, printable, read_text_files

    # Everything that can fail without the model fails before spending seconds loading it.
    require("llamaindex", "ragblend ingest")
    _check_model(args)
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
    rag = _open_index(args)
    rag.lock_wait_s, rag.read_limits = args.wait, limits
    if args.rebuild:
        rag.rebuild()
        print(f"Emptied the index at {rag.path} (the KV store is kept); ingesting again.", file=sys.stderr)
    # First the chunks and their embeddings (searchable), then the KV (faster answers).
    report = rag.ingest_documents(documents, report, kv="skip")
    _print_ingest_report(report, rag)
    print(rag.kv_projection(warn=False).describe())
    return _ingest_kv(args, rag)


def _ingest_kv(args, rag) -> int:
    """The KV phase of `ragblend ingest`, after the chunks are searchable."""
    from ragblend.integrations.kv_fill import KVFillBusyError

    coverage = rag.kv_coverage()
    fill = f"`ragblend cache fill{_index_option(args)}`"
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
              f"in the background by process {pid} (log: {log_file}); `ragblend cache stats{_index_option(args)}` "
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


def _index_option(args) -> str:
    """The options that name this command's index (and model) in a command it suggests: those
    the environment would not give the suggested command too."""
    import shlex

    options = ["--index", args.index] if args.index else []
    if getattr(args, "model", None):   # the KV of another model would be another's entries
        options += ["--model", args.model]
    if getattr(args, "dtype", None):   # another weights form keys its KV apart too
        options += ["--dtype", args.dtype]
    if args.chroma_url and args.chroma_url != os.environ.get("RAGBLEND_CHROMA_URL"):
        options += ["--chroma-url", args.chroma_url]
    if args.collection != _env_collection():
        options += ["--collection", args.collection]
    return "".join(f" {shlex.quote(str(option))}" for option in options)


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
    log_file = rag.path / "kv-fill.log"
    with open(log_file, "ab") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)
    return process.pid, str(log_file)


def _print_skipped(report) -> None:
    from ragblend.integrations.local_index import printable

    for path, reason in report.skipped:   # names escaped: a file name must not write to the terminal
        print(f"skipped {printable(path)}: {printable(reason)}", file=sys.stderr)


def _print_ingest_report(report, rag) -> None:
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


def _print_answer(label: str, answer) -> None:
    s = answer.stats
    if s is None:
        print(f"[{label}] {answer.text}\n  (no chunk was retrieved, so the model was not called)")
        return
    strategy = s.strategy if s.ratio is None else f"{s.strategy} {s.ratio:g}"   # what ran, not what was asked
    # chunks missing from the store are computed alone now (and stored): their tokens are neither
    # reused from the store nor recomputed in the prompt, so the line names them
    computed = f", {s.chunks_computed} computed now and stored" if s.chunks_computed else ""
    # which tier the reused chunks came from: a process reads a chunk from disk once, then from memory
    tiers = ": " + ", ".join(f"{tier} {n}" for tier, n in sorted(s.tiers.items())) if s.tiers else ""
    print(f"[{label}] TTFT {s.ttft_s:.2f} s | {strategy} | {s.prompt_tokens} prompt tokens: {s.reused_tokens} "
          f"reused, {s.recomputed_tokens} recomputed ({s.chunks_reused} chunk{'' if s.chunks_reused == 1 else 's'} "
          f"from the KV store{tiers}{computed})")
    if s.fusion_skipped:   # say why nothing was reused
        print("  (a full prefill: too few of the prompt's tokens are in cached chunks for fusion to save work; "
              "stats.strategy_reason says more)")
    print(f"  {answer.text}\n")


def _check_options(args) -> None:
    """Fail on bad options before spending seconds loading the model."""
    from ragblend.integrations.common import make_strategy

    make_strategy(getattr(args, "strategy", "default"), args.ratio)
    _check_model(args)
    if getattr(args, "questions", 1) < 1:
        raise InvalidInputError(f"--questions must be at least 1, got {args.questions}.")


def _ask(args) -> int:
    from ragblend.core.prompt import check_text

    _check_options(args)
    try:
        check_text(args.question, "the question")
    except InvalidInputError:
        raise InvalidInputError("the question is not valid UTF-8 text; set your terminal to UTF-8 (e.g. "
                                "LANG=C.UTF-8) or pass the question in UTF-8.") from None
    if not args.question.strip():   # LocalIndex.ask says the same, but only once the model has loaded
        raise InvalidInputError("Ask a non-empty question.")
    from ragblend.core.extras import require

    require("llamaindex", "ragblend ask")   # a missing extra says so before a missing index does
    if not args.chroma_url:
        from ragblend.integrations.local_index import index_folder

        index = index_folder(args.index)
        if not index.is_dir():
            where = f" --index {args.index}" if args.index else ""
            raise InvalidInputError(f"There is no index at {index}; make one first with "
                                    f"`ragblend ingest <files or folders>{where}`.")
    rag = _open_index(args)   # --model, --decode-dtype
    options = dict(mode=args.mode, top_k=args.top_k, max_new_tokens=args.max_new_tokens, ratio=args.ratio)
    if not args.compare:
        _print_answer(args.strategy, rag.ask(args.question, strategy=args.strategy, **options))
        return 0
    _compare(rag, args.question, args.strategy, args.strategy, **options)
    return 0


def _compare(rag, question: str, label: str, strategy: str, *, ratio=None, **options) -> float | None:
    """Answer ``question`` with ``strategy`` and with a full prefill, each path warmed up first
    (untimed, see ragblend.integrations.compare), and print both and how they compare; returns
    full prefill's TTFT over the fused one (None when either answer had no model call)."""
    from ragblend.integrations.compare import FULL_PREFILL, compare, compare_line, warm_up, warm_up_note

    note = warm_up_note(warm_up(rag, question, (strategy, FULL_PREFILL), ratio=ratio, **options))
    if note:
        print(note + "\n")
    fused = rag.ask(question, strategy=strategy, ratio=ratio, **options)
    _print_answer(label, fused)
    full = rag.ask(question, strategy=FULL_PREFILL, ratio=None, **options)   # --ratio is not a full prefill's
    _print_answer("full prefill", full)
    speed = compare(fused.stats, full.stats)
    if speed is not None:
        print(compare_line(speed) + "\n")
    return speed.ratio if speed is not None else None


def _demo(args) -> int:
    from ragblend.core.extras import require
    from ragblend.core.model import cache_dir
    from ragblend.data import load_sample, sample_dir
    from ragblend.integrations.compare import FULL_PREFILL, SpeedRatio, warm_up, warm_up_note

    require("llamaindex", "ragblend demo")
    _check_options(args)
    from ragblend.integrations.local_index import LocalIndex

    # ragblend's own cache, not a fixed name in a shared /tmp that another user could create first
    folder = args.index or str(cache_dir() / "demo-index")
    model = "the default model" if args.model is None else args.model
    print(f"Loading {model} and the index in {folder}...", flush=True)
    rag = LocalIndex(folder, options=engine_options.from_args(args))
    report = rag.ingest([sample_dir()])
    print(f"Ingested {len(report.files)} sample documents from {sample_dir()} "
          f"({len(rag)} chunks in the index, KV precomputed for each).\n")
    questions = load_sample()["demo"]
    # Both paths are warmed up before the first timed answer (ragblend.integrations.compare), on
    # a sample question the demo does not time where there is one, so that the timed answers
    # read their chunks' KV as a new question does (the chunks they share with it excepted: each
    # answer's line names the tiers).
    spare = questions[args.questions:] or questions
    note = warm_up_note(warm_up(rag, spare[-1]["question"], ("default", FULL_PREFILL), ratio=args.ratio,
                                top_k=args.top_k))
    if note:
        print(note + "\n")
    ratios = []
    for item in questions[: args.questions]:
        print(f"Q: {item['question']}   (the documents say: {item['answer']})")
        ratio = _compare(rag, item["question"], "BlendLLM", "default", ratio=args.ratio, top_k=args.top_k,
                         max_new_tokens=args.max_new_tokens)
        if ratio is not None:
            ratios.append(ratio)
    if len(ratios) > 1:
        from statistics import median

        shown = SpeedRatio.of(median(ratios))   # worded like each question's
        print(f"Over {len(ratios)} questions, median: {shown.text} (each path warmed up first, untimed).")
    return 0


def _store_folder(args):
    from pathlib import Path

    from ragblend.integrations.local_index import index_folder

    # The KV that `ragblend ingest/ask` use lives in the index folder.
    folder = Path(args.kv_dir).expanduser() if args.kv_dir else index_folder(args.index) / "kv"
    if folder.exists() and not folder.is_dir():
        raise InvalidInputError(f"{folder} is a file, not a KV store folder; pass the folder given as kv_dir "
                                "(or an index folder with --index).")
    return folder


def _disk_store(args, spec=None):
    from ragblend.core.store import DiskStore, EntrySpec, NotAStoreError, store_faults

    folder = _store_folder(args)
    try:
        return DiskStore(folder, spec or EntrySpec("", 0, 0, 0))
    except NotAStoreError:
        raise   # its message says what to do; nothing in the folder was touched
    except store_faults() as err:
        if _is_broken_database(err):
            advice = f"`ragblend cache clear --kv-dir {folder}` removes the broken store"
        else:
            advice = "try again once the folder is writable and no other process holds the store"
        raise StoreUnavailableError(f"the KV store in {folder} cannot be opened ({type(err).__name__}: {err}). "
                                    f"Engines still answer (they keep KV in memory); {advice}.") from err


def _is_broken_database(err: BaseException) -> bool:
    """A database that is garbage or malformed, as opposed to locked, read-only or missing."""
    import sqlite3

    return isinstance(err, sqlite3.DatabaseError) and not isinstance(err, sqlite3.OperationalError)


def _cache(args) -> int:
    from ragblend.core.store import check_store_folder

    if args.action == "fill":   # opens (or creates) the index's store like ingest does
        return _fill(args)
    folder = _store_folder(args)
    if not (folder / "cache.db").exists():   # look, never create
        print(f"No KV store at {folder}: nothing has been stored there yet.")
        return 0
    # Only a folder that is a ragblend store is read or changed (--kv-dir may be any folder).
    check_store_folder(folder, create=False)
    if args.action == "stats":
        return _cache_stats(args)
    if args.action == "clear":
        return _clear(args)
    # verify: needs the model to know which fingerprint and shape entries must have
    engine = _load_engine(args, kv_dir=False)   # (args.kv_dir is the store verified, not the engine's)
    store = _disk_store(args, engine.entry_spec)
    bad, checked = {}, 0
    for key in store.keys():
        checked += 1
        reason = store.verify(key)
        if reason is not None:
            bad[key] = reason
    for key, reason in bad.items():
        print(f"  {key[:16]}...  {reason}")
        if args.fix:
            store.delete(key)
    print(f"{checked} entries checked: {checked - len(bad)} sound, {len(bad)} failing"
          + (" (removed)" if args.fix and bad else ""))
    return 1 if bad and not args.fix else 0


def _cache_stats(args) -> int:
    """`ragblend cache stats`: the store's entries (by dtype), hit rate, the index's coverage and projected KV."""
    store = _disk_store(args)
    disk = store.stats()["disk"]
    lookups = disk["hits"] + disk["misses"]
    rate = f"{disk['hits'] / lookups:.1%}" if lookups else "n/a"
    print(f"KV store: {disk['directory']}")
    print(f"  disk tier:   {disk['entries']} entries, {disk['bytes'] / 2**20:.1f} MiB "
          f"(limit {disk['max_bytes'] / 2**30:.1f} GiB), hit rate {rate} ({disk['hits']} hits, {disk['misses']} misses)")
    by_dtype = store.entries_by_dtype()
    if by_dtype:
        print("  by dtype:    " + "; ".join(f"{dtype}: {row['entries']} entries, {row['bytes'] / 2**20:.1f} MiB"
                                          for dtype, row in sorted(by_dtype.items())))
    if disk["faults"]:
        print(f"  faults:      {disk['faults']} while reading these statistics (see the warning above)")
    print("  memory tier: lives inside each process (see engine.store.stats())")
    coverage = _index_coverage(args, store)
    projection = _stored_projection(coverage, by_dtype, disk["max_bytes"])
    if projection is not None:
        print(f"  projected:   {projection.describe()}")
    if coverage is not None:
        # Without the model the lead entries' keys are unknown: a chunk counts by its own entry.
        fill = f"`ragblend cache fill{_index_option(args)}`"
        hint = (f" ({fill} computes them)" if coverage.pending else
                f" (each chunk's own entry; {fill} also adds any lead entries missing)")
        print(f"  index:       {coverage.describe()}{hint}")
    return 0


def _stored_projection(coverage, by_dtype: dict, budget: int):
    """The projected KV of the whole index from what its stored chunks weigh (no model loaded:
    the bytes of the store's entries over the index's chunks that have theirs); None without an
    index or before any chunk of it is stored."""
    from ragblend.core.kv_budget import Projection

    if coverage is None or not coverage.stored:
        return None
    stored = sum(row["bytes"] for row in by_dtype.values())
    per_chunk = stored / coverage.stored
    dtype = next(iter(by_dtype)) if len(by_dtype) == 1 else ""
    return Projection(coverage.keyed, round(per_chunk * coverage.keyed), budget, dtype,
                      f"{per_chunk / 2**20:.2f} MiB a chunk, as the {coverage.stored:,} stored weigh")


def _index_coverage(args, store):
    """How much of the index's chunks' KV ``store`` holds; None without an index (e.g. --kv-dir
    alone) or when its Chroma database holds no ragblend collection. Needs no model."""
    from ragblend.integrations.kv_fill import coverage_of
    from ragblend.integrations.local_index import chroma_client, index_folder

    if args.kv_dir is not None:
        return None
    folder = index_folder(args.index)
    if args.chroma_url is None and not (folder / "chroma").is_dir():
        return None
    try:
        collection = chroma_client(folder, args.chroma_url).get_collection(args.collection)
    except Exception:   # no such collection (chromadb raises its own NotFoundError or ValueError)
        return None
    return coverage_of(collection, store.keys())


def _fill(args) -> int:
    """`ragblend cache fill`: compute the KV of the index's chunks that have none, and the lead
    entries of those that have only their own (as far as the store has room)."""
    from ragblend.core.extras import require
    from ragblend.integrations.kv_fill import KVFillBusyError

    if args.kv_dir is not None:
        raise InvalidInputError("cache fill works on an index (--index FOLDER), whose KV store is its kv folder; "
                                "--kv-dir does not apply.")
    require("llamaindex", "ragblend cache fill")
    _check_model(args)
    rag = _open_index(args)
    before = rag.kv_coverage()
    print(f"Index at {rag.path}: {before.describe()}.", flush=True)
    if not before.to_compute:
        return 0
    try:
        rag.kv.run(progress=sys.stderr.isatty())
    except KVFillBusyError as err:
        print(f"ragblend: {err}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print(f"\nragblend: interrupted; {rag.kv_coverage().describe()}. Run it again to go on.", file=sys.stderr)
        return 130
    print(f"Done: {rag.kv_coverage().describe()}.")
    return 0


def _clear(args) -> int:
    """Empty the store; a store too broken to open has its own files removed instead."""
    from ragblend.core.store import DiskStore

    folder = _store_folder(args)
    try:
        store = _disk_store(args)
    except StoreUnavailableError as err:
        if not _is_broken_database(err.__cause__):
            raise   # locked by another process or read-only: its files are not ours to remove now
        print(f"ragblend: {err}", file=sys.stderr)
        removed = DiskStore.remove_files(folder)
        print(f"Removed the broken store's database and {removed} entry file(s).")
        return 0
    print(f"Removed {store.clear()} entries.")
    return 0


def _selection(row: dict) -> str:
    """A calibration row's selection, for its table (rows of older files have fewer keys)."""
    if row.get("sentence_runs"):
        return "sentences"
    window = row.get("neighbour_window", 0.0)
    return f"runs of {window:.4g} chunk" if window else "single tokens"


def _calibrate(args) -> int:
    from ragblend.core.calibration import check_answer_options

    check_answer_options(args.answer_tokens, args.answer_margin)   # before minutes of loading and measuring
    engine = _load_engine(args, kv_dir=False)
    print(f"Calibrating {engine.name} on the built-in prompts (once per model; 5-20 minutes on a 2-core CPU)...",
          flush=True)
    result = engine.calibrate(progress=True, neighbour_window=args.neighbour_window,
                              sentence_runs=True if args.sentence_runs else None, answer_tokens=args.answer_tokens,
                              answer_margin=args.answer_margin)
    answers = result.order_noise_answer_kl is not None
    # the largest one-step KL over the answer: in files written before it was measured, absent
    peaks = answers and result.order_noise_answer_kl_peak is not None

    def cells(pairs) -> str:   # (mean, median) pairs
        return "".join(f" {mean:.4f} | {median:.4f} |" for mean, median in pairs)

    extra = ("answer_kl",) * answers + ("answer_kl_peak",) * peaks
    measures = ("kl", *extra)
    print("| QueryAware ratio | selection | compute | KL mean | KL median |" +
          (" answer KL mean | answer KL median |" if answers else "") +
          (" largest step KL mean | largest step KL median |" if peaks else "") +
          "\n|---:|---:|---:|---:|---:|" + "---:|---:|" * len(extra))
    for row in result.tried:
        print(f"| {row['ratio']:.2f} | {_selection(row)} | {row['compute']:.1%} |" +
              cells((row[f"{name}_mean"], row[f"{name}_median"]) for name in measures))
    noise = {"kl": result.order_noise_kl, "answer_kl": result.order_noise_answer_kl,
             "answer_kl_peak": result.order_noise_answer_kl_peak}
    print("| order noise | | 100% |" + cells(noise[name] for name in measures))
    print(f"Chosen: {result.reason}.")
    if result.source:
        print(f"Engines of this model use it from now on. Delete {result.source} to go back to the calibration "
              "shipped with ragblend (SmolLM2's, Qwen2.5-Coder-0.5B's, Gemma 3 270M's) or, for other models, "
              "QueryAware(0.3).")
    return 0


def _print_stored_kv(engine) -> None:
    """`ragblend info`: what the engine stores a token of KV in, its weight, and why that dtype."""
    from ragblend.core.kv_budget import CHUNK_TOKENS, DEFAULT_KV_DTYPE_WHY, bytes_per_token, entry_bytes

    dtype = str(engine.kv_dtype).split(".")[-1]
    shape, entries = engine.kv_shape, len(engine.ingestion.variants)
    chunk = entries * entry_bytes(shape, CHUNK_TOKENS, dtype)
    print(f"Stored KV (kv_dtype={dtype!r}): {bytes_per_token(shape, dtype):,.0f} bytes a token; a {CHUNK_TOKENS}-token "
          f"chunk {chunk / 2**20:.1f} MiB ({entries} entr{'y' if entries == 1 else 'ies'}). {DEFAULT_KV_DTYPE_WHY}")


def _info(args) -> int:
    from ragblend.core.kernels import cpu_summary
    from ragblend.core.model import int4_available, int8_available, kernel_plan_for

    engine = _load_engine(args, kv_dir=False)
    plan = engine.kernel_plan
    if plan is not None and plan.source != "fixed" and (args.measure or plan.measured is None or plan.measuring):
        print(f"Kernels: {plan.state()}.", flush=True)
        if plan.background is not None:   # this process's own, started as the engine loaded: finished first
            plan.background.join()
        if args.measure or plan.measured is None:
            print("Measuring the kernels now (a few seconds; best on an otherwise idle machine)...", flush=True)
            plan = kernel_plan_for(engine.hf_model, remeasure=True)   # cached for the next engines
    print(f"Host: {cpu_summary()}")
    print(f"Model: {engine.name} ({engine.adapter.arch}, {engine.adapter.shape.num_layers} layers, "
          f"{engine.adapter.dtype}, {engine.adapter.device})")
    from ragblend.core.quantized import describe, is_quantized

    print(f"Weights: held {engine.weights_form}, because: "
          f"{getattr(engine.hf_model, 'ragblend_weights_reason', None) or 'the model was passed in as it is'}")
    for line in describe(engine.hf_model):
        print(f"  {line}")
    if plan is None and not is_quantized(engine.hf_model):   # (a quantized or 16-bit model's: described above)
        print("Kernels: the model does not run in float32 on the CPU, so its own (transformers') kernels run it.")
    elif plan is not None:
        when = {"measured": "measured just now", "cache": "measured earlier on this host, cached"}.get(
            plan.source, "not measured")
        print(f"Kernels per pass size ({when}; RAGBLEND_KERNELS=linear keeps F.linear everywhere):")
        print(f"  choice {plan.state()}")
        for line in plan.describe():
            print(f"  {line}")
    for bits, why_not in (("4", int4_available()), ("8", int8_available())):
        print(f"{bits}-bit decoding (decode_dtype='int{bits}'): "
              f"{'available' if why_not is None else 'unavailable: ' + why_not}")
    layers = ", ".join(f"{count} {kind}" for kind, count in engine.decode_weights.layer_counts().items())
    print(f"Decoding step (decode_dtype={engine.decode_dtype!r}, chosen on this host): linear layers {layers}")
    print(f"Decoding K/V (decode_kv_dtype={engine.options.decode_kv_dtype!r}, chosen on this host): "
          f"{str(engine.answers.kv_dtype).split('.')[-1]}")
    _print_stored_kv(engine)
    _print_fusion_cost(engine, args.measure)
    drafts = engine.options.prompt_lookup_num_tokens
    if drafts == 0:
        print("Drafts (prompt lookup): off (prompt_lookup_num_tokens=0)")
    elif not engine.answers.can_draft:
        print(f"Drafts (prompt lookup): off (drafts are verified in float32 only; this model runs in {engine.adapter.dtype})")
    else:
        print(f"Drafts (prompt lookup, up to {drafts} a pass, measured at engine start): a drafted token costs "
              f"{engine.answers.draft_row_cost:.0%} of a one-token pass here, so a pass drafts only what it "
              f"expects to keep at that price")
    return 0


def _print_fusion_cost(engine, measure: bool) -> None:
    """What ``ragblend info`` says of where the engine's own strategy fuses (core.fusion_cost)."""
    from ragblend.core.fusion_cost import default_constants

    cost, selection = engine.fusion_cost, engine.resolve().selection
    constants = cost.remeasure() if measure else cost.known()
    if constants is None:
        where = ("not measured on this host yet (the first prompt that needs them measures them, about a second; "
                 "`ragblend info --measure` now), so from scaled defaults")
        constants = default_constants(engine.adapter)
    else:
        where = "measured on this host" if constants.measured else "scaled defaults"
    speedup = engine.min_fusion_speedup
    if selection is None or not speedup:
        print(f"Fusion: always (min_fusion_speedup={speedup:g})")
        return
    at = cost.break_even(selection, min_speedup=speedup, constants=constants)
    print(f"Fusion: the default strategy fuses a prompt where predicted at least {speedup:g}x faster than its full "
          f"prefill, else runs the full prefill (stats.fusion_skipped); from about "
          f"{f'{at} prompt tokens' if at else 'no prompt size'} up with ~45 uncached tokens (cost constants "
          f"{where}: {constants.layer_s * 1e3:.3f} ms a pass, {constants.row_s * 1e6:.2f} us a row, "
          f"{constants.pair_s * 1e9:.2f} ns an attention pair, {constants.cached_s * 1e6:.3f} us a cached token, "
          f"per layer)")


def _app(args) -> int:
    """Start the Streamlit demo app (apps/streamlit_app.py of the source checkout)."""
    import subprocess
    from pathlib import Path

    from ragblend.core.extras import require
    from ragblend.core.model import local_model_path

    # Each a clear error now, not a traceback from inside Streamlit later.
    require("app", "ragblend app")
    require("llamaindex", "ragblend app")
    app = Path(__file__).resolve().parents[1] / "apps" / "streamlit_app.py"
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


def _serve(args) -> int:
    """Start the OpenAI-compatible server (ragblend.serving) over one engine."""
    from ragblend.core.extras import require

    require("serve", "ragblend serve")   # before the model loads, not after
    from ragblend.serving.app import serve

    print(f"Loading the model{'' if args.model is None else ' ' + args.model}...", file=sys.stderr, flush=True)
    keys = _serve_keys(args)   # a bad keys file is an error before the model loads
    engine = _load_engine(args, kv_dir=False if args.kv_dir == "none" else args.kv_dir)
    tenants = len(set(keys["tenants"].values()))
    print(f"Serving {args.model_name or engine.name} on http://{args.host}:{args.port}/v1 "
          f"(key {'required' if keys['tenants'] or keys['operator_key'] else 'not required'}"
          f"{f'; {tenants} tenant(s)' if tenants else ''}"
          f"{', one shared KV cache' if tenants and args.shared_cache else ''}); Ctrl+C stops it.",
          file=sys.stderr, flush=True)
    serve(engine, host=args.host, port=args.port, **keys, shared_cache=args.shared_cache,
          partition_by_user=args.partition_by_user, queue_size=args.queue_size,
          request_timeout_s=args.timeout, max_body_bytes=int(args.max_body_mb * (1 << 20)),
          model_name=args.model_name, max_batch=args.max_batch, max_kv_bytes=int(args.max_kv_mb * (1 << 20)))
    return 0


def _serve_keys(args) -> dict:
    """The server's keys from --api-key (repeatable, or $RAGBLEND_API_KEY), --api-keys-file and
    --operator-key: each client key a tenant, except that the only key of a one-key server is its
    operator's (one user: the shared KV cache, as before tenants)."""
    from ragblend.serving.tenants import read_keys_file, tenant_name

    tenants = read_keys_file(args.api_keys_file) if args.api_keys_file else {}
    api_keys = [key for key in (args.api_key or [os.environ.get("RAGBLEND_API_KEY")]) if key]
    operator = args.operator_key or None
    if len(api_keys) == 1 and not tenants and operator is None:
        return {"api_key": None, "tenants": {}, "operator_key": api_keys[0]}
    for key in api_keys:
        if key in tenants:
            raise InvalidInputError("an --api-key is also in the keys file; give it once.")
        tenants[key] = tenant_name(key)
    return {"api_key": None, "tenants": tenants, "operator_key": operator}


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
whole_number = whole_number_from(0)


# Engine options' flags come from ragblend.core.options (their type, default and choices declared
# once there); only the help of two is worded here, for a command line ('none', not False).
ENGINE_FLAG_HELP = {
    "model": "a .gguf file or a Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)",
    "kv_dir": "KV store folder (default: <user cache>/ragblend/kv; 'none': memory only)",
    "dtype": "how the weights are held in memory: auto (default: a GGUF in float32 up to 4 GiB of it, else "
             "quantized; an HF dir as stored, bf16/fp16 staying 16-bit), float32, bfloat16, float16, or quantized "
             "(GGUF files only); see docs/models.md",
}


def _add_engine_options(p: argparse.ArgumentParser, *names: str) -> None:
    engine_options.add_arguments(p, names, help=ENGINE_FLAG_HELP)


def _load_engine(args, **overrides):
    """The engine the command's engine flags describe (``overrides`` over them)."""
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained(options=engine_options.from_args(args, **overrides))


def _add_index(p, default="<user cache>/ragblend/index"):
    p.add_argument("--index", default=None, help=f"index folder (default: {default})")
    p.add_argument("--chroma-url", default=os.environ.get("RAGBLEND_CHROMA_URL") or None,
                   help="a Chroma server (e.g. http://127.0.0.1:8000 from `chroma run`) instead of the "
                        "Chroma database in the index folder; default: $RAGBLEND_CHROMA_URL")
    _add_collection(p)


def _env_collection() -> str:
    return os.environ.get("RAGBLEND_CHROMA_COLLECTION") or "ragblend"


def _add_collection(p):
    p.add_argument("--collection", default=_env_collection(),
                   help="the index's Chroma collection: give each index on one Chroma server its own "
                        "(default: $RAGBLEND_CHROMA_COLLECTION or ragblend)")


def _add_answer_options(p):
    p.add_argument("--top-k", type=positive_int, default=4, help="chunks to retrieve")
    p.add_argument("--ratio", type=ratio_value, default=None,
                   help="recompute ratio in (0, 1] (default: the model's calibrated one); "
                        "auto for ask --strategy cacheblend")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)


def _ingest_parser(sub) -> None:
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
    _add_engine_options(ingest, "model", "dtype")
    _add_index(ingest)
    ingest.set_defaults(func=_ingest)


def _ask_parser(sub) -> None:
    ask = sub.add_parser("ask", help="answer a question from the index")
    ask.add_argument("question")
    ask.add_argument("--strategy", default="default", choices=STRATEGY_NAMES,
                     help="fusion strategy (default: QueryAware at the model's calibrated ratio)")
    ask.add_argument("--mode", default="compact", choices=["compact", "refine", "tree_summarize", "blend"],
                     help="LlamaIndex response mode, or blend for BlendSynthesizer")
    ask.add_argument("--compare", action="store_true", help="also answer with a full prefill")
    _add_engine_options(ask, "model", "dtype", "decode_dtype", "decode_kv_dtype")
    _add_answer_options(ask)
    _add_index(ask)
    ask.set_defaults(func=_ask)


def _demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="ingest the sample documents and answer sample questions, "
                                       "with fusion and with a full prefill")
    demo.add_argument("--questions", type=int, default=3, help="how many sample questions to ask")
    _add_engine_options(demo, "model", "dtype")
    _add_answer_options(demo)
    demo.add_argument("--index", default=None, help="index folder (default: <user cache>/ragblend/demo-index)")
    demo.set_defaults(func=_demo)


def _calibrate_parser(sub) -> None:
    calibrate = sub.add_parser("calibrate", help="find the model's cheapest recompute ratio within half its "
                                                 "order noise, once (5-20 minutes on a 2-core CPU); engines use it "
                                                 "from then on, in place of a shipped calibration")
    selection = calibrate.add_mutually_exclusive_group()
    selection.add_argument("--neighbour-window", type=number_in(0.0, 1.0), default=None, metavar="FRACTION",
                           help="try only this QueryAware neighbour window, a fraction of a chunk in [0, 1] "
                                "(0: single tokens; default: try single tokens, runs of 1/16 chunk and sentences)")
    selection.add_argument("--sentence-runs", action="store_true",
                           help="try only runs by sentence (QueryAware's sentence_runs)")
    calibrate.add_argument("--answer-tokens", type=whole_number, default=32,
                           help="also measure the KL over full prefill's greedy answer of this many tokens "
                                "(default: 32; 0: first token only, faster)")
    calibrate.add_argument("--answer-margin", type=number_in(0.0, 100.0, low_open=True), default=None, metavar="SHARE",
                           help="also require that answer-level KL within this share of the order noise's, e.g. 1.0 "
                                "(default: reported, not required; a safer ratio, often a slower one)")
    _add_engine_options(calibrate, "model", "dtype")
    calibrate.set_defaults(func=_calibrate)


def _info_parser(sub) -> None:
    info = sub.add_parser("info", help="show this host's CPU and the matmul kernels chosen for the model "
                                       "(measured once per host, then cached)")
    _add_engine_options(info, "model", "dtype", "decode_dtype", "decode_kv_dtype", "prompt_lookup_num_tokens")
    info.add_argument("--measure", action="store_true",
                      help="measure the kernels and the fusion's cost constants again now and cache them (e.g. "
                           "if the first measurement ran on a busy machine: `choice unsettled`)")
    info.set_defaults(func=_info)


def _app_parser(sub) -> None:
    app = sub.add_parser("app", help="start the Streamlit demo app (its model: --model, else $RAGBLEND_MODEL, "
                                     "else the embedded SmolLM2)")
    app.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only; the app has no login)")
    app.add_argument("--port", type=int, default=8501)
    app.add_argument("--files-root", default=os.environ.get("RAGBLEND_FILES_ROOT") or None,
                     help="let the app's path box ingest files and folders under this folder (default: "
                          "$RAGBLEND_FILES_ROOT; unset: the box is off and only uploads are ingested)")
    _add_engine_options(app, "model")
    _add_index(app, default="<user cache>/ragblend/app-index")
    app.set_defaults(func=_app)


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    _add_engine_options(serve, "model", "dtype", "kv_dir", "kv_dtype", "decode_dtype", "decode_kv_dtype")
    serve.add_argument("--model-name", default=None, help="the id clients send as `model` (default: the model's name)")
    serve.add_argument("--api-key", action="append", default=None,
                       help="require Authorization: Bearer KEY on every endpoint but /health (default: "
                            "$RAGBLEND_API_KEY); repeat it for several clients, each a tenant with its own KV "
                            "cache (a lone key is the operator's)")
    serve.add_argument("--api-keys-file", default=None,
                       help="tenants' keys, one `TENANT-NAME KEY` a line: each tenant's requests reuse only "
                            "its own KV and the shared (operator's) KV")
    serve.add_argument("--operator-key", default=os.environ.get("RAGBLEND_OPERATOR_KEY") or None,
                       help="the operator's key: what its requests and /v1/chunks store is shared with every "
                            "tenant (default: $RAGBLEND_OPERATOR_KEY)")
    serve.add_argument("--shared-cache", action="store_true",
                       help="one KV cache for every tenant, as before tenants: a client can then tell from "
                            "cached_tokens or timing whether a text is in another's prompt (docs/serving.md)")
    serve.add_argument("--partition-by-user", action="store_true",
                       help="also give each `user` a request names its own KV cache within its tenant")
    serve.add_argument("--queue-size", type=positive_int, default=16, help="requests that may wait; more get 429")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds a request may wait and run (then 504)")
    serve.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (then 413)")
    serve.add_argument("--max-batch", type=positive_int, default=8,
                       help="answers decoded together, one pass over the weights per step (1: one at a time)")
    serve.add_argument("--max-kv-mb", type=float, default=2048.0,
                       help="KV buffer memory the answers being decoded may hold; a request beyond it waits")
    serve.set_defaults(func=_serve)


def _cache_parser(sub) -> None:
    cache = sub.add_parser("cache", help="inspect or clear the on-disk KV store")
    cache.add_argument("action", choices=["stats", "fill", "clear", "verify"],
                       help="stats: entries (by dtype), bytes, hit rate, and how many of the index's chunks have "
                            "KV; fill: compute the KV the index's chunks lack (resumes an interrupted ingest's); "
                            "clear: delete every entry; verify: check every entry against the model (exit 1 if "
                            "any fails)")
    cache.add_argument("--index", default=None, help="index folder whose KV store to use (default: the default index)")
    cache.add_argument("--chroma-url", default=os.environ.get("RAGBLEND_CHROMA_URL") or None,
                       help="the index's Chroma server, if it uses one (default: $RAGBLEND_CHROMA_URL)")
    _add_collection(cache)
    # Not the engine's kv_dir option: the store to inspect (verify loads its engine with no store).
    cache.add_argument("--kv-dir", default=None, help="any KV store directory instead (e.g. an engine's kv_dir)")
    _add_engine_options(cache, "model", "dtype")
    cache.add_argument("--fix", action="store_true", help="with verify: delete failing entries")
    cache.set_defaults(func=_cache)


def build_parser() -> argparse.ArgumentParser:
    from ragblend import __version__

    parser = argparse.ArgumentParser(prog="ragblend", description="Fast RAG on local models (CacheBlend).")
    parser.add_argument("--version", action="version", version=f"ragblend {__version__}")
    # Not required: `ragblend` alone prints this help, its commands listed (main).
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for add in (_ingest_parser, _ask_parser, _demo_parser, _calibrate_parser, _info_parser, _app_parser,
                _serve_parser, _cache_parser):
        add(sub)
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
        hint = (" Files already ingested are kept; run the same command again to go on." if args.func is _ingest
                else "")   # (an interrupt in ingest's KV phase is reported by _ingest_kv itself)
        print(f"\nragblend: interrupted.{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
