"""LlamaIndex ingestion hooks: precompute each node's KV as it enters a vector store.

Add :class:`KVPrecompute` to an ``IngestionPipeline`` (after the splitter) and wrap the
vector store in :class:`KVAwareVectorStore` so deleting a document drops its KV too::

    import chromadb
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.vector_stores.chroma import ChromaVectorStore
    from ragblend import BlendEngine, KVPrecompute
    from ragblend.vectorstore_hooks.llamaindex import KVAwareVectorStore

    engine = BlendEngine.from_pretrained()
    client = chromadb.PersistentClient("./index", settings=chromadb.Settings(anonymized_telemetry=False))
    store = KVAwareVectorStore(ChromaVectorStore(chroma_collection=client.get_or_create_collection("docs")), engine)
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=256), KVPrecompute(engine), embed_model],
                                 vector_store=store)
    pipeline.run(documents=documents, show_progress=True)
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TransformComponent
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryResult,
)

from ragblend.core.engine import BlendEngine
from ragblend.core.store.kv import KV_METADATA_KEY as KV_KEY


def llm_text(node: BaseNode) -> str:
    """The text of a node as the LLM sees it in a prompt (synthesizers strip it)."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


class KVPrecompute(TransformComponent):
    """Ingestion transform: precompute and store the KV of every node's LLM-visible text.

    The entry's key goes into ``node.metadata["ragblend_kv_key"]``, excluded from the LLM
    and embedding views of the node, so it never changes a prompt or an embedding. Nodes
    whose text is too long for the model's window, or too short to be found in a prompt
    (``engine.min_chunk_tokens``), are skipped with their key unset.

    When a query-time postprocessor shows the LLM another text than the node's, precompute
    that text instead. Sentence-window retrieval is the common case: the LLM sees
    ``metadata["window"]``, so pass ``metadata_key="window"``::

        IngestionPipeline(transformations=[SentenceWindowNodeParser.from_defaults(),
                                           KVPrecompute(engine, metadata_key="window"), embed_model])
        index.as_query_engine(llm=BlendLLM(engine=engine),
                              node_postprocessors=[MetadataReplacementPostProcessor(target_metadata_key="window")])
    """

    model_fingerprint: str = Field(default="", description="Fingerprint of the engine's model; part of the ingestion cache key.")
    show_progress: bool = Field(default=False, description="Show a progress bar.")
    metadata_key: Optional[str] = Field(
        default=None, description="Precompute the node with its text replaced by this metadata value, as "
                                  "MetadataReplacementPostProcessor(target_metadata_key=...) will show it to the LLM "
                                  "(e.g. 'window' for SentenceWindowNodeParser). None: the node's own text.")
    compute: bool = Field(
        default=True, description="Compute the KV now. False: only write each node's key, so the node is "
                                   "searchable at once and its KV can be computed later (LocalIndex's KV filler "
                                   "finds the nodes whose key is not in the store).")
    _engine: BlendEngine = PrivateAttr()

    def __init__(self, engine: BlendEngine, **kwargs: Any):
        super().__init__(model_fingerprint=engine.fingerprint, **kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVPrecompute"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        for node in nodes:
            for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
                if KV_KEY not in excluded:
                    excluded.append(KV_KEY)
        texts = [llm_text(self._as_shown(node)) for node in nodes]
        if self.compute:
            # One call: the engine runs many chunks through the model per pass.
            refs = self._engine.precompute(texts, skip_unusable=True,
                                           progress=kwargs.get("show_progress", self.show_progress))
            keys = [None if ref is None else ref.key for ref in refs]
        else:
            keys = [self._key_if_usable(text) for text in texts]
        for node, key in zip(nodes, keys):
            if key is None:
                node.metadata.pop(KV_KEY, None)
            else:
                node.metadata[KV_KEY] = key
        return nodes

    def _key_if_usable(self, text: str) -> Optional[str]:
        """The key ``precompute(text, skip_unusable=True)`` would store under, without
        computing: None for a chunk it would skip (too short to find, too long for the window)."""
        engine = self._engine
        ids = engine.tokenize(text)
        if not text.strip() or not engine.min_chunk_tokens <= len(ids) <= engine.context_window - len(engine.sink_ids):
            return None
        return engine.key_of(text)

    def _as_shown(self, node: BaseNode) -> BaseNode:
        """The node as the LLM will see it: its text replaced by ``metadata_key``'s value."""
        if self.metadata_key is None or self.metadata_key not in node.metadata:
            return node
        shown = node.model_copy()
        shown.set_content(str(node.metadata[self.metadata_key]))
        return shown


class EmbedWithProgress(TransformComponent):
    """An embedding step that reports progress per document: it embeds one embedding batch
    at a time and calls ``on_documents_done(n)`` as documents get their last chunk embedded,
    so a progress bar over files moves per file, not once per batch of files."""

    embed_model: BaseEmbedding
    _on_documents_done: Optional[Callable[[int], Any]] = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "EmbedWithProgress"

    @property
    def on_documents_done(self) -> Optional[Callable[[int], Any]]:
        return self._on_documents_done

    @on_documents_done.setter
    def on_documents_done(self, callback: Optional[Callable[[int], Any]]) -> None:
        self._on_documents_done = callback

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        nodes = list(nodes)
        ends = sorted({node.ref_doc_id: i for i, node in enumerate(nodes)}.values())   # each document's last chunk
        step = max(1, int(getattr(self.embed_model, "embed_batch_size", 10) or 10))
        done = 0
        for start in range(0, len(nodes), step):
            self.embed_model(nodes[start:start + step], **kwargs)
            finished = sum(1 for i in ends if i < start + step)
            if self._on_documents_done is not None and finished > done:
                self._on_documents_done(finished - done)
            done = finished
        return nodes


class KVChunkHints(BaseNodePostprocessor):
    """Query-time node postprocessor: tells the engine that the retrieved nodes are chunks.

    BlendLLM finds chunks in the synthesizer's flat prompt by their token ids. It knows the
    chunks in the store; with this postprocessor it also knows the retrieved nodes whose KV
    is missing (evicted, deleted, never precomputed), which are then computed in isolation,
    used, and written back instead of being computed as plain text::

        index.as_query_engine(llm=BlendLLM(engine=engine), node_postprocessors=[KVChunkHints(engine)])
    """

    _engine: BlendEngine = PrivateAttr()

    def __init__(self, engine: BlendEngine, **kwargs: Any):
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVChunkHints"

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        for node in nodes:
            text = llm_text(node.node)
            if text:
                self._engine.remember_chunk(text)
        return nodes


class KVAwareVectorStore(BasePydanticVectorStore):
    """Wraps any LlamaIndex vector store; deleting nodes or documents also drops their KV.

    Everything else is passed through unchanged. The KV keys are read back from the stored
    nodes' metadata (``get_nodes``), so this works across processes and restarts.
    """

    stores_text: bool = True
    inner: BasePydanticVectorStore = Field(description="The vector store that holds the nodes.")
    _engine: BlendEngine = PrivateAttr()

    def __init__(self, inner: BasePydanticVectorStore, engine: BlendEngine, **kwargs: Any):
        super().__init__(inner=inner, stores_text=inner.stores_text, **kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVAwareVectorStore"

    @property
    def client(self) -> Any:
        return self.inner.client

    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> List[str]:
        return self.inner.add(nodes, **kwargs)

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self.inner.query(query, **kwargs)

    def get_nodes(self, node_ids: Optional[List[str]] = None, filters: Optional[MetadataFilters] = None) -> List[BaseNode]:
        return self.inner.get_nodes(node_ids=node_ids, filters=filters)

    def _drop_kv(self, leaving: Sequence[BaseNode]) -> int:
        """Drop the KV of nodes about to leave the store, except entries that nodes staying
        in it still use (identical texts, e.g. a duplicated document, share one entry)."""
        keys = {n.metadata[KV_KEY] for n in leaving if n.metadata.get(KV_KEY)}
        if not keys:
            return 0
        leaving_ids = {n.node_id for n in leaving}
        sharing = self.inner.get_nodes(node_ids=None, filters=MetadataFilters(
            filters=[MetadataFilter(key=KV_KEY, value=sorted(keys), operator=FilterOperator.IN)]))
        still_used = {n.metadata.get(KV_KEY) for n in sharing if n.node_id not in leaving_ids}
        return self._engine.forget(keys - still_used)

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        filters = MetadataFilters(filters=[MetadataFilter(key="ref_doc_id", value=ref_doc_id)])
        self._drop_kv(self.inner.get_nodes(node_ids=None, filters=filters))
        self.inner.delete(ref_doc_id, **delete_kwargs)

    def delete_nodes(self, node_ids: Optional[List[str]] = None, filters: Optional[MetadataFilters] = None,
                     **delete_kwargs: Any) -> None:
        self._drop_kv(self.inner.get_nodes(node_ids=node_ids, filters=filters))
        self.inner.delete_nodes(node_ids=node_ids, filters=filters, **delete_kwargs)

    def clear(self) -> None:
        self._drop_kv(self.inner.get_nodes(node_ids=None))
        self.inner.clear()

    def persist(self, persist_path: str, fs: Any = None) -> None:
        self.inner.persist(persist_path, fs=fs)
