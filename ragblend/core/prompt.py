"""Prompt assembly: segments in, token ids out, with every chunk's token span known.

A prompt is a list of *segments*: :class:`Chunk` (text whose KV may be cached) or ``str``
(computed fresh: instructions, the question). The segments form the user turn of the
model's chat template, joined by a separator. Each piece is tokenized on its own and the
ids are concatenated, so a chunk's ids in the prompt are exactly the ids it was
precomputed with, wherever it lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .errors import InvalidInputError, SegmentTypeError


def check_text(text, what: str) -> str:
    """``text`` if it is a str that can be encoded as UTF-8; a clear error otherwise."""
    if not isinstance(text, str):
        raise SegmentTypeError(f"{what} must be a str, got {type(text).__name__}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInputError(
            f"{what} contains a character that is not valid Unicode ({err.reason} at position {err.start}); "
            "decode your text with errors='replace' or drop lone surrogates first.") from None
    return text


# The passage every chunk is precomputed after (then dropped with the sink's KV). A chunk
# precomputed right after the system prompt is encoded as the start of a text, yet in a RAG
# prompt most chunks sit after other passages; after any passage its KV is much closer to a
# full prefill's (first-token KL 2-3x lower at the same recompute on SQuAD; see
# docs/benchmarks.md, "Chunk context"). Neutral on purpose: an encyclopedic paragraph about no
# real place, written for ragblend, so that it adds no facts an answer could pick up.
CHUNK_CONTEXT = (
    "The river rises in a range of low hills and flows for about three hundred kilometres before it "
    "reaches the sea. In its upper course it runs quickly through narrow valleys, where small mills were "
    "built in the eighteenth century; further down it widens and slows, and the plain on either side has "
    "been farmed for centuries. Several towns grew up at places where the river could be crossed, and two "
    "of them became regional markets. In the nineteenth century a canal was cut to link the river with a "
    "neighbouring valley, and a railway later followed the same route. Today the lower valley is known for "
    "its orchards and for a wetland reserve near the estuary, which is visited by migrating birds in spring "
    "and autumn."
)

@dataclass(frozen=True)
class Chunk:
    """A piece of context whose KV cache is stored and reused (a retrieved document chunk)."""

    text: str

    def __post_init__(self):
        check_text(self.text, "Chunk text")
        if not self.text:
            raise InvalidInputError("Chunk text is empty; drop empty chunks, or pass the text as a plain str.")


Segment = Union[str, Chunk]

# Stands in for the user message while rendering the template; the text around it is the
# template's own prefix and suffix.
_MARKER = "RAGBLENDSEGMENTSMARKER"


@dataclass(frozen=True)
class ChunkSpan:
    """Where a chunk's tokens sit in the prompt: ``prompt[start:end] ==
    token_ids[offset:offset + end - start]``. ``token_ids`` are the whole chunk's ids (its
    key); a span may cover only part of the chunk (``offset`` > 0 or a shorter length)."""

    start: int
    end: int
    token_ids: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class PromptLayout:
    token_ids: list[int]
    chunk_spans: list[ChunkSpan]


def check_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Validate a segments list, raising a clear error for anything ragblend cannot use."""
    if isinstance(segments, (str, Chunk)):
        segments = [segments]
    if not isinstance(segments, Sequence):
        raise SegmentTypeError(
            f"segments must be a list of str and Chunk, got {type(segments).__name__}.")
    if len(segments) == 0:
        raise InvalidInputError("segments is empty: pass at least one str or Chunk, e.g. "
                                "[Chunk(text), 'Question: ...?'].")
    for i, seg in enumerate(segments):
        if not isinstance(seg, (str, Chunk)):
            raise SegmentTypeError(
                f"segment {i} is a {type(seg).__name__}; segments must be str (computed fresh) "
                f"or ragblend.Chunk (KV reused).")
        if isinstance(seg, str):
            check_text(seg, f"segment {i}")
    return list(segments)


class PromptBuilder:
    """Turns segments into prompt token ids with the model's chat template."""

    def __init__(self, tokenizer, *, separator: str = "\n\n", use_chat_template: bool | None = None):
        self.tokenizer = tokenizer
        self.separator = separator
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = use_chat_template
        self._separator_ids = self.tokenize(separator) if separator else []

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def template_parts(self, system: str | None, history: Sequence[tuple[str, str]] = ()) -> tuple[list[int], list[int]]:
        """Token ids the template puts before and after the (last) user message.

        ``history`` holds earlier turns as ``(role, text)`` with role "user" or "assistant".
        """
        if system is not None:
            check_text(system, "system")
        if not self.use_chat_template:
            prefix = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
            for text in ([system] if system else []) + [text for _, text in history]:
                prefix += self.tokenize(text) + self._separator_ids
            return prefix, []
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages += [{"role": role, "content": text} for role, text in history]
        messages.append({"role": "user", "content": _MARKER})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, marker, after = text.partition(_MARKER)
        if not marker:
            raise InvalidInputError("The model's chat template drops the user message; "
                                    "pass use_chat_template=False.")
        return self.tokenize(before), self.tokenize(after)

    def sink_ids(self, context: str = "") -> list[int]:
        """The fixed prefix chunks are precomputed after (its KV is dropped).

        The template's opening (with its default system prompt) is what most prompts start
        with, so a chunk computed after it sees a realistic "attention sink" instead of
        being the very first tokens of a sequence. ``context``, when given, follows it (then
        the chunk separator): a passage, so that the chunk is computed as a passage in the
        middle of a prompt rather than as the first thing after the system prompt.
        """
        prefix, _ = self.template_parts(None)
        if not prefix:
            tok = self.tokenizer
            prefix = [tok.bos_token_id] if tok.bos_token_id is not None else [tok.eos_token_id]
        if context:
            prefix = prefix + self.tokenize(context) + self._separator_ids
        return prefix

    def build(self, segments: Sequence[Segment], system: str | None = None,
              history: Sequence[tuple[str, str]] = (), separator: str | None = None) -> PromptLayout:
        """Lay out ``segments`` as the user turn, after ``history``, under ``system``."""
        segments = check_segments(segments)
        prefix, suffix = self.template_parts(system, history)
        separator_ids = self._separator_ids if separator is None else self.tokenize(separator) if separator else []
        ids = list(prefix)
        spans = []
        for i, seg in enumerate(segments):
            if i:
                ids += separator_ids
            if isinstance(seg, Chunk):
                tokens = self.tokenize(seg.text)
                spans.append(ChunkSpan(len(ids), len(ids) + len(tokens), tuple(tokens)))
                ids += tokens
            else:
                ids += self.tokenize(seg)
        ids += suffix
        return PromptLayout(ids, spans)


class ChunkFinder:
    """Finds known chunks, whole or in part, inside a prompt's token ids.

    Frameworks hand the LLM one flat prompt. Tokenizing that prompt whole gives exactly the
    ids a plain prefill would use; wherever a run of them equals a run of a known chunk's
    ids, that part of the chunk's cached KV can be reused. A chunk usually appears whole;
    parts appear when a synthesizer re-splits text to fit a window, or when the token at a
    boundary merges with its neighbour.

    Each chunk is indexed by the ``NGRAM`` ids starting at every ``STRIDE``-th position, so
    any common run of at least ``NGRAM + STRIDE - 1`` ids contains an indexed n-gram; a hit
    is then extended both ways to the longest common run.
    """

    NGRAM = 8
    STRIDE = 8
    MIN_RUN = 16  # shorter matches are not worth reusing

    def __init__(self):
        self._index: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
        self._chunks: set[tuple[int, ...]] = set()

    def add(self, token_ids: Sequence[int]) -> None:
        ids = tuple(token_ids)
        if len(ids) < self.MIN_RUN or ids in self._chunks:
            return
        self._chunks.add(ids)
        for offset in range(0, len(ids) - self.NGRAM + 1, self.STRIDE):
            self._index.setdefault(ids[offset:offset + self.NGRAM], []).append((ids, offset))

    def __len__(self) -> int:
        return len(self._chunks)

    def find(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        """Non-overlapping matched runs, left to right, the longest run at each hit."""
        ids, spans, floor, i = list(token_ids), [], 0, 0
        while i <= len(ids) - self.NGRAM:
            best = None  # (start, end, chunk, offset)
            for chunk, offset in self._index.get(tuple(ids[i:i + self.NGRAM]), ()):
                back = 0
                while i - back > floor and offset - back > 0 and ids[i - back - 1] == chunk[offset - back - 1]:
                    back += 1
                end, pos = i + self.NGRAM, offset + self.NGRAM
                while end < len(ids) and pos < len(chunk) and ids[end] == chunk[pos]:
                    end, pos = end + 1, pos + 1
                if best is None or end - (i - back) > best[1] - best[0]:
                    best = (i - back, end, chunk, offset - back)
            if best is None or best[1] - best[0] < self.MIN_RUN:
                i += 1
                continue
            start, end, chunk, offset = best
            spans.append(ChunkSpan(start, end, chunk, offset))
            floor = i = end
        return spans
