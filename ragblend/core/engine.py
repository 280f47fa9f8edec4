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
:class:`~ragblend.core.decode.answers.Answers` (an answer's decoding after the prefill).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import threading
import time
from dataclasses import replace
from typing import Iterable, Sequence

import torch

from .calibration.record import Calibration, load_calibration
from .calibration.search import calibrate_and_save
from .decode.answers import Answers, decode_kv_dtype, eos_ids_of
from .decode.generate import Decoding, SamplingParams, sampling_params
from .decode.prefix_cache import PrefixCache
from .description import EngineDescription, describe
from .errors import InvalidInputError, PromptTooLongError
from .fusion.controller import LoadingController
from .fusion.fusion_cost import FusionCost
from .fusion.ingest import Ingestion
from .fusion.strategies import Strategy
from .model.adapter import ModelAdapter
from .model.decode_weights import DecodeWeights
from .model.kernels import KernelPlan, measure_in_background
from .model.linear import CpuLinear, kernel_layers, kernel_plan_for, with_linears
from .model.loading import load_model, return_freed_memory
from .model.omp import release_thread_pool
from .model.quantized import HELD_FORM_VERSION, is_quantized, prefill_twin, scoring_twin
from .options import EngineOptions
from .paths import cache_dir
from .plan import StrategyPlan, check_strategy, default_strategy, resolve_strategy
from .prompt import ChunkFinder, PromptBuilder, PromptLayout, Segment, check_text
from .results import Generation, Prefill, PromptTrace, Stats, TextStream
from .runner import PrefillRunner
from .store.chunk_index import ChunkIndex
from .store.kv import ChunkRef, calibration_key, check_namespace, check_uint4_shape, lead_key
from .store.kv_budget import KVShape, Projection, entry_bytes, project, store_budget
from .store.tiers import EntrySpec, KVStore, MemoryStore, open_store

__all__ = ["BlendEngine", "Generation", "Prefill", "PromptTrace", "Stats", "TextStream"]
log = logging.getLogger("ragblend")


class BlendEngine:
    """Fusion engine over one local model: precompute chunk KV, then prefill/generate with reuse.

    Build it with :meth:`from_pretrained`. Model passes are serialised by ``lock``, so threads may
    share an engine; ``last_stats`` and ``last_prompt`` then describe whichever call finished last.
    KV write-back and promotion to memory run in the background (:meth:`flush` waits for them)."""

    def __init__(self, hf_model, tokenizer, *, store: KVStore | None = None, strategy: Strategy | None = None,
                 options: EngineOptions | None = None, **keywords):
        """``options`` (:class:`~ragblend.core.options.EngineOptions`) and/or its engine fields as keywords."""
        self.options = options = EngineOptions.merged(options, keywords, engine_only=True)
        self.hf_model, self.tokenizer, self.lock = hf_model, tokenizer, threading.RLock()
        self.adapter, self.kernel_plan = _fast_adapter(hf_model)
        if options.storage_dtype == torch.uint4:
            check_uint4_shape(self.adapter.shape.head_dim)
        self.store = store if store is not None else MemoryStore()
        self.prompts = PromptBuilder(tokenizer, separator=options.separator, use_chat_template=options.use_chat_template,
                                     max_tokens=self.adapter.shape.context_window)
        self.sink_ids = self.prompts.chunk_sink(options.sink_prefix, options.chunk_context)
        # A prompt's first chunk follows the template's opening, not a passage: it is fused from a
        # second entry of each chunk, its lead entry, computed after the opening alone (see .ingest).
        self.template_opening = self.prompts.sink_ids()   # what a lead entry is computed after
        lead_sink = self.template_opening if options.lead_chunk_kv and options.sink_prefix is None else None
        self.lead_sink_ids = lead_sink if lead_sink != self.sink_ids else None
        # The model's identity (what its calibration is stored under), and what its KV is stored
        # under: a model on quantized weights (core.model.quantized) is the same model as its file in
        # float32, but computes KV that differs by float rounding, so its entries are its own (and
        # those of an older held form, whose rounding differed, are not read).
        self.model_fingerprint = self.adapter.fingerprint(tokenizer)
        self.weights_form = self.adapter.weights_form()
        self.fingerprint = self.model_fingerprint if not self.weights_form.startswith("quantized") else \
            hashlib.sha256(f"{self.model_fingerprint}|{self.weights_form}|{HELD_FORM_VERSION}".encode()).hexdigest()
        self.index = ChunkIndex()
        self.ingestion = Ingestion(self.adapter, self.prompts, self.sink_ids, self.fingerprint, options.storage_dtype,
                                   self.lock, self.index, self.lead_sink_ids)
        self.context_window: int = self.adapter.shape.context_window
        # What a stored entry must match to be this model's; lead entries are recognised also where this
        # engine keeps none (another engine on the store may).
        opening = tuple(self.template_opening) if self.template_opening != self.sink_ids else None
        self.entry_spec: EntrySpec = replace(self.ingestion.entry_spec, lead_sink_ids=opening)
        # the model, what chunks follow
        self.calibration_id = calibration_key(self.model_fingerprint, self.sink_ids, self.lead_sink_ids)
        self.calibration: Calibration | None = load_calibration(self.calibration_id)
        self._engine_chose = strategy is None   # the calibration's (or the safe default), not the caller's
        self.strategy = check_strategy(default_strategy(self.calibration) if strategy is None else strategy,
                                       self.adapter.shape.num_layers)
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
        self.answers = Answers(self.decode_weights, tokenizer, eos_ids_of(hf_model, tokenizer), self.context_window,
                               self.lock, decode_kv_dtype(self.decode_weights, options.decode_kv_dtype))
        self.prefetch, self.write_back = options.prefetch, options.write_back   # these five may be changed later
        self.min_fusion_speedup = options.min_fusion_speedup
        self.precompute_batch_tokens, self.prompt_lookup_num_tokens = (options.precompute_batch_tokens,
                                                                       options.prompt_lookup_num_tokens)
        self.name = options.name or getattr(hf_model.config, "_name_or_path", "") or self.adapter.arch
        self.last_stats: Stats | None = None
        self.last_prompt: PromptTrace | None = None
        self._warned_budget: set[str] = set()   # "index", "prompt": each KV budget warning is logged once
        self._precomputed: dict[str, int] = {}   # key -> tokens of every chunk precompute() stored here
        # Prefills that ran as the exact full prefill instead of fusing (Stats.fusion_skipped), and the
        # last one's reason: what the server's /metrics and a long-running app report.
        self.fusion_skips = 0
        self.last_skip_reason = ""
        release_thread_pool()     # as every prefill, precompute and answer ends: see .omp
        return_freed_memory()     # the start-up measurements' buffers (glibc keeps freed memory otherwise)
        if self.kernel_plan is not None:   # measured (or refined) off the answering thread, between passes
            self.kernel_plan.attach(self.lock)
            measure_in_background(self.kernel_plan, *kernel_layers(hf_model))

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, strategy: Strategy | None = None,
                        store: KVStore | None = None, options: EngineOptions | None = None,
                        **keywords) -> "BlendEngine":
        """Load ``model`` (None: the embedded SmolLM2-135M-Instruct; a ``.gguf`` file or a local
        Hugging Face directory) and wrap it. KV entries live in memory (LRU, ``memory_bytes``) in
        front of a disk store at ``kv_dir`` (default ``<user cache>/ragblend/kv``; ``False``: memory
        only). Any :class:`~ragblend.core.options.EngineOptions` field may be a keyword, over ``options``."""
        hf_model, tokenizer, options = _load(options, keywords if model is None else {**keywords, "model": model})
        engine = cls(hf_model, tokenizer, store=store if store is not None else MemoryStore(options.memory_bytes),
                     strategy=strategy, options=options)   # the loading options are kept there, for the record
        if store is None and options.kv_dir is not False:
            engine.store = open_store(options.kv_dir or cache_dir() / "kv", engine.entry_spec, options.memory_bytes,
                                      options.disk_bytes)
        return engine

    # What the engine is

    min_chunk_tokens = ChunkFinder.MIN_RUN   # shorter chunks are never found in flat prompts: hooks skip them

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype new chunk KV is stored in (their keys name it); settable."""
        return self.ingestion.kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype) -> None:
        self.ingestion.kv_dtype = dtype

    def describe(self) -> EngineDescription:
        """What the engine is, in plain values (what ``ragblend info`` prints): see :mod:`.description`."""
        return describe(self)

    @property
    def loading(self) -> LoadingController:
        """The loading controller, built on first use (see :mod:`ragblend.core.fusion.controller`)."""
        if self._controller is None:
            self._controller = LoadingController.for_store(self.adapter, self.entry_spec, self.kv_dtype, self.store)
        return self._controller

    # Chunks: ingestion (.ingest) and the chunk index (.chunk_index)

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of ``text`` (no special tokens): what a chunk is keyed by."""
        return self.prompts.tokenize(text)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text))

    def key_of(self, text: str, *, namespace: str = "") -> str:
        """The key a chunk text's KV is stored under for ``namespace`` (see :func:`ragblend.core.store.kv.chunk_key`)."""
        return self.ingestion.key_for(self.tokenize(text), namespace=check_namespace(namespace))

    def is_own_tokenization(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` are what this engine makes of some text: no control token (the chat
        template's markup, BOS/EOS), and the ids of their own decoded text. Only such ids may become
        a stored chunk (a client's ids could otherwise hold what no text tokenizes to, e.g. the
        template's opening)."""
        ids = list(token_ids)
        if not ids or self.prompts.text_encoder.control_ids.intersection(ids):
            return False
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            return self.tokenize(text) == ids
        except InvalidInputError:
            return False

    def lead_key(self, key: str) -> str | None:
        """The key of the lead entry of the chunk keyed ``key``; None where the engine keeps none."""
        return self.ingestion.lead_key(key)

    def entry_keys(self, key: str) -> tuple[str, ...]:
        """The keys of the entries this engine keeps for the chunk keyed ``key``: its own, and its
        lead entry's where the engine keeps lead entries."""
        lead = self.lead_key(key)
        return (key,) if lead is None else (key, lead)

    def missing_entries(self, key: str, stored=None) -> list[str]:
        """The entries this engine keeps for the chunk keyed ``key`` that are not in ``stored``
        (a set of keys, or by default this engine's store)."""
        stored = self.store if stored is None else stored
        return [entry for entry in self.entry_keys(key) if entry not in stored]

    def entries_stored(self, key: str, stored=None) -> bool:
        """Whether every entry this engine keeps for the chunk keyed ``key`` is in ``stored``."""
        return not self.missing_entries(key, stored)

    def precompute(self, texts: str | Iterable[str], *, progress: bool = False,
                   skip_unusable: bool = False, namespace: str = "") -> list[ChunkRef | None]:
        """Compute and store each chunk text's KV: see :meth:`ragblend.core.fusion.ingest.Ingestion.precompute`. ``namespace``
        ("": shared, the default) is who may find the chunks in flat prompts (see :meth:`find_chunks`)."""
        refs = self.ingestion.precompute(texts, self.store, batch_tokens=self.precompute_batch_tokens,
                                         progress=progress, skip_unusable=skip_unusable,
                                         namespace=check_namespace(namespace))
        return self._count_precomputed(refs)

    def precompute_ids(self, chunks: Iterable[Sequence[int]], *, namespace: str = "") -> list[ChunkRef]:
        """:meth:`precompute` of chunks given as token ids (a server's client may send ids: LMCache
        warms a chunk by sending it alone), each of this model's vocabulary and short enough to
        follow the sink in the context window. A server stores only ids that pass
        :meth:`is_own_tokenization`, in the sender's namespace."""
        limit, vocab = self.context_window - len(self.sink_ids), self.entry_spec.vocab_size
        chunks = [_token_ids(ids, f"chunk {i}", vocab) for i, ids in enumerate(chunks)]
        for i, ids in enumerate(chunks):
            if len(ids) > limit:
                raise PromptTooLongError(f"chunk {i} has {len(ids)} tokens; at most {limit} fit in the context "
                                         f"window ({self.context_window}) after the sink prefix. Split it.")
        return self._count_precomputed(self.ingestion.precompute_ids(
            chunks, self.store, batch_tokens=self.precompute_batch_tokens, namespace=check_namespace(namespace)))

    def _count_precomputed(self, refs: list) -> list:
        """Count the chunks this engine precomputed, and warn once (:meth:`kv_projection`) when its
        store's budget cannot keep the KV of all of them: the ones evicted are computed per query."""
        for ref in refs:
            if ref is not None:
                self._precomputed[ref.key] = ref.num_tokens
        if self._precomputed:
            tokens = -(-sum(self._precomputed.values()) // len(self._precomputed))
            self.kv_projection(len(self._precomputed), tokens)
        return refs

    @property
    def kv_shape(self) -> KVShape:
        """The part of the model's shape its stored KV's size depends on."""
        shape = self.adapter.shape
        return KVShape(shape.num_layers, shape.num_kv_heads, shape.head_dim)

    def kv_projection(self, chunks: int, tokens_per_chunk: int, *, warn: bool = True) -> Projection:
        """The projected size of the KV of ``chunks`` chunks of ``tokens_per_chunk`` tokens in this
        engine's stored dtype (both entries of a chunk where it keeps lead entries), against its
        store's budget. ``warn``: log once (per engine) when the budget holds only part of it."""
        projection = project(self.kv_shape, self.kv_dtype, chunks, tokens_per_chunk, len(self.ingestion.variants),
                             store_budget(self.store))
        if warn and not projection.fits and "index" not in self._warned_budget:
            self._warned_budget.add("index")
            log.warning("ragblend: %s", projection.describe())
        return projection

    def _check_prompt_budget(self, layout: PromptLayout) -> None:
        """Say once when the KV store cannot hold even one prompt's chunks: the prompt is answered,
        the chunks the store cannot keep computed each time."""
        if "prompt" in self._warned_budget or not layout.chunk_spans:
            return
        budget = store_budget(self.store)
        needed = sum(entry_bytes(self.kv_shape, len(span.token_ids), self.kv_dtype) for span in layout.chunk_spans)
        if budget is not None and needed > budget:
            self._warned_budget.add("prompt")
            log.warning("ragblend: a prompt's %d chunk(s) need %.1f MiB of KV, more than the KV store keeps (%.1f MiB): "
                        "they are answered, the chunks it cannot keep computed at each query. Raise memory_bytes / "
                        "disk_bytes, or store smaller KV (kv_dtype).", len(layout.chunk_spans), needed / 2**20,
                        budget / 2**20)

    def forget(self, keys: Iterable[str]) -> int:
        """Drop the stored KV of these chunk keys (e.g. when their document is deleted), each
        chunk's lead entry with it, also where this engine keeps none (another engine on the store
        may); returns how many chunk keys had an entry."""
        removed = 0
        for key in keys:
            lead = lead_key(key, self.template_opening) if self.template_opening != self.sink_ids else None
            had_lead = lead is not None and bool(self.store.delete(lead))
            removed += bool(self.store.delete(key)) or had_lead
        return removed

    def remember_chunk(self, text: str, *, namespace: str = "") -> str:
        """Declare ``text`` a chunk, stored or not: see :meth:`ragblend.core.fusion.ingest.Ingestion.remember`."""
        return self.ingestion.remember(text, check_namespace(namespace))

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

    def pieces_info(self) -> dict:
        """The history pieces' memory: its entries, bytes (and budget) and evictions; {} when off."""
        return self.runner.piece_store.info() if self.runner.keeps_pieces else {}

    def flush(self) -> None:
        """Wait for background KV writes to finish; re-raises the first one that failed."""
        self.runner.background.flush()

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

    # Prefill (.runner) and decoding (.answers)

    def prefill(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                strategy: Strategy | StrategyPlan | None = None) -> Prefill:
        """The fused prefill of ``segments`` (the user turn) under ``system``, or of a
        :class:`PromptLayout` from :meth:`find_chunks` (``system`` is part of it then)."""
        t0 = time.perf_counter()
        plan = strategy if isinstance(strategy, StrategyPlan) else self.resolve(strategy)
        layout = segments if isinstance(segments, PromptLayout) else self.prompts.build(segments, system)
        pre, self.last_prompt = self.runner.run(layout, plan, self.store, prefetch=self.prefetch,
                                                write_back=self.write_back, t0=t0, min_speedup=self.min_fusion_speedup)
        self._check_prompt_budget(layout)
        if pre.stats.fusion_skipped:
            self.fusion_skips += 1
            self.last_skip_reason = pre.stats.skip_reason
        self.last_stats = pre.stats
        return pre

    def decoding_adapter(self) -> ModelAdapter:
        """The adapter decoding runs on (see :class:`~ragblend.core.model.decode_weights.DecodeWeights`)."""
        return self.decode_weights.decoding_adapter()

    def begin(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
              strategy: Strategy | None = None, params: SamplingParams | None = None, **sampling) -> Decoding:
        """Prefill with fusion and return the answer's decoding, not stepped yet: iterate it for text
        deltas, or step it with others (:class:`~ragblend.core.decode.batching.BatchDecoder`); :meth:`finish` completes its
        ``stats``. Sampling is ``params`` or, as keywords, any of its fields (``max_new_tokens=256``,
        ``temperature=0.0``, ``top_p=1.0``, ``seed``, ``stop``), not both."""
        params = sampling_params(params, **sampling)
        pre = self.prefill(segments, system=system, strategy=strategy)
        return self.answers.start(pre, params, draft_tokens=self.prompt_lookup_num_tokens)

    def finish(self, decoding: Decoding) -> Stats:
        """The stats of a decoding from :meth:`begin`, completed with its answer's; its K/V go to the prefix
        tier, and its turns' text to the KV store as pieces of the conversation (in the background: see .pieces)."""
        self.last_stats = decoding.finish_stats(decoding.stats)
        if decoding.prefill is not None:
            adapter = self.decoding_adapter()
            self.runner.remember_answer(decoding, exact_decoding=adapter is self.decode_weights.adapter)
            self.runner.remember_pieces(decoding, self.store, self.precompute_batch_tokens)
        return decoding.stats

    def generate(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
                 strategy: Strategy | None = None, params: SamplingParams | None = None, **sampling) -> Generation:
        """Prefill with fusion, then decode the whole answer (:meth:`begin`'s arguments;
        ``temperature=0``, the default, is greedy)."""
        params = sampling_params(params, **sampling)
        decoding = self.begin(segments, system=system, strategy=strategy, params=params)
        for _ in decoding:
            pass
        pre = decoding.prefill
        return Generation(decoding.text, decoding.token_ids, decoding.finish_reason, self.finish(decoding),
                          pre.token_ids, pre.logits)

    def stream(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
               strategy: Strategy | None = None, params: SamplingParams | None = None, **sampling) -> TextStream:
        """Iterate the answer's text as it is decoded (:meth:`begin`'s arguments, checked now, not at
        the first delta); the stream's ``stats`` are this call's, complete once it is exhausted."""
        params = sampling_params(params, **sampling)
        text_stream = TextStream()

        def run():
            decoding = self.begin(segments, system=system, strategy=strategy, params=params)
            text_stream.stats = decoding.stats
            yield from decoding  # the engine lock is taken per decoding step, never across a yield
            self.finish(decoding)

        text_stream._deltas = run()
        return text_stream


def _fast_adapter(hf_model) -> tuple[ModelAdapter, KernelPlan | None]:
    """The adapter the engine computes with, and its CPU kernel plan (None off float32 CPU)."""
    adapter = ModelAdapter(hf_model)   # checks the architecture first
    if is_quantized(hf_model):
        # Prefill on the quantized weights dequantized per layer (core.model.quantized); QueryAware's
        # question pass on the low-bit kernels up to the rows measured faster on this host; decoding
        # steps run the model itself, on the low-bit kernels (core.model.decode_weights).
        adapter = ModelAdapter(prefill_twin(hf_model))
        adapter.scoring = ModelAdapter(scoring_twin(hf_model))
        return adapter, None
    if adapter.dtype != torch.float32 or adapter.device.type != "cpu":
        return adapter, None
    # The same weights through the CPU kernels measured fastest on this host (core.model.kernels);
    # the model itself is left as it is. Nothing waits for a measurement: F.linear until one is in.
    plan = kernel_plan_for(hf_model, wait=False)
    return ModelAdapter(with_linears(hf_model, lambda layer: CpuLinear(layer, plan))), plan


def _load(options: EngineOptions | None, keywords: dict):
    """``(hf_model, tokenizer, options)`` for :meth:`BlendEngine.from_pretrained`, the options
    naming the model when they did not."""
    options = EngineOptions.merged(options, keywords)
    hf_model, tokenizer = load_model(options.model, dtype=options.dtype, device=options.device)
    if options.name is None:
        options = replace(options, name="SmolLM2-135M-Instruct" if options.model is None
                          else os.path.basename(str(options.model).rstrip("/")))
    return hf_model, tokenizer, options


def _token_ids(ids, what: str, vocab: int) -> list[int]:
    """``ids`` as a list of Python ints (numpy's and torch's integers too, not bools), each in
    ``[0, vocab)``; else an :class:`InvalidInputError` naming ``what``."""
    try:
        if isinstance(ids, (str, bytes, set, frozenset, dict)):   # no ids, or in no order
            raise TypeError
        ids = list(ids)
        if any(isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool for t in ids):
            raise TypeError
        ids = [operator.index(t) for t in ids]
    except TypeError:
        ids = None
    if not ids or not all(0 <= t < vocab for t in ids):
        raise InvalidInputError(f"{what} must be a non-empty list of integer token ids in [0, {vocab}).")
    return ids
