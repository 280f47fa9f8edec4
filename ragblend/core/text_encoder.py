"""Text tokenized *as text* (:class:`TextEncoder`), and the check every text passes first (:func:`check_text`).

Documents, user messages, system prompts and history may contain the strings of the model's
control tokens (``<|im_start|>``...); tokenized here they become ordinary tokens, so retrieved
text cannot open a turn of its own. Only the chat template's own text is tokenized with its
control tokens parsed (:meth:`~ragblend.core.chat_template.ChatTemplateMixin.tokenize_template`).
"""

from __future__ import annotations

import json
import threading
import weakref

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


class TextEncoder:
    """Tokenizes text *as text*: the string of a control token (``<|im_start|>``) in it
    becomes ordinary tokens, never the control token itself.

    Control tokens are the tokenizer's special added tokens, plus the other added tokens its
    chat template writes (Qwen's ``<tool_call>``...), except whitespace ones. For text without
    them the ids are exactly the tokenizer's own (``tokenizer(text, add_special_tokens=False)``).

    Hugging Face's ``split_special_tokens=True`` does the splitting, but it works by setting a
    flag on the tokenizer shared by every thread. Text holding no control string tokenizes the
    same with the flag or without, so it runs on the fast tokenizer's own Rust backend
    untouched; only text that holds one runs on a private copy of the backend with the flag
    set once, so no other call can flip it under it. That copy is made on the first such text:
    it holds a second vocabulary (48 MB for Qwen2.5's 151k tokens), which most engines never
    need. Built once per tokenizer (:func:`text_encoder`).
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
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._private, self._private_lock = None, threading.Lock()
        # probed through the path every text takes (a backend left padding falls back to the copy)
        if self._backend is not None and self._encode_backend(self.PROBE) != self._encode_wrapper(self.PROBE):
            self._backend = None   # the wrapper does more than the Rust tokenizer: use the wrapper

    @staticmethod
    def state_of(tokenizer) -> tuple:
        """What the encoder depends on besides the vocabulary: the added tokens and the template."""
        return len(getattr(tokenizer, "added_tokens_decoder", {}) or {}), str(getattr(tokenizer, "chat_template", None))

    def _private_backend(self):
        """The backend's copy with every control token split as text (made once, on first use)."""
        with self._private_lock:
            if self._private is None:
                from tokenizers import Tokenizer

                state = json.loads(self._backend.to_str())
                state["truncation"] = state["padding"] = None
                for token in state.get("added_tokens", []):
                    if token["content"] in self.control_strings:
                        token["special"] = True   # split by encode_special_tokens like the special ones
                copy = Tokenizer.from_str(json.dumps(state))
                copy.encode_special_tokens = True
                self._private = copy
            return self._private

    def _encode_shared(self, text: str) -> list[int] | None:
        """The ids of text holding no control string, from the tokenizer's own backend; None where
        that backend's result is not the plain one: a control token found after all (through its
        normalizer), or truncation or padding another caller left set on the shared backend."""
        # encode_batch releases the GIL while it works (encode holds it: ~0.8 s on a 540k-character
        # prompt, during which a server's event loop could not answer even /health).
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        ids = encoding.ids
        if encoding.overflowing or sum(encoding.attention_mask) != len(ids) or self.control_ids.intersection(ids):
            return None
        return ids

    def _encode_backend(self, text: str) -> list[int]:
        ids = None if self.contains_control(text) else self._encode_shared(text)
        if ids is None:
            ids = self._private_backend().encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def _encode_wrapper(self, text: str) -> list[int]:
        with split_flag_lock:
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
split_flag_lock = threading.Lock()
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
