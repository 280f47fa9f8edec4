"""BlendEngine: the one object the integrations, CLI and app talk to.

Example::

    from ragblend import BlendEngine, Chunk, CacheBlend

    engine = BlendEngine.from_pretrained()            # embedded SmolLM2-135M-Instruct
    docs = ["Paris is the capital of France. It lies on the Seine, and with its suburbs it is home to "
            "about twelve million people, a fifth of the country's population.",
            "Berlin is the capital of Germany. It lies on the Spree, and it has been the seat of the "
            "federal government since 1999, when the parliament moved there from Bonn."]
    engine.precompute(docs)                          # at ingestion: each chunk's KV, stored
    out = engine.generate([Chunk(docs[0]), Chunk(docs[1]), "Question: what is the capital of Germany?"],
                          max_new_tokens=16)
    print(out.text, out.stats.ttft_s, out.stats.reused_tokens)   # a chunk must outweigh the template

The engine is a facade over named parts, each usable alone (docs/concepts.md, "Map of the
rooms"): :class:`~ragblend.core.fusion.ingest.Ingestion` (chunk texts -> stored entries), :class:`~ragblend.core.store.chunk_index.ChunkIndex`
(chunks in flat prompts), :func:`~.plan.resolve_strategy` (one plan per call),
:class:`~.runner.PrefillRunner` (the fused prefill over the store),
:class:`~ragblend.core.model.decode_weights.DecodeWeights` (the weights decoding runs on) and
:class:`~ragblend.core.decode.answers.Answers` (an answer's decoding after the prefill). What it is
built from is decided in :mod:`.engine_parts`; its answers (``begin``, ``generate``, ``stream``)
are :class:`~.generation.GenerationMixin`'s; its KV budget warnings are
:class:`~ragblend.core.store.kv_budget.BudgetWarnings`'.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Sequence

import torch

from .calibration.record import Calibration, load_calibration
from .calibration.search import calibrate_and_save
from .cancel import EngineLock
from .chunks import ChunksMixin
from .decode.answers import Answers, decode_kv_dtype, eos_ids_of
from .decode.prefix_cache import PrefixCache
from .description import EngineDescription, describe
from .engine_parts import entry_identity, fast_adapter, load, settle
from .errors import InvalidInputError
from .fusion.controller import LoadingController
from .fusion.fusion_cost import FusionCost
from .fusion.ingest import Ingestion
from .fusion.strategies import Strategy
from .generation import GenerationMixin
from .model.adapter import ModelAdapter
from .model.decode_weights import DecodeWeights
from .options import EngineOptions
from .paths import cache_dir
from .plan import StrategyPlan, check_strategy, default_strategy, resolve_strategy
from .prompt import PromptBuilder, PromptLayout, Segment, check_text
from .results import Generation, Prefill, PromptTrace, Stats, TextStream
from .runner import PrefillRunner
from .store.chunk_index import ChunkIndex
from .store.kv import check_namespace, check_uint4_shape
from .store.kv_budget import BudgetWarnings, KVShape
from .store.tiers import EntrySpec, KVStore, MemoryStore, open_store

__all__ = ["BlendEngine", "Generation", "Prefill", "PromptTrace", "Stats", "TextStream"]


class BlendEngine(ChunksMixin, GenerationMixin):
    """Fusion engine over one local model: precompute chunk KV, then prefill/generate with reuse.

    Build it with :meth:`from_pretrained`. Model passes are serialised by ``lock``, so threads may
    share an engine; ``last_stats`` and ``last_prompt`` then describe whichever call finished last.
    KV write-back and promotion to memory run in the background (:meth:`flush` waits for them)."""

    def __init__(self, hf_model, tokenizer, *, store: KVStore | None = None, strategy: Strategy | None = None,
                 options: EngineOptions | None = None, **keywords):
        """``options`` (:class:`~ragblend.core.options.EngineOptions`) and/or its engine fields as keywords."""
        self.options = options = EngineOptions.merged(options, keywords, engine_only=True)
        self.hf_model, self.tokenizer, self.lock = hf_model, tokenizer, EngineLock()
        self.adapter, self.kernel_plan = fast_adapter(hf_model)
        shape = self.adapter.shape
        if options.storage_dtype == torch.uint4:
            check_uint4_shape(shape.head_dim)
        self.store = store if store is not None else MemoryStore()
        self.context_window: int = shape.context_window
        self.prompts = PromptBuilder(tokenizer, separator=options.separator, use_chat_template=options.use_chat_template,
                                     max_tokens=self.context_window)
        identity = entry_identity(self.adapter, tokenizer, self.prompts, options)   # what entries are keyed by
        self.sink_ids, self.template_opening = identity.sink_ids, identity.template_opening
        self.lead_sink_ids, self.weights_form = identity.lead_sink_ids, identity.weights_form
        self.model_fingerprint, self.fingerprint = identity.model_fingerprint, identity.fingerprint
        self.index = ChunkIndex()
        self.ingestion = Ingestion(self.adapter, self.prompts, self.sink_ids, self.fingerprint, options.storage_dtype,
                                   self.lock, self.index, self.lead_sink_ids)
        # What a stored entry must match to be this model's; lead entries are recognised also where this
        # engine keeps none (another engine on the store may).
        self.entry_spec: EntrySpec = replace(self.ingestion.entry_spec, lead_sink_ids=identity.opening)
        self.calibration_id = identity.calibration_id
        self.calibration: Calibration | None = load_calibration(self.calibration_id)
        self._engine_chose = strategy is None   # the calibration's (or the safe default), not the caller's
        self.strategy = check_strategy(default_strategy(self.calibration) if strategy is None else strategy,
                                       shape.num_layers)
        self._controller: LoadingController | None = None
        # Whether fusing a prompt pays on this host (the engine's own strategy fuses only where it
        # does): constants measured once per host and model, at the first prompt that needs them.
        self.fusion_cost = FusionCost(self.adapter, self.model_fingerprint, options.storage_dtype.itemsize)
        # The K/V of recent prompts and answers, which a prompt starting alike reuses (.prefix_cache).
        self.prefix = PrefixCache(options.prefix_cache_bytes) if options.prefix_cache_bytes else None
        self.runner = PrefillRunner(self.adapter, self.ingestion, self.index, self.lock, lambda: self.loading,
                                    lambda: self.prompts.sentence_end_ids, self.fusion_cost, self.prefix,
                                    pieces=options.history_pieces, piece_bytes=options.history_pieces_bytes)
        if getattr(self.strategy, "sentence_runs", False):
            self.prompts.sentence_end_ids   # made now (~0.7 s for a 151k-token vocabulary), not in the first TTFT
        self.decode_dtype = options.decode_dtype
        self.decode_weights = DecodeWeights(hf_model, self.adapter, self.kernel_plan, options.decode_dtype, self.lock)
        self.decoding_adapter()   # built now (seconds for 4-bit weights), not in the first answer's TTFT
        self.runner.prefixes.decode_weights = self.decode_weights
        self.answers = Answers(self.decode_weights, tokenizer, eos_ids_of(hf_model, tokenizer), self.context_window,
                               self.lock, decode_kv_dtype(self.decode_weights, options.decode_kv_dtype))
        self.prefetch, self.write_back = options.prefetch, options.write_back   # these five may be changed later
        self.min_fusion_speedup = options.min_fusion_speedup
        self.precompute_batch_tokens, self.prompt_lookup_num_tokens = (options.precompute_batch_tokens,
                                                                       options.prompt_lookup_num_tokens)
        self.name = options.name or getattr(hf_model.config, "_name_or_path", "") or self.adapter.arch
        self.last_stats: Stats | None = None
        self.last_prompt: PromptTrace | None = None
        self.kv_shape = KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim)   # what its KV's size depends on
        self.budget = BudgetWarnings(self.kv_shape, len(self.ingestion.variants))
        # Prefills that ran as the exact full prefill instead of fusing (Stats.fusion_skipped), and the
        # last one's reason: what the server's /metrics and a long-running app report.
        self.fusion_skips = 0
        self.last_skip_reason = ""
        self.fusion_fallbacks = 0   # fused answers that began to loop and fell back to the exact path (.decode.repeats)
        settle(hf_model, self.kernel_plan, self.lock)   # kernels measured (or refined) off the answering thread

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, strategy: Strategy | None = None,
                        store: KVStore | None = None, options: EngineOptions | None = None,
                        **keywords) -> "BlendEngine":
        """Load ``model`` (None: the embedded SmolLM2-135M-Instruct; a ``.gguf`` file or a local
        Hugging Face directory) and wrap it. KV entries live in memory (LRU, ``memory_bytes``) in
        front of a disk store at ``kv_dir`` (default ``<user cache>/ragblend/kv``; ``False``: memory
        only). Any :class:`~ragblend.core.options.EngineOptions` field may be a keyword, over ``options``."""
        hf_model, tokenizer, options = load(options, keywords if model is None else {**keywords, "model": model})
        engine = cls(hf_model, tokenizer, store=store if store is not None else MemoryStore(options.memory_bytes),
                     strategy=strategy, options=options)   # the loading options are kept there, for the record
        if store is None and options.kv_dir is not False:
            engine.store = open_store(options.kv_dir or cache_dir() / "kv", engine.entry_spec, options.memory_bytes,
                                      options.disk_bytes)
        return engine

    # What the engine is

    def describe(self) -> EngineDescription:
        """What the engine is, in plain values (what ``ragblend info`` prints): see :mod:`.description`."""
        return describe(self)

    @property
    def loading(self) -> LoadingController:
        """The loading controller, built on first use (see :mod:`ragblend.core.fusion.controller`)."""
        if self._controller is None:
            self._controller = LoadingController.for_store(self.adapter, self.entry_spec, self.kv_dtype, self.store)
        return self._controller

    # Prompts: laid out (.prompt), with the known chunks found in them (.chunk_index)

    def build_prompt(self, segments: Sequence[Segment], *, system: str | None = None,
                     history: Sequence[tuple[str, str]] = (), separator: str | None = None,
                     namespace: str = "") -> PromptLayout:
        """Lay out segments as the last user turn: see :meth:`.prompt.PromptBuilder.build`. The chunks
        are read from (and written back to) ``namespace``, or the shared one where it holds them."""
        return self.prompts.build(segments, system, history=history, separator=separator,
                                  namespace=check_namespace(namespace))

    def find_chunks(self, prompt: str, *, system: str | None = None,
                    history: Sequence[tuple[str, str]] = (), namespace: str = "") -> PromptLayout:
        """Lay out a flat prompt (one user message) as a plain full prefill would, with the known chunks
        marked where their token ids appear unchanged (:meth:`ragblend.core.store.chunk_index.ChunkIndex.mark`): the
        shared ones, and ``namespace``'s."""
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a str, got {type(prompt).__name__}.")
        check_text(prompt, "prompt")
        # built in the namespace too: the builder's remembered layouts are each caller's own
        layout = self.build_prompt([prompt], system=system, history=history, namespace=namespace)
        return self.find_chunks_in_ids(layout.token_ids, namespace=namespace, conversation=layout.conversation)

    def find_chunks_in_ids(self, token_ids: Sequence[int], *, namespace: str = "",
                           conversation: bool = False) -> PromptLayout:
        """:meth:`find_chunks` of a prompt's token ids. No span covers the template's opening
        (:meth:`.prompt.PromptBuilder.opening_length`): its KV is the prompt's own. ``conversation``:
        the ids are of chat messages with earlier turns, whose text is kept as history pieces (.pieces)."""
        namespaces = ("", check_namespace(namespace)) if namespace else ("",)
        layout = self.index.mark(token_ids, self.store, namespaces=namespaces,
                                 start=self.prompts.opening_length(token_ids))
        return replace(layout, namespace=namespace, conversation=conversation)

    def prefix_info(self) -> dict:
        """The prefix tier's entries, bytes (and budget), hits, misses and tokens served; {} when off."""
        return self.prefix.info() if self.prefix is not None else {}

    def prefix_held(self, token_ids: Sequence[int], namespace: str = "") -> int:
        """How many of a prompt's first tokens the prefix tier holds in ``namespace`` (its own
        entries only), looked up as the engine's own strategy looks them up but counted as neither
        hit nor miss; 0 where the tier is off or not read. A server asks it before the prompt runs,
        to know which part of it the prefill will compute (serving.reuse)."""
        found = self.runner.prefixes.lookup(PromptLayout(list(token_ids), [], namespace=namespace), self.resolve())
        return 0 if found is None else found.num_tokens

    def pieces_info(self) -> dict:
        """The history pieces' memory: its entries, bytes (and budget) and evictions; {} when off."""
        return self.runner.piece_store.info() if self.runner.keeps_pieces else {}

    def flush(self) -> None:
        """Wait for background KV writes to finish; re-raises the first one that failed."""
        self.runner.background.flush()

    def background_jobs(self) -> int:
        """The engine's own work off the TTFT path, waiting or running: KV write-backs, promotions,
        the prefix tier's next-turn openings, a conversation's pieces (and their storings due again
        after yielding to a request)."""
        return self.runner.background.pending() + self.runner.history.retries_due

    # Strategy (.plan, .calibration)

    def calibrate(self, prompts=None, *, save: bool = True, progress: bool = True, **options) -> Calibration:
        """Find this model's cheapest ratio within its order noise (:func:`ragblend.core.calibration.search.calibrate_and_save`;
        ``options``: ``neighbour_window``, ``sentence_runs``, ``answer_tokens``, ``answer_margin``); it becomes this engine's strategy
        unless the engine was given one."""
        self.calibration = result = calibrate_and_save(self, prompts, save=save, progress=progress, **options)
        if self._engine_chose:
            self.strategy = result.strategy
            if self.runner.prefix is not None:   # its fused K/V were the old strategy's
                self.runner.prefix.clear()
        return result

    def resolve(self, strategy: Strategy | None = None) -> StrategyPlan:
        """The plan a call with ``strategy`` (None: the engine's own) runs: see :mod:`.plan`."""
        return resolve_strategy(strategy, engine_strategy=self.strategy, engine_chose=self._engine_chose,
                                calibration=self.calibration, num_layers=self.adapter.shape.num_layers)

    # Prefill (.runner); decoding is GenerationMixin's (.generation), on the adapter below

    def prefill(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                strategy: Strategy | StrategyPlan | None = None) -> Prefill:
        """The fused prefill of ``segments`` (the user turn) under ``system``, or of a
        :class:`PromptLayout` from :meth:`find_chunks` (``system`` is part of it then)."""
        t0 = time.perf_counter()
        plan = strategy if isinstance(strategy, StrategyPlan) else self.resolve(strategy)
        layout = segments if isinstance(segments, PromptLayout) else self.prompts.build(segments, system)
        pre, self.last_prompt = self.runner.run(layout, plan, self.store, prefetch=self.prefetch,
                                                write_back=self.write_back, t0=t0, min_speedup=self.min_fusion_speedup)
        # warned once if the store cannot keep even this prompt's chunks
        self.budget.check_prompt([len(span.token_ids) for span in layout.chunk_spans], self.store, self.kv_dtype)
        if pre.stats.fusion_skipped:
            self.fusion_skips += 1
            self.last_skip_reason = pre.stats.skip_reason
        self.last_stats = pre.stats
        return pre

    def decoding_adapter(self) -> ModelAdapter:
        """The adapter decoding runs on (see :class:`~ragblend.core.model.decode_weights.DecodeWeights`)."""
        return self.decode_weights.decoding_adapter()
