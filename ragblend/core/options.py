"""EngineOptions: every engine option, declared once.

Each field says its type, default and help text (and, where the CLI exposes it, its flag and
choices); :meth:`EngineOptions.__post_init__` is the one place an option is checked. The
readers all take it from here:

* :class:`~ragblend.BlendEngine` and :meth:`~ragblend.BlendEngine.from_pretrained` (as
  ``options=`` or as the same-named keywords),
* the CLI and the server (:func:`add_arguments` / :func:`from_args`),
* the framework integrations' pydantic fields (:func:`field_help`, :data:`KV_DTYPES`...).

Example::

    options = EngineOptions(kv_dtype="int8", decode_dtype="float32")
    engine = BlendEngine.from_pretrained(options=options)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import InvalidInputError, InvalidTypeError
from .model.kernels import DRAFT_ROWS
from .prompt import CHUNK_CONTEXT, check_text
from .store.disk_limit import check_disk_bytes
from .store.tiers import STORAGE_DTYPES

KV_DTYPES = tuple(STORAGE_DTYPES)                    # ("float32", "float16", "bfloat16", "int8", "uint4")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16", "quantized")   # EngineOptions.dtype by name
DECODE_DTYPES = ("auto", "float32", "float16", "int4", "int8")
DECODE_KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
# A pass over more rows than this is timed and run as a prefill (kernels.BUCKETS).
MAX_DRAFT_TOKENS = DRAFT_ROWS - 1


_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def byte_size(text: str) -> int:
    """An argparse type: bytes, as a whole number or with a binary unit (``512MiB``, ``37.6GiB``,
    ``40G``: K, M, G, T all powers of 1024, as ragblend prints sizes)."""
    number = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = number[-1:] if number[-1:] in _SIZE_UNITS else ""
    try:
        value = float(number[:len(number) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 8589934592, 512MiB or 8GiB, got {text!r}")
    return math.ceil(value)


def option(default, help: str, *, flag: str | None = None, choices: tuple | None = None,
           load: bool = False, type=None):
    """A field of :class:`EngineOptions`: its default and help, and for the CLI its ``flag``
    (with ``type`` and ``choices``). ``load``: an option of loading the model
    (:meth:`BlendEngine.from_pretrained`), not of the engine around it."""
    metadata = {"help": help, "flag": flag, "choices": choices, "load": load, "type": type}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineOptions:
    """The options of a :class:`~ragblend.BlendEngine` (see the module docstring)."""

    # -- loading the model (from_pretrained)
    model: str | os.PathLike | None = option(
        None, "Local Hugging Face model directory or .gguf file; None: the embedded SmolLM2-135M-Instruct.",
        flag="--model", load=True, type=str)
    kv_dir: str | os.PathLike | Literal[False] | None = option(
        None, "Folder of the KV store's disk tier; None: <user cache>/ragblend/kv; False: memory only.",
        flag="--kv-dir", load=True, type=str)
    memory_bytes: int = option(2 << 30, "Size of the KV store's memory tier (LRU), in bytes; it lasts one process.",
                               flag="--memory-bytes", load=True, type=byte_size)
    disk_bytes: int | None = option(
        None, "Size of the KV store's disk tier (LRU), in bytes: what the next process finds. Saved with the store: "
              "None (the default) keeps the size saved there (8 GiB where none was); a size given is saved for later "
              "openers, and one below what the store holds evicts its least recently used entries (and says so).",
        flag="--disk-bytes", load=True, type=byte_size)
    dtype: torch.dtype | str | None = option(
        None, "How the model's weights are held in memory: 'auto' (or None, the default): a GGUF file's in float32 "
              "where that takes at most 4 GiB, else in its quantized form; an HF directory's as stored (bfloat16 or "
              "float16 stay 16-bit). 'quantized': a GGUF file's quantized form whatever its size. 'float32', "
              "'bfloat16', 'float16': that dtype. On the CPU, 16-bit and quantized weights are computed in float32 "
              "(docs/models.md).", flag="--dtype", choices=WEIGHT_DTYPES, load=True, type=str)
    device: str | torch.device = option("cpu", "Device the model runs on.", load=True)
    # -- the engine around it
    separator: str = option("\n\n", "What joins the segments of a prompt.")
    sink_prefix: str | None = option(
        None, "Template text every chunk is precomputed after (its control tokens are parsed); "
              "None: the chat template's opening, then chunk_context.")
    chunk_context: str = option(
        CHUNK_CONTEXT, "A neutral passage every chunk is precomputed after, so that a chunk's cached KV is that of "
                       "a passage in the middle of a prompt (\"\" for none; docs/notes/chunk-context.md).")
    lead_chunk_kv: bool = option(
        True, "Also store each chunk's KV as computed right after the template's opening, for where the chunk is a "
              "prompt's first passage (its cached KV is then nearly exact there): about twice the ingestion time and "
              "KV storage (docs/notes/lead-entries.md). Off when chunk_context is \"\" or sink_prefix is set.")
    use_chat_template: bool | None = option(None, "Wrap prompts in the tokenizer's chat template; None: when it has one.")
    kv_dtype: str | torch.dtype = option(
        "float16", "How chunk KV is stored: 'int8' takes about half the bytes of float16, 'uint4' (4-bit, a step and "
                   "minimum per group of 32) 0.31x, each at a fidelity cost measured in docs/benchmarks.md ('Stored KV "
                   "dtypes'); bytes per token per model size: docs/models.md.", flag="--kv-dtype", choices=KV_DTYPES,
        type=str)
    prefetch: bool = option(True, "Read cached KV from disk (on a GPU, from any tier) ahead of the layer that needs "
                                    "it, in a background thread.")
    min_fusion_speedup: float = option(
        0.0, "The engine's own strategy fuses a prompt only where that is predicted at least this many times faster "
             "than its full prefill on this host (stats.fusion_skipped and stats.skip_reason say when it is not: "
             "short prompts); 0 (the default): always fuse, since on the user-like benchmark 1.3 only ran prompts "
             "under 600 tokens as full prefills that fusing answered as well and faster (docs/benchmarks.md). A strategy the caller names is always run as asked.", type=float)
    prefix_cache_bytes: int = option(
        512 << 20, "Memory for the prefix tier, in bytes (0: off): the K/V of recent prompts and answers, which a "
                   "prompt starting with the same tokens reuses as they are (an exact repeat computes nothing: its "
                   "logits are kept too; a conversation's next turn, its new text). Per namespace (a server's tenant); least "
                   "recently used out first. Read by the engine's own strategy only.", type=int)
    history_pieces: bool = option(
        True, "Keep a conversation's turns (questions, the engine's answers, system text) as pieces once answered, "
              "fused like chunks in later prompts of the same namespace, so that a turn reuses its history even "
              "where the prompt's front changed (new context in the system message). Only for conversations: a "
              "prompt laid out with history holding an assistant's answer); a single-shot query keeps nothing "
              "and costs nothing more. Pieces live in their own memory (history_pieces_bytes), never in the KV "
              "store: they never evict a document's KV. Read by the engine's own strategy only; needs write_back.")
    history_pieces_bytes: int = option(
        256 << 20, "Memory for history pieces, in bytes, apart from the KV store's; least recently used out first "
                   "(an evicted piece is no longer looked for in prompts).", type=int)
    write_back: bool = option(True, "Store the KV of chunks a query had to compute, for the next query.")
    name: str | None = option(None, "The model's name in stats and the server; None: from the model.")
    decode_dtype: str = option(
        "auto", "Weights of the decoding matmuls. 'auto': 4-bit where the model's weights already are 4-bit (a "
                "Q4_0/Q4_1 GGUF such as the embedded SmolLM2; lossless for the weights, activations rounded to "
                "bfloat16), 8-bit (one scale per row) for the other layers of a model loaded from a GGUF file, each "
                "only where it measures faster than float32 on this host; float32 otherwise. 'int4' / 'int8': 4-bit "
                "(LM head float32) / 8-bit weights for every layer. 'float32' and 'float16' as named. Measured "
                "trade-offs: docs/benchmarks.md, 'Decoding'.", flag="--decode-dtype", choices=DECODE_DTYPES, type=str)
    decode_kv_dtype: str = option(
        "auto", "Dtype of the K/V an answer's decoding attends over. 'auto': float16 where the decoding matmuls "
                "already round activations to bfloat16 (4-bit or 8-bit weights) and float16 attention measures faster "
                "than float32 on this host; float32 otherwise. 'bfloat16' only when asked: it changed more answers. "
                "Measured trade-offs: docs/benchmarks.md, 'Decoding'.", flag="--decode-kv-dtype", choices=DECODE_KV_DTYPES, type=str)
    # precompute() runs up to this many chunk tokens through the model in one pass (and holds the
    # engine that long): large enough to fill the matmuls, short enough that a query waiting behind
    # ingestion is not kept for long. 0: one chunk per pass, whose entry is bit-identical to the one
    # a query computes for a missing chunk (a packed pass agrees with it to ~1e-6, which can flip a
    # float16 rounding).
    precompute_batch_tokens: int = option(
        1024, "Chunk tokens precompute() runs through the model in one pass (0: one chunk per pass).", type=int)
    # Greedy decoding drafts up to this many tokens per pass by prompt lookup and keeps those the
    # pass confirms (generate.PromptLookup): answers are unchanged. How many it drafts on each pass
    # is learned over the answer (generate.DraftPolicy: how often drafts were kept), against what a
    # row costs on this host (answers.draft_row_cost, timed at engine start); drafting 3 on every
    # pass made free-text answers slower than none (docs/benchmarks.md, "Decoding").
    prompt_lookup_num_tokens: int = option(
        3, f"Most tokens greedy decoding drafts per pass by prompt lookup (0: no drafting; at most "
           f"{MAX_DRAFT_TOKENS}); how many it drafts is learned over the answer.",
        flag="--prompt-lookup-num-tokens", type=int)

    def __post_init__(self):
        if not isinstance(self.chunk_context, str):
            raise InvalidInputError(
                f"chunk_context must be a str (\"\" for none), got {type(self.chunk_context).__name__}.")
        if self.sink_prefix is not None:
            check_text(self.sink_prefix, "sink_prefix")
        if not isinstance(self.lead_chunk_kv, bool):
            raise InvalidInputError(f"lead_chunk_kv must be True or False, got {self.lead_chunk_kv!r}.")
        storage_dtype(self.kv_dtype)
        if self.decode_dtype not in DECODE_DTYPES:
            raise InvalidInputError(
                f"decode_dtype must be 'auto' (the default: 4-bit weights where the model's already are 4-bit, else "
                f"float32), 'float32', 'float16' (float16 weights in the decoding matmuls), 'int4' (4-bit weights, "
                f"bfloat16 activations) or 'int8' (8-bit weights, bfloat16 activations), got {self.decode_dtype!r}.")
        if self.decode_kv_dtype not in DECODE_KV_DTYPES:
            raise InvalidInputError(f"decode_kv_dtype must be one of {', '.join(map(repr, DECODE_KV_DTYPES))}, "
                                    f"got {self.decode_kv_dtype!r}.")
        object.__setattr__(self, "disk_bytes", check_disk_bytes(self.disk_bytes))
        prefix_bytes = self.prefix_cache_bytes
        if isinstance(prefix_bytes, bool) or not isinstance(prefix_bytes, numbers.Integral) or prefix_bytes < 0:
            raise InvalidInputError(f"prefix_cache_bytes must be an integer >= 0 (0: no prefix tier), got {prefix_bytes!r}.")
        object.__setattr__(self, "prefix_cache_bytes", int(prefix_bytes))
        piece_bytes = self.history_pieces_bytes
        if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, numbers.Integral) or piece_bytes < 0:
            raise InvalidInputError(f"history_pieces_bytes must be an integer >= 0 (0: keep no pieces), got {piece_bytes!r}.")
        object.__setattr__(self, "history_pieces_bytes", int(piece_bytes))
        batch = self.precompute_batch_tokens
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 0:
            raise InvalidInputError(f"precompute_batch_tokens must be an integer >= 0 (0: one chunk per pass), "
                                    f"got {batch!r}.")
        speedup = self.min_fusion_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, numbers.Real) or not 0 <= speedup < 100:
            raise InvalidInputError(f"min_fusion_speedup must be a number from 0 (always fuse) to 100, got {speedup!r}.")
        object.__setattr__(self, "min_fusion_speedup", float(speedup))
        drafts = self.prompt_lookup_num_tokens
        if isinstance(drafts, bool) or not isinstance(drafts, numbers.Integral) or not 0 <= drafts <= MAX_DRAFT_TOKENS:
            raise InvalidInputError(f"prompt_lookup_num_tokens must be an integer from 0 (no drafting) to "
                                    f"{MAX_DRAFT_TOKENS}, got {drafts!r}.")
        object.__setattr__(self, "precompute_batch_tokens", int(batch))
        object.__setattr__(self, "prompt_lookup_num_tokens", int(drafts))

    @property
    def storage_dtype(self) -> torch.dtype:
        """``kv_dtype`` as a torch dtype."""
        return storage_dtype(self.kv_dtype)

    @classmethod
    def merged(cls, options: "EngineOptions | None", keywords: dict, *, engine_only: bool = False) -> "EngineOptions":
        """``options`` (default: the defaults) with ``keywords`` over them. Unknown keywords are an
        InvalidTypeError (a TypeError, as for any function); with ``engine_only``, so are the loading options."""
        allowed = ENGINE_FIELDS if engine_only else FIELDS
        unknown = [k for k in keywords if k not in allowed]
        if unknown:
            raise InvalidTypeError(f"unexpected keyword argument {unknown[0]!r}; engine options are {', '.join(allowed)}.")
        if options is not None and not isinstance(options, EngineOptions):
            raise InvalidTypeError(f"options must be a ragblend EngineOptions, got {type(options).__name__}.")
        return dataclasses.replace(options or cls(), **keywords)

    def engine_keywords(self) -> dict:
        """The options of the engine around the model (what :class:`BlendEngine` itself takes)."""
        return {name: getattr(self, name) for name in ENGINE_FIELDS}


FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions))
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineOptions) if not f.metadata["load"])
_BY_NAME = {f.name: f for f in dataclasses.fields(EngineOptions)}


def storage_dtype(kv_dtype) -> torch.dtype:
    """The torch dtype of a ``kv_dtype`` option (a name of :data:`KV_DTYPES` or the dtype itself)."""
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in STORAGE_DTYPES.values():
        return kv_dtype
    if isinstance(kv_dtype, str) and kv_dtype in STORAGE_DTYPES:
        return STORAGE_DTYPES[kv_dtype]
    raise InvalidInputError(f"kv_dtype must be one of {', '.join(STORAGE_DTYPES)}, got {kv_dtype!r}.")


def field_help(name: str) -> str:
    """The help text of option ``name`` (for the integrations' field descriptions)."""
    return _BY_NAME[name].metadata["help"]


def field_default(name: str):
    """The default of option ``name``."""
    return _BY_NAME[name].default


def add_arguments(parser: argparse.ArgumentParser, names, *, help: dict | None = None) -> None:
    """Add the CLI flags of options ``names`` to ``parser`` (``help``: texts to use instead of
    the options' own, by name). Their ``dest`` is the option's name, so :func:`from_args`
    reads them back."""
    for name in names:
        f = _BY_NAME[name]
        meta = f.metadata
        if not meta["flag"]:
            raise InvalidInputError(f"engine option {name!r} has no CLI flag; give it one in ragblend.core.options.")
        default, text = f.default, (help or {}).get(name, meta["help"])
        if "default" not in text:   # every flag's help says its default (argparse fills it in)
            text += " (default: %(default)s)"
        parser.add_argument(meta["flag"], dest=name, default=default, type=meta["type"], choices=meta["choices"],
                            help=text)


def from_args(args: argparse.Namespace, **overrides) -> EngineOptions:
    """The options parsed by flags from :func:`add_arguments` (those the parser has), with
    ``overrides`` over them."""
    given = {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    return EngineOptions(**{**given, **overrides})
