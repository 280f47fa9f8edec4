"""Chroma as a :class:`~ragblend.integrations.local_index.LocalIndex` uses it: the client (the
index folder's own database, or a Chroma server), and the collection, which on a server is stamped
with the index folder that uses it, so that two folders sharing one collection are told."""

from __future__ import annotations

import logging
from pathlib import Path

from ragblend.core.errors import InvalidInputError

log = logging.getLogger("ragblend.integrations.local_index")   # the index's own log, as before the split


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


OWNER_KEY = "ragblend_index"   # a server collection's metadata: the index folder that uses it


def _owner(metadata: dict) -> str | None:
    """The index folder a server collection's metadata names as its owner; None if none (the
    server's metadata is not ours to trust: anything but a string is no claim)."""
    owner = metadata.get(OWNER_KEY)
    return owner if isinstance(owner, str) else None


def open_collection(client, name: str, folder: Path, url: str | None):
    """The collection ``name`` of ``client`` (created if new); on a Chroma server (``url``) it is
    claimed for the index at ``folder`` (:func:`claim_collection`)."""
    collection = client.get_or_create_collection(name)
    if url is not None:
        claim_collection(client, collection, name, folder, url)
    return collection


def claim_collection(client, collection, name: str, folder: Path, url: str) -> None:
    """Stamp a Chroma server's collection with this index's folder, and warn when another
    folder stamped it first: two index folders on one server, each with the default
    collection name, would answer from each other's files and reconcile each other's."""
    metadata = dict(collection.metadata or {})
    owner, mine = _owner(metadata), str(folder.resolve())
    if owner == mine:
        return
    if owner is None or not Path(owner).is_dir():   # unclaimed, or its folder moved: claim it
        # chromadb refuses any modify() naming the distance function, even unchanged; the
        # server keeps it in the collection's configuration all the same.
        metadata.pop("hnsw:space", None)
        try:
            collection.modify(metadata={**metadata, OWNER_KEY: mine})
            # Another folder opening it at the same moment may have stamped it after us: the
            # stamp read back names the one that wrote last, and the other one is warned.
            owner = _owner(client.get_collection(name).metadata or {})
        except Exception as err:   # the stamp only serves the warning below: a server that refuses it is fine
            log.info("ragblend: could not stamp the Chroma collection %r with this index (%s: %s).",
                     name, type(err).__name__, err)
            return
    if owner not in (None, mine):
        log.warning("ragblend: the collection %r on the Chroma server %s belongs to the index at %s, not to "
                    "this one (%s): both answer from, and ingest into, the same chunks. Give this index its "
                    "own collection (LocalIndex(..., collection='NAME') or --collection NAME) unless that "
                    "is meant.", name, url, owner, mine)
