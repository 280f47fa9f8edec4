"""Calibration: the recompute budget that keeps one model's fused prefill within its order noise.

A model moves its own answer when nothing but the order of the retrieved chunks changes
(full prefill, chunks reversed): that *order noise* is the yardstick. Fusion that stays
within it answers as well as a full prefill. How much recompute that takes depends on the
model (SmolLM2 needs less than Qwen2.5), so :func:`calibrate` measures it once per model on
built-in prompts (the Lowenmark sample: whole documents and single paragraphs):

1. the order noise: first-token KL between the full prefills of each prompt's chunks in
   order and reversed (mean and median over the prompts);
2. the same KL for :class:`~ragblend.core.strategies.QueryAware` at each ratio of
   :data:`LADDER`, cheapest first;
3. the choice: the cheapest ratio whose mean *and* median KL stay within :data:`MARGIN` of
   the noise, over all prompts and over the long ones alone (or the most faithful one tried,
   said so, when none does). The margin is there because 8 prompts are few and the user's
   prompts are not these: on the benchmark sets a ratio that only just met the noise on one
   set missed it on another, and prompts from another domain sit further from full prefill.

The result is a small JSON file under ``<cache>/calibration/`` named by the engine's
``calibration_id`` (the model's fingerprint and what chunks are precomputed after). An
engine built without an explicit strategy uses it; a model without one
gets :data:`UNCALIBRATED`, a ratio that stayed within the noise on every benchmark set of
both benchmark models (``docs/benchmarks.md``). A file that is unreadable, for another
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

CALIBRATION_FORMAT = 3                # 2: chunks precomputed after CHUNK_CONTEXT; 3: QueryAware's attention scale
LADDER = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)   # QueryAware ratios tried, cheapest first
# Chosen KL (mean and median) <= MARGIN x order noise. Half, because prompts from another
# domain land further from full prefill than the built-in ones: on held-out news prompts the
# old default's KL was 2.0x the noise where SQuAD's was 1.2x (docs/benchmarks.md, Calibration).
MARGIN = 0.5
LONG_PROMPT_TOKENS = 2048             # prompts at least this long must also pass on their own
UNCALIBRATED = QueryAware(0.3)        # within the order noise on every benchmark set, both models (scale 1.0; 0.7 lower)
MAX_FILE_BYTES = 1 << 16


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
    tried: list[dict] = field(default_factory=list)   # {"ratio", "kl_mean", "kl_median", "compute"}
    prompts: int = 0
    seconds: float = 0.0
    format: int = CALIBRATION_FORMAT
    source: str = field(default="", compare=False)   # the file it came from (not stored in it)

    @property
    def strategy(self) -> QueryAware:
        return QueryAware(self.ratio)

    @property
    def reason(self) -> str:
        origin = ("shipped with ragblend" if self.source == SHIPPED else
                  f"from {self.source}" if self.source else "measured by this engine, not saved")
        noise = f"order noise KL {self.order_noise_kl[0]:.4f}/{self.order_noise_kl[1]:.4f} (mean/median)"
        if self.within_noise:
            return (f"calibrated ({origin}): QueryAware({self.ratio}) is the cheapest ratio whose KL "
                    f"{self.chosen_kl[0]:.4f}/{self.chosen_kl[1]:.4f} stays within {MARGIN:.0%} of the model's "
                    f"{noise} on {self.prompts} prompts (the long ones too)")
        return (f"calibrated ({origin}): no ratio tried stayed within {MARGIN:.0%} of the model's {noise}; "
                f"using the most faithful, QueryAware({self.ratio}), KL {self.chosen_kl[0]:.4f}/{self.chosen_kl[1]:.4f}")


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
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as err:
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
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r} "
                         f"is not {CALIBRATION_FORMAT}")

    def number(value, low=0.0, high=math.inf) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not low <= value <= high:
            raise ValueError(f"bad value {value!r}")
        return float(value)

    def pair(value) -> tuple[float, float]:
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"bad pair {value!r}")
        return number(value[0]), number(value[1])

    if not isinstance(data["fingerprint"], str) or not isinstance(data["within_noise"], bool):
        raise ValueError("bad fingerprint or within_noise")
    ratio = number(data["ratio"], 0.0, 1.0)
    if ratio == 0:
        raise ValueError("ratio 0")
    tried = data.get("tried", [])
    if not isinstance(tried, list) or len(tried) > 64:
        raise ValueError("bad tried list")
    tried = [{k: number(row[k]) for k in ("ratio", "kl_mean", "kl_median", "compute")} for row in tried]
    return Calibration(data["fingerprint"], ratio, data["within_noise"], pair(data["order_noise_kl"]),
                       pair(data["chosen_kl"]), tried, int(number(data.get("prompts", 0), 0, 1e6)),
                       number(data.get("seconds", 0.0)))


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


def calibrate(engine, prompts: list[tuple[list[str], str]] | None = None, *, progress: bool = False) -> Calibration:
    """Measure ``engine``'s model (see the module docstring). ``prompts`` replaces the
    built-in ones with your own ``(chunks, question)`` pairs (at least two chunks each)."""
    from .prompt import Chunk

    t0 = time.perf_counter()
    prompts = builtin_prompts() if prompts is None else list(prompts)
    if not prompts or any(len(chunks) < 2 for chunks, _ in prompts):
        raise CalibrationError("calibrate needs prompts of at least two chunks each, as (chunks, question) pairs.")
    kl = first_token_kl
    noise, fused, lengths = [], {ratio: [] for ratio in LADDER}, []
    compute = {ratio: [] for ratio in LADDER}
    skipped = {ratio: 0 for ratio in LADDER}   # prompts whose fusion ran as a full prefill (exact: KL 0)
    items = prompts
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(prompts, desc="Calibrating", unit="prompt")
    try:
        for chunks, question in items:
            engine.precompute(chunks)
            segments = [Chunk(c) for c in chunks] + [question]
            full = engine.prefill(segments, strategy=FullRecompute())
            reference = full.logits
            lengths.append(len(full.token_ids))
            reordered = engine.prefill([Chunk(c) for c in reversed(chunks)] + [question], strategy=FullRecompute())
            noise.append(kl(reference, reordered.logits))
            for ratio in LADDER:
                out = engine.prefill(segments, strategy=QueryAware(ratio))
                fused[ratio].append(kl(reference, out.logits))
                compute[ratio].append(out.stats.compute_fraction)
                skipped[ratio] += out.stats.fusion_skipped
    except RagblendError as err:
        raise CalibrationError(f"calibration could not run on this model: {err}") from err
    if any(skipped.values()):
        # Their KL of 0 is real (a full prefill ran) but says nothing of fusing longer prompts.
        log.warning("ragblend: calibration: on %s of %d prompts QueryAware ran as a full prefill (their chunks are "
                    "short beside the rest of the prompt), so they do not judge the fusion; calibrate on prompts "
                    "like your real ones.", max(skipped.values()), len(prompts))
    noise_kl = (statistics.mean(noise), statistics.median(noise))
    tried = [{"ratio": r, "kl_mean": statistics.mean(fused[r]), "kl_median": statistics.median(fused[r]),
              "compute": statistics.mean(compute[r])} for r in LADDER]
    ratio = cheapest_within_margin(noise, fused, lengths)
    chosen = next(row for row in tried if row["ratio"] == ratio) if ratio is not None else \
        min(tried, key=lambda row: row["kl_mean"])
    return Calibration(engine.calibration_id, chosen["ratio"], ratio is not None, noise_kl,
                       (chosen["kl_mean"], chosen["kl_median"]), tried, len(prompts), time.perf_counter() - t0)


def cheapest_within_margin(noise: list[float], fused: dict[float, list[float]],
                           lengths: list[int]) -> float | None:
    """The cheapest ratio of ``fused`` (ratio -> per-prompt KL, cheapest first) whose mean and
    median KL stay within :data:`MARGIN` of the per-prompt order ``noise``, over all prompts
    and over the long ones (``lengths`` >= :data:`LONG_PROMPT_TOKENS`) alone; None if none does."""
    # Long prompts are judged on their own too: on Qwen2.5 a ratio comfortably within the noise
    # on short prompts was outside it on ~3k-token ones, and the short ones outnumber them.
    groups = [list(range(len(noise)))]
    long = [i for i, n in enumerate(lengths) if n >= LONG_PROMPT_TOKENS]
    if 0 < len(long) < len(noise):
        groups.append(long)

    def within_margin(kls: list[float]) -> bool:
        for group in groups:
            ours, theirs = [kls[i] for i in group], [noise[i] for i in group]
            if statistics.mean(ours) > MARGIN * statistics.mean(theirs) or \
                    statistics.median(ours) > MARGIN * statistics.median(theirs):
                return False
        return True

    return next((ratio for ratio, kls in fused.items() if within_margin(kls)), None)


def first_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || fused) between the next-token distributions of two prefills."""
    return torch.nn.functional.kl_div(torch.log_softmax(logits.float(), -1), torch.log_softmax(reference.float(), -1),
                                      log_target=True, reduction="sum").item()


def calibrate_and_save(engine, prompts=None, *, save: bool = True, progress: bool = True) -> Calibration:
    """:func:`calibrate`, then (``save``) store the result; a folder that cannot be written
    is a warning, not a loss of minutes of measuring."""
    result = calibrate(engine, prompts, progress=progress)
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
    log_ref, log_other = torch.log_softmax(reference.float(), -1), torch.log_softmax(logits.float(), -1)
    return (log_ref.exp() * (log_ref - log_other)).sum(-1).mean().item()
