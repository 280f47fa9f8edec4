"""The chunk index: the token ids of every chunk an engine knows, for finding chunks in flat
prompts (a prompt tokenized whole, with no markers saying where its chunks are).

Each chunk is filed under the namespace it was stored for ("": shared; a server's tenants have
their own, see :func:`~ragblend.core.store.kv.chunk_key`), and a prompt is searched only for the
chunks of the namespaces its caller names."""

from __future__ import annotations

from typing import Sequence

from ..prompt import ChunkFinder, PromptLayout
from .kv import PIECE_NAMESPACE_PREFIX
from .tiers import KVStore


class ChunkIndex:
    """Known chunks by key: those precomputed or declared here, and those other processes
    stored in the same KV store (learnt from the store's headers, see :meth:`learn_store`)."""

    def __init__(self):
        self.finder = ChunkFinder()   # token ids of known chunks, for finding them in flat prompts
        self._keys: set[str] = set()
        self._passed_over: set[str] = set()   # store entries never to index: foreign, unreadable, old pieces
        self._store_size = -1

    def add(self, key: str, token_ids: Sequence[int], namespace: str = "") -> None:
        """Know the chunk of these token ids (stored under ``key``, for ``namespace``)."""
        if key not in self._keys:
            self._keys.add(key)
            self.finder.add(token_ids, namespace)

    def forget(self, key: str, token_ids: Sequence[int], namespace: str = "") -> None:
        """No longer find the chunk stored under ``key`` (a history piece its memory evicted)."""
        self._keys.discard(key)
        self.finder.remove(token_ids, namespace)

    def learn_store(self, store: KVStore) -> None:
        """Learn the token ids of entries other processes stored (reads only new headers), each
        under the namespace its header names.

        Never deletes: a KV directory may be shared with other models, whose entries this
        engine cannot use but must leave alone.
        """
        size = len(store)
        if size == self._store_size:
            return
        for key in store.keys():
            if key in self._keys or key in self._passed_over:
                continue
            reader = store.open(key, drop_unusable=False)
            if reader is None:
                self._passed_over.add(key)  # foreign or unreadable: do not look again
                continue
            namespace = getattr(reader, "namespace", "")
            reader.close()
            # a piece an older version stored: pieces are kept in memory now, and one of the same
            # text stored there must still reach the finder (add() skips keys it knows)
            if namespace.startswith(PIECE_NAMESPACE_PREFIX):
                self._passed_over.add(key)
                continue
            self.add(key, reader.token_ids, namespace)
        self._store_size = size

    def mark(self, token_ids: Sequence[int], store: KVStore, *, namespaces: Sequence[str] = ("",),
             start: int = 0) -> PromptLayout:
        """``token_ids`` laid out with every known chunk of ``namespaces`` found inside them marked,
        none before ``start`` (the template's opening)."""
        self.learn_store(store)
        return PromptLayout(list(token_ids), self.finder.find(token_ids, namespaces, start))
