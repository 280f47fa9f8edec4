"""Spotting a fused answer that starts to loop, so that it can fall back to the exact path.

A fused prefill's K/V are close to a full prefill's, not equal to them, and on a small model a
near tie can tip greedy decoding into a loop the full prefill's answer does not enter (issue 59:
"It was a great product." three times; a whole paragraph again and again to the token limit).
:class:`RepeatGuard` watches an answer's tokens as they are decoded and says when its tail is
copies of one unit back to back; :meth:`~ragblend.core.decode.generate.Decoding.fall_back` then
drops the copies after the first, recomputes the exact K/V of prompt + kept answer, and decoding
goes on from there as a full prefill's would. The fused tokens already shown cannot be taken back, and the
loop may have been set up by them (the trial's answer differed from the full prefill's inside the
first copy: "follow-up" for "following up"), so the exact path, given them, may loop on (:class:`DroppedCopy` watches for it): where it writes
the dropped copy twice more in a row, the answer ends before them, one copy shown, as the full
prefill's answer ended, instead of looping to the token limit.

What counts as the start of a loop (:class:`RepeatRule`): a unit of at least 8 visible characters,
a letter among them, not itself a run of a shorter unit, complete twice in a row if it has 4 tokens or
more, three times if fewer. Prose practically never holds a 4-token, 8-character phrase twice back to
back ("It was a great product. It was a great product." is already the loop) nor a shorter one three
times ("removable removable removable", which a fused answer gave). Structured text does ("[0, 0, 0,
0]," rows, "| Not included | Not included |", a code line twice): units without a letter never count,
and for the rest a false alarm costs time, not the answer: the answer goes on as the full prefill's
would from the kept tokens (about one full prefill of prompt + answer, paid once; an answer on the
exact path is never checked for new loops), the dropped copy is written again and shown, and the
answer ends early only where the exact path writes it twice more (three equal rows in a row).

Streaming must not show a copy that is then taken back, so the guard also says how many of the
last tokens could be a second copy in progress (:attr:`RepeatGuard.held`): those are held back,
as a stop string's first characters are, until the copy breaks (they are shown) or completes
(they are dropped). That is often a token or two (a common word seen before), rarely more.
After a fallback, the exact path's tokens that write the dropped copy again are held back alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RepeatRule:
    """When an answer's tail counts as the start of a loop: a unit whose text holds at least
    ``min_unit_chars`` non-space characters, complete twice in a row if it has at least
    ``min_unit_tokens`` tokens, else ``short_unit_copies`` times."""

    min_unit_tokens: int = 4
    min_unit_chars: int = 8
    short_unit_copies: int = 3
    # Units longer than this are not watched: the loops seen were a sentence or a paragraph (up to
    # ~20 tokens), and the cap keeps each token's cost flat however long the answer.
    max_unit_tokens: int = 128
    needs_letter: bool = True   # units of digits and punctuation alone (matrix rows, table rules) never count

    def copies(self, unit: int) -> int:
        """How many copies of a ``unit``-token unit in a row make a loop."""
        return 2 if unit >= self.min_unit_tokens else self.short_unit_copies


@dataclass(frozen=True)
class Repeat:
    """A unit of ``unit`` tokens just completed ``copies`` times in a row; the copies after the first
    start at answer token ``start``."""

    unit: int
    start: int
    copies: int = 2

    def describe(self) -> str:
        times = "twice" if self.copies == 2 else f"{self.copies} times"
        return (f"repeating answer: a {self.unit}-token unit {times} in a row, ending at token "
                f"{self.start + (self.copies - 1) * self.unit}")


class RepeatGuard:
    """Follows one answer's tokens (:meth:`observe`, one at a time) and says when it starts to loop.

    For every unit length L it keeps ``runs[L]``: how many of the last tokens equal the token L
    before each, i.e. how far the copies after a first of the L tokens before them have got: k
    copies are complete when the run reaches (k - 1) L; a shorter run is a copy in progress. Each token
    updates every L up to ``max_unit_tokens`` once: at most 128 integer compares a token, however long
    the answer (the text of a unit is decoded only for a candidate loop or a copy held back)."""

    def __init__(self, text_of: Callable[[list[int]], str], rule: RepeatRule = RepeatRule(),
                 asked: str | Callable[[], str] = ""):
        self.text_of, self.rule = text_of, rule
        self._asked = asked   # the prompt's text after its chunks, its question (see asked_for); or what makes it
        self.tokens: list[int] = []
        self.runs: list[int] = [0]   # runs[L] for L = 1..len(tokens) - 1; runs[0] unused

    @functools.cached_property
    def asked(self) -> str:
        """The question's text as :meth:`asked_for` compares it: made at the first loop found, not
        before the answer's first token."""
        return _plain(self._asked() if callable(self._asked) else self._asked)

    def asked_for(self, copy: list[int]) -> bool:
        """Whether the prompt's question holds the text of ``copy`` (a loop's unit): repetition the
        user asked for ("say lighthouse ten times", a chorus after each verse), which the exact
        path then writes as often as it does, not a loop to end the answer at. The unit was found
        where its copies met, so any turn of it may be the text asked for (a chorus's second half
        first): each is looked for, only when a loop was found."""
        for turn in range(len(copy)):
            text = _plain(self.text_of(copy[turn:] + copy[:turn]))
            if len(text) >= 4 and text in self.asked:
                return True
        return False

    def observe(self, token: int) -> Repeat | None:
        """Take the answer's next token; the loop it completes, if any."""
        tokens, runs = self.tokens, self.runs
        tokens.append(token)
        last = len(tokens) - 1
        for unit in range(1, min(last, self.rule.max_unit_tokens) + 1):
            if unit == len(runs):
                runs.append(0)
            runs[unit] = runs[unit] + 1 if tokens[last - unit] == token else 0
        for unit in range(1, min((last + 1) // 2, self.rule.max_unit_tokens) + 1):   # two copies fit
            copies = self.rule.copies(unit)
            if runs[unit] == (copies - 1) * unit and self._is_loop(unit, copies):
                return Repeat(unit, len(tokens) - (copies - 1) * unit, copies)
        return None

    @property
    def held(self) -> int:
        """How many of the last tokens could be a further copy in progress of a unit that would count
        (to hold back from a stream): the longest such run, 0 where there is none."""
        runs, rule, n = self.runs, self.rule, len(self.tokens)
        in_progress = [unit for unit in range(1, len(runs)) if 0 < runs[unit] < (rule.copies(unit) - 1) * unit]
        for unit in sorted(in_progress, key=lambda unit: -runs[unit]):
            run = runs[unit]
            # a run of a shorter unit never counts ("| 0 | 0 | 0"), nor a unit without words
            if not self._shorter_period(unit + run, unit) and self._counts(self.tokens[n - run - unit:n - run]):
                return run
        return 0

    def _is_loop(self, unit: int, copies: int) -> bool:
        """Whether the ``copies`` of ``unit`` tokens just completed count: not a run of a shorter unit
        (their span has no shorter period), and text enough in the unit."""
        return not self._shorter_period(copies * unit, unit) and self._counts(self.tokens[-unit:])

    def _shorter_period(self, span: int, unit: int) -> bool:
        """Whether the last ``span`` tokens repeat with a period shorter than ``unit``."""
        return any(self.runs[period] >= span - period for period in range(1, unit))

    def _counts(self, unit_tokens: list[int]) -> bool:
        """Whether a unit has text enough to count: ``min_unit_chars`` visible characters, a letter among them."""
        text = self.text_of(unit_tokens)
        return (sum(not c.isspace() for c in text) >= self.rule.min_unit_chars
                and (not self.rule.needs_letter or any(c.isalpha() for c in text)))


class DroppedCopy:
    """The copy a fallback dropped, watched for on the exact path that follows: :meth:`observe` says
    whether the exact path's next token goes on writing it again. Only where the exact path writes it
    twice more in a row (:attr:`complete`: it loops too, given the text already shown) does the answer
    end, before those copies; a single copy again is legitimate repeated text (two equal table rows)
    and is shown. Its tokens so far (:attr:`held`) are held back from a stream until then; at the first
    token that differs the watch ends."""

    COPIES = 2

    def __init__(self, tokens: list[int]):
        self.tokens, self.held = list(tokens), 0

    def observe(self, token: int) -> bool:
        if not self.complete and self.tokens[self.held % len(self.tokens)] == token:
            self.held += 1
            return True
        return False

    @property
    def complete(self) -> bool:
        return self.held == self.COPIES * len(self.tokens)


def _plain(text: str) -> str:
    """``text`` lowercased, its whitespace runs as one space, without punctuation at either end."""
    return " ".join(text.lower().split()).strip(" .,;:!?'\"")
