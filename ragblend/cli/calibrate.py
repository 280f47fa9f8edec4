"""`ragblend calibrate`: measure the model's cheapest safe recompute ratio, once."""

from __future__ import annotations

from .args import add_engine_options, load_engine, number_in, whole_number


def _selection(row: dict) -> str:
    """A calibration row's selection, for its table (rows of older files have fewer keys)."""
    if row.get("sentence_runs"):
        return "sentences"
    window = row.get("neighbour_window", 0.0)
    return f"runs of {window:.4g} chunk" if window else "single tokens"


def run(args) -> int:
    from ragblend.core.calibration.search import check_answer_options

    check_answer_options(args.answer_tokens, args.answer_margin)   # before minutes of loading and measuring
    engine = load_engine(args, kv_dir=False)
    print(f"Calibrating {engine.name} on the built-in prompts (once per model; 5-20 minutes on a 2-core CPU)...",
          flush=True)
    result = engine.calibrate(progress=True, neighbour_window=args.neighbour_window,
                              sentence_runs=True if args.sentence_runs else None, answer_tokens=args.answer_tokens,
                              answer_margin=args.answer_margin)
    answers = result.order_noise_answer_kl is not None
    # the largest one-step KL over the answer: in files written before it was measured, absent
    peaks = answers and result.order_noise_answer_kl_peak is not None

    def cells(pairs) -> str:   # (mean, median) pairs
        return "".join(f" {mean:.4f} | {median:.4f} |" for mean, median in pairs)

    extra = ("answer_kl",) * answers + ("answer_kl_peak",) * peaks
    measures = ("kl", *extra)
    print("| QueryAware ratio | selection | compute | KL mean | KL median |" +
          (" answer KL mean | answer KL median |" if answers else "") +
          (" largest step KL mean | largest step KL median |" if peaks else "") +
          "\n|---:|---:|---:|---:|---:|" + "---:|---:|" * len(extra))
    for row in result.tried:
        print(f"| {row['ratio']:.2f} | {_selection(row)} | {row['compute']:.1%} |" +
              cells((row[f"{name}_mean"], row[f"{name}_median"]) for name in measures))
    noise = {"kl": result.order_noise_kl, "answer_kl": result.order_noise_answer_kl,
             "answer_kl_peak": result.order_noise_answer_kl_peak}
    print("| order noise | | 100% |" + cells(noise[name] for name in measures))
    print(f"Chosen: {result.reason}.")
    if result.source:
        print(f"Engines of this model use it from now on. Delete {result.source} to go back to the calibration "
              "shipped with ragblend (SmolLM2's, Qwen2.5-Coder-0.5B's, Gemma 3 270M's) or, for other models, "
              "QueryAware(0.3).")
    return 0


def add_parser(sub) -> None:
    calibrate = sub.add_parser("calibrate", help="find the model's cheapest recompute ratio within half its "
                                                 "order noise, once (5-20 minutes on a 2-core CPU); engines use it "
                                                 "from then on, in place of a shipped calibration")
    selection = calibrate.add_mutually_exclusive_group()
    selection.add_argument("--neighbour-window", type=number_in(0.0, 1.0), default=None, metavar="FRACTION",
                           help="try only this QueryAware neighbour window, a fraction of a chunk in [0, 1] "
                                "(0: single tokens; default: try single tokens, runs of 1/16 chunk and sentences)")
    selection.add_argument("--sentence-runs", action="store_true",
                           help="try only runs by sentence (QueryAware's sentence_runs)")
    calibrate.add_argument("--answer-tokens", type=whole_number, default=32,
                           help="also measure the KL over full prefill's greedy answer of this many tokens "
                                "(default: 32; 0: first token only, faster)")
    calibrate.add_argument("--answer-margin", type=number_in(0.0, 100.0, low_open=True), default=None, metavar="SHARE",
                           help="also require that answer-level KL within this share of the order noise's, e.g. 1.0 "
                                "(default: reported, not required; a safer ratio, often a slower one)")
    add_engine_options(calibrate, "model", "dtype")
    calibrate.set_defaults(func=run)
