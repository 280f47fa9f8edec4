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

The engine is a facade over named parts, each usable alone (docs/concepts.md, "Map of the
rooms"): :class:`~.ingest.Ingestion` (chunk texts -> stored entries), :class:`~.chunk_index.ChunkIndex`
(chunks in flat prompts), :func:`~.plan.resolve_strategy` (one plan per call),
:class:`~.runner.PrefillRunner` (the fused prefill over the store) and
:class:`~.decode_weights.DecodeWeights` (the weights decoding runs on).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Iterable, Sequence

import torch

from .calibration import Calibration, calibrate, load_calibration, save_calibration
from .chunk_index import ChunkIndex
from .decode_weights import DecodeWeights
from .errors import InvalidInputError, PromptTooLongError
from .generate import Decoding, SamplingParams, sampling_params, start_decoding
from .ingest import Ingestion
from .kernels import KernelPlan
from .kv import ChunkKV, ChunkRef, calibration_key
from .model import CpuLinear, ModelAdapter, cache_dir, kernel_plan_for, load_model, with_linears
from .options import EngineOptions
from .plan import StrategyPlan, check_strategy, default_strategy, resolve_strategy
from .prompt import ChunkFinder, PromptBuilder, PromptLayout, Segment, check_text
from .results import Generation, Prefill, PromptTrace, Stats, TextStream
from .runner import PrefillRunner
from .store import DiskStore, EntrySpec, KVStore, MemoryStore, open_store
from .strategies import Strategy

__all__ = ["BlendEngine", "Generation", "Prefill", "PromptTrace", "Stats", "TextStream"]
log = logging.getLogger("ragblend")


class BlendEngine:
    """Fusion engine over one local model: precompute chunk KV, then prefill/generate with reuse.

    Build it with :meth:`from_pretrained`. Model computations (prefill layers, each decoding
    step) are serialised by ``lock``, so threads may share an engine; ``last_stats`` and
    ``last_prompt`` then describe whichever call finished last. KV write-back and promotion
    to memory run in a background thread (:meth:`flush` waits for them).
    """

    def __init__(self, hf_model, tokenizer, *, store: KVStore | None = None, strategy: Strategy | None = None,
                 options: EngineOptions | None = None, **keywords):
        """``options`` (an :class:`~ragblend.core.options.EngineOptions`) and/or its engine
        fields as keywords (``kv_dtype=``, ``decode_dtype=``, ``separator=``...), keywords over it;
        its loading fields (``model``, ``kv_dir``...) are :meth:`from_pretrained`'s."""
        self.options = options = EngineOptions.merged(options, keywords, engine_only=True)
        self.hf_model, self.tokenizer = hf_model, tokenizer
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
        sink_ids = (self.prompts.tokenize_template(options.sink_prefix) if options.sink_prefix is not None
                    else self.prompts.sink_ids(options.chunk_context))
        self.fingerprint = self.adapter.fingerprint(tokenizer)
        self.lock = threading.RLock()
        self.index = ChunkIndex()
        self.ingestion = Ingestion(self.adapter, self.prompts, sink_ids, self.fingerprint, options.storage_dtype,
                                   self.lock, self.index)
        self.calibration: Calibration | None = load_calibration(self.calibration_id)
        self._engine_chose = strategy is None   # the calibration's (or the safe default), not the caller's
        self.strategy = check_strategy(default_strategy(self.calibration) if strategy is None else strategy,
                                       self.adapter.shape.num_layers)
        self.prefetch, self.write_back = options.prefetch, options.write_back
        self.precompute_batch_tokens = options.precompute_batch_tokens
        self.prompt_lookup_num_tokens = options.prompt_lookup_num_tokens
        self.name = options.name or getattr(hf_model.config, "_name_or_path", "") or self.adapter.arch
        self.last_stats: Stats | None = None
        self.last_prompt: PromptTrace | None = None
        self._controller = None
        self.runner = PrefillRunner(self.adapter, self.ingestion, self.index, self.lock, lambda: self.loading)
        eos = hf_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.decode_weights = DecodeWeights(hf_model, self.adapter, self.kernel_plan, options.decode_dtype, self.lock)
        # Built now (a few seconds for 4-bit weights), not in the first answer's time to first token.
        self.decoding_adapter()

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
            options = replace(options, name="SmolLM2-135M-Instruct" if options.model is None
                              else os.path.basename(str(options.model).rstrip("/")))
        engine = cls(hf_model, tokenizer, store=store if store is not None else MemoryStore(options.memory_bytes),
                     strategy=strategy, options=options)   # the loading options are kept there, for the record
        if store is None and options.kv_dir is not False:
            engine.store = open_store(options.kv_dir or cache_dir() / "kv", engine.entry_spec, options.memory_bytes,
                                      options.disk_bytes)
        return engine

    # ------------------------------------------------------------------ what the engine is

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

    @property
    def sink_ids(self) -> list[int]:
        """The token ids every chunk is precomputed after."""
        return self.ingestion.sink_ids

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype chunk KV is stored in (new entries; their keys name it)."""
        return self.ingestion.kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype) -> None:
        self.ingestion.kv_dtype = dtype

    @property
    def decode_dtype(self) -> str:
        return self.decode_weights.decode_dtype

    @property
    def calibration_id(self) -> str:
        """What a calibration holds for: the model and what chunks are precomputed after."""
        return calibration_key(self.fingerprint, self.sink_ids)

    # ------------------------------------------------------------------ chunks: ingestion and the index

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.tokenize(text))

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (no special tokens): what a chunk is keyed by."""
        return self.prompts.tokenize(text)

    def key_of(self, text: str) -> str:
        """The key under which a chunk text's KV is stored (see :func:`ragblend.core.kv.chunk_key`)."""
        return self.ingestion.key_for(self.tokenize(text))

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
        return self.ingestion.precompute(texts, self.store, batch_tokens=self.precompute_batch_tokens,
                                         progress=progress, skip_unusable=skip_unusable)

    def compute_entry(self, token_ids: list[int]) -> ChunkKV:
        """A chunk's KV computed in isolation after the sink prefix, in the storage dtype (not stored)."""
        return self.ingestion.compute_entry(token_ids)

    def forget(self, keys: Iterable[str]) -> int:
        """Drop the stored KV of these chunk keys (e.g. when their document is deleted)."""
        return sum(bool(self.store.delete(key)) for key in keys)

    def remember_chunk(self, text: str) -> str:
        """Declare ``text`` a chunk, so :meth:`find_chunks` marks it in flat prompts even
        when its KV is not stored (it is then computed in isolation and written back).
        Returns its key."""
        ids = self.prompts.tokenize(text)
        key = self.ingestion.key_for(ids)
        self.index.add(key, ids)
        return key

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
        return self.index.mark(self.build_prompt([prompt], system=system, history=history).token_ids, self.store)

    def find_chunks_in_ids(self, token_ids: Sequence[int]) -> PromptLayout:
        """Mark the known chunks inside raw prompt token ids (no chat template is added),
        e.g. a text-completion prompt tokenized by the caller."""
        return self.index.mark(token_ids, self.store)

    def flush(self) -> None:
        """Wait for background KV writes to finish; re-raises the first one that failed."""
        self.runner.background.flush()

    # ------------------------------------------------------------------ strategy

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
        if self._engine_chose:
            self.strategy = result.strategy
        return result

    def resolve(self, strategy: Strategy | None = None) -> StrategyPlan:
        """The plan a call with ``strategy`` (None: the engine's own) runs: see :mod:`.plan`."""
        return resolve_strategy(strategy, engine_strategy=self.strategy, engine_chose=self._engine_chose,
                                calibration=self.calibration, num_layers=self.adapter.shape.num_layers)

    def plan(self, prompt_tokens: int, reused_tokens: int, tier: str | None = None):
        """What the loading controller would do for such a prompt (see :mod:`.controller`)."""
        return self.loading.plan(prompt_tokens, reused_tokens, tier)

    @property
    def loading(self):
        """The loading controller (built on first use; see :mod:`.controller`)."""
        if self._controller is None:
            from .controller import LoadingController

            disk = getattr(self.store, "disk", self.store)   # probe reads on the disk tier's device
            probe_dir = disk.directory.parent if isinstance(disk, DiskStore) else cache_dir()
            self._controller = LoadingController(self.adapter, self.entry_spec, self.kv_dtype, probe_dir)
        return self._controller

    # ------------------------------------------------------------------ prefill and decoding

    def prefill(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                strategy: Strategy | StrategyPlan | None = None) -> Prefill:
        """Run the fused prefill of ``segments`` (the user turn) under ``system``.

        ``segments`` may also be a :class:`PromptLayout` from :meth:`find_chunks` (then
        ``system`` is already part of it).
        """
        t0 = time.perf_counter()
        plan = strategy if isinstance(strategy, StrategyPlan) else self.resolve(strategy)
        layout = segments if isinstance(segments, PromptLayout) else self.prompts.build(segments, system)
        n = len(layout.token_ids)
        if n > self.context_window:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but the model's context window is {self.context_window}; "
                "pass fewer or shorter chunks.")
        pre, self.last_prompt = self.runner.run(layout, plan, self.store, prefetch=self.prefetch,
                                                write_back=self.write_back, t0=t0)
        self.last_stats = pre.stats
        return pre

    def decoding_adapter(self) -> ModelAdapter:
        """The adapter decoding runs on (see :class:`~.decode_weights.DecodeWeights`)."""
        return self.decode_weights.decoding_adapter()

    def decoding_layers(self) -> dict[str, int]:
        """How many linear layers a decoding step runs in each weight format on this host, e.g.
        ``{"4-bit": 210, "8-bit": 1}`` (the decoding twin is built if it was not yet)."""
        return self.decode_weights.layer_counts()

    def _decoding(self, segments, system, strategy, params: SamplingParams) -> tuple[Prefill, Decoding]:
        pre = self.prefill(segments, system=system, strategy=self.resolve(strategy))
        decoding = start_decoding(pre, self.decoding_adapter(), self.tokenizer, params, eos_ids=self.eos_ids,
                                  context_window=self.context_window, lock=self.lock,
                                  draft_tokens=self.prompt_lookup_num_tokens,
                                  drafts_allowed=self.adapter.dtype == torch.float32)
        return pre, decoding

    def stream(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
               strategy: Strategy | None = None, params: SamplingParams | None = None, max_new_tokens: int = 256,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop: Sequence[str] | None = None) -> "TextStream":
        """Iterate the answer's text as it is decoded. The returned stream's ``stats`` are
        this call's (complete once the stream is exhausted), whatever other threads do.
        Sampling is ``params`` or, as shortcuts, the keywords after it (not both)."""
        params = sampling_params(params, max_new_tokens, temperature, top_p, seed, stop)
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
        params = sampling_params(params, max_new_tokens, temperature, top_p, seed, stop)
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
        params = sampling_params(params, 256, 0.0, 1.0, None, None)
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
