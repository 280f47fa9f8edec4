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
tokenized with its control tokens parsed (see :class:`TextEncoder` and
:meth:`PromptBuilder.chat_ids`).
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Sequence, Union

from .errors import InvalidInputError, PromptTooLongError, SegmentTypeError


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

# A role is written into the template as template text (``'<|im_start|>' + role``), so it
# must be a plain name, never free text.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


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
    # a chat request's first turn (the server's chat completions): it will likely go on, so its turn
    # (question and answer) is kept as a piece too (core.store.pieces.turn_runs)
    chat: bool = False


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


def _checked_role(role, what: str) -> str:
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise InvalidInputError(f"{what} role must be a plain name such as 'user' or 'assistant', got {str(role)[:40]!r}.")
    return role


def _checked_history(history) -> list[tuple[str, str]]:
    """``history`` as a list of ``(role, text)`` turns, each checked."""
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise InvalidInputError("history must be a list of (role, text) pairs, e.g. [('user', 'Hi'), ('assistant', 'Hello')].")
    turns = []
    for i, turn in enumerate(history):
        if not isinstance(turn, (tuple, list)) or len(turn) != 2:
            raise InvalidInputError(f"history turn {i} must be a (role, text) pair, got {type(turn).__name__}.")
        turns.append((_checked_role(turn[0], f"history turn {i}'s"), check_text(turn[1], f"history turn {i}")))
    return turns


def _checked_messages(messages) -> list[tuple[str, str]]:
    """Chat messages (``{"role", "content"}`` dicts) as ``(role, text)`` turns."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts.")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidInputError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}.")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                       for b in content):
                raise InvalidInputError(f"message {i}'s content blocks must all be {{'type': 'text', 'text': ...}}.")
            content = "".join(b["text"] for b in content)
        turns.append((_checked_role(message.get("role"), f"message {i}'s"), check_text(content, f"message {i}")))
    return turns


class TextEncoder:
    """Tokenizes text *as text*: the string of a control token (``<|im_start|>``) in it
    becomes ordinary tokens, never the control token itself.

    Control tokens are the tokenizer's special added tokens, plus the other added tokens its
    chat template writes (Qwen's ``<tool_call>``...), except whitespace ones. For text without
    them the ids are exactly the tokenizer's own (``tokenizer(text, add_special_tokens=False)``).

    Hugging Face's ``split_special_tokens=True`` does the splitting, but it works by setting a
    flag on the tokenizer shared by every thread; this encoder runs on a private copy of the
    fast tokenizer with the flag set once, so no other call can flip it under it. Built
    once per tokenizer (:func:`text_encoder`).
    """

    # Ordinary text whose ids the private copy must reproduce exactly (else it is not used).
    PROBE = "Hello, world! It's 2024: 3.14 apples.\n\n  Indented\ttext, café, 東京 🙂 end"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.state = self.state_of(tokenizer)
        template = str(getattr(tokenizer, "chat_template", None) or "")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        control = {i: t.content for i, t in added.items()
                   if t.special or (t.content in template and not t.content.isspace())}
        self.control_ids = frozenset(control)
        self.control_strings = tuple(sorted(set(control.values()), key=len, reverse=True))
        self._backend = self._private_backend(set(control.values()))
        if self._backend is not None and self._encode_backend(self.PROBE) != self._encode_wrapper(self.PROBE):
            self._backend = None   # the wrapper does more than the Rust tokenizer: use the wrapper

    @staticmethod
    def state_of(tokenizer) -> tuple:
        """What the encoder depends on besides the vocabulary: the added tokens and the template."""
        return len(getattr(tokenizer, "added_tokens_decoder", {}) or {}), str(getattr(tokenizer, "chat_template", None))

    def _private_backend(self, control: set[str]):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        from tokenizers import Tokenizer

        state = json.loads(backend.to_str())
        state["truncation"] = state["padding"] = None
        for token in state.get("added_tokens", []):
            if token["content"] in control:
                token["special"] = True   # split by encode_special_tokens like the special ones
        copy = Tokenizer.from_str(json.dumps(state))
        copy.encode_special_tokens = True
        return copy

    def _encode_backend(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~0.8 s on a 540k-character
        # prompt, during which a server's event loop could not answer even /health).
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def _encode_wrapper(self, text: str) -> list[int]:
        with _split_flag_lock:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def __call__(self, text: str) -> list[int]:
        ids = self._encode_backend(text) if self._backend is not None else self._encode_wrapper(text)
        if self.control_ids.intersection(ids):
            # Never seen with the supported tokenizers (tests/unit/test_injection.py checks them).
            raise InvalidInputError(
                "This model's tokenizer turns plain text into a control token, so ragblend cannot keep the text "
                "from acting as the chat template's markup; remove the control-token strings from the text.")
        return ids

    def contains_control(self, text: str) -> bool:
        return any(s in text for s in self.control_strings)

    def is_own_tokenization(self, token_ids) -> bool:
        """Whether ``token_ids`` are what this encoder makes of some text: no control token (the chat
        template's markup, BOS/EOS), and the ids of their own decoded text. Only such ids may become
        a stored chunk (a client's ids could otherwise hold what no text tokenizes to, e.g. the
        template's opening)."""
        ids = list(token_ids)
        if not ids or self.control_ids.intersection(ids):
            return False
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            return self(text) == ids
        except InvalidInputError:
            return False


# A fast tokenizer keeps split_special_tokens as a flag on itself: calls that set it hold this lock.
_split_flag_lock = threading.Lock()
_encoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def text_encoder(tokenizer) -> TextEncoder:
    """The :class:`TextEncoder` of ``tokenizer`` (copying a large tokenizer takes ~0.2 s, so
    engines over the same tokenizer share one)."""
    with _encoders_lock:
        try:
            encoder = _encoders.get(tokenizer)
        except TypeError:   # not weak-referenceable: no sharing
            return TextEncoder(tokenizer)
        if encoder is None or encoder.state != TextEncoder.state_of(tokenizer):   # tokens or template changed since
            encoder = _encoders[tokenizer] = TextEncoder(tokenizer)
        return encoder


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


class PromptBuilder:
    """Turns segments into prompt token ids with the model's chat template.

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

    def tokenize_template(self, text: str) -> list[int]:
        """Ids of text with its control tokens parsed: only for text the chat template or the
        developer wrote (a ``sink_prefix``), never for documents or messages."""
        with _split_flag_lock:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ the chat template

    def template_parts(self, system: str | None, history: Sequence[tuple[str, str]] = ()) -> tuple[list[int], list[int]]:
        """Token ids the template puts before and after the (last) user message.

        ``history`` holds earlier turns as ``(role, text)`` with role "user" or "assistant".
        """
        turns = ([] if system is None else [("system", check_text(system, "system"))]) + _checked_history(history)
        if not self.use_chat_template:
            return self._plain_ids(turns, more_follows=True), self._plain_cue()
        pieces = self._chat_pieces(turns + [("user", None)], add_generation_prompt=True)
        hole = pieces.index(None)
        return self._encode(pieces[:hole]), self._encode(pieces[hole + 1:])

    def chat_ids(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole chat, ``[{"role": ..., "content": ...}, ...]``, every
        message's content tokenized as text.

        What ``tokenizer.apply_chat_template(messages, tokenize=True)`` gives for ordinary
        text (and what :meth:`build` lays out for the same turns), without letting a message
        open turns of its own. ``content`` is a str or a list of ``{"type": "text", "text":
        ...}`` blocks (joined); other message keys are ignored.
        """
        turns = _checked_messages(messages)
        if not self.use_chat_template:
            ids = self._plain_ids(turns)
            return ids + self._plain_cue() if add_generation_prompt and turns[-1][0] != "assistant" else ids
        return self._encode(self._chat_pieces(turns, add_generation_prompt=add_generation_prompt))

    # ------------------------------------------------------------------ the plain layout (no chat template)

    def _plain_ids(self, turns: list[tuple[str, str]], more_follows: bool = False) -> list[int]:
        """BOS, then each turn's text (an assistant's after the answer cue), joined by the separator
        (and followed by it when ``more_follows`` and there was a turn). An empty system prompt adds nothing."""
        ids = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        pieces = [(f"{self.answer_cue} {text}" if role == "assistant" and self.answer_cue else text)
                  for role, text in turns if text or role != "system"]
        for i, text in enumerate(pieces):
            ids += (self._separator_ids if i else []) + self.tokenize(text)
        return ids + self._separator_ids if more_follows and pieces else ids

    def _plain_cue(self) -> list[int]:
        """What follows the user's text: the separator and the answer cue (nothing without a cue)."""
        return self._separator_ids + self.tokenize(self.answer_cue) if self.answer_cue else []

    def _render(self, turns, contents, add_generation_prompt: bool) -> str:
        messages = [{"role": role, "content": content} for (role, _), content in zip(turns, contents)]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _chat_pieces(self, turns: list[tuple[str, str | None]], *, add_generation_prompt: bool) -> list:
        """The rendered chat as pieces: ``(text, True)`` for the template's own text,
        ``(text, False)`` for a message's text, and None where the turn whose text is None
        (the last user message, laid out by :meth:`build`) goes.

        The template is rendered with a fresh random placeholder for every message, so no
        input can forge one (a fixed marker in a system prompt would split the template
        there). Each message's text is then what the template makes of it (a template may
        trim it), read off a render with only that message filled in.
        """
        marks = [f"ragblend{uuid.uuid4().hex}" for _ in turns]
        rendered = self._render(turns, marks, add_generation_prompt)
        parts = re.split(f"({'|'.join(marks)})", rendered)
        for mark, (role, text) in zip(marks, turns):
            count = parts[1::2].count(mark)
            if text is None and count == 0:
                raise InvalidInputError("The model's chat template drops the user message; "
                                        "pass use_chat_template=False.")
            if count > 1:
                raise InvalidInputError(f"The model's chat template writes the {role} message's text more than "
                                        "once; ragblend cannot lay out such a prompt. Pass use_chat_template=False.")
        # Where the template writes every message's text as given (most do), one render with all of
        # them in says so, and none per message is needed (each takes ~0.4 ms: a long chat paid ms a turn).
        texts = [mark if text is None else text for mark, (_, text) in zip(marks, turns)]
        as_given = self._render(turns, texts, add_generation_prompt) == "".join(
            texts[marks.index(part)] if k % 2 else part for k, part in enumerate(parts))
        pieces: list = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if part:
                    pieces.append((part, True))
                continue
            i = marks.index(part)
            if turns[i][1] is None:
                pieces.append(None)
                continue
            if as_given:
                pieces.append((turns[i][1], False))
                continue
            start = rendered.index(part)
            before, after = rendered[:start], rendered[start + len(part):]
            filled = self._render(turns, marks[:i] + [turns[i][1]] + marks[i + 1:], add_generation_prompt)
            if filled.startswith(before) and filled.endswith(after) and len(filled) >= len(before) + len(after):
                pieces.append((filled[len(before):len(filled) - len(after)], False))
            else:   # the template treats this text specially: take it as given
                pieces.append((turns[i][1], False))
        return pieces

    def _encode(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Ids of template and message pieces: the template's control tokens parsed, the
        messages' as text.

        Tokenizing the pieces joined is what the template gives ordinary text (tokens may
        merge across a piece boundary), so that is used whenever it is safe: no message
        holds a control token's string and the joined ids hold exactly the template's own
        control tokens. Otherwise each piece is tokenized on its own.
        """
        if not pieces:
            return []
        ids = self.tokenize_template("".join(text for text, _ in pieces))
        control = self.text_encoder.control_ids
        if not any(not own and self.text_encoder.contains_control(text) for text, own in pieces):
            template_controls = [i for text, own in pieces if own for i in self.tokenize_template(text) if i in control]
            if [i for i in ids if i in control] == template_controls:
                return ids
        out: list[int] = []
        for text, own in pieces:
            out += self.tokenize_template(text) if own else self.tokenize(text)
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
            turns = ([] if system is None else [check_text(system, "system")]) + [t for _, t in _checked_history(history)]
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
