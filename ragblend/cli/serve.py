"""`ragblend serve`: the OpenAI-compatible server over one engine."""

from __future__ import annotations

import os
import sys

from ragblend.core.errors import InvalidInputError
from ragblend.serving.options import SERVER_DEFAULTS

from .args import add_engine_options, load_engine, positive_int

MB = 1 << 20   # the flags' unit (MiB)


def run(args) -> int:
    """Start the OpenAI-compatible server (ragblend.serving) over one engine."""
    from ragblend.core.extras import require

    require("serve", "ragblend serve")   # before the model loads, not after
    from ragblend.serving.app import serve

    print(f"Loading the model{'' if args.model is None else ' ' + args.model}...", file=sys.stderr, flush=True)
    keys = serve_keys(args)   # a bad keys file is an error before the model loads
    engine = load_engine(args, kv_dir=False if args.kv_dir == "none" else args.kv_dir)
    tenants = len(set(keys["tenants"].values()))
    print(f"Serving {args.model_name or engine.name} on http://{args.host}:{args.port}/v1 "
          f"(key {'required' if keys['tenants'] or keys['operator_key'] else 'not required'}"
          f"{f'; {tenants} tenant(s)' if tenants else ''}"
          f"{', one shared KV cache' if tenants and args.shared_cache else ''}); Ctrl+C stops it.",
          file=sys.stderr, flush=True)
    serve(engine, host=args.host, port=args.port, **keys, shared_cache=args.shared_cache,
          partition_by_user=args.partition_by_user, queue_size=args.queue_size,
          request_timeout_s=args.timeout, max_body_bytes=int(args.max_body_mb * MB),
          model_name=args.model_name, max_batch=args.max_batch, max_kv_bytes=int(args.max_kv_mb * MB),
          max_completion_tokens=args.max_completion_tokens)
    return 0


def serve_keys(args) -> dict:
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


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add_engine_options(serve, "model", "dtype", "kv_dir", "kv_dtype", "disk_bytes", "memory_bytes", "decode_dtype", "decode_kv_dtype")
    serve.add_argument("--model-name", default=None, help="the id clients send as `model` (default: the model's name)")
    serve.add_argument("--api-key", action="append", default=None,
                       help="require Authorization: Bearer KEY on every endpoint but /health (default: "
                            "$RAGBLEND_API_KEY); repeat it for several clients, each a tenant with its own KV "
                            "cache (a lone key is the operator's)")
    serve.add_argument("--api-keys-file", default=None,
                       help="tenants' keys, one `TENANT-NAME KEY` a line: each tenant's requests reuse only "
                            "its own KV and the shared (operator's) KV (default: none)")
    serve.add_argument("--operator-key", default=os.environ.get("RAGBLEND_OPERATOR_KEY") or None,
                       help="the operator's key: what its requests and /v1/chunks store is shared with every "
                            "tenant (default: $RAGBLEND_OPERATOR_KEY)")
    serve.add_argument("--shared-cache", action="store_true",
                       help="one KV cache for every tenant, as before tenants: a client can then tell from "
                            "cached_tokens or timing whether a text is in another's prompt (docs/serving.md)")
    serve.add_argument("--partition-by-user", action="store_true",
                       help="also give each `user` a request names its own KV cache within its tenant")
    serve.add_argument("--queue-size", type=positive_int, default=SERVER_DEFAULTS.queue_size,
                       help="requests that may wait; more get 429 (default: %(default)s)")
    serve.add_argument("--timeout", type=float, default=SERVER_DEFAULTS.request_timeout_s,
                       help="seconds a request may wait and run (then 504; default: %(default)s)")
    serve.add_argument("--max-body-mb", type=float, default=SERVER_DEFAULTS.max_body_bytes / MB,
                       help="largest request body, MB (then 413; default: %(default)s)")
    serve.add_argument("--max-batch", type=positive_int, default=SERVER_DEFAULTS.max_batch,
                       help="answers decoded together, one pass over the weights per step (1: one at a time; default: %(default)s)")
    serve.add_argument("--max-kv-mb", type=float, default=SERVER_DEFAULTS.max_kv_bytes / MB,
                       help="KV buffer memory the answers being decoded may hold; a request beyond it waits (default: %(default)s)")
    serve.add_argument("--max-completion-tokens", type=positive_int, default=SERVER_DEFAULTS.max_completion_tokens,
                       help="tokens one answer may ask for, and gets when it names no max_tokens (never past "
                            "the model's window); a request asking for more gets 400 (default: %(default)s)")
    serve.set_defaults(func=run)
