"""Fusion against a full prefill, timed and worded alike by `ragblend ask --compare`, `ragblend
demo` and the Streamlit app.

**Warm both paths alike.** A process's first fused answer pays one-off costs that its later
ones do not (measured on SmolLM2, one process: the first fused answer 14.2 s, the next ones on
other prompts 0.9-1.7 s; the first full prefill 25.6 s, the next 5.3 s), and they are paid
once per path, not per prompt. Timing each path's first answer would compare those costs, not
the paths, so :func:`warm_up` gives each path one untimed one-token answer first, on the same
question. The warm-up reads the chunks' KV from the store like any answer, which leaves it in
the store's memory tier: the timed fused answer then reads it from there, as a running process
(the app, a server) does for chunks it has answered from before; its line names the tier. A
chunk the store lacked is computed and stored by the warm-up, as by any first question on it,
and :func:`warm_up_note` says so.

**Time fusion, not the prefix tier** (:func:`fusion_only`). The warm-up runs the timed prompt
(or one with the same chunks) once already, so with the engine's prefix tier on the timed
"fused" answer would be an exact repeat served from the tier: a comparison keeps the tier out
while it runs.

**Word the ratio the right way round** (:func:`speed_ratio`): "fused 2.1x faster than full
prefill", "fused 0.8x: slower than full prefill", never a slowdown worded or coloured as a gain.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

# `with fusion_only():` answers in this thread (and its context) neither read nor fill the engine's
# prefix tier, so what is timed is the fused prefill and the full one, as asked; other threads
# (another app session, a server's requests) use the tier as usual.
from ragblend.core.decode.prefix_cache import bypassed as fusion_only  # noqa: F401 (the callers' name)
from ragblend.core.results import Stats

FULL_PREFILL = "full_recompute"   # the strategy every comparison is against

# The paths each engine has answered on in this process (warmed): a process's one-off costs are
# paid once per path, so a later comparison on the same engine needs no warm-up.
_warmed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SpeedRatio:
    """How fused TTFT compares with a full prefill's, as shown: ``ratio`` is full prefill's TTFT
    over the fused one (> 1: fusion faster); ``direction`` ("faster", "slower" or "same") is
    decided on the ratio as printed, so "1.0x" is never called faster or slower."""

    ratio: float
    shown: str        # the ratio as printed, e.g. "2.1"
    direction: str    # "faster" | "slower" | "same"
    fused_s: float | None = None   # the two TTFTs, where the ratio is of two answers
    full_s: float | None = None

    @classmethod
    def of(cls, ratio: float, fused_s: float | None = None, full_s: float | None = None) -> "SpeedRatio":
        """The comparison for ``ratio`` (full prefill's TTFT over the fused one, > 0)."""
        shown = f"{ratio:.1f}" if ratio >= 0.1 else f"{ratio:.2f}"   # 0.04x, not 0.0x
        value = float(shown)
        direction = "faster" if value > 1.0 else "slower" if value < 1.0 else "same"
        return cls(ratio, shown, direction, fused_s, full_s)

    @property
    def short(self) -> str:
        """The ratio and its direction: "2.1x faster", "0.8x: slower", "1.0x: as fast"."""
        return {"faster": f"{self.shown}x faster", "slower": f"{self.shown}x: slower"}.get(
            self.direction, f"{self.shown}x: as fast")

    @property
    def text(self) -> str:
        """The sentence: "fused 2.1x faster than full prefill", "fused 0.8x: slower than full prefill"."""
        return f"fused {self.short} {'as' if self.direction == 'same' else 'than'} full prefill"

    @property
    def ttft_change(self) -> str:
        """The fused TTFT's change from full prefill's, signed: "-1.23 s" when fusion is faster."""
        return f"{self.fused_s - self.full_s:+.2f} s"

    @property
    def metric_color(self) -> str:
        """A Streamlit ``st.metric`` ``delta_color`` for :attr:`ttft_change` as the delta: a lower
        TTFT is the gain ("inverse": green for a minus), grey when the ratio shows as 1.0."""
        return "off" if self.direction == "same" else "inverse"


def speed_ratio(fused_ttft_s: float, full_ttft_s: float) -> SpeedRatio | None:
    """The comparison of two TTFTs (seconds); None when either is not a positive time."""
    if not (fused_ttft_s > 0 and full_ttft_s > 0):
        return None
    return SpeedRatio.of(full_ttft_s / fused_ttft_s, fused_ttft_s, full_ttft_s)


def warmed_paths(engine) -> set[str]:
    """The strategies ``engine`` has had a warm-up (or a timed answer after one) on in this process."""
    return _warmed.setdefault(engine, set())


def warm_up(rag, question: str, strategies=("default", FULL_PREFILL), *, ratio=None, **options) -> dict[str, Stats]:
    """One untimed one-token answer to ``question`` from ``rag`` (a
    :class:`~ragblend.integrations.local_index.LocalIndex`) on each of ``strategies`` that its
    engine has not answered on yet in this process, so that the timed answers after it pay no
    one-off cost of the process (see the module's docstring). ``ratio`` is the fused strategies'
    (a full prefill takes none); ``options`` are :meth:`LocalIndex.ask`'s. Returns each warm-up's
    stats, by strategy (empty when every path was warm)."""
    done = warmed_paths(rag.engine)
    stats = {}
    for strategy in strategies:
        if strategy in done:
            continue
        answer = rag.ask(question, strategy=strategy, ratio=None if strategy == FULL_PREFILL else ratio,
                         **{**options, "max_new_tokens": 1})
        done.add(strategy)
        if answer.stats is not None:
            stats[strategy] = answer.stats
    return stats


def warm_up_note(stats: dict[str, Stats]) -> str:
    """What a :func:`warm_up` cost and left behind, in one line ("" when nothing ran)."""
    if not stats:
        return ""
    costs = ", ".join(f"{'full prefill' if strategy == FULL_PREFILL else 'fused'} {s.ttft_s:.2f} s"
                      for strategy, s in stats.items())
    note = f"Warm-up, untimed (a process's first answer on each path pays one-off costs): {costs}."
    computed = sum(s.chunks_computed for s in stats.values())
    if computed:
        note += (f" It computed and stored the KV of {computed} chunk(s) the store lacked, which the timed "
                 "answer reuses.")
    return note


def compare(fused: Stats | None, full: Stats | None) -> SpeedRatio | None:
    """How two answers' stats compare (None when either answer made no model call)."""
    return speed_ratio(fused.ttft_s, full.ttft_s) if fused is not None and full is not None else None


def compare_line(ratio: SpeedRatio) -> str:
    """The line `ragblend ask --compare` and `ragblend demo` print under the two answers."""
    return f"=> {ratio.text} (TTFT {ratio.fused_s:.2f} s against {ratio.full_s:.2f} s)"
