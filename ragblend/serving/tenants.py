"""Who a request is, and so which stored KV it may hit: the server's tenants.

The server reuses the KV of what its clients send (passages, marked chunks, token-id warm-ups),
and ``cached_tokens`` (and the time to the first token) tell a client how much of its prompt was
found stored. Were every client's text stored in one pool, that would answer "is this text in
someone else's prompt?". So what a request stores goes into its **namespace**, and a prompt is
searched only for the shared chunks and its own namespace's:

* each API key is a tenant (a name, from ``--api-keys-file``, or made from the key); its requests
  have the tenant's namespace;
* the operator's key (``--operator-key``; or the only key of a one-key server) and a server with
  no key at all (one user, on loopback) use the **shared** namespace: the index ingested into the
  KV dir, and chunks the operator registers, are found in every tenant's prompts;
* ``shared_cache`` (``--shared-cache``) puts every tenant in the shared namespace (one pool, as
  before tenants: the side channel above is then open between them, docs/serving.md);
* a request's ``cache_salt`` (vLLM's field) partitions further, and so does its ``user`` where
  the operator turns that on (``--partition-by-user``).

A namespace is a digest of those parts (``""``: shared), so that no name or salt is written into
the store's headers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Mapping

from ragblend.core.errors import InvalidInputError

from .requests import cache_salt

OPERATOR = ""   # the tenant name of the operator's key (and of a server with no key): the shared namespace


@dataclass(frozen=True)
class Tenants:
    """The keys a server accepts and what each request's namespace is.

    ``keys``: API key -> tenant name (:data:`OPERATOR`, ``""``, for an operator key). No keys at
    all: no key is needed and every request is the operator's."""

    keys: Mapping[str, str] = field(default_factory=dict)
    shared_cache: bool = False
    partition_by_user: bool = False

    def __post_init__(self):
        for key, name in self.keys.items():
            if not isinstance(key, str) or not key or not key.isprintable() or " " in key:
                raise InvalidInputError("API keys must be non-empty strings without spaces.")
            if not isinstance(name, str):
                raise InvalidInputError(f"tenant names must be strings, got {type(name).__name__}.")
        # What the Authorization header must say, once per key (compared in constant time).
        object.__setattr__(self, "_headers", [(f"Bearer {key}".encode(), name) for key, name in self.keys.items()])

    @classmethod
    def of(cls, api_key: str | None = None, tenants: Mapping[str, str] | None = None,
           operator_key: str | None = None, **options) -> "Tenants":
        """From :func:`~ragblend.serving.app.create_app`'s arguments: ``api_key`` and
        ``operator_key`` are operator keys (a one-key server is one user's), ``tenants`` maps each
        client key to its tenant's name."""
        keys = {key: name for key, name in (tenants or {}).items()}
        for key in (api_key, operator_key):
            if key is not None:
                if key in keys:
                    raise InvalidInputError("the operator's key is also a tenant's key; give each its own.")
                keys[key] = OPERATOR
        return cls(keys, **options)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def tenant_of(self, authorization: bytes) -> str | None:
        """The tenant an ``Authorization`` header names (OPERATOR where no key is needed), None for
        a missing or wrong key. Every key is compared, so the time says nothing of which matched."""
        if not self.keys:
            return OPERATOR
        found = None
        for expected, name in self._headers:
            if hmac.compare_digest(authorization, expected):
                found = name
        return found

    def namespace(self, tenant: str, body: dict, *, own: bool = False) -> str:
        """The namespace of a request of ``tenant`` with this body (its ``cache_salt`` and ``user``,
        checked by the caller): "" (shared) or a hex digest. ``own``: the tenant's own even under
        ``--shared-cache`` (the prefix tier: whole prompts and answers are never shared, passages may be)."""
        parts = {}
        if tenant != OPERATOR and (own or not self.shared_cache):
            parts["tenant"] = tenant
        user = body.get("user")
        if self.partition_by_user and isinstance(user, str) and user:
            parts["user"] = user
        salt = cache_salt(body)
        if salt:
            parts["salt"] = salt
        if not parts:
            return ""
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def tenant_name(key: str) -> str:
    """The name of a tenant given by its key alone (``--api-key``): made from the key, not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """``{key: tenant name}`` from a keys file: one ``NAME KEY`` pair a line (blank lines and lines
    starting with ``#`` skipped). Two lines with one key, or a line without both, is an error."""
    keys: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidInputError(f"cannot read the keys file {path} ({type(err).__name__}: {err}).") from None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidInputError(f"{path}, line {number}: expected `TENANT-NAME API-KEY`, got {len(parts)} fields.")
        name, key = parts
        if key in keys:
            raise InvalidInputError(f"{path}, line {number}: this key is also tenant {keys[key]!r}'s; give each its own.")
        keys[key] = name
    return keys
