"""Command line: ``ragblend demo`` and ``ragblend cache stats|clear|verify``.

``ragblend demo`` loads the embedded default model, precomputes the KV of the six sample
passages, and answers the sample question twice, with CacheBlend fusion and with a full
prefill, printing both answers and their time to first token.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from ragblend import BlendEngine, CacheBlend, Chunk, FullRecompute
    from ragblend.data import load_sample

    print("Loading the default model (the first run converts it once, ~20 s)...", flush=True)
    engine = BlendEngine.from_pretrained(args.model)
    sample = load_sample()
    chunks = sample["chunks"]
    question = args.question or sample["question"]
    engine.precompute(chunks, progress=True)
    segments = [Chunk(c) for c in chunks] + [question]
    print(f"\n{question}\n")
    for label, strategy in (("CacheBlend(ratio=%.2f)" % args.ratio, CacheBlend(args.ratio)),
                            ("full prefill", FullRecompute())):
        out = engine.generate(segments, strategy=strategy, max_new_tokens=args.max_new_tokens)
        s = out.stats
        print(f"[{label}] TTFT {s.ttft_s:.2f} s | {s.prompt_tokens} prompt tokens: "
              f"{s.reused_tokens} reused, {s.recomputed_tokens} recomputed")
        print(f"  {out.text.strip()}\n")
    return 0


def _disk_store(args, spec=None):
    from ragblend.core.model import cache_dir
    from ragblend.core.store import DiskStore, EntrySpec

    directory = args.kv_dir or cache_dir() / "kv"
    return DiskStore(directory, spec or EntrySpec("", 0, 0, 0))


def _cache(args) -> int:
    if args.action == "stats":
        disk = _disk_store(args).stats()["disk"]
        lookups = disk["hits"] + disk["misses"]
        rate = f"{disk['hits'] / lookups:.1%}" if lookups else "n/a"
        print(f"KV store: {disk['directory']}")
        print(f"  disk tier:   {disk['entries']} entries, {disk['bytes'] / 2**20:.1f} MiB "
              f"(limit {disk['max_bytes'] / 2**30:.1f} GiB), hit rate {rate} ({disk['hits']} hits, {disk['misses']} misses)")
        print("  memory tier: lives inside each process (see engine.store.stats())")
        return 0
    if args.action == "clear":
        removed = _disk_store(args).clear()
        print(f"Removed {removed} entries.")
        return 0
    # verify: needs the model to know which fingerprint and shape entries must have
    from ragblend import BlendEngine

    engine = BlendEngine.from_pretrained(args.model, kv_dir=False)
    store = _disk_store(args, engine.entry_spec)
    bad = {}
    for key in store.keys():
        reason = store.verify(key)
        if reason is not None:
            bad[key] = reason
    for key, reason in bad.items():
        print(f"  {key[:16]}...  {reason}")
        if args.fix:
            store.delete(key)
    print(f"{len(store) if args.fix else len(store) - len(bad)} entries verified, {len(bad)} failing"
          + (" (removed)" if args.fix and bad else ""))
    return 1 if bad and not args.fix else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragblend", description="Fast RAG on local models (CacheBlend).")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="answer the sample question with fusion and with a full prefill")
    demo.add_argument("--model", default=None, help="HF model dir or .gguf file (default: embedded SmolLM2)")
    demo.add_argument("--question", default=None, help="ask this instead of the sample question")
    demo.add_argument("--ratio", type=float, default=0.15, help="CacheBlend recompute ratio")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(func=_demo)

    cache = sub.add_parser("cache", help="inspect or clear the on-disk KV store")
    cache.add_argument("action", choices=["stats", "clear", "verify"],
                       help="stats: entries, bytes, hit rate; clear: delete every entry; "
                            "verify: check every entry against the model (exit 1 if any fails)")
    cache.add_argument("--kv-dir", default=None, help="KV store directory (default: <user cache>/ragblend/kv)")
    cache.add_argument("--model", default=None, help="model whose entries to verify (default: embedded SmolLM2)")
    cache.add_argument("--fix", action="store_true", help="with verify: delete failing entries")
    cache.set_defaults(func=_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ragblend import RagblendError

    try:
        return args.func(args)
    except RagblendError as err:
        print(f"ragblend: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
