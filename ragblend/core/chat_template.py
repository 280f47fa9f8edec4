"""The model's chat template, for :class:`~ragblend.core.prompt.PromptBuilder` (:class:`ChatTemplateMixin`).

Turns (a system prompt, earlier user and assistant turns, chat messages) become token ids the
way ``tokenizer.apply_chat_template`` makes them for ordinary text, with every message's text
tokenized as text (:class:`~ragblend.core.text_encoder.TextEncoder`) and only the template's own
text with its control tokens parsed. A model without a chat template gets the *plain layout*
(see :mod:`ragblend.core.prompt`). A mixin, as Hugging Face's tokenizers get their special
tokens from ``SpecialTokensMixin``: rendering the template is one concern of its own, and the
builder's tokenizing, which it calls, stays the builder's.
"""

from __future__ import annotations

import functools
import re
import uuid
from typing import Sequence, TypeVar

from jinja2 import TemplateError

from .errors import InvalidInputError
from .text_encoder import check_text, split_flag_lock

T = TypeVar("T")   # what a chat turn carries besides its role (a text, or a text and its blocks)

# A role is written into the template as template text (``'<|im_start|>' + role``), so it
# must be a plain name, never free text.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")

# The roles a chat is laid out with: the template's own names. "tool" is a tool's result, laid out
# with the template's tool role where the template has one (ChatTemplateMixin.check_tool_turns).
CHAT_ROLES = ("system", "user", "assistant", "tool")

# A template with a tool role names it as a string it compares a message's role with
# (Qwen's, Llama 3's, Mistral's: ``message.role == "tool"``); one without writes any role as
# given (SmolLM2's ChatML) or refuses it (Gemma 3's), and its model never saw a tool turn.
_TOOL_ROLE = re.compile(r"""(['"])tool\1""")
# The placeholder a message's text is rendered as (:meth:`ChatTemplateMixin._chat_pieces`): one
# pattern for all of them, compiled once (a pattern of each render's own placeholders took ~1 ms).
_MARK = re.compile(r"(ragblend[0-9a-f]{32})")

RESULT_AS_TEXT = "give the tool's result as text in a user message (e.g. 'The weather tool says: ...')"


def _checked_role(role, what: str) -> str:
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise InvalidInputError(f"{what} role must be a plain name such as 'user' or 'assistant', got {str(role)[:40]!r}.")
    return role


def checked_history(history) -> list[tuple[str, str]]:
    """``history`` as a list of ``(role, text)`` turns, each checked."""
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise InvalidInputError("history must be a list of (role, text) pairs, e.g. [('user', 'Hi'), ('assistant', 'Hello')].")
    turns = []
    for i, turn in enumerate(history):
        if not isinstance(turn, (tuple, list)) or len(turn) != 2:
            raise InvalidInputError(f"history turn {i} must be a (role, text) pair, got {type(turn).__name__}.")
        turns.append((_checked_role(turn[0], f"history turn {i}'s"), check_text(turn[1], f"history turn {i}")))
    return turns


def split_chat(turns: Sequence[tuple[str, T]], who: str = "The chat") -> tuple[T | None, list[tuple[str, T]], T]:
    """``(system, history, last)`` of a chat's ``(role, value)`` turns, roles the template's
    ("system", "user", "assistant"), as ``apply_chat_template`` renders them: a first system
    turn is the system prompt (an empty one too, so a template's default prompt is not put in
    its place), the turns after it the history in their order (a later system turn keeps its
    place), the last turn, which must be the user's, the question. The one splitter of the
    library (BlendLLM.chat, BlendChatModel) and the server (``ChatPrompt.parse``). A "tool"
    turn (a tool's result) may be in the history; the template lays it out, or refuses it
    (:meth:`ChatTemplateMixin.check_tool_turns`)."""
    turns = list(turns)
    for i, (role, _) in enumerate(turns):
        if role not in CHAT_ROLES:
            raise InvalidInputError(f"{who}: message {i} has the role {str(role)[:40]!r}; ragblend lays out "
                                    "system, user, assistant and tool messages.")
    if turns and turns[-1][0] == "tool":
        raise InvalidInputError(f"{who} ends with a tool's result; ragblend answers a user turn and does not "
                                f"implement tool calling: {RESULT_AS_TEXT}.")
    if not turns or turns[-1][0] != "user":
        raise InvalidInputError(f"{who} needs the last message to be the user's: ragblend answers a user turn; "
                                "it does not continue an assistant's or answer a system message alone.")
    if turns[0][0] != "system":
        return None, turns[:-1], turns[-1][1]
    return turns[0][1], turns[1:-1], turns[-1][1]


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


class ChatTemplateMixin:
    """Token ids of turns through the chat template (or the plain layout). What it uses of the
    builder: ``tokenizer``, ``use_chat_template``, ``answer_cue``, ``text_encoder``, ``tokenize``
    and ``_separator_ids``."""

    def tokenize_template(self, text: str) -> list[int]:
        """Ids of text with its control tokens parsed: only for text the chat template or the
        developer wrote (a ``sink_prefix``), never for documents or messages."""
        with split_flag_lock:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])

    def template_parts(self, system: str | None, history: Sequence[tuple[str, str]] = ()) -> tuple[list[int], list[int]]:
        """Token ids the template puts before and after the (last) user message.

        ``history`` holds earlier turns as ``(role, text)`` with role "user" or "assistant".
        """
        turns = ([] if system is None else [("system", check_text(system, "system"))]) + checked_history(history)
        self.check_tool_turns(turns)
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
        self.check_tool_turns(turns)
        if not self.use_chat_template:
            ids = self._plain_ids(turns)
            return ids + self._plain_cue() if add_generation_prompt and turns[-1][0] != "assistant" else ids
        return self._encode(self._chat_pieces(turns, add_generation_prompt=add_generation_prompt))

    def next_turn_opening(self) -> list[int]:
        """Token ids the template writes between an assistant message's text and the next user
        message's text (ChatML's ``<|im_end|>\n<|im_start|>user\n``): what the next turn of a
        conversation starts with after an answer (computed ahead by the prefix tier, which reuses
        them only where a next prompt holds the same ids). Empty where the template refuses such a
        chat. Rendered once."""
        return list(self._opening_after_answer)

    @functools.cached_property
    def _opening_after_answer(self) -> tuple[int, ...]:
        if not self.use_chat_template:
            return tuple(self._separator_ids)   # the plain layout joins every turn with the separator
        try:
            pieces = self._chat_pieces([("user", "Hello."), ("assistant", "Hi."), ("user", None)],
                                       add_generation_prompt=True)
        except InvalidInputError:   # a template that refuses such a chat: nothing to compute ahead
            return ()
        answer = [k for k, piece in enumerate(pieces) if piece is not None and not piece[1]][-1]
        between = pieces[answer + 1:pieces.index(None)]
        return tuple(self.tokenize_template("".join(text for text, _ in between)))

    def check_tool_turns(self, turns: Sequence[tuple[str, object]], who: str | None = None) -> None:
        """Refuse a tool turn unless the chat template has a tool role: written as any other
        role (ChatML's ``<|im_start|>tool``) or as the user's, a model trained without tool
        turns reads a tool's result as something it or the user said. ``who``: the message the
        error names (an integration's "BlendChatModel: messages[3]"), else "The chat"."""
        if not any(role == "tool" for role, _ in turns):
            return
        template = self.tokenizer.chat_template if self.use_chat_template else None
        if isinstance(template, dict):   # named templates: apply_chat_template renders "default" (without tools=)
            template = template.get("default")
        if not template or not _TOOL_ROLE.search(template):
            where = "the model's chat template has no tool role" if template else "the model has no chat template"
            subject = f"{who} is a tool's result" if who else "The chat holds a tool's result"
            raise InvalidInputError(f"{subject}, and {where}: {RESULT_AS_TEXT}, or use a model whose template has "
                                    "a tool role (Qwen2.5, Llama 3.1).")

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
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as err:   # the template's own rule (e.g. Gemma's: roles alternate, system first)
            roles = ", ".join(role for role, _ in turns)
            raise InvalidInputError(f"The model's chat template refused these turns ({roles}): {err}. Send them "
                                    "as the template expects (for most: one system message first, then user and "
                                    "assistant turns in turn).") from err

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
        parts = _split_at(rendered, marks)
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


def _split_at(rendered: str, marks: list[str]) -> list[str]:
    """``rendered`` split at each of ``marks``: text, mark, text, ..., text (as ``re.split`` with a
    group of the marks gives); text that only looks like a mark stays text."""
    parts = _MARK.split(rendered)
    wanted = set(marks)
    out = [parts[0]]
    for k in range(1, len(parts), 2):
        if parts[k] in wanted:
            out += [parts[k], parts[k + 1]]
        else:
            out[-1] += parts[k] + parts[k + 1]
    return out
