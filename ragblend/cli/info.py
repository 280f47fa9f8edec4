"""`ragblend info`: the host, and what the engine is (BlendEngine.describe())."""

from __future__ import annotations

import sys
import textwrap

from .args import add_engine_options, load_engine


def run(args) -> int:
    from ragblend.core.description import remeasure_fusion_cost, settle_kernels
    from ragblend.core.model.kernels import cpu_summary

    engine = load_engine(args, kv_dir=False)
    # what it waits for goes to stderr: stdout is one statement of the engine as it is once settled
    settle_kernels(engine, args.measure, say=lambda line: print(line, file=sys.stderr, flush=True))
    if args.measure:
        remeasure_fusion_cost(engine)
    about = engine.describe()
    print(f"Host: {cpu_summary()}")
    computes_in = str(about.dtype).removeprefix("torch.")   # the activations'; the weights' form is the next line
    print(f"Model: {about.name} ({about.arch}, {about.num_layers} layers, computes in {computes_in}, {about.device})")
    print_weights(about.weights_form, about.weights_reason, about.weights_lines)
    _print_kernels(about)
    for bits in ("4", "8"):
        why_not = about.low_bit_decoding[f"int{bits}"]
        print(f"{bits}-bit decoding (decode_dtype='int{bits}'): "
              f"{'available' if why_not is None else 'unavailable: ' + why_not}")
    layers = ", ".join(f"{count} {kind}" for kind, count in about.decode_layers.items())
    print(f"Decoding step (decode_dtype={about.decode_dtype!r}, chosen on this host): linear layers {layers}")
    print(f"Decoding K/V (decode_kv_dtype={about.decode_kv_option!r}, chosen on this host): {about.decode_kv_dtype}")
    _print_stored_kv_line(about.stored_kv)
    _print_fusion_line(about.fusion)
    _print_prefix_tier(about.prefix_tier)
    _print_history_pieces(about.history_pieces)
    _print_drafts(about)
    return 0


# Lines `ragblend info` says at length (why the weights are held so, how they run) are wrapped at this width.
WIDTH = 100


def print_wrapped(text: str, indent: str = "", more: str = "    ") -> None:
    """``text`` in lines of at most :data:`WIDTH` characters (a longer word alone), the first after
    ``indent``, the rest after ``indent + more``."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                        break_long_words=False, break_on_hyphens=False))


def print_weights(form: str, reason: str, lines) -> None:
    """How the weights are held and why (a clause of the reason a line), then how they run."""
    first, *clauses = reason.split("; ")
    print_wrapped(f"Weights: held {form}, because: {first}" + (";" if clauses else ""))
    for i, clause in enumerate(clauses, 1):
        print_wrapped(clause + (";" if i < len(clauses) else ""), "    ", "  ")
    for line in lines:   # a line indented under the one before keeps its indent
        print_wrapped(line.strip(), "  " + line[:len(line) - len(line.lstrip())])


def _print_memory_tier(title: str, what: str, off: str, info: dict, counts: str) -> None:
    """One line for a tier kept in memory: off (and how it is switched off), or its use."""
    if not info:
        print(f"{title}: off ({off})")
        return
    print(f"{title} ({what}): up to {info['max_bytes'] / 2**20:,.0f} MiB in memory per process; "
          f"{info['entries']} entries ({info['bytes'] / 2**20:,.1f} MiB), {counts}")


def _print_prefix_tier(tier: dict) -> None:
    _print_memory_tier("Prefix tier", "recent prompts' and answers' K/V, reused by exact prefix", "prefix_cache_bytes=0",
                       tier, tier and f"{tier['hits']} hits, {tier['hit_tokens']} tokens served"
                       + (f", {tier['faults']} not kept (see the log)" if tier.get("faults") else ""))


def _print_history_pieces(pieces: dict) -> None:
    _print_memory_tier("History pieces", "a conversation's turns, fused like chunks in its later turns",
                       "history_pieces=False or history_pieces_bytes=0", pieces,
                       pieces and f"{pieces['evictions']} evicted")


def _print_kernels(about) -> None:
    kernels = about.kernels
    if kernels is None and not about.quantized:   # (a quantized or 16-bit model's: described above)
        print("Kernels: the model does not run in float32 on the CPU, so its own (transformers') kernels run it.")
    elif kernels is not None:
        when = {"measured": "measured just now", "cache": "measured earlier on this host, cached"}.get(
            kernels.source, "not measured")
        print(f"Kernels per pass size ({when}; RAGBLEND_KERNELS=linear keeps F.linear everywhere):")
        print(f"  choice {kernels.state}")
        for line in kernels.buckets:
            print(f"  {line}")


def _print_drafts(about) -> None:
    drafts = about.drafts
    if drafts.max_tokens == 0:
        print("Drafts (prompt lookup): off (prompt_lookup_num_tokens=0)")
    elif not drafts.can_draft:
        print(f"Drafts (prompt lookup): off (drafts are verified in float32 only; this model runs in {about.dtype})")
    else:
        print(f"Drafts (prompt lookup, up to {drafts.max_tokens} a pass, measured at engine start): a drafted token "
              f"costs {drafts.row_cost:.0%} of a one-token pass here, so a pass drafts only what it expects to keep "
              "at that price")


def print_stored_kv(engine) -> None:
    """`ragblend info`: what the engine stores a token of KV in, its weight, and why that dtype."""
    _print_stored_kv_line(engine.describe().stored_kv)


def _print_stored_kv_line(kv) -> None:
    print(f"Stored KV (kv_dtype={kv.dtype!r}): {kv.bytes_per_token:,.0f} bytes a token; a {kv.chunk_tokens}-token "
          f"chunk {kv.chunk_bytes / 2**20:.1f} MiB ({kv.entries_per_chunk} "
          f"entr{'y' if kv.entries_per_chunk == 1 else 'ies'}). {kv.why}")


def print_fusion_cost(engine, measure: bool) -> None:
    """What ``ragblend info`` says of where the engine's own strategy fuses (core.fusion.fusion_cost)."""
    if measure:
        from ragblend.core.description import remeasure_fusion_cost

        remeasure_fusion_cost(engine)
    _print_fusion_line(engine.describe().fusion)


def _print_fusion_line(fusion) -> None:
    constants, speedup = fusion.constants, fusion.min_speedup
    where = {"unmeasured": "not measured on this host yet (the first prompt that needs them measures them, about a "
                           "second; `ragblend info --measure` now), so from scaled defaults",
             "measured": "measured on this host"}.get(fusion.constants_source, "scaled defaults")
    if fusion.always:
        print(f"Fusion: always (min_fusion_speedup={speedup:g})")
        return
    at = fusion.break_even_tokens
    print(f"Fusion: the default strategy fuses a prompt where predicted at least {speedup:g}x faster than its full "
          f"prefill, else runs the full prefill (stats.fusion_skipped); from about "
          f"{f'{at} prompt tokens' if at else 'no prompt size'} up with ~45 uncached tokens (cost constants "
          f"{where}: {constants.layer_s * 1e3:.3f} ms a pass, {constants.row_s * 1e6:.2f} us a row, "
          f"{constants.pair_s * 1e9:.2f} ns an attention pair, {constants.cached_s * 1e6:.3f} us a cached token, "
          f"per layer)")


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="show this host's CPU and the matmul kernels chosen for the model "
                                       "(measured once per host, then cached)")
    add_engine_options(info, "model", "dtype", "decode_dtype", "decode_kv_dtype", "prompt_lookup_num_tokens")
    info.add_argument("--measure", action="store_true",
                      help="measure the kernels and the fusion's cost constants again now and cache them (e.g. "
                           "if the first measurement ran on a busy machine: `choice unsettled`)")
    info.set_defaults(func=run)
