"""Prompt assembly: segments in, token ids out, with every chunk's token span known.

A prompt is a list of *segments*: :class:`Chunk` (text whose KV may be cached) or ``str``
(computed fresh: instructions, the question). The segments form the user turn of the
model's chat template, joined by a separator. Each piece is tokenized on its own and the
ids are concatenated, so a chunk's ids in the prompt are exactly the ids it was
precomputed with, wherever it lands.

A model without a chat template (a base model such as Gemma 3 270M) gets the *plain layout*:
the BOS token, the system text, earlier turns, the segments, then an answer cue, every piece
followed by the separator::

    <bos>{system}

    {passage 1}

    {passage 2}

    {question}

    Answer:

An earlier assistant turn is written ``Answer: {text}`` and a user turn as its bare text, so
a conversation reads as questions and answers. ``PromptBuilder(answer_cue=...)`` changes the
cue ("" leaves it out).

Text is always tokenized as text. Documents, user messages, system prompts and history may
contain the strings of the model's control tokens (``<|im_start|>``...); those become ordinary
tokens, so retrieved text cannot open a turn of its own. Only the chat template's own text is
tokenized with its control tokens parsed (see :class:`~ragblend.core.text_encoder.TextEncoder` and
:meth:`PromptBuilder.chat_ids`).

The chat template itself (and the plain layout) is rendered by
:class:`~ragblend.core.chat_template.ChatTemplateMixin`; text is tokenized by
:mod:`ragblend.core.text_encoder`. This module lays segments out in the user turn, bounds them by
the context window, and finds known chunks in token ids (:class:`ChunkFinder`).
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass, replace
from typing import Sequence, Union

from .chat_template import ChatTemplateMixin, checked_history
from .errors import InvalidInputError, PromptTooLongError, SegmentTypeError

# Text is checked and tokenized in text_encoder; the names callers import from here stay importable here.
from .text_encoder import TextEncoder, check_text, text_encoder  # noqa: F401

# The passage every chunk is precomputed after (then dropped with the sink's KV). A chunk
# precomputed right after the system prompt is encoded as the start of a text, yet in a RAG
# prompt most chunks sit after other passages; after any passage its KV is much closer to a
# full prefill's (first-token KL 2-3x lower at the same recompute on SQuAD; see
# docs/notes/chunk-context.md). Neutral on purpose: an encyclopedic paragraph about no
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

@dataclass(frozen=True)
class ChunkSpan:
    """Where a chunk's tokens sit in the prompt: ``prompt[start:end] ==
    token_ids[offset:offset + end - start]``. ``token_ids`` are the whole chunk's ids (its
    key); a span may cover only part of the chunk (``offset`` > 0 or a shorter length)."""

    start: int
    end: int
    token_ids: tuple[int, ...]
    offset: int = 0
    namespace: str = ""   # whose entry of the chunk is read and stored ("": the shared one; see kv.chunk_key)


@dataclass(frozen=True)
class PromptLayout:
    token_ids: list[int]
    chunk_spans: list[ChunkSpan]
    namespace: str = ""   # whose prompt it is: the prefix tier (core.decode.prefix_cache) reuses only its K/V
    # laid out from chat messages with earlier turns: its turns are kept as history pieces (core.store.pieces)
    conversation: bool = False
    # a chat request's first turn (the server's chat completions, BlendLLM.chat, BlendChatModel): it will
    # likely go on, so its turn (question and answer) is kept as a piece too (core.store.pieces.turn_runs)
    chat: bool = False

    def as_chat(self) -> "PromptLayout":
        """This layout marked as a chat request's (:attr:`chat`)."""
        return replace(self, chat=True)


def is_conversation(history: Sequence[tuple[str, str]]) -> bool:
    """Whether earlier turns make a conversation: one has an assistant's answer. Two user messages
    alone (context, then the question) are a single-shot prompt."""
    return any(role == "assistant" for role, _ in history)


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


# Tokenizing takes time in proportion to the text (SmolLM2's tokenizer: ~1.4 us a character of
# CJK text, 5.4 s for a 1.3M-character prompt), so a text that must fit in a window of n tokens
# is tokenized in prefixes of FIRST_PREFIX * n characters, then twice as many each time, and
# refused as soon as a prefix holds more than PREFIX_MARGIN * n tokens: no longer text holds fewer
# tokens than its start, but where the cut splits a word the prefix may hold a few more, hence
# the margin. A text that fits is tokenized whole at the end: at most twice its own cost.
FIRST_PREFIX = 4
PREFIX_MARGIN = 2


@dataclass(frozen=True)
class TooLong:
    """What showed that a text is over a token bound: it holds exactly ``tokens`` when ``exact``
    (it was tokenized whole), else more than ``tokens`` (its characters alone or a bounded start
    of it told, see :meth:`PromptBuilder.tokenize_bounded`)."""

    tokens: int
    exact: bool

    def __str__(self) -> str:
        return f"{self.tokens} tokens" if self.exact else f"more than {self.tokens} tokens"


class PromptBuilder(ChatTemplateMixin):
    """Turns segments into prompt token ids with the model's chat template (:class:`ChatTemplateMixin`).

    Every piece of text (chunks, segments, system, history) is tokenized as text
    (:class:`TextEncoder`); only the template's own text has its control tokens parsed.
    With ``max_tokens`` (the engine's context window), :meth:`build` refuses a prompt that does
    not fit in it, saying how many tokens it holds, and a long text before tokenizing it whole
    (:meth:`tokenize_bounded`).
    """

    #: What the plain layout (no chat template) ends a prompt with, and writes before an assistant turn.
    ANSWER_CUE = "Answer:"

    def __init__(self, tokenizer, *, separator: str = "\n\n", use_chat_template: bool | None = None,
                 answer_cue: str = ANSWER_CUE, max_tokens: int | None = None):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.separator = separator
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = use_chat_template
        self.answer_cue = check_text(answer_cue, "answer_cue")
        self.text_encoder = text_encoder(tokenizer)
        self._separator_ids = self.tokenize(separator) if separator else []
        # The layouts of the last prompts built, by their inputs: a repeated prompt (a user asking again,
        # a retry) skips templating and tokenizing. Exact: the same inputs always give the same ids.
        self._layouts: collections.OrderedDict[tuple, PromptLayout] = collections.OrderedDict()
        self._layouts_lock = threading.Lock()

    RECENT_LAYOUTS = 16   # layouts kept (a 3k-token prompt's ids: ~100 KiB of Python ints)

    @functools.cached_property
    def sentence_end_ids(self) -> frozenset[int]:
        """Ids of the tokens that end a sentence: those whose text holds ``.``, ``!``, ``?`` or a
        line break (QueryAware's ``sentence_runs``). Made on first use, from the whole vocabulary
        (the engine makes it when built if its own strategy asks for sentences)."""
        ids = [[i] for i in range(len(self.tokenizer))]
        # A fast tokenizer's Rust backend decodes the vocabulary in one call, ~3x sooner than
        # batch_decode's Python loop (0.5-0.9 s against 2.1-2.4 s for Qwen2.5's 151k tokens, AVX2 EPYC).
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        texts = backend.decode_batch(ids, skip_special_tokens=False) if backend is not None \
            else self.tokenizer.batch_decode(ids)
        return frozenset(i for i, text in enumerate(texts) if any(c in text for c in ".!?\n"))

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` as text: control-token strings in it are ordinary characters."""
        return self.text_encoder(text)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can cover: the vocabulary's longest entry, twice over
        for tokenizers that normalize text (a text longer than this many per token cannot fit)."""
        return 2 * max(max(map(len, self.tokenizer.get_vocab()), default=1), 1)

    def tokenize_bounded(self, text: str, max_tokens: int) -> list[int] | TooLong:
        """:meth:`tokenize` of ``text``, or :class:`TooLong` when it holds more than ``max_tokens``
        tokens: found without tokenizing it whole where its characters alone
        (:attr:`max_chars_per_token`) or its first characters (:data:`FIRST_PREFIX`) tell."""
        too_long = self._too_long_start(text, max_tokens)
        if too_long is not None:
            return too_long
        ids = self.tokenize(text)
        return ids if len(ids) <= max_tokens else TooLong(len(ids), exact=True)

    def tokenize_within(self, text: str, max_tokens: int) -> list[int] | None:
        """:meth:`tokenize_bounded`, with None for a text over ``max_tokens``."""
        ids = self.tokenize_bounded(text, max_tokens)
        return None if isinstance(ids, TooLong) else ids

    def _too_long_start(self, text: str, max_tokens: int) -> TooLong | None:
        """TooLong when ``text``'s characters or a start of it show that it holds more than
        ``max_tokens`` tokens; None when only tokenizing it whole can tell."""
        if len(text) > max_tokens * self.max_chars_per_token:
            return TooLong(max_tokens, exact=False)
        size = max(FIRST_PREFIX * max_tokens, 256)
        while size < len(text):
            if len(self.tokenize(text[:size])) > PREFIX_MARGIN * max_tokens:
                return TooLong(max_tokens, exact=False)
            size *= 2
        return None

    def _check_turns(self, turns: list[str], texts: list[str]) -> None:
        """Refuse, without tokenizing them whole, texts that cannot fit in :attr:`max_tokens`:
        all of them by their characters, the system prompt and history (``turns``) by a bounded
        start of them together (the chat template tokenizes them next, once)."""
        window, chars = self.max_tokens, sum(map(len, turns)) + sum(map(len, texts))
        if chars > window * self.max_chars_per_token:
            raise PromptTooLongError(f"The prompt's texts hold {chars} characters, more than fit the model's context "
                                     f"window ({window} tokens); shorten them.")
        # "\n" between turns: each turn adds at least a token of the template's anyway
        too_long = self._too_long_start("\n".join(turns), window)
        if too_long is not None:
            raise PromptTooLongError(f"The system prompt and history hold {too_long}, more than the model's context "
                                     f"window ({window}); shorten them.")

    def _fitting(self, texts: list[str], used: int, separator_ids: list[int]) -> list[list[int]]:
        """The ids of ``texts`` (joined by ``separator_ids``), which must fit in :attr:`max_tokens`
        after the ``used`` tokens of the template, system prompt and history (else
        PromptTooLongError, raised before a long text is tokenized whole)."""
        window, out = self.max_tokens, []
        if used > window:
            raise PromptTooLongError(f"The system prompt and history hold {used} tokens with the chat template's, "
                                     f"more than the model's context window ({window}); shorten them.")
        for i, text in enumerate(texts):
            used += len(separator_ids) if i else 0
            ids = self.tokenize_bounded(text, max(window - used, 0))
            if isinstance(ids, TooLong):
                total = used + ids.tokens
                # exact only once every text is counted; the ones after this would add more
                held = f"more than {total}" if not ids.exact else f"{total}" if i == len(texts) - 1 \
                    else f"at least {total}"
                raise PromptTooLongError(f"The prompt has {held} tokens; the model's context window holds {window}. "
                                         "Shorten it or pass fewer or shorter chunks.")
            used += len(ids)
            out.append(ids)
        if used > window:   # the separators tipped it over
            raise PromptTooLongError(f"The prompt has {used} tokens; the model's context window holds {window}. "
                                     "Shorten it or pass fewer or shorter chunks.")
        return out

    def chunk_sink(self, sink_prefix: str | None, chunk_context: str) -> list[int]:
        """What every chunk is precomputed after: the template's opening, then a neutral passage
        (``chunk_context``), so that a chunk's cached KV is that of a passage in the middle of a
        prompt, as it will be used (docs/notes/chunk-context.md). A ``sink_prefix`` is
        the developer's own template text instead: its control tokens are parsed."""
        return self.tokenize_template(sink_prefix) if sink_prefix is not None else self.sink_ids(chunk_context)

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

    def opening_length(self, token_ids: Sequence[int]) -> int:
        """How many of a prompt's first tokens are the template's opening: the attention sink and the
        template's text before the first message (with or without a system prompt), at least the
        first token. No chunk's KV may stand in for them: KV computed after a sink is no sink."""
        ids, longest = list(token_ids), 1
        for opening in self._openings:
            common = 0
            while common < min(len(ids), len(opening)) and ids[common] == opening[common]:
                common += 1
            longest = max(longest, common)
        return min(longest, len(ids))

    @functools.cached_property
    def _openings(self) -> list[list[int]]:
        """What prompts start with: the template's opening without a system prompt (its default one
        included), and the template's text before a system prompt's."""
        openings = [self.sink_ids()]
        if self.use_chat_template:
            pieces = self._chat_pieces([("system", "ragblend"), ("user", None)], add_generation_prompt=True)
            if pieces and pieces[0] is not None and pieces[0][1]:
                openings.append(self.tokenize_template(pieces[0][0]))
        return openings

    def build(self, segments: Sequence[Segment], system: str | None = None,
              history: Sequence[tuple[str, str]] = (), separator: str | None = None,
              namespace: str = "") -> PromptLayout:
        """Lay out ``segments`` as the last user turn, after ``history`` (``(role, text)`` pairs, role
        "user" or "assistant"), under ``system``, joined by ``separator`` (default: the builder's).
        The chunks' spans are ``namespace``'s (see :class:`ChunkSpan`)."""
        segments = check_segments(segments)
        template = getattr(self.tokenizer, "chat_template", None) if self.use_chat_template else None
        try:   # the inputs as a key (a history of unhashable or odd turns is checked, and refused, below)
            key = (tuple((isinstance(s, Chunk), s.text if isinstance(s, Chunk) else s) for s in segments), system,
                   tuple(tuple(turn) for turn in history), separator, namespace, self.use_chat_template,
                   self.answer_cue, self.max_tokens, template)
            hash(key)
        except TypeError:
            key = None
        if isinstance(template, str) and "strftime_now" in template:
            key = None   # the template writes today's date (Llama 3): the same inputs give other ids tomorrow
        with self._layouts_lock:
            recent = self._layouts.get(key) if key is not None else None
            if recent is not None:
                self._layouts.move_to_end(key)
        if recent is not None:   # copies: a caller may edit its layout's lists
            return replace(recent, token_ids=list(recent.token_ids), chunk_spans=list(recent.chunk_spans))
        layout = self._build(segments, system, history, separator, namespace)
        if key is not None:
            with self._layouts_lock:
                self._layouts[key] = replace(layout, token_ids=list(layout.token_ids), chunk_spans=list(layout.chunk_spans))
                while len(self._layouts) > self.RECENT_LAYOUTS:
                    self._layouts.popitem(last=False)
        return layout

    def _build(self, segments: list[Segment], system: str | None, history, separator: str | None,
               namespace: str) -> PromptLayout:
        texts = [s.text if isinstance(s, Chunk) else s for s in segments]
        separator_ids = self._separator_ids if separator is None else self.tokenize(separator) if separator else []
        if self.max_tokens is not None:   # texts too long for the window are refused before their whole is tokenized
            turns = ([] if system is None else [check_text(system, "system")]) + [t for _, t in checked_history(history)]
            self._check_turns(turns, texts)
        prefix, suffix = self.template_parts(system, history)   # system and history tokenized once, here
        if self.max_tokens is not None:
            segment_ids = self._fitting(texts, len(prefix) + len(suffix), separator_ids)
        else:
            segment_ids = [self.tokenize(text) for text in texts]
        ids = list(prefix)
        spans = []
        for i, (seg, tokens) in enumerate(zip(segments, segment_ids)):
            if i:
                ids += separator_ids
            if isinstance(seg, Chunk):
                spans.append(ChunkSpan(len(ids), len(ids) + len(tokens), tuple(tokens), namespace=namespace))
            ids += tokens
        ids += suffix
        return PromptLayout(ids, spans, namespace, conversation=is_conversation(history))


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

    Chunks are kept per namespace (a server's tenants: see :func:`~ragblend.core.store.kv.chunk_key`),
    each with its own index and bounds, and a search looks only in the namespaces it is given:
    what one tenant stored is never found in another's prompt.
    """

    NGRAM = 8
    STRIDE = 8
    MIN_RUN = 16  # shorter matches are not worth reusing
    # Chunks indexed under one n-gram, at most. Stored text is untrusted: without a bound, chunks
    # of one repeated token make every prompt position try every chunk (200 such chunks and a
    # 48k-token prompt took 13 s). Ordinary passages share an 8-gram with few others.
    MAX_CHUNKS_PER_NGRAM = 32

    def __init__(self):
        # (namespace, n-gram) -> [(chunk ids, offset)], and the known (namespace, chunk ids)
        self._index: dict[tuple[str, tuple[int, ...]], list[tuple[tuple[int, ...], int]]] = {}
        self._chunks: set[tuple[str, tuple[int, ...]]] = set()

    def add(self, token_ids: Sequence[int], namespace: str = "") -> None:
        ids = tuple(token_ids)
        if len(ids) < self.MIN_RUN or (namespace, ids) in self._chunks:
            return
        self._chunks.add((namespace, ids))
        seen = set()
        for offset in range(0, len(ids) - self.NGRAM + 1, self.STRIDE):
            ngram = ids[offset:offset + self.NGRAM]
            if ngram in seen:   # a repeat inside the chunk: its first place is extended both ways anyway
                continue
            seen.add(ngram)
            places = self._index.setdefault((namespace, ngram), [])
            if len(places) < self.MAX_CHUNKS_PER_NGRAM:
                places.append((ids, offset))

    def remove(self, token_ids: Sequence[int], namespace: str = "") -> None:
        """Forget the chunk of these ids in ``namespace`` (an evicted history piece: core.store.pieces)."""
        ids = tuple(token_ids)
        if (namespace, ids) not in self._chunks:
            return
        self._chunks.discard((namespace, ids))
        for offset in range(0, len(ids) - self.NGRAM + 1, self.STRIDE):
            place = (namespace, ids[offset:offset + self.NGRAM])
            kept = [p for p in self._index.get(place, ()) if p[0] != ids]
            # new lists, not edits in place: a find() in another thread may be reading the old one
            if kept:
                self._index[place] = kept
            else:
                self._index.pop(place, None)

    def __len__(self) -> int:
        return len(self._chunks)

    def find(self, token_ids: Sequence[int], namespaces: Sequence[str] = ("",), start: int = 0) -> list[ChunkSpan]:
        """Non-overlapping matched runs, left to right, the longest run at each hit, of the chunks of
        ``namespaces`` (a span names the namespace its chunk came from), none before ``start`` (the
        template's opening: :meth:`PromptBuilder.opening_length`)."""
        ids, spans, floor, i = list(token_ids), [], start, start
        namespaces = list(dict.fromkeys(namespaces))
        while i <= len(ids) - self.NGRAM:
            best = None  # (start, end, chunk, offset, namespace)
            ngram = tuple(ids[i:i + self.NGRAM])
            for namespace in namespaces:
                for chunk, offset in self._index.get((namespace, ngram), ()):
                    back = 0
                    while i - back > floor and offset - back > 0 and ids[i - back - 1] == chunk[offset - back - 1]:
                        back += 1
                    end, pos = i + self.NGRAM, offset + self.NGRAM
                    while end < len(ids) and pos < len(chunk) and ids[end] == chunk[pos]:
                        end, pos = end + 1, pos + 1
                    if best is None or end - (i - back) > best[1] - best[0]:
                        best = (i - back, end, chunk, offset - back, namespace)
            if best is None or best[1] - best[0] < self.MIN_RUN:
                i += 1
                continue
            first, end, chunk, offset, namespace = best
            spans.append(ChunkSpan(first, end, chunk, offset, namespace))
            floor = i = end
        return spans
