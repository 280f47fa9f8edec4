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

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from .errors import InvalidInputError, PromptTooLongError
from .fusion import CacheBlend, ReusedSpan, Strategy, check_strategy, fused_prefill, isolated_kv
from .generate import Decoding, SamplingParams, build_cache
from .kv import ChunkKV, ChunkRef, chunk_key
from .model import ModelAdapter, load_model
from .pipeline import SequentialSource
from .prompt import Chunk, PromptBuilder, PromptLayout, Segment
from .store import KVStore, MemoryStore


@dataclass
class Stats:
    """What one prefill (and the decode after it, if any) cost and reused."""

    ttft_s: float = 0.0            # from the call to the first token's logits
    prompt_tokens: int = 0
    reused_tokens: int = 0         # prompt tokens whose KV came from the store
    recomputed_tokens: int = 0     # prompt tokens computed through every layer
    load_s: float = 0.0            # reading cached KV
    compute_s: float = 0.0         # running layers
    strategy: str = ""
    chunks_reused: int = 0         # chunks found in the store
    chunks_missing: int = 0        # Chunk segments with no stored KV (computed as text)
    generated_tokens: int = 0
    decode_s: float = 0.0
    finish_reason: str | None = None

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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


@dataclass
class Generation:
    """Result of :meth:`BlendEngine.generate`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_token_ids: list[int] = field(repr=False)


class BlendEngine:
    """Fusion engine over one local model: precompute chunk KV, then prefill/generate with reuse.

    Build it with :meth:`from_pretrained`. Not safe for concurrent prefill calls from
    several threads; a lock serialises them.
    """

    def __init__(self, hf_model, tokenizer, *, store: KVStore | None = None,
                 strategy: Strategy | None = None, separator: str = "\n\n",
                 sink_prefix: str | None = None, use_chat_template: bool | None = None,
                 name: str | None = None):
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(hf_model)
        self.store = store if store is not None else MemoryStore()
        self.strategy = check_strategy(strategy or CacheBlend(), self.adapter.shape.num_layers)
        self.prompts = PromptBuilder(tokenizer, separator=separator, use_chat_template=use_chat_template)
        self.sink_ids = (self.prompts.tokenize(sink_prefix) if sink_prefix is not None
                         else self.prompts.sink_ids())
        self.fingerprint = self.adapter.fingerprint(tokenizer)
        self.name = name or getattr(hf_model.config, "_name_or_path", "") or self.adapter.arch
        self.last_stats: Stats | None = None
        self._lock = threading.RLock()
        eos = hf_model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, strategy: Strategy | None = None,
                        dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                        memory_bytes: int = 2 << 30, store: KVStore | None = None, **kwargs) -> "BlendEngine":
        """Load a model and wrap it.

        ``model`` is None (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file or a local
        Hugging Face directory. ``memory_bytes`` bounds the in-memory KV store.
        """
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        hf_model, tokenizer = load_model(model, dtype=dtype, device=device)
        name = "SmolLM2-135M-Instruct" if model is None else os.path.basename(str(model).rstrip("/"))
        store = store if store is not None else MemoryStore(memory_bytes)
        return cls(hf_model, tokenizer, store=store, strategy=strategy, name=name, **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def context_window(self) -> int:
        return self.adapter.shape.context_window

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.tokenize(text))

    # ------------------------------------------------------------------ precompute

    def key_for(self, token_ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, self.sink_ids, list(token_ids))

    def precompute(self, texts: str | Iterable[str], *, progress: bool = False) -> list[ChunkRef]:
        """Compute and store the KV of each chunk text (skipping ones already stored).

        Every text is validated before anything is stored, so a bad item stores nothing.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidInputError(f"precompute takes chunk texts (str); item {i} is {type(text).__name__}.")
        tokenized = [self.prompts.tokenize(t) for t in texts]
        limit = self.context_window - len(self.sink_ids)
        for i, ids in enumerate(tokenized):
            if not ids:
                raise InvalidInputError(f"chunk {i} is empty; drop empty chunks before precomputing.")
            if len(ids) > limit:
                raise PromptTooLongError(
                    f"chunk {i} has {len(ids)} tokens; at most {limit} fit in the context window "
                    f"({self.context_window}) after the sink prefix. Split it into smaller chunks.")
        refs = []
        items = zip(texts, tokenized)
        if progress:
            from tqdm.auto import tqdm
            items = tqdm(items, total=len(texts), desc="Precomputing KV", unit="chunk")
        for _, ids in items:
            refs.append(self._ensure_stored(ids))
        return refs

    def _ensure_stored(self, token_ids: list[int]) -> ChunkRef:
        key = self.key_for(token_ids)
        if key not in self.store:
            with self._lock:
                keys, values = isolated_kv(self.adapter, self.sink_ids, token_ids)
            self.store.put(ChunkKV(key, list(token_ids), keys, values))
        return ChunkRef(key, len(token_ids))

    # ------------------------------------------------------------------ prefill

    def prefill(self, segments: Sequence[Segment], *, system: str | None = None,
                strategy: Strategy | None = None) -> Prefill:
        """Run the fused prefill of ``segments`` (the user turn) under ``system``."""
        t0 = time.perf_counter()
        strategy = check_strategy(strategy or self.strategy, self.adapter.shape.num_layers)
        layout = self.prompts.build(segments, system)
        n = len(layout.token_ids)
        if n > self.context_window:
            raise PromptTooLongError(
                f"The prompt has {n} tokens but the model's context window is {self.context_window}; "
                "pass fewer or shorter chunks.")
        spans, chunks, missing = [], [], 0
        for span in layout.chunk_spans:
            entry = self.store.get(self.key_for(span.token_ids)) if span.token_ids else None
            if entry is None:
                missing += bool(span.token_ids)
                continue
            spans.append(ReusedSpan(span.start, span.end - span.start))
            chunks.append(entry)
        source = SequentialSource(chunks, self.adapter.dtype, self.adapter.device)
        with self._lock:
            fused = fused_prefill(self.adapter, layout.token_ids, spans, source, strategy)
        recomputed = int(fused.recomputed.sum())
        stats = Stats(
            ttft_s=time.perf_counter() - t0, prompt_tokens=n, reused_tokens=n - recomputed,
            recomputed_tokens=recomputed, load_s=source.load_s, compute_s=fused.compute_s,
            strategy=strategy.name, chunks_reused=len(chunks), chunks_missing=missing,
        )
        self.last_stats = stats
        return Prefill(layout.token_ids, fused.logits, stats, fused.keys, fused.values,
                       fused.recomputed, layout)

    # ------------------------------------------------------------------ generation

    def _decoding(self, segments, system, strategy, params: SamplingParams) -> tuple[Prefill, Decoding]:
        pre = self.prefill(segments, system=system, strategy=strategy)
        cache = build_cache(self.hf_model, pre.keys, pre.values)
        decoding = Decoding(self.hf_model, self.tokenizer, cache, pre.logits.to(self.adapter.device),
                            len(pre.token_ids), params, self.eos_ids, self.context_window)
        return pre, decoding

    def stream(self, segments: Sequence[Segment], *, system: str | None = None,
               strategy: Strategy | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None) -> Iterator[str]:
        """Yield the answer's text as it is decoded; ``engine.last_stats`` has the totals at the end."""
        params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
        pre, decoding = self._decoding(segments, system, strategy, params)
        with self._lock:
            yield from decoding
        self._finish_stats(pre.stats, decoding)

    def generate(self, segments: Sequence[Segment], *, system: str | None = None,
                 strategy: Strategy | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | None = None) -> Generation:
        """Prefill with fusion, then decode. ``temperature=0`` is greedy."""
        params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
        pre, decoding = self._decoding(segments, system, strategy, params)
        with self._lock:
            for _ in decoding:
                pass
        self._finish_stats(pre.stats, decoding)
        return Generation(decoding.text, decoding.token_ids, decoding.finish_reason, pre.stats, pre.token_ids)

    def _finish_stats(self, stats: Stats, decoding: Decoding) -> None:
        stats.generated_tokens = len(decoding.token_ids)
        stats.decode_s = decoding.decode_s
        stats.finish_reason = decoding.finish_reason
        self.last_stats = stats
