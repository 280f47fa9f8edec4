"""A calibration's record: :class:`Calibration` (what :func:`~.search.calibrate` measured and
chose), the bars it was judged by, and its JSON file under ``<cache>/calibration/``: written
atomically, and read back checked (a file that is unreadable, for another model or of another
format version is ignored and logged, never trusted).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import RagblendError
from ..fusion.strategies import QueryAware
from ..paths import cache_dir

log = logging.getLogger("ragblend")

# 2: chunks precomputed after CHUNK_CONTEXT; 3: QueryAware's attention scale; 4: its neighbour
# window; 5: its sentence runs; 6: sentence runs with a share of each token's own claim (an older
# file reads as single tokens or its window, a 5 that chose sentences is refused: it measured
# whole sentences alone; ragblend before 6 ignores a 6, never misreads it)
CALIBRATION_FORMAT = 6
READABLE_FORMATS = (3, 4, 5, 6)

# Chosen KL (mean and median) <= MARGIN x order noise. Half, because prompts from another
# domain land further from full prefill than the built-in ones: on held-out news prompts the
# old default's KL was 2.0x the noise where SQuAD's was 1.2x (docs/notes/calibration.md).
MARGIN = 0.5

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
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "calibration"
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


def selection_name(neighbour_window: float, sentence_runs: bool) -> str:
    """A selection's QueryAware keywords, as written after the ratio (empty for single tokens)."""
    return ", sentence_runs=True" if sentence_runs else \
        f", neighbour_window={neighbour_window:g}" if neighbour_window else ""
