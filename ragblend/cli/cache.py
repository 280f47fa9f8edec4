"""`ragblend cache stats|fill|clear|verify`: the on-disk KV store of an index."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys

from ragblend.core.errors import InvalidInputError, StoreUnavailableError

from .args import add_collection, add_engine_options, check_model, index_option, load_engine, open_index


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
    from ragblend.core.store.tiers import DiskStore, EntrySpec, NotAStoreError, store_faults

    folder = _store_folder(args)
    try:
        # None: the limit saved with the store. `cache` looks at and empties a store; it never resizes
        # one (a --disk-bytes given here is only the projection's budget).
        return DiskStore(folder, spec or EntrySpec("", 0, 0, 0), None)
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


def run(args) -> int:
    from ragblend.core.store.tiers import DATABASE, MARKER, check_store_folder

    if args.action == "fill":   # opens (or creates) the index's store like ingest does
        return _fill(args)
    folder = _store_folder(args)
    if (folder / MARKER).exists():   # a damaged marker is said as an engine opening the folder says it
        check_store_folder(folder, create=False)
    if not (folder / DATABASE).exists():   # look, never create
        print(f"No KV store at {folder}: nothing has been stored there yet.")
        return 0
    # Only a folder that is a ragblend store is read or changed (--kv-dir may be any folder).
    check_store_folder(folder, create=False)
    if args.action == "stats":
        return _cache_stats(args)
    if args.action == "clear":
        return _clear(args)
    # verify: needs the model to know which fingerprint and shape entries must have
    engine = load_engine(args, kv_dir=False)   # (args.kv_dir is the store verified, not the engine's)
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
    from ragblend.core.store.kv_budget import size_arg

    store = _disk_store(args)
    disk = store.stats()["disk"]
    lookups = disk["hits"] + disk["misses"]
    rate = f"{disk['hits'] / lookups:.1%}" if lookups else "n/a"
    print(f"KV store: {disk['directory']}")
    print(f"  disk tier:   {disk['entries']} entries, {disk['bytes'] / 2**20:.1f} MiB "
          f"(limit {size_arg(disk['max_bytes'], ' ')}), hit rate {rate} ({disk['hits']} hits, {disk['misses']} misses)")
    by_dtype = store.entries_by_dtype()
    if by_dtype:
        print("  by dtype:    " + "; ".join(f"{dtype}: {row['entries']} entries, {row['bytes'] / 2**20:.1f} MiB"
                                          for dtype, row in sorted(by_dtype.items())))
    if disk["faults"]:
        print(f"  faults:      {disk['faults']} while reading these statistics (see the warning above)")
    print("  memory tier: lives inside each process (see engine.store.stats())")
    asked = getattr(args, "disk_bytes", None)
    if asked is not None and asked != disk["max_bytes"]:
        print(f"  (--disk-bytes {size_arg(asked, ' ')}: the projection below is at that size; the store keeps its "
              f"{size_arg(disk['max_bytes'], ' ')}, which `ingest`, `ask` or `serve` with --disk-bytes change)")
    _print_index(args, store, by_dtype, asked or disk["max_bytes"])
    return 0


def _print_index(args, store, by_dtype: dict, budget: int) -> None:
    """The lines of `cache stats` about the index: projected KV, coverage, and what was counted."""
    found = _index_coverage(args, store)
    if found is None:
        return
    coverage, projection, keyed_apart = found
    if projection is None:   # the index's recorded keys: weighed by what is stored
        projection = _stored_projection(coverage, by_dtype, budget)
    if projection is not None:
        print(f"  projected:   {projection.describe(flags=True)}")
    else:   # nothing to weigh yet: no model is loaded here
        print("  projected:   nothing of the index stored yet to weigh; `ragblend info --model M` says what a token "
              "of stored KV weighs")
    fill = f"`ragblend cache fill{index_option(args)}`"
    if keyed_apart:   # the fill computes the keys the index recorded: the ingesting engine's
        hint = (f" ({keyed_apart:,} keyed apart from the keys the index recorded, another engine's: queries with "
                "these flags compute and store them; `ragblend ingest --rebuild` with them keys the index for this one)")
    elif coverage.lead_missing is None:   # no model: the lead entries' keys are unknown, a chunk counts by its own
        hint = (f" ({fill} computes them)" if coverage.pending else
                f" (each chunk's own entry; {fill} also adds any lead entries missing)")
    else:
        hint = f" ({fill} computes them)" if coverage.to_compute else ""
    print(f"  index:       {coverage.describe()}{hint}")
    if _names_an_engine(args):
        print(f"  counted:     the KV of the engine {_engine_flags(args)} names, each chunk keyed as it keys it")
    else:
        print("  counted:     the KV of the engine that ingested the index (the keys it recorded); --model M "
              "counts M's instead (it loads M)")


# The flags that make other entries' keys: the model, its weights' form, the stored dtype.
_KEYING_FLAGS = ("model", "dtype", "kv_dtype")


def _names_an_engine(args) -> bool:
    """Whether the flags name an engine whose keys may differ from those the index recorded."""
    from ragblend.core.options import field_default

    return any(getattr(args, name, None) not in (None, field_default(name)) for name in _KEYING_FLAGS)


def _engine_flags(args) -> str:
    from ragblend.core.options import field_default

    return " ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in _KEYING_FLAGS
                    if getattr(args, name, None) not in (None, field_default(name)))


def _stored_projection(coverage, by_dtype: dict, budget: int):
    """The projected KV of the whole index from what its stored chunks weigh (no model loaded:
    the bytes of the store's entries over the index's chunks that have theirs); None without an
    index or before any chunk of it is stored."""
    from ragblend.core.store.kv_budget import Projection

    if coverage is None or not coverage.stored:
        return None
    stored = sum(row["bytes"] for row in by_dtype.values())
    per_chunk = stored / coverage.stored
    dtype = next(iter(by_dtype)) if len(by_dtype) == 1 else ""
    return Projection(coverage.keyed, round(per_chunk * coverage.keyed), budget, dtype,
                      f"{per_chunk / 2**20:.2f} MiB a chunk, as the {coverage.stored:,} stored weigh")


def _index_coverage(args, store):
    """``(coverage, projection, keyed apart)``: how much of the index's chunks' KV ``store`` holds,
    with its projection and how many chunks the engine keys apart from the index where the flags
    name an engine (:func:`_engine_coverage`). Without --model, --dtype or --kv-dtype it needs no
    model: it counts the keys the index recorded (the ingesting engine's), with no projection and
    0 apart. None without an index (e.g. --kv-dir alone) or when its Chroma database holds no
    ragblend collection."""
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
    if _names_an_engine(args):
        return _engine_coverage(args, collection, store)
    return coverage_of(collection, store.keys()), None, 0


def _engine_coverage(args, collection, store):
    """The index's coverage by the KV of the engine the flags name (its model loaded, with no store
    of its own): each chunk keyed as ingesting with that engine keys it, from the text its model is
    shown (the keys the index recorded are the ingesting engine's; another model's, weights form's
    or stored dtype's entries are others). With its projection (from the model's shape and the
    chunks' mean length) and how many chunks it keys apart from the recorded keys."""
    from llama_index.core.vector_stores.utils import metadata_dict_to_node

    from ragblend.integrations.kv_fill import KVCoverage, index_pages
    from ragblend.vectorstore_hooks.llamaindex import KV_KEY, KVPrecompute, llm_text

    print("Loading the model to key the index's chunks as it does...", file=sys.stderr, flush=True)
    engine = load_engine(args, kv_dir=False)
    keyer, stored = KVPrecompute(engine, compute=False), set(store.keys())
    chunks = keyed = covered = lead_missing = tokens = apart = 0
    for page in index_pages(collection, include=("metadatas", "documents")):
        nodes = [metadata_dict_to_node(meta, text=text) for meta, text in zip(page["metadatas"], page["documents"])]
        recorded = [node.metadata.get(KV_KEY) for node in nodes]
        for node, was in zip(keyer(nodes), recorded):
            chunks += 1
            key = node.metadata.get(KV_KEY)
            apart += key != was
            if key is None:
                continue
            keyed += 1
            tokens += engine.count_tokens(llm_text(node))
            if key in stored:
                covered += 1
                lead_missing += not engine.entries_stored(key, stored)
    projection = engine.budget.project(store, engine.kv_dtype, keyed, -(-tokens // keyed), warn=False) if keyed else None
    return KVCoverage(chunks, keyed, covered, lead_missing), projection, apart



def _fill(args) -> int:
    """`ragblend cache fill`: compute the KV of the index's chunks that have none, and the lead
    entries of those that have only their own (as far as the store has room)."""
    from ragblend.core.extras import require
    from ragblend.integrations.kv_fill import KVFillBusyError

    if args.kv_dir is not None:
        raise InvalidInputError("cache fill works on an index (--index FOLDER), whose KV store is its kv folder; "
                                "--kv-dir does not apply.")
    require("llamaindex", "ragblend cache fill")
    check_model(args)
    rag = open_index(args)
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
    folder = _store_folder(args)
    with _no_fill_running(folder):
        return _clear_store(args, folder)


def _clear_store(args, folder) -> int:
    from ragblend.core.store.tiers import DiskStore

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


@contextlib.contextmanager
def _no_fill_running(folder):
    """Hold the fill lock of the index whose KV ``folder`` is (``INDEX/kv``) while the body runs,
    or refuse: a fill running meanwhile would go on writing into the emptied store (and its
    memory tier would count entries that are gone)."""
    from ragblend.integrations.kv_fill import FILL_LOCK_FILE, KVFillBusyError, fill_lock

    index = folder.parent
    with contextlib.ExitStack() as held:
        if (index / FILL_LOCK_FILE).is_file():   # else no fill ever ran there (e.g. an engine's kv_dir)
            try:
                held.enter_context(fill_lock(index))
            except OSError:   # the lock file cannot be opened (a read-only index): the lock cannot tell
                pass
            except KVFillBusyError:
                pid = _lock_holder(index / FILL_LOCK_FILE)
                stats = f"ragblend cache stats --index {shlex.quote(str(index))}"
                raise KVFillBusyError(
                    f"the KV store in {folder} was not cleared: process {pid} is computing the KV of the index at "
                    f"{index} (a `ragblend ingest --kv background` or `ragblend cache fill`). Wait for it to finish "
                    f"(log: {index / 'kv-fill.log'}; `{stats}` shows the coverage) or stop it "
                    f"(`kill {pid}`; what it stored stays), then clear again.") from None
        yield


def _lock_holder(path) -> str:
    """The pid a fill lock's holder wrote into it ("unknown" if unreadable)."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def add_parser(sub) -> None:
    cache = sub.add_parser("cache", help="inspect or clear the on-disk KV store")
    cache.add_argument("action", choices=["stats", "fill", "clear", "verify"],
                       help="stats: entries (by dtype), bytes, hit rate, and how many of the index's chunks have "
                            "KV; fill: compute the KV the index's chunks lack (resumes an interrupted ingest's); "
                            "clear: delete every entry; verify: check every entry against the model (exit 1 if "
                            "any fails)")
    cache.add_argument("--index", default=None, help="index folder whose KV store to use (default: the default index)")
    cache.add_argument("--chroma-url", default=os.environ.get("RAGBLEND_CHROMA_URL") or None,
                       help="the index's Chroma server, if it uses one (default: $RAGBLEND_CHROMA_URL)")
    add_collection(cache)
    # Not the engine's kv_dir option: the store to inspect (verify loads its engine with no store).
    cache.add_argument("--kv-dir", default=None, help="any KV store directory instead (e.g. an engine's kv_dir)")
    add_engine_options(cache, "model", "dtype", "kv_dtype", "disk_bytes", "memory_bytes")
    cache.add_argument("--fix", action="store_true", help="with verify: delete failing entries")
    cache.set_defaults(func=run)
