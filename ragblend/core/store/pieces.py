"""History pieces: a conversation's earlier turns, stored and fused like chunks (issue 60).

Chat engines (LlamaIndex's ``condense_plus_context`` and ``context``, LangChain's history-aware
chains) put the newly retrieved context in the system message of every turn, so a prompt differs
from the last one from its system message on and the prefix tier (:mod:`ragblend.core.decode.prefix_cache`) reuses
almost nothing: the whole history would be computed again. So every turn's text is also kept as
*pieces*: after an answer, the *turn* (the question through the answer, with the template's
control tokens between them: a short question, ``user\nWho...?``, is kept with its answer) and, in a
conversation, every other stretch of the prompt that no chunk or known piece covers
(:func:`turn_runs`), is computed alone after the sink, exactly as a chunk is at ingestion, and
stored in the engine's piece memory under the piece namespace of the prompt's namespace
(:func:`piece_namespace`). The next prompt of that namespace has them marked where their token ids
appear, before its last message (the question: :func:`last_message_start`, :func:`with_pieces`),
and the fused prefill reuses them with its selective recompute, as it does chunks; but never at the
template's control tokens (``<|im_end|>``, ``<|im_start|>``): a piece's span is split around them, so
they are computed in every prompt (their K/V, computed with nothing but the piece before them,
differ most from the full prefill's: reusing them lifted turn 5's first-token KL 0.0017 -> 0.0232 in
benchmarks.conversation).

The prefix tier goes first: where a prompt starts with a recent one, that prefix is reused
exactly and the rest computed in full; pieces serve the prompts it has no hit for.

Example::

    namespace = piece_namespace("")                      # "turns:"
    question = last_message_start(prompt_ids, control_ids, closing)   # never found as a piece while it is the question
    runs = turn_runs(prompt_ids + answer_ids, layout.chunk_spans, question=question,
                     prompt_tokens=len(prompt_ids), start=opening, history=True)
    layout = with_pieces(next_layout, finder, start=opening, end=next_question,
                         control_ids=control_ids)   # spans of stored pieces, split around control tokens
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..prompt import ChunkFinder, ChunkSpan, PromptLayout
from .kv import PIECE_NAMESPACE_PREFIX, ChunkKV
from .tiers import MemoryStore

# Piece entries are kept apart from the chunks of the same namespace (under PIECE_NAMESPACE_PREFIX):
# a chunk found in any prompt is the operator's or tenant's document, a piece only their own
# conversation's text.


class PieceStore(MemoryStore):
    """The pieces' own memory, apart from the KV store: a conversation's turns never evict a
    document's KV, and pieces go least recently used first within ``max_bytes``. ``forget`` is
    called with each entry evicted or deleted, so that the chunk finder stops looking for it."""

    def __init__(self, max_bytes: int, forget: Callable[[ChunkKV], None]):
        super().__init__(max_bytes)
        self.forget = forget
        self.evictions = 0

    def dropped(self, entry: ChunkKV) -> None:
        self.evictions += 1
        self.forget(entry)

    def info(self) -> dict[str, int]:
        """Its entries, bytes (and budget) and evictions: for ``ragblend info`` and a server's ``/metrics``."""
        return {"entries": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes, "evictions": self.evictions}


def piece_namespace(namespace: str) -> str:
    """The namespace the pieces of ``namespace``'s conversations are stored and found under."""
    return PIECE_NAMESPACE_PREFIX + namespace


def is_piece(span: ChunkSpan) -> bool:
    return span.namespace.startswith(PIECE_NAMESPACE_PREFIX)


def _covered(spans: Sequence[ChunkSpan], length: int) -> list[bool]:
    """Per position of a sequence of ``length`` tokens, whether one of ``spans`` covers it."""
    covered = [False] * length
    for span in spans:
        covered[span.start:span.end] = [True] * len(covered[span.start:span.end])
    return covered


def piece_runs(token_ids: Sequence[int], spans: Sequence[ChunkSpan], *, start: int,
               min_tokens: int = ChunkFinder.MIN_RUN, max_tokens: int | None = None,
               end: int | None = None) -> list[list[int]]:
    """The runs of ``token_ids[start:end]`` that hold no token of ``spans``, each of at least
    ``min_tokens`` (shorter ones are never found again), cut into runs of at most ``max_tokens``.
    A run holds the template's control tokens where they fall in it: :func:`with_pieces` never
    reuses them."""
    end = len(token_ids) if end is None else end
    covered = _covered(spans, len(token_ids))
    runs, run = [], []
    for i in range(start, end + 1):
        if i < end and not covered[i]:
            run.append(int(token_ids[i]))
            continue
        if len(run) >= min_tokens:
            size = max_tokens or len(run)
            runs += [run[k:k + size] for k in range(0, len(run), size) if len(run[k:k + size]) >= min_tokens]
        run = []
    return runs


# A chat's first turn keeps its turn only where the question is this short: a first message holding
# more is a stuffed prompt (context and question in one), whose passages the server stores as chunks,
# and computing it again as a piece would cost a single-shot query a prefill in the background.
FIRST_TURN_QUESTION_TOKENS = 256


def turn_runs(token_ids: Sequence[int], spans: Sequence[ChunkSpan], *, question: int, prompt_tokens: int,
              start: int, history: bool, min_tokens: int = ChunkFinder.MIN_RUN,
              max_tokens: int | None = None) -> list[list[int]]:
    """The pieces of a turn just answered: ``token_ids`` its prompt's (the first ``prompt_tokens``)
    and its answer's ids, ``spans`` the chunks and known pieces in it, ``question`` where its last
    message begins, ``start`` the end of the template's opening.

    The *turn* runs from the question, with the template tokens before it where they are too few to
    be a piece of their own (the previous message's end, the user turn's opening), through the
    answer, control tokens and all: so a question of a few tokens is kept with its answer (cut at
    the control tokens, it was no piece and computed again every turn). With ``history`` (earlier
    turns in the prompt), the other stretches before the question are kept too (system text,
    earlier turns not kept yet); without, only the turn, and only where the question holds at most
    :data:`FIRST_TURN_QUESTION_TOKENS` tokens no chunk covers."""
    if question <= start:   # no message boundary after the opening (the plain layout): none
        return []
    before = [s.end for s in spans if s.end <= question]
    gap = max([start, *before])
    turn = gap if question - gap < min_tokens else question
    covered = _covered(spans, prompt_tokens)
    if not history and prompt_tokens - turn - sum(covered[turn:]) > FIRST_TURN_QUESTION_TOKENS:
        return []
    runs = piece_runs(token_ids, spans, start=start, end=turn, min_tokens=min_tokens,
                      max_tokens=max_tokens) if history else []
    return runs + piece_runs(token_ids, spans, start=turn, min_tokens=min_tokens, max_tokens=max_tokens)


def last_message_start(token_ids: Sequence[int], control_ids: frozenset[int], closing: Sequence[int],
                       user_opening: Sequence[int] = ()) -> int:
    """Where a prompt's last message (its question) begins: after the last control token before the
    template text that closes it (``closing``: what the template puts after the last user message).
    A prompt that does not end so (an assistant's turn begun after the question: "...assistant\nAnswer:")
    has its question after the last ``user_opening`` (the template's opening of a user turn), and what
    follows it counts as the question too. Without control tokens (the plain layout) that is the
    first token after BOS: the whole prompt."""
    ids = list(token_ids)
    closed = bool(closing) and ids[-len(closing):] == list(closing)
    if not closed and user_opening:
        size = len(user_opening)
        for i in range(len(ids) - size, -1, -1):
            if ids[i:i + size] == list(user_opening):
                return i + size
    end = len(ids) - len(closing) if closed else len(ids)
    for i in range(end - 1, -1, -1):
        if ids[i] in control_ids:
            return i + 1
    return min(1, len(ids))


def with_pieces(layout: PromptLayout, finder: ChunkFinder, *, start: int, end: int,
                control_ids: frozenset[int] = frozenset()) -> PromptLayout:
    """``layout`` with the known pieces of its namespace marked where no chunk span is, between
    ``start`` (the template's opening) and ``end`` (the last message: QueryAware asks the question
    there, so it is never a piece's, as the server's passages leave it out; see :func:`last_message_start`).
    A piece found across ``end`` (a turn kept with its question, in a repeat of its prompt) is cut there.
    Each piece's span is split around the ``control_ids`` in it: those are computed, never reused."""
    found = finder.find(layout.token_ids, [piece_namespace(layout.namespace)], start=start)
    found = [replace(s, end=min(s.end, end)) for s in found if min(s.end, end) - s.start >= finder.MIN_RUN]
    taken = [(s.start, s.end) for s in layout.chunk_spans]
    new = [part for s in found if not any(s.start < stop and begin < s.end for begin, stop in taken)
           for part in _split(s, layout.token_ids, control_ids)]
    if not new:
        return layout
    return replace(layout, chunk_spans=sorted([*layout.chunk_spans, *new], key=lambda s: s.start))


def _split(span: ChunkSpan, token_ids: Sequence[int], control_ids: frozenset[int]) -> list[ChunkSpan]:
    """``span`` without the positions of ``control_ids``: the spans of the runs between them."""
    parts, begin = [], span.start
    for i in range(span.start, span.end + 1):
        if i == span.end or token_ids[i] in control_ids:
            if i > begin:
                parts.append(replace(span, start=begin, end=i, offset=span.offset + begin - span.start))
            begin = i + 1
    return parts
