"""BlendEngine: the one object the integrations, CLI and app talk to.

Example::

    from ragblend import BlendEngine, Chunk, CacheBlend

    engine = BlendEngine.from_pretrained()            # embedded SmolLM2-135M-Instruct
    engine.precompute(["Paris is the capital of France.", "Berlin is the capital of Germany."])
    out = engine.generate(
        [Chunk("Paris is the capital of France."), Chunk("Berlin is the capital of Germany."),
         "Question: what is the capital of Germany?"],
        max_new_tokens=16,
    )
    print(out.text, out.stats.ttft_s, out.stats.reused_tokens)
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Sequence

import torch

from .calibration import UNCALIBRATED, Calibration, calibrate, load_calibration, save_calibration
from .errors import InvalidInputError, PromptTooLongError
from .fusion import (
    CacheBlend,
    FullRecompute,
    QueryAware,
    ReusedSpan,
    Strategy,
    check_strategy,
    fused_prefill,
    isolated_kv,
    packed_isolated_kv,
    sink_kv,
)
from .generate import Decoding, KVDecoder, PromptLookup, SamplingParams
from .kernels import MIN_GAIN, KernelPlan, fastest_rounds
from .kv import ChunkKV, ChunkRef, calibration_key, chunk_key, to_storage
from .model import (
    EXACT_INT4,
    CpuLinear,
    HalfLinear,
    Int4Linear,
    Int8Head,
    Int8Linear,
    ModelAdapter,
    cache_dir,
    from_gguf,
    int4_available,
    int8_available,
    kernel_plan_for,
    load_model,
    on_int4_grid,
    with_linears,
)
from .options import EngineOptions
from .pipeline import PrefetchSource, SequentialSource
from .prompt import ChunkFinder, PromptBuilder, PromptLayout, Segment, check_text
from .store import (
    ChunkReader,
    CorruptEntryError,
    DiskStore,
    EntrySpec,
    KVStore,
    MemoryReader,
    MemoryStore,
    TieredStore,
    open_store,
)

log = logging.getLogger("ragblend")

_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # hf_model -> {decode_dtype: ModelAdapter}
_TWINS_LOCK = threading.Lock()


@dataclass
class Stats:
    """What one prefill (and the decode after it, if any) cost and reused."""

    ttft_s: float = 0.0            # from the call to the first token's logits
    prompt_tokens: int = 0
    reused_tokens: int = 0         # prompt tokens whose KV came from the store (and was kept)
    cache_hit_tokens: int = 0      # prompt tokens found in the store: the reused ones plus those the fusion recomputed
    recomputed_tokens: int = 0     # prompt tokens computed through every layer
    compute_fraction: float = 0.0  # token-layers computed, as a share of a full prefill's
    load_s: float = 0.0            # reading cached KV (in the background when pipelined)
    load_wait_s: float = 0.0       # of which the fusion had to wait for
    compute_s: float = 0.0         # running layers
    strategy: str = ""
    ratio: float | None = None     # the recompute ratio (CacheBlend's "auto" resolved)
    cached_attention_scale: float | None = None   # QueryAware's factor on attention to the reused tokens left cached
    chunks_reused: int = 0         # distinct chunks whose KV came from the store (however many spans)
    chunks_missing: int = 0        # distinct chunks with no (usable) stored KV
    chunks_computed: int = 0       # of those, computed in isolation now and written back
    isolate_s: float = 0.0         # time spent computing those
    tiers: dict = field(default_factory=dict)   # chunks served per tier, e.g. {"memory": 5, "disk": 1}
    generated_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0          # model passes after the prefill: one per token after the first, fewer when drafts were kept
    finish_reason: str | None = None
    strategy_reason: str = ""      # why this strategy and ratio (caller's choice, calibration, default)
    store_faults: int = 0          # KV store failures during this prefill, each served as a miss

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_hidden_fraction(self) -> float:
        """Share of the KV load time that overlapped compute (1.0 = fully hidden)."""
        # The wait also holds thread hand-off latency, so it can exceed a tiny load.
        return min(1.0, max(0.0, 1.0 - self.load_wait_s / self.load_s)) if self.load_s > 0 else 1.0


@dataclass
class Prefill:
    """Result of :meth:`BlendEngine.prefill`."""

    token_ids: list[int]          # exact prompt ids after chat templating
    logits: torch.Tensor          # [vocab] next-token logits after the prompt (float32)
    stats: Stats
    keys: list[torch.Tensor] = field(repr=False)     # per layer [kv_heads, N, head_dim], after RoPE
    values: list[torch.Tensor] = field(repr=False)
    recomputed: torch.Tensor = field(repr=False)     # bool [N]: tokens recomputed at the last layer
    layout: PromptLayout = field(repr=False)
    # float [N] added to every attention score on each key (QueryAware's cached_attention_scale),
    # or None; decoding from keys/values must add it too, as generate() does
    key_bias: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class PromptTrace:
    """The last prompt an engine prefilled, for display: its ids, which tokens were
    recomputed, and where the reused chunks sit."""

    token_ids: list[int]
    recomputed: torch.Tensor          # bool [N]
    chunk_spans: list                 # ChunkSpan, in prompt order


@dataclass
class Generation:
    """Result of :meth:`BlendEngine.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_token_ids: list[int] = field(repr=False)
    logits: torch.Tensor = field(default=None, repr=False)   # [vocab] logits after the prompt (first token)


class TextStream:
    """Text deltas of one :meth:`BlendEngine.stream` call, with that call's ``stats``
    (set once the prefill is done, complete when the stream ends)."""

    def __init__(self):
        self.stats: Stats | None = None
        self._deltas: Iterator[str] = iter(())

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()


class BlendEngine:
    """Fusion engine over one local model: precompute chunk KV, then prefill/generate with reuse.

    Build it with :meth:`from_pretrained`. Model computations (prefill layers, each decoding
    step) are serialised by a lock, so threads may share an engine; ``last_stats`` and
    ``last_prompt`` then describe whichever call finished last. KV write-back and promotion
    to memory run in a background thread (:meth:`flush` waits for them).
    """

    def __init__(self, hf_model, tokenizer, *, store: KVStore | None = None, strategy: Strategy | None = None,
                 options: EngineOptions | None = None, **keywords):
        """``options`` (an :class:`~ragblend.core.options.EngineOptions`) and/or its engine
        fields as keywords (``kv_dtype=``, ``decode_dtype=``, ``separator=``...), keywords over it."""
        options = EngineOptions.merged(options, keywords, engine_only=True)
        self.options = options
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(hf_model)   # checks the architecture first
        self.kernel_plan: KernelPlan | None = None
        if self.adapter.dtype == torch.float32 and self.adapter.device.type == "cpu":
            # The same weights through the CPU kernels measured fastest on this host (core.kernels);
            # the model itself is left as it is.
            self.kernel_plan = kernel_plan_for(hf_model)
            self.adapter = ModelAdapter(with_linears(hf_model, lambda layer: CpuLinear(layer, self.kernel_plan)))
        self.store = store if store is not None else MemoryStore()
        self.prompts = PromptBuilder(tokenizer, separator=options.separator, use_chat_template=options.use_chat_template)
        # What every chunk is precomputed after: the template's opening, then a neutral passage
        # (chunk_context), so that a chunk's cached KV is that of a passage in the middle of a
        # prompt, as it will be used (docs/benchmarks.md, "Chunk context").
        # A sink_prefix is the developer's own template text: its control tokens are parsed.
        self.sink_ids = (self.prompts.tokenize_template(options.sink_prefix)
                         if options.sink_prefix is not None else self.prompts.sink_ids(options.chunk_context))
        self._sink_kv: list | None = None   # the sink's K/V, computed once (see _compute_entries)
        self.fingerprint = self.adapter.fingerprint(tokenizer)
        self.calibration: Calibration | None = load_calibration(self.calibration_id)
        self._default_strategy = strategy is None
        if strategy is None:
            strategy = self.calibration.strategy if self.calibration else UNCALIBRATED
        self.strategy = check_strategy(strategy, self.adapter.shape.num_layers)
        self.kv_dtype = options.storage_dtype
        self.decode_dtype = options.decode_dtype
        self._decode_adapter: ModelAdapter | None = None
        self.prefetch = options.prefetch
        self.write_back = options.write_back
        self.precompute_batch_tokens = options.precompute_batch_tokens
        self.prompt_lookup_num_tokens = options.prompt_lookup_num_tokens
        name = options.name
        self.name = name or getattr(hf_model.config, "_name_or_path", "") or self.adapter.arch
        self.last_stats: Stats | None = None
        self.last_prompt: PromptTrace | None = None
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-writeback")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragblend-prefetch")  # disk read-ahead
        self._pending_writes: list[Future] = []
        self._controller = None
        self.chunks = ChunkFinder()   # token ids of known chunks, for finding them in flat prompts
        self._indexed_keys: set[str] = set()
        self._indexed_store_size = -1
        self._writes_lock = threading.Lock()
        self._warned_unstored = False
        eos = hf_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        # Built now (a few seconds for 4-bit weights), not in the first answer's time to first token.
        self._decoding_adapter()

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, strategy: Strategy | None = None,
                        store: KVStore | None = None, options: EngineOptions | None = None,
                        **keywords) -> "BlendEngine":
        """Load a model and wrap it.

        ``model`` is None (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file or a local
        Hugging Face directory. KV entries live in memory (LRU, ``memory_bytes``) in front of
        a disk store at ``kv_dir`` (default ``<user cache>/ragblend/kv``; LRU, ``disk_bytes``).
        Pass ``kv_dir=False`` for memory only. Every option of
        :class:`~ragblend.core.options.EngineOptions` may be passed as ``options=`` and/or as a
        keyword (``kv_dir``, ``memory_bytes``, ``dtype``, ``kv_dtype``, ``decode_dtype``,
        ``prompt_lookup_num_tokens``, ``prefetch``, ``separator``...), keywords over ``options``.
        """
        if model is not None:
            keywords["model"] = model
        options = EngineOptions.merged(options, keywords)
        dtype = getattr(torch, options.dtype) if isinstance(options.dtype, str) else options.dtype
        hf_model, tokenizer = load_model(options.model, dtype=dtype, device=options.device)
        if options.name is None:
            name = ("SmolLM2-135M-Instruct" if options.model is None
                    else os.path.basename(str(options.model).rstrip("/")))
            options = replace(options, name=name)
        engine = cls(hf_model, tokenizer, store=store if store is not None else MemoryStore(options.memory_bytes),
                     strategy=strategy, options=options)   # the loading options are kept there, for the record
        if store is None and options.kv_dir is not False:
            engine.store = open_store(options.kv_dir or cache_dir() / "kv", engine.entry_spec, options.memory_bytes,
                                      options.disk_bytes)
        return engine

    # ------------------------------------------------------------------ properties

    @property
    def context_window(self) -> int:
        return self.adapter.shape.context_window

    @property
    def entry_spec(self) -> EntrySpec:
        shape = self.adapter.shape
        vocab_size = self.hf_model.get_input_embeddings().num_embeddings
        return EntrySpec(self.fingerprint, shape.num_layers, shape.num_kv_heads, shape.head_dim, vocab_size)

    @property
    def min_chunk_tokens(self) -> int:
        """Chunks shorter than this are never found inside flat prompts (BlendLLM,
        BlendChatModel without markers), so ingestion hooks do not store them."""
        return ChunkFinder.MIN_RUN

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.tokenize(text))

    # ------------------------------------------------------------------ precompute

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (no special tokens): what a chunk is keyed by."""
        return self.prompts.tokenize(text)

    def key_of(self, text: str) -> str:
        """The key under which a chunk text's KV is stored (see :func:`ragblend.core.kv.chunk_key`)."""
        return self._key_for(self.tokenize(text))

    def _key_for(self, token_ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, self.sink_ids, list(token_ids), str(self.kv_dtype))

    def precompute(self, texts: str | Iterable[str], *, progress: bool = False,
                   skip_unusable: bool = False) -> list[ChunkRef | None]:
        """Compute and store the KV of each chunk text (skipping ones already stored).

        Every text is validated before anything is stored, so a bad item stores nothing.
        With ``skip_unusable`` (what ingestion hooks want), a chunk that is empty, too long
        for the window or too short to be found in a prompt (``min_chunk_tokens``) is not
        an error: its place in the result is None and nothing is stored for it.
        Each returned :class:`ChunkRef` says whether its entry is ``stored``: when the KV
        store fails (full disk, read-only or deleted folder...) it is not, a warning says
        why, and queries compute that chunk instead.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Iterable):
            raise InvalidInputError(f"precompute takes a chunk text or a list of them, got {type(texts).__name__}.")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInputError(f"precompute takes chunk texts (str); item {i} is {type(text).__name__}.")
            check_text(text, f"chunk {i}")
        tokenized = [self.prompts.tokenize(t) for t in texts]
        limit = self.context_window - len(self.sink_ids)
        if skip_unusable:
            tokenized = [ids if self.min_chunk_tokens <= len(ids) <= limit else None for ids in tokenized]
        for i, ids in enumerate(tokenized):
            if ids is None:
                continue
            if not ids or not texts[i].strip():
                raise InvalidInputError(f"chunk {i} is empty or only whitespace; drop such chunks before precomputing.")
            if len(ids) > limit:
                raise PromptTooLongError(
                    f"chunk {i} has {len(ids)} tokens; at most {limit} fit in the context window "
                    f"({self.context_window}) after the sink prefix. Split it into smaller chunks.")
        refs: list[ChunkRef | None] = [None] * len(tokenized)
        todo: dict[str, tuple[int, list[int]]] = {}   # key -> (first index, ids), not stored yet
        keys = [None if ids is None else self._key_for(ids) for ids in tokenized]
        for i, (ids, key) in enumerate(zip(tokenized, keys)):
            if ids is None:
                continue
            self._index_chunk(key, ids)
            if key in todo or key not in self.store:
                todo.setdefault(key, (i, ids))
            else:
                refs[i] = ChunkRef(key, len(ids), True)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(texts), initial=len(texts) - len(todo), desc="Precomputing KV", unit="chunk")
        for batch in _packs(list(todo.items()), self.precompute_batch_tokens):
            entries = self._compute_entries([ids for _, (_, ids) in batch])
            for (key, (i, ids)), entry in zip(batch, entries):
                refs[i] = ChunkRef(key, len(ids), self.store.put(entry))
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        for i, key in enumerate(keys):   # repeats of a text share its first occurrence's entry
            if key is not None and refs[i] is None:
                refs[i] = refs[todo[key][0]]
        unstored = sum(ref is not None and not ref.stored for ref in refs)
        if unstored and not self._warned_unstored:
            self._warned_unstored = True
            log.warning("ragblend: %d of %d chunk(s) could not be stored in the KV store (cause logged above); "
                        "queries compute them instead. ChunkRef.stored says which.", unstored, len(refs))
        return refs

    def forget(self, keys: Iterable[str]) -> int:
        """Drop the stored KV of these chunk keys (e.g. when their document is deleted)."""
        return sum(bool(self.store.delete(key)) for key in keys)

    # ------------------------------------------------------------------ finding chunks in flat prompts

    def remember_chunk(self, text: str) -> str:
        """Declare ``text`` a chunk, so :meth:`find_chunks` marks it in flat prompts even
        when its KV is not stored (it is then computed in isolation and written back).
        Returns its key."""
        ids = self.prompts.tokenize(text)
        key = self._key_for(ids)
        self._index_chunk(key, ids)
        return key

    def _index_chunk(self, key: str, token_ids: Sequence[int]) -> None:
        if key not in self._indexed_keys:
            self._indexed_keys.add(key)
            self.chunks.add(token_ids)

    def _index_store(self) -> None:
        """Learn the token ids of entries other processes stored (reads only new headers).

        Never deletes: a KV directory may be shared with other models, whose entries this
        engine cannot use but must leave alone.
        """
        size = len(self.store)
        if size == self._indexed_store_size:
            return
        for key in self.store.keys():
            if key in self._indexed_keys:
                continue
            reader = self.store.open(key, drop_unusable=False)
            if reader is None:
                self._indexed_keys.add(key)  # foreign or unreadable: do not look again
                continue
            self._index_chunk(key, reader.token_ids)
            reader.close()
        self._indexed_store_size = size

    def build_prompt(self, segments: Sequence[Segment], *, system: str | None = None,
                     history: Sequence[tuple[str, str]] = (), separator: str | None = None) -> PromptLayout:
        """Lay out segments as the last user turn after ``history`` (``(role, text)`` pairs,
        role "user" or "assistant"), joined by ``separator`` (default: the engine's)."""
        return self.prompts.build(segments, system, history=history, separator=separator)

    def find_chunks(self, prompt: str, *, system: str | None = None,
                    history: Sequence[tuple[str, str]] = ()) -> PromptLayout:
        """Lay out a flat prompt (one user message) and mark the known chunks inside it.

        The prompt is tokenized whole, so ``layout.token_ids`` are exactly those of a plain
        full prefill of the same text; a known chunk is marked where its token ids appear
        unchanged. Pass the layout to :meth:`prefill`, :meth:`generate` or :meth:`stream`.
        """
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a str, got {type(prompt).__name__}.")
        check_text(prompt, "prompt")
        self._index_store()
        layout = self.build_prompt([prompt], system=system, history=history)
        return PromptLayout(layout.token_ids, self.chunks.find(layout.token_ids))

    def find_chunks_in_ids(self, token_ids: Sequence[int]) -> PromptLayout:
        """Mark the known chunks inside raw prompt token ids (no chat template is added),
        e.g. a text-completion prompt tokenized by the caller."""
        self._index_store()
        return PromptLayout(list(token_ids), self.chunks.find(token_ids))

    @property
    def calibration_id(self) -> str:
        """What a calibration holds for: the model and what chunks are precomputed after."""
        return calibration_key(self.fingerprint, self.sink_ids)

    def _compute_entry(self, token_ids: list[int]) -> ChunkKV:
        """A chunk's KV computed in isolation after the sink prefix, in the storage dtype."""
        return self._compute_entries([token_ids])[0]

    def _compute_entries(self, chunks: list[list[int]]) -> list[ChunkKV]:
        """Several chunks' entries, computed in one pass after the sink, whose K/V are computed
        once per engine (a sliding window shorter than sink + chunk needs the one-at-a-time
        path, which computes the sink each time)."""
        windows = [w for i in range(self.adapter.shape.num_layers) if (w := self.adapter.window(i)) is not None]
        if windows and len(self.sink_ids) + max(map(len, chunks)) > min(windows):
            entries = []
            for ids in chunks:
                with self._lock:
                    keys, values = isolated_kv(self.adapter, self.sink_ids, ids)
                entries.append(self._storage_entry(ids, keys, values))
            return entries
        with self._lock:
            if self._sink_kv is None:
                self._sink_kv = sink_kv(self.adapter, self.sink_ids)
            kvs = packed_isolated_kv(self.adapter, self.sink_ids, chunks, sink=self._sink_kv)
        return [self._storage_entry(ids, keys, values) for ids, (keys, values) in zip(chunks, kvs)]

    def _storage_entry(self, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> ChunkKV:
        entry = ChunkKV(self._key_for(token_ids), list(token_ids), keys, values)
        stored = to_storage(entry, self.kv_dtype)
        if self.kv_dtype == torch.int8:
            # int8 entries are read back in float16: they need float16's range too.
            fits = max(keys.abs().max(), values.abs().max()) <= torch.finfo(torch.float16).max
        else:
            fits = torch.isfinite(stored.keys).all() and torch.isfinite(stored.values).all()
        if not fits:
            # Out of the storage dtype's range: keep float32 (the key still names the storage dtype).
            stored = ChunkKV(entry.key, entry.token_ids, keys.float(), values.float())
        return stored.to_cpu()

    def flush(self) -> None:
        """Wait for background KV writes to finish; re-raises the first one that failed."""
        with self._writes_lock:
            pending, self._pending_writes = self._pending_writes, []
        for future in pending:
            future.result()

    def calibrate(self, prompts=None, *, save: bool = True, progress: bool = True) -> Calibration:
        """Measure which recompute ratio keeps this model within its own order noise (once
        per model, ~2-5 min for SmolLM2 and ~5 min for Qwen2.5-0.5B on a 2-core CPU; see
        :mod:`ragblend.core.calibration`). The result is stored (``save``) and becomes this
        engine's strategy unless one was passed explicitly; later engines of the same model
        load it. ``prompts``: your own ``(chunks, question)`` pairs instead of the built-in ones."""
        result = calibrate(self, prompts, progress=progress)
        if save:
            try:
                result.source = str(save_calibration(result))
            except OSError as err:   # minutes of measuring are not thrown away for a cache folder
                log.warning("ragblend: could not save the calibration (%s: %s); this engine uses it, later "
                            "engines will not.", type(err).__name__, err)
        self.calibration = result
        if self._default_strategy:
            self.strategy = result.strategy
        return result

    def _own_query_aware_ratio(self) -> float:
        """What ``QueryAware(ratio=None)`` runs at: the engine's own QueryAware ratio, else its
        calibration's, else the safe default (an engine built with ``QueryAware(None)`` too)."""
        if isinstance(self.strategy, QueryAware) and self.strategy.ratio is not None:
            return self.strategy.ratio
        return self.calibration.ratio if self.calibration else UNCALIBRATED.ratio

    def _strategy_reason(self, chosen_by_caller: bool) -> str:
        if chosen_by_caller or not self._default_strategy:
            return "chosen by the caller"
        if self.calibration is not None:
            return self.calibration.reason
        return ("default for an uncalibrated model: a ratio that stayed within the order noise on every "
                "benchmark set; run engine.calibrate() to find this model's cheapest safe ratio")

    def _in_background(self, fn, *args) -> None:
        """Run a store write off the TTFT path; a failure is kept for :meth:`flush`."""
        with self._writes_lock:
            # keep unfinished and failed writes; finished good ones need no more attention
            self._pending_writes = [f for f in self._pending_writes if not f.done() or f.exception()]
            self._pending_writes.append(self._writer.submit(fn, *args))

    # ------------------------------------------------------------------ prefill

    def plan(self, prompt_tokens: int, reused_tokens: int, tier: str | None = None):
        """What the loading controller would do for such a prompt (see :mod:`.controller`)."""
        return self._loading.plan(prompt_tokens, reused_tokens, tier)

    @property
    def _loading(self):
        """The loading controller (built on first use)."""
        if self._controller is None:
            from .controller import LoadingController

            disk = getattr(self.store, "disk", self.store)   # probe reads on the disk tier's device
            probe_dir = disk.directory.parent if isinstance(disk, DiskStore) else cache_dir()
            self._controller = LoadingController(self.adapter, self.entry_spec, self.kv_dtype, probe_dir)
        return self._controller

    def prefill(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                strategy: Strategy | None = None) -> Prefill:
        """Run the fused prefill of ``segments`` (the user turn) under ``system``.

        ``segments`` may also be a :class:`PromptLayout` from :meth:`find_chunks` (then
        ``system`` is already part of it).
        """
        t0 = time.perf_counter()
        reason = self._strategy_reason(chosen_by_caller=strategy is not None)
        strategy = check_strategy(strategy or self.strategy, self.adapter.shape.num_layers)
        if isinstance(strategy, QueryAware) and strategy.ratio is None:
            strategy = replace(strategy, ratio=self._own_query_aware_ratio())
        layout = segments if isinstance(segments, PromptLayout) else self.prompts.build(segments, system)
        n = len(layout.token_ids)
        if n > self.context_window:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but the model's context window is {self.context_window}; "
                "pass fewer or shorter chunks.")
        stats = Stats(prompt_tokens=n, strategy=strategy.name, strategy_reason=reason)
        faults_before = self.store.faults
        computed: dict[str, ChunkKV] = {}  # chunks computed during this call, by key
        # A stored entry can turn out corrupt mid-fusion; it is then dropped and the
        # prefill restarts, at most once per chunk.
        attempts = len(layout.chunk_spans) + 1
        for attempt in range(attempts):
            try:
                fused, source, from_store = self._fuse(layout, strategy, stats, computed)
                break
            except CorruptEntryError as err:
                self.store.delete(err.key)
                if attempt == attempts - 1:
                    raise
        recomputed = int(fused.recomputed.sum())
        stats.ttft_s = time.perf_counter() - t0
        stats.recomputed_tokens = recomputed
        stats.compute_fraction = fused.token_layers / (n * self.adapter.shape.num_layers)
        stats.reused_tokens = int((from_store & ~fused.recomputed).sum())
        stats.cache_hit_tokens = int(from_store.sum())
        stats.chunks_computed = len(computed)
        stats.load_s, stats.load_wait_s, stats.compute_s = source.load_s, source.wait_s, fused.compute_s
        stats.store_faults = self.store.faults - faults_before
        self.last_stats = stats
        self.last_prompt = PromptTrace(layout.token_ids, fused.recomputed, layout.chunk_spans)
        return Prefill(layout.token_ids, fused.logits, stats, fused.keys, fused.values,
                       fused.recomputed, layout, fused.key_bias)

    def _fuse(self, layout: PromptLayout, strategy: Strategy, stats: Stats, computed: dict):
        """One fusion attempt. Returns the fused prefill, its source, and a mask of the
        prompt tokens whose KV came from the store (not computed during this call)."""
        # A chunk can appear in several spans (repeated, or split where the prompt's tokens
        # differ from its own); the chunk counts in Stats are of distinct chunks.
        spans, readers, tier_of, missing = [], [], {}, set()
        from_store = torch.zeros(len(layout.token_ids), dtype=torch.bool)
        reuse = not isinstance(strategy, FullRecompute)
        try:
            for span in layout.chunk_spans:
                if not span.token_ids or not reuse:
                    continue
                key = self._key_for(span.token_ids)
                reader = MemoryReader(computed[key], "computed") if key in computed else self._open(key, span.token_ids)
                if reader is None:
                    if not self.write_back:
                        missing.add(key)
                        continue  # computed as plain text inside the prompt
                    t = time.perf_counter()
                    computed[key] = self._compute_entry(list(span.token_ids))
                    self._index_chunk(key, span.token_ids)
                    stats.isolate_s += time.perf_counter() - t
                    self._in_background(self.store.put, computed[key])
                    reader = MemoryReader(computed[key], "computed")
                spans.append(ReusedSpan(span.start, span.end - span.start, span.offset))
                readers.append(reader)
                tier_of.setdefault(key, reader.tier)
                if reader.tier != "computed":
                    from_store[span.start:span.end] = True
            tiers = {}
            for tier in tier_of.values():
                tiers[tier] = tiers.get(tier, 0) + 1
            stats.chunks_reused = len(tier_of) - tiers.get("computed", 0)
            stats.chunks_missing = len(missing) + tiers.get("computed", 0)
            stats.tiers = tiers
            if isinstance(strategy, CacheBlend) and strategy.ratio == "auto":
                tier = "disk" if "disk" in tiers else "memory"
                reused = sum(sp.num_tokens for sp in spans)
                strategy = replace(strategy, ratio=self.plan(len(layout.token_ids), reused, tier).ratio)
            stats.ratio = getattr(strategy, "ratio", None)
            stats.cached_attention_scale = getattr(strategy, "cached_attention_scale", None)
            windows = [slice(sp.offset, sp.offset + sp.num_tokens) for sp in spans]
            # Reading ahead pays off for slow tiers; from memory it would only take CPU from the compute.
            if self.prefetch and "disk" in tiers:
                source = PrefetchSource(readers, self.adapter.device, windows=windows, pool=self._reader)
            else:
                source = SequentialSource(readers, self.adapter.device, windows=windows)
        except BaseException:
            for reader in readers:
                reader.close()
            raise
        try:
            with self._lock:
                fused = fused_prefill(self.adapter, layout.token_ids, spans, source, strategy)
        finally:
            source.close()
        self._promote([r.key for r in readers if r.tier == "disk"])
        return fused, source, from_store

    def _open(self, key: str, token_ids) -> ChunkReader | None:
        """A reader for a stored chunk, or None; an entry for other tokens is dropped."""
        reader = self.store.open(key)
        if reader is not None and list(reader.token_ids) != list(token_ids):
            reader.close()
            self.store.delete(key)
            return None
        return reader

    def _promote(self, keys: list[str]) -> None:
        """Chunks served from disk also go to the memory tier, in the background."""
        if isinstance(self.store, TieredStore):
            for key in dict.fromkeys(keys):
                self._in_background(self._promote_one, key)

    def _promote_one(self, key: str) -> None:
        entry = self.store.disk.read_uncounted(key)
        if entry is not None:
            self.store.promote(entry)

    # ------------------------------------------------------------------ generation

    def _decoding(self, segments, system, strategy, params: SamplingParams) -> tuple[Prefill, Decoding]:
        pre = self.prefill(segments, system=system, strategy=strategy)
        capacity = min(len(pre.token_ids) + params.max_new_tokens, self.context_window)
        decoder = KVDecoder(self._decoding_adapter(), pre.keys, pre.values, capacity, pre.key_bias)
        # The prompt's K/V now live in the decoder's buffers; keep views, not a second copy.
        n = len(pre.token_ids)
        pre.keys, pre.values = [k[:, :n] for k in decoder.keys], [v[:, :n] for v in decoder.values]
        lookup = None
        # Drafts are verified in a pass over several tokens, which in float32 gives each token's
        # logits to ~1e-5; in bfloat16 a trial saw 0.69 and a changed answer, so only float32 drafts.
        if self.prompt_lookup_num_tokens and params.temperature == 0 and self.adapter.dtype == torch.float32:
            lookup = PromptLookup(pre.token_ids)
        decoding = Decoding(decoder, self.tokenizer, pre.logits.to(self.adapter.device),
                            len(pre.token_ids), params, self.eos_ids, self.context_window, lock=self._lock,
                            lookup=lookup, draft_tokens=self.prompt_lookup_num_tokens)
        return pre, decoding

    def _decoding_adapter(self) -> ModelAdapter:
        """The adapter decoding runs on: the engine's own, or a twin (built with the engine) whose
        linear layers hold float16 weights (``decode_dtype="float16"``) or 4-bit ones
        (``"int4"``; with ``"auto"`` only the layers whose weights already are 4-bit, as a Q4_0/Q4_1
        GGUF's are; the LM head stays float32, its logits pick the answer)."""
        if self.decode_dtype == "float32" or self.adapter.dtype != torch.float32 or self.adapter.device.type != "cpu":
            return self.adapter
        with self._lock:
            if self._decode_adapter is None:
                # Engines over one model share its decoding twin (building a 4-bit one takes seconds).
                with _TWINS_LOCK:
                    twins = _TWINS.setdefault(self.hf_model, {})
                    if self.decode_dtype not in twins:   # None: no twin, decode on the engine's own adapter
                        twins[self.decode_dtype] = self._build_decoding_adapter()
                    self._decode_adapter = twins[self.decode_dtype] or self.adapter
        return self._decode_adapter

    def decoding_layers(self) -> dict[str, int]:
        """How many linear layers a decoding step runs in each weight format on this host, e.g.
        ``{"4-bit": 210, "8-bit": 1}`` (the decoding twin is built if it was not yet)."""
        names = {Int4Linear: "4-bit", Int8Linear: "8-bit", Int8Head: "8-bit", HalfLinear: "float16"}
        counts: dict[str, int] = {}
        for module in self._decoding_adapter().hf_model.modules():
            if isinstance(module, (torch.nn.Linear, CpuLinear, HalfLinear)):
                kind = names.get(type(module), "float32")
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _build_decoding_adapter(self) -> ModelAdapter | None:
        if self.decode_dtype == "float16":
            return ModelAdapter(with_linears(self.hf_model, HalfLinear))
        low_bit = self._low_bit_layers()
        if not low_bit:
            return None
        twin = with_linears(self.hf_model, lambda layer: low_bit.get(id(layer.weight)) or
                            CpuLinear(layer, self.kernel_plan))
        kinds = sorted({type(layer).__name__ for layer in low_bit.values()})
        log.info("ragblend: %d linear layer(s) decode on low-bit weights (%s; decode_dtype=%r)", len(low_bit),
                 ", ".join(kinds), self.decode_dtype)
        return ModelAdapter(twin)

    def _low_bit_layers(self) -> dict[int, CpuLinear]:
        """The low-bit layer to decode with, by the id of the float32 weight it replaces.

        ``"int4"``: 4-bit weights for every layer but the LM head; ``"int8"``: 8-bit weights for
        every layer. ``"auto"``: 4-bit where the weights already are 4-bit (lossless); for a model
        loaded from a GGUF file (its weights quantized already, at 5-8 bits where not 4), 8-bit
        for the others, the LM head included; each kind kept only if a decoding step over its
        layers measures faster than float32 on this host (see :meth:`_keep_faster`).
        """
        wanted = self.decode_dtype
        if wanted != "auto":
            why_not = int4_available() if wanted == "int4" else int8_available()
            if why_not:
                log.warning("ragblend: decode_dtype=%r cannot run here (%s); decoding in float32.", wanted, why_not)
                return {}
        runnable = {kind for kind, why_not in (("int4", int4_available()), ("int8", int8_available())) if not why_not}
        eight_bit = from_gguf(self.hf_model)   # "auto": 8-bit only for weights a GGUF file had quantized already
        head_weight = getattr(getattr(self.hf_model, "lm_head", None), "weight", None)
        layers: dict[int, CpuLinear] = {}
        skipped = []
        for module in self.hf_model.modules():
            if type(module) is not torch.nn.Linear:
                continue
            is_head = module.weight is head_weight
            if wanted == "auto":
                kinds = ["int4"] if not is_head and on_int4_grid(module.weight) else []
                kinds += ["int8"] if eight_bit else []
            else:
                kinds = [wanted] if wanted == "int8" or not is_head else []
            for kind in (k for k in kinds if k in runnable):
                try:
                    kind_class = Int4Linear if kind == "int4" else Int8Head if is_head else Int8Linear
                    layer = kind_class(module, self.kernel_plan)
                except (ValueError, RuntimeError) as err:   # a shape the packing does not take
                    skipped.append(f"{module.out_features}x{module.in_features} ({err})")
                    continue
                if wanted == "auto" and kind == "int4" and layer.quantization_error > EXACT_INT4:
                    continue
                layers[id(module.weight)] = layer
                break
        if wanted != "auto":
            if skipped:
                log.warning("ragblend: %d linear layer(s) cannot hold %s-bit weights and decode in float32: %s",
                            len(skipped), wanted[3:], "; ".join(sorted(set(skipped))))
            lossy = sum(isinstance(layer, Int4Linear) and layer.quantization_error > EXACT_INT4
                        for layer in layers.values())
            if lossy:
                log.warning("ragblend: decode_dtype='int4': %d of %d layers' weights are not 4-bit, so they were "
                            "quantized at load; answers can differ from float32 decoding (docs/benchmarks.md, "
                            "'Decoding'). decode_dtype='auto' keeps 4-bit for weights that already are.",
                            lossy, len(layers))
            return layers
        return self._keep_faster(layers)

    def _keep_faster(self, layers: dict[int, CpuLinear]) -> dict[int, CpuLinear]:
        """``layers`` less each kind (4-bit, 8-bit) whose decoding step -- one row through all
        its layers, as a step runs them -- is not faster than the same layers in float32 on this
        host beyond the noise (a 4-bit or 8-bit kernel can lose to float32 on some CPUs).
        ``RAGBLEND_KERNELS=linear`` keeps float32 everywhere."""
        if os.environ.get("RAGBLEND_KERNELS", "").strip().lower() == "linear":
            return {}
        kept = {}
        with torch.inference_mode():
            for kind in (Int4Linear, Int8Linear, Int8Head):
                group = {key: layer for key, layer in layers.items() if type(layer) is kind}
                if not group:
                    continue
                inputs = {n: torch.randn(1, n) for n in {layer.weight.shape[1] for layer in group.values()}}
                seconds = fastest_rounds({
                    "float32": lambda g=group: [layer.plan.run(inputs[layer.weight.shape[1]], layer.weight, layer.bias)
                                                for layer in g.values()],
                    "low-bit": lambda g=group: [layer.rows(inputs[layer.weight.shape[1]]) for layer in g.values()],
                })
                faster = seconds["low-bit"] * MIN_GAIN < seconds["float32"]
                log.info("ragblend: %s decoding step over %d layers: %.2f ms against %.2f ms in float32: %s",
                         kind.__name__, len(group), seconds["low-bit"] * 1e3, seconds["float32"] * 1e3,
                         "used" if faster else "not faster here, float32 kept")
                if faster:
                    kept.update(group)
        return kept

    def stream(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
               strategy: Strategy | None = None, params: SamplingParams | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop: Sequence[str] | None = None) -> "TextStream":
        """Iterate the answer's text as it is decoded. The returned stream's ``stats`` are
        this call's (complete once the stream is exhausted), whatever other threads do.
        Sampling is ``params`` or, as shortcuts, the keywords after it (not both)."""
        params = _sampling(params, max_new_tokens, temperature, top_p, seed, stop)
        text_stream = TextStream()

        def run():
            pre, decoding = self._decoding(segments, system, strategy, params)
            text_stream.stats = pre.stats
            yield from decoding  # the engine lock is taken per decoding step, never across a yield
            self._finish_stats(pre.stats, decoding)

        text_stream._deltas = run()
        return text_stream

    def generate(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                 strategy: Strategy | None = None, params: SamplingParams | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None) -> Generation:
        """Prefill with fusion, then decode. ``temperature=0`` is greedy. Sampling is
        ``params`` or, as shortcuts, the keywords after it (not both)."""
        params = _sampling(params, max_new_tokens, temperature, top_p, seed, stop)
        pre, decoding = self._decoding(segments, system, strategy, params)
        for _ in decoding:
            pass
        self._finish_stats(pre.stats, decoding)
        return Generation(decoding.text, decoding.token_ids, decoding.finish_reason, pre.stats, pre.token_ids,
                          pre.logits)

    def begin(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
              strategy: Strategy | None = None, params: SamplingParams | None = None) -> Decoding:
        """Prefill with fusion and return the decoding, not yet stepped, for a loop that decodes
        many requests together (:class:`~ragblend.core.batching.BatchDecoder`). Its ``stats``
        are this call's; :meth:`finish` completes them once the decoding is done."""
        params = _sampling(params, 256, 0.0, 1.0, None, None)
        pre, decoding = self._decoding(segments, system, strategy, params)
        decoding.stats = pre.stats
        return decoding

    def finish(self, decoding: Decoding) -> Stats:
        """The stats of a decoding from :meth:`begin`, completed with its answer's."""
        self._finish_stats(decoding.stats, decoding)
        return decoding.stats

    def _finish_stats(self, stats: Stats, decoding: Decoding) -> None:
        stats.generated_tokens = len(decoding.token_ids)
        stats.decode_s = decoding.decode_s
        stats.decode_steps = decoding.steps
        stats.finish_reason = decoding.finish_reason
        self.last_stats = stats


def _sampling(params, max_new_tokens, temperature, top_p, seed, stop) -> SamplingParams:
    shortcuts = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
    if params is None:
        return shortcuts
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"params must be a ragblend SamplingParams, got {type(params).__name__}.")
    if shortcuts != SamplingParams():
        raise InvalidInputError("Pass sampling options either as params=SamplingParams(...) or as keywords, not both.")
    return params


def _packs(items: list, max_tokens: int):
    """Consecutive groups of ``(key, (index, ids))`` items of at most ``max_tokens`` tokens
    (a longer chunk goes alone)."""
    pack, tokens = [], 0
    for item in items:
        n = len(item[1][1])
        if pack and tokens + n > max_tokens:
            yield pack
            pack, tokens = [], 0
        pack.append(item)
        tokens += n
    if pack:
        yield pack
