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


@dataclass(frozen=True)
class Chunk:
    """A piece of context whose KV cache is stored and reused (a retrieved document chunk)."""

    text: str

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise SegmentTypeError(f"Chunk text must be a str, got {type(self.text).__name__}.")


Segment = Union[str, Chunk]

# Stands in for the user message while rendering the template; the text around it is the
# template's own prefix and suffix.
_MARKER = "RAGBLENDSEGMENTSMARKER"


@dataclass(frozen=True)
class ChunkSpan:
    """Where a chunk's tokens sit in the prompt: ``token_ids[start:end]``."""

    start: int
    end: int
    segment_index: int
    token_ids: tuple[int, ...]


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

    def sink_ids(self) -> list[int]:
        """The fixed prefix chunks are precomputed after (its KV is dropped).

        The template's opening (with its default system prompt) is what most prompts start
        with, so a chunk computed after it sees a realistic "attention sink" instead of
        being the very first tokens of a sequence.
        """
        prefix, _ = self.template_parts(None)
        if prefix:
            return prefix
        tok = self.tokenizer
        return [tok.bos_token_id] if tok.bos_token_id is not None else [tok.eos_token_id]

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
                spans.append(ChunkSpan(len(ids), len(ids) + len(tokens), i, tuple(tokens)))
                ids += tokens
            else:
                ids += self.tokenize(seg)
        ids += suffix
        return PromptLayout(ids, spans)


class ChunkFinder:
    """Finds known chunks inside a prompt's token ids.

    Frameworks hand the LLM one flat prompt. Tokenizing that prompt whole gives exactly the
    ids a plain prefill would use; wherever a known chunk's token ids appear in them
    unchanged, the chunk's cached KV can be reused. Chunks are indexed by their first
    ``MIN_TOKENS`` ids, so a scan costs one dictionary lookup per prompt position.
    """

    MIN_TOKENS = 8  # shorter chunks are not worth a cache entry

    def __init__(self):
        self._by_prefix: dict[tuple[int, ...], set[tuple[int, ...]]] = {}

    def add(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) >= self.MIN_TOKENS:
            ids = tuple(token_ids)
            self._by_prefix.setdefault(ids[:self.MIN_TOKENS], set()).add(ids)

    def __len__(self) -> int:
        return sum(len(c) for c in self._by_prefix.values())

    def find(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        """Non-overlapping spans of known chunks, left to right, the longest match first."""
        ids, k, spans, i = list(token_ids), self.MIN_TOKENS, [], 0
        while i <= len(ids) - k:
            candidates = self._by_prefix.get(tuple(ids[i:i + k]))
            match = None
            if candidates:
                fitting = [c for c in candidates if tuple(ids[i:i + len(c)]) == c]
                match = max(fitting, key=len, default=None)
            if match is None:
                i += 1
                continue
            spans.append(ChunkSpan(i, i + len(match), -1, match))
            i += len(match)
        return spans
