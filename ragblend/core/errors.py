"""Error types. Every error ragblend raises on purpose derives from :class:`RagblendError`,
and also from the built-in type a Python user would expect (``ValueError``, ``TypeError``...)."""


class RagblendError(Exception):
    """Base class of all ragblend errors."""


class InvalidInputError(RagblendError, ValueError):
    """An argument has the right type but a value ragblend cannot use."""


class InvalidTypeError(RagblendError, TypeError):
    """An argument has a type ragblend cannot use."""


class SegmentTypeError(InvalidTypeError):
    """A prompt segment is neither a ``str`` nor a :class:`ragblend.Chunk`."""


class PromptTooLongError(InvalidInputError):
    """The prompt (or one chunk) does not fit in the model's context window."""


class UnsupportedModelError(RagblendError, ValueError):
    """The model's architecture has no adapter in :mod:`ragblend.core.model`."""


class ModelNotFoundError(RagblendError, FileNotFoundError):
    """The requested model (or the embedded default) is not installed."""


class ModelFileError(InvalidInputError):
    """A model file exists but cannot be loaded as it is: not a GGUF file, damaged, truncated,
    one shard of a split GGUF, or without the tokenizer ragblend needs. Not a
    ``FileNotFoundError``: the file is there, and the message says what to do with it."""


class StoreUnavailableError(RagblendError, OSError):
    """A KV store folder cannot be opened (not a folder, unreadable, broken database).
    Engines never raise it (they keep KV in memory instead); ``ragblend cache`` does."""
