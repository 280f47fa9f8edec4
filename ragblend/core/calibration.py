"""Calibration: the recompute budget that keeps one model's fused prefill within its order noise.

A model moves its own answer when nothing but the order of the retrieved chunks changes
(full prefill, chunks reversed): that *order noise* is the yardstick. Fusion that stays
within it answers as well as a full prefill. How much recompute that takes depends on the
model (SmolLM2 needs less than Qwen2.5), so :func:`calibrate` measures it once per model on
built-in prompts (the Lowenmark sample: whole documents and single paragraphs):

1. the order noise: between the full prefills of each prompt's chunks in order and
   reversed, the first-token KL and the *answer-level* KL (:func:`answer_kl`: the mean KL over
   full prefill's own greedy answer, teacher-forced, :data:`ANSWER_TOKENS` tokens; an answer
   can drift after a faithful first token), and the answer's largest one-step KL (a year's
   digit can turn a short answer while the mean over the answer barely moves);
2. the same for :class:`~ragblend.core.strategies.QueryAware` at each ratio of
   :data:`LADDER`, cheapest first, with each selection of :data:`SELECTIONS` (single tokens,
   runs of neighbours a sixteenth of the chunk long, sentences);
3. the choice: the cheapest ratio at which some selection's first-token KL stays within
   :data:`MARGIN` of the noise's in mean *and* median, over all prompts and over the long ones
   alone, its answer's largest step within :data:`PEAK_MARGIN` of the noise's over all prompts,
   and its answer-level KL within :data:`ANSWER_MEAN_MARGIN` of the noise's in mean over all
   prompts; of the selections that pass at that ratio, the one with the lower answer-level KL.
   Ratios above it are not measured (they could not be chosen). When none passes, the most
   faithful one tried, said so. The margin is there because 8 prompts are few and the
   user's prompts are not these: on the benchmark sets a ratio that only just met the noise on
   one set missed it on another, and prompts from another domain sit further from full prefill.
   The largest step is judged because a short factual answer turns on one token: on the sample
   documents' questions a ratio within half the noise at the first token still changed years
   and once repeated itself (``docs/notes/lead-entries.md``). The answer-level mean
   is judged at the first token's margin because a ratio whose answers sat at 0.6 of the noise's
   on these prompts left a SQuAD answer over 3x the noise's median (Gemma 3 at 0.05;
   ``docs/notes/calibration.md``).

The answer-level *median* is reported, and judged only when asked (``answer_margin``, e.g. 1.0:
the answer-level KL within the noise's in mean and median). Not by default, because on Qwen2.5
that bar takes the ratio from 0.20 to 0.50, past its speed target: the noise's answer-level
median over the 8 prompts is low (on half of them the reversed order barely moves the answer),
and no ratio up to 0.30 gets under it (``docs/notes/calibration.md``).

The result is a small JSON file under ``<cache>/calibration/`` named by the engine's
``calibration_id`` (the model's fingerprint and what chunks are precomputed after). An
engine built without an explicit strategy uses it; a model without one
gets :data:`UNCALIBRATED`, a ratio that stayed within the noise on every benchmark set of
both benchmark models (``docs/notes/calibration.md``). A file that is unreadable, for another
model or of another format version is ignored (and logged), never trusted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import RagblendError
from .model import cache_dir
from .strategies import FullRecompute, QueryAware

log = logging.getLogger("ragblend")

# 2: chunks precomputed after CHUNK_CONTEXT; 3: QueryAware's attention scale; 4: its neighbour
# window; 5: its sentence runs; 6: sentence runs with a share of each token's own claim (an older
# file reads as single tokens or its window, a 5 that chose sentences is refused: it measured
# whole sentences alone; ragblend before 6 ignores a 6, never misreads it)
CALIBRATION_FORMAT = 6
READABLE_FORMATS = (3, 4, 5, 6)
LADDER = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)   # QueryAware ratios tried, cheapest first
# Chosen KL (mean and median) <= MARGIN x order noise. Half, because prompts from another
# domain land further from full prefill than the built-in ones: on held-out news prompts the
# old default's KL was 2.0x the noise where SQuAD's was 1.2x (docs/notes/calibration.md).
MARGIN = 0.5
LONG_PROMPT_TOKENS = 2048             # prompts at least this long must also pass on their own
ANSWER_TOKENS = 32                    # full prefill's greedy answer, for the answer-level KL
# QueryAware's selections tried at each ratio, as (neighbour_window, sentence_runs): single tokens,
# runs of neighbours 1/16 of the chunk long, sentences (selection.SENTENCE_OWN_SHARE)
SELECTIONS = ((0.0, False), (1 / 16, False), (0.0, True))
UNCALIBRATED = QueryAware(0.3)        # within the order noise on every benchmark set, both models (scale 1.0; 0.7 lower)
# The answer's largest one-step KL (mean and median) <= PEAK_MARGIN x the order noise's, where the
# calibration measures answers (answer_tokens > 0).
PEAK_MARGIN = 1.0
# The answer-level KL's mean <= ANSWER_MEAN_MARGIN x the noise's, where answers are measured: the
# first token's margin, for the same reason (the user's prompts sit further from full prefill).
ANSWER_MEAN_MARGIN = MARGIN
MAX_FILE_BYTES = 1 << 16
MAX_ANSWER_MARGIN = 100.0


class CalibrationError(RagblendError, RuntimeError):
    """Calibration could not run on this model."""


@dataclass
class Calibration:
    """What :func:`calibrate` measured and chose for one model."""

    fingerprint: str
    ratio: float                      # the chosen QueryAware ratio
    within_noise: bool                # False: no ratio tried stayed within the noise
    order_noise_kl: tuple[float, float]           # (mean, median) over the prompts
    chosen_kl: tuple[float, float]
    # {"ratio", "kl_mean", "kl_median", "compute"}, and "neighbour_window", "sentence_runs",
    # "answer_kl_mean", "answer_kl_median" (and "answer_kl_peak_mean", "answer_kl_peak_median") where
    # the calibration tried selections and measured the answer level
    tried: list[dict] = field(default_factory=list)
    prompts: int = 0
    seconds: float = 0.0
    format: int = CALIBRATION_FORMAT
    neighbour_window: float = 0.0     # QueryAware's, with the chosen ratio
    sentence_runs: bool = False       # QueryAware's: recompute by sentence (format 5; with its tokens' own share: 6)
    order_noise_answer_kl: tuple[float, float] | None = None   # (mean, median); None: not measured
    answer_margin: float | None = None   # the answer-level bar the choice also met; None: not judged
    # (mean, median) over the prompts of the answer's largest one-step KL, and the bar on it the
    # choice also met (None: not judged, as in files made before lead entries)
    order_noise_answer_kl_peak: tuple[float, float] | None = None
    answer_peak_margin: float | None = None
    answer_mean_margin: float | None = None   # the bar on the answer-level mean (None: not judged, older files)
    source: str = field(default="", compare=False)   # the file it came from (not stored in it)

    @property
    def strategy(self) -> QueryAware:
        return QueryAware(self.ratio, neighbour_window=self.neighbour_window, sentence_runs=self.sentence_runs)

    @property
    def strategy_name(self) -> str:
        return f"QueryAware({self.ratio}{selection_name(self.neighbour_window, self.sentence_runs)})"

    @property
    def reason(self) -> str:
        origin = ("shipped with ragblend" if self.source == SHIPPED else
                  f"from {self.source}" if self.source else "measured by this engine, not saved")
        noise = f"order noise KL {self.order_noise_kl[0]:.4f}/{self.order_noise_kl[1]:.4f} (mean/median)"
        if self.within_noise:
            answers = "".join(f", and its {what} within {margin:.0%} of the noise's" for what, margin in
                              (("answer's largest step", self.answer_peak_margin),
                               ("answer-level mean", self.answer_mean_margin),
                               ("answer-level KL", self.answer_margin)) if margin)
            return (f"calibrated ({origin}): {self.strategy_name} is the cheapest ratio whose KL "
                    f"{self.chosen_kl[0]:.4f}/{self.chosen_kl[1]:.4f} stays within {MARGIN:.0%} of the model's "
                    f"{noise} on {self.prompts} prompts (the long ones too){answers}")
        return (f"calibrated ({origin}): no ratio tried stayed within {MARGIN:.0%} of the model's {noise}; "
                f"using the most faithful{' over the answer' if self.answer_margin else ''}, {self.strategy_name}, "
                f"KL {self.chosen_kl[0]:.4f}/{self.chosen_kl[1]:.4f}")


def calibration_file(fingerprint: str) -> Path:
    return cache_dir() / "calibration" / f"{fingerprint[:32]}.json"


# Calibrations measured by the project and shipped with the package (the embedded default
# model's, so that it runs at its own ratio out of the box); the user's own file wins.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
SHIPPED = "shipped"   # Calibration.source of a shipped calibration


def load_calibration(fingerprint: str) -> Calibration | None:
    """The stored calibration of the model with this fingerprint: the user's own, else one
    shipped with ragblend, else None. A file that is unreadable, foreign or of another format
    is ignored (and logged), never trusted."""
    user = calibration_file(fingerprint)
    for path, source in ((user, str(user)), (SHIPPED_DIR / user.name, SHIPPED)):
        try:
            if not path.exists() and not path.is_symlink():
                continue
            if path.is_symlink() or not path.is_file():
                raise ValueError("not a regular file")
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError("file too large")
            data = json.loads(path.read_text(encoding="utf-8"))
            calibration = _from_json(data)
        except (OSError, ValueError, TypeError, KeyError, RecursionError, OverflowError) as err:
            log.warning("ragblend: ignoring the calibration file %s (%s); delete it, or run engine.calibrate() "
                        "again.", path, err)
            continue
        if calibration.fingerprint != fingerprint:
            log.warning("ragblend: ignoring the calibration file %s: it was made for another model; delete it.", path)
            continue
        calibration.source = source
        return calibration
    return None


def _from_json(data) -> Calibration:
    if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
        raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r} "
                         f"is not one of {READABLE_FORMATS}")
    if not isinstance(data["fingerprint"], str) or not isinstance(data["within_noise"], bool):
        raise ValueError("bad fingerprint or within_noise")
    ratio = _number(data["ratio"], 0.0, 1.0)
    if ratio == 0:
        raise ValueError("ratio 0")
    tried = data.get("tried", [])
    if not isinstance(tried, list) or len(tried) > 64:
        raise ValueError("bad tried list")
    sentence_runs = data.get("sentence_runs", False)
    if not isinstance(sentence_runs, bool) or sentence_runs and data.get("neighbour_window"):
        raise ValueError("bad sentence_runs")
    if sentence_runs and data["format"] == 5:
        raise ValueError("it chose whole sentences, which QueryAware(sentence_runs=True) no longer runs")
    answer_noise, answer_margin = data.get("order_noise_answer_kl"), data.get("answer_margin")
    peak_noise, peak_margin = data.get("order_noise_answer_kl_peak"), data.get("answer_peak_margin")
    mean_margin = data.get("answer_mean_margin")
    if (answer_margin is not None or mean_margin is not None) and answer_noise is None:
        raise ValueError("an answer margin without order_noise_answer_kl")
    if peak_margin is not None and peak_noise is None:
        raise ValueError("answer_peak_margin without order_noise_answer_kl_peak")
    return Calibration(data["fingerprint"], ratio, data["within_noise"], _pair(data["order_noise_kl"]),
                       _pair(data["chosen_kl"]), [_tried_row(row) for row in tried],
                       int(_number(data.get("prompts", 0), 0, 1e6)), _number(data.get("seconds", 0.0)),
                       neighbour_window=_number(data.get("neighbour_window", 0.0), 0.0, 1.0), sentence_runs=sentence_runs,
                       order_noise_answer_kl=None if answer_noise is None else _pair(answer_noise),
                       answer_margin=None if answer_margin is None else _number(answer_margin, 1e-9, MAX_ANSWER_MARGIN),
                       order_noise_answer_kl_peak=None if peak_noise is None else _pair(peak_noise),
                       answer_peak_margin=None if peak_margin is None else _number(peak_margin, 1e-9, MAX_ANSWER_MARGIN),
                       answer_mean_margin=None if mean_margin is None else _number(mean_margin, 1e-9, MAX_ANSWER_MARGIN))


def _number(value, low=0.0, high=math.inf) -> float:
    """A number read from a calibration file, checked: a float in [low, high]."""
    try:
        good = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
            and low <= value <= high
    except OverflowError:   # a JSON integer too large for a float
        good = False
    if not good:
        raise ValueError(f"bad value {str(value)[:40]}")
    return float(value)


def _pair(value) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"bad pair {value!r}")
    return _number(value[0]), _number(value[1])


def _tried_row(row) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"bad tried row {row!r}")
    measured = {k: _number(row[k], 0.0, 1.0 if k in ("ratio", "compute") else math.inf)
                for k in ("ratio", "kl_mean", "kl_median", "compute")}
    if "neighbour_window" in row:
        measured["neighbour_window"] = _number(row["neighbour_window"], 0.0, 1.0)
    if "sentence_runs" in row:
        if not isinstance(row["sentence_runs"], bool):
            raise ValueError("bad sentence_runs in a tried row")
        measured["sentence_runs"] = row["sentence_runs"]
    return measured | {k: _number(row[k]) for k in ("answer_kl_mean", "answer_kl_median", "answer_kl_peak_mean",
                                                    "answer_kl_peak_median") if k in row}


def save_calibration(calibration: Calibration) -> Path:
    path = calibration_file(calibration.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = asdict(calibration)
    del data["source"]   # where a file came from is not part of it
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def builtin_prompts() -> list[tuple[list[str], str]]:
    """``(chunks, question)`` pairs from the Lowenmark sample: six prompts of six single
    paragraphs (~700 tokens, like a typical top-k retrieval) and two of the six whole
    documents (~3k tokens) in rotated orders."""
    from ragblend.data import load_sample

    sample = load_sample()
    paragraphs = [p.strip() for doc in sample["chunks"] for p in doc.split("\n\n") if p.strip()]
    questions = [q["question"] for q in sample["demo"]] + [sample["question"]]
    prompts = []
    for i, question in enumerate(questions[:6]):
        picks = [paragraphs[(5 * i + 7 * j) % len(paragraphs)] for j in range(6)]
        prompts.append((list(dict.fromkeys(picks)), f"Question: {question} Answer briefly."))
    documents = sample["chunks"]
    for i in range(2):
        prompts.append((documents[2 * i:] + documents[:2 * i], f"Question: {questions[i]} Answer briefly."))
    return prompts


def calibrate(engine, prompts: list[tuple[list[str], str]] | None = None, *, neighbour_window: float | None = None,
              sentence_runs: bool | None = None, answer_tokens: int = ANSWER_TOKENS, answer_margin: float | None = None,
              progress: bool = False) -> Calibration:
    """Measure ``engine``'s model (see the module docstring). ``prompts`` replaces the
    built-in ones with your own ``(chunks, question)`` pairs (at least two chunks each).
    ``neighbour_window``: try only this QueryAware window; ``sentence_runs=True``: only whole
    sentences, ``False``: no sentences (both None: each of :data:`SELECTIONS`).
    ``answer_tokens``: the length of full prefill's greedy answer the answer-level KL is taken
    over (0: first token only; faster). ``answer_margin``: also require the answer-level KL
    within this share of the noise's, in mean and median (None: reported, not judged)."""
    t0 = time.perf_counter()
    prompts = builtin_prompts() if prompts is None else list(prompts)
    if not prompts or any(len(chunks) < 2 for chunks, _ in prompts):
        raise CalibrationError("calibrate needs prompts of at least two chunks each, as (chunks, question) pairs.")
    check_answer_options(answer_tokens, answer_margin)
    selections = selections_to_try(neighbour_window, sentence_runs)
    # every strategy made now, so that a bad option is an error before minutes of measuring
    strategies = {(ratio, selection): QueryAware(ratio, neighbour_window=selection[0], sentence_runs=selection[1])
                  for ratio in LADDER for selection in selections}
    from tqdm.auto import tqdm
    bar = tqdm(total=len(prompts) * (1 + len(strategies)), desc="Calibrating", unit="prefill", disable=not progress)
    try:
        references = []
        for chunks, question in prompts:
            references.append(measure_reference(engine, chunks, question, answer_tokens))
            bar.update()
        lengths = [reference.tokens for reference in references]
        measures = ("kl", "answer_kl", "answer_kl_peak") if answer_tokens else ("kl",)
        noise = {measure: [reference.noise[measure] for reference in references] for measure in measures}
        # The bars a ratio must meet: (measure, the share of its per-prompt order noise a ratio may
        # reach, the prompts' lengths to also judge the long ones alone by, whether the median is judged).
        bars = [("kl", MARGIN, lengths, True)]
        if answer_tokens:
            # Over all prompts only: on the long ones alone (two of the built-in eight) a mean and
            # median would be those of two values, too few to judge by. The answer-level median is
            # not judged by default (the module docstring says why).
            bars += [("answer_kl_peak", PEAK_MARGIN, [], True), ("answer_kl", ANSWER_MEAN_MARGIN, [], False)]
        if answer_margin:
            bars.append(("answer_kl", answer_margin, lengths, True))
        tried, passing, skipped = [], [], 0
        for (ratio, (window, sentences)), strategy in strategies.items():   # cheapest ratio first
            if passing and ratio > passing[0]["ratio"]:
                break   # a cheaper ratio passed: the dearer ones could not be chosen
            rows = []
            for (chunks, question), reference in zip(prompts, references):
                rows.append(measure_strategy(engine, chunks, question, reference, strategy))
                bar.update()
            skipped = max(skipped, sum(row["fusion_skipped"] for row in rows))
            values = {measure: [row[measure] for row in rows] for measure in measures}
            summary = {"ratio": ratio, "neighbour_window": window, "sentence_runs": sentences,
                       "compute": statistics.mean(row["compute"] for row in rows)}
            for measure in measures:
                summary[f"{measure}_mean"], summary[f"{measure}_median"] = mean_median(values[measure])
            tried.append(summary)
            if all(within_margin(values[measure], noise[measure], margin, long_lengths, median=median)
                   for measure, margin, long_lengths, median in bars):
                passing.append(summary)
    except RagblendError as err:
        raise CalibrationError(f"calibration could not run on this model: {err}") from err
    finally:
        bar.total = bar.n   # ratios above the choice are not measured
        bar.close()
    if skipped:
        # Their KL of 0 is real (a full prefill ran) but says nothing of fusing longer prompts.
        log.warning("ragblend: calibration: on %s of %d prompts QueryAware ran as a full prefill (their chunks are "
                    "short beside the rest of the prompt), so they do not judge the fusion; calibrate on prompts "
                    "like your real ones.", skipped, len(prompts))
    closer = "answer_kl_mean" if answer_tokens else "kl_mean"      # breaks a tie between selections
    faithfulness = "answer_kl_mean" if answer_margin else "kl_mean"   # what the choice judges
    within_noise = bool(passing)
    chosen = min(passing, key=lambda row: row[closer]) if passing else min(tried, key=lambda row: row[faithfulness])
    noise_summary = {measure: mean_median(values) for measure, values in noise.items()}
    return Calibration(engine.calibration_id, chosen["ratio"], within_noise, noise_summary["kl"],
                       (chosen["kl_mean"], chosen["kl_median"]), tried, len(prompts), time.perf_counter() - t0,
                       neighbour_window=chosen["neighbour_window"], sentence_runs=chosen["sentence_runs"],
                       order_noise_answer_kl=noise_summary.get("answer_kl"), answer_margin=answer_margin,
                       order_noise_answer_kl_peak=noise_summary.get("answer_kl_peak"),
                       answer_peak_margin=PEAK_MARGIN if answer_tokens else None,
                       answer_mean_margin=ANSWER_MEAN_MARGIN if answer_tokens else None)


def selections_to_try(neighbour_window: float | None, sentence_runs: bool | None) -> list[tuple[float, bool]]:
    """The ``(neighbour_window, sentence_runs)`` pairs :func:`calibrate` tries, as asked (both
    given, or a bad value: QueryAware's own error, when calibrate makes the strategies)."""
    if sentence_runs:
        return [(neighbour_window or 0.0, sentence_runs)]
    if neighbour_window is not None:
        return [(neighbour_window, False)]
    return [selection for selection in SELECTIONS if not (sentence_runs is False and selection[1])]


def selection_name(neighbour_window: float, sentence_runs: bool) -> str:
    """A selection's QueryAware keywords, as written after the ratio (empty for single tokens)."""
    return ", sentence_runs=True" if sentence_runs else \
        f", neighbour_window={neighbour_window:g}" if neighbour_window else ""


def check_answer_options(answer_tokens, answer_margin) -> None:
    """:func:`calibrate`'s answer options, checked before minutes of measuring."""
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 0:
        raise CalibrationError(f"calibrate's answer_tokens must be a whole number >= 0 (0: first token only), "
                               f"not {answer_tokens!r}.")
    if answer_margin is not None:
        if isinstance(answer_margin, bool) or not isinstance(answer_margin, (int, float)) or \
                not 0 < answer_margin <= MAX_ANSWER_MARGIN:
            raise CalibrationError(f"calibrate's answer_margin must be a number in (0, {MAX_ANSWER_MARGIN:g}] "
                                   f"(e.g. 1.0: within the order noise), not {answer_margin!r}.")
        if not answer_tokens:
            raise CalibrationError("calibrate's answer_margin judges the answers, so it needs answer_tokens > 0.")


def mean_median(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.median(values)


@dataclass
class Reference:
    """One calibration prompt's yardstick: its length in ``tokens``, full prefill's first-token
    ``logits``, greedy ``answer`` and the logits at each of its steps (``steps``, teacher-forced),
    and the order noise's row (``noise``, as :func:`measure_strategy`'s)."""

    tokens: int
    noise: dict
    logits: torch.Tensor | None = None
    answer: list[int] = field(default_factory=list)   # empty: first token only
    steps: torch.Tensor | None = None


def measure_reference(engine, chunks: list[str], question: str, answer_tokens: int) -> Reference:
    """Full prefill of one calibration prompt, its greedy answer (``answer_tokens`` long, at least
    its first token; 0: none) and the order noise (the chunks reversed) measured against it."""
    from .prompt import Chunk

    engine.precompute(chunks)
    segments = [Chunk(c) for c in chunks] + [question]
    full = engine.prefill(segments, strategy=FullRecompute())
    reference = Reference(len(full.token_ids), {}, full.logits)
    if answer_tokens:
        answer = engine.generate(segments, strategy=FullRecompute(), max_new_tokens=answer_tokens).token_ids
        reference.answer = answer or [int(full.logits.argmax())]
        reference.steps = answer_logits(engine, full, reference.answer)
    reordered = engine.prefill([Chunk(c) for c in reversed(chunks)] + [question], strategy=FullRecompute())
    reference.noise = against_reference(engine, reference, reordered)
    return reference


def measure_strategy(engine, chunks: list[str], question: str, reference: Reference, strategy) -> dict:
    """One strategy on one calibration prompt: the first-token ``"kl"`` against full prefill and,
    where the reference has an answer, the ``"answer_kl"`` over it and its ``"answer_kl_peak"``,
    the largest KL at any one step (a short factual answer turns on a token or two, which the mean
    over the answer dilutes); and its ``"compute"`` and whether the fusion was skipped."""
    from .prompt import Chunk

    out = engine.prefill([Chunk(c) for c in chunks] + [question], strategy=strategy)
    return against_reference(engine, reference, out) | {"compute": out.stats.compute_fraction,
                                                        "fusion_skipped": out.stats.fusion_skipped}


def against_reference(engine, reference: Reference, prefill) -> dict:
    row = {"kl": first_token_kl(reference.logits, prefill.logits)}
    if reference.answer:
        row |= answer_kls(reference.steps, answer_logits(engine, prefill, reference.answer))
    return row


def within_margin(values: list[float], noise: list[float], margin: float, lengths: list[int], *,
                  median: bool = True) -> bool:
    """Whether per-prompt ``values`` stay within ``margin`` x the per-prompt ``noise`` in mean (and
    ``median``), over all prompts and over the long ones (``lengths`` >= :data:`LONG_PROMPT_TOKENS`) alone."""
    # Long prompts are judged on their own too: on Qwen2.5 a ratio comfortably within the noise
    # on short prompts was outside it on ~3k-token ones, and the short ones outnumber them.
    groups = [list(range(len(noise)))]
    long = [i for i, n in enumerate(lengths) if n >= LONG_PROMPT_TOKENS]
    if 0 < len(long) < len(noise):
        groups.append(long)
    for group in groups:
        ours, theirs = [values[i] for i in group], [noise[i] for i in group]
        if statistics.mean(ours) > margin * statistics.mean(theirs) or \
                median and statistics.median(ours) > margin * statistics.median(theirs):
            return False
    return True


def first_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || fused) between the next-token distributions of two prefills."""
    return torch.nn.functional.kl_div(torch.log_softmax(logits.float(), -1), torch.log_softmax(reference.float(), -1),
                                      log_target=True, reduction="sum").item()


def calibrate_and_save(engine, prompts=None, *, save: bool = True, progress: bool = True,
                       **options) -> Calibration:
    """:func:`calibrate` (``options``: its keyword arguments), then (``save``) store the result;
    a folder that cannot be written is a warning, not a loss of minutes of measuring."""
    result = calibrate(engine, prompts, progress=progress, **options)
    if save:
        try:
            result.source = str(save_calibration(result))
        except OSError as err:
            log.warning("ragblend: could not save the calibration (%s: %s); this engine uses it, later "
                        "engines will not.", type(err).__name__, err)
    return result


def answer_logits(engine, prefill, answer_ids: list[int], *, decoding_bias=True) -> torch.Tensor:
    """The next-token logits ``[len(answer_ids), vocab]`` at each step of ``answer_ids`` after
    ``prefill`` (a :class:`~ragblend.core.results.Prefill`), teacher-forced: step i is conditioned
    on ``answer_ids[:i]``, whatever the prefill would have chosen. One pass on the engine's
    decoding weights. ``decoding_bias=False`` leaves the fused prefill's key bias (QueryAware's
    cached-attention scale) out of the answer's steps, keeping it in the prefill's own logits.
    ``decoding_bias`` may also be a function ``step -> factor`` (step 1 is the answer's second
    token): the bias times that factor at each step, e.g. a scale that fades over the answer
    (one pass per token then, since each step sees another bias)."""
    from .generate import KVDecoder

    n = len(prefill.token_ids)
    first = prefill.logits.float()[None]
    if len(answer_ids) < 2:
        return first[:len(answer_ids)]
    bias = prefill.key_bias if decoding_bias is not False else None
    decoder = KVDecoder(engine.decoding_adapter(), prefill.keys, prefill.values, n + len(answer_ids), bias)
    with engine.lock:
        if bias is None or not callable(decoding_bias):
            rest = decoder.extend(list(answer_ids[:-1]))
        else:
            steps = []
            for i, token in enumerate(answer_ids[:-1], start=1):
                decoder.key_bias[:n] = bias * float(decoding_bias(i))
                steps.append(decoder.extend([token]))
            rest = torch.cat(steps)
    return torch.cat([first, rest.float()])


def answer_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Answer-level KL: the mean over the answer's steps of KL(reference || other), both from
    :func:`answer_logits` on the same answer (the reference's own greedy answer). First-token KL
    sees only the first step; this sees the answer drift that follows."""
    return answer_kl_steps(reference, logits).mean().item()


def answer_kls(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """``{"answer_kl", "answer_kl_peak"}``: :func:`answer_kl` and the largest KL at any one step
    of the answer (a short factual answer turns on a token or two, which the mean dilutes)."""
    steps = answer_kl_steps(reference, logits)
    return {"answer_kl": steps.mean().item(), "answer_kl_peak": steps.max().item()}


def answer_kl_steps(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) at each step of the answer ``[steps]``; see :func:`answer_kl`."""
    log_ref, log_other = torch.log_softmax(reference.float(), -1), torch.log_softmax(logits.float(), -1)
    return (log_ref.exp() * (log_ref - log_other)).sum(-1)
