"""Answers from an engine: its prefill, then decoding (:class:`GenerationMixin`).

What Hugging Face's ``GenerationMixin`` is to a model, this is to
:class:`~ragblend.core.engine.BlendEngine`: the one concern of turning the engine's pass (its
``prefill``) into an answer. :meth:`~GenerationMixin.begin` prefills and starts the answer's
decoding (:meth:`~ragblend.core.decode.answers.Answers.start`); :meth:`~GenerationMixin.finish`
completes its stats and hands what the answer leaves behind to the runner (its K/V to the prefix
tier, its turns' text to the store as pieces); ``generate`` and ``stream`` are ``begin`` run to
the end. Of the engine it uses ``prefill``, ``answers``, ``runner``, ``decode_weights``,
``store`` and two settings (``prompt_lookup_num_tokens``, ``precompute_batch_tokens``).
"""

from __future__ import annotations

from typing import Sequence

from .decode.generate import Decoding, SamplingParams, sampling_params
from .fusion.strategies import Strategy
from .prompt import PromptLayout, Segment
from .results import Generation, Stats, TextStream


class GenerationMixin:
    """``begin``, ``finish``, ``generate`` and ``stream`` of :class:`~ragblend.core.engine.BlendEngine`."""

    def begin(self, segments: Sequence[Segment] | PromptLayout, *, system: str | None = None,
              strategy: Strategy | None = None, params: SamplingParams | None = None, **sampling) -> Decoding:
        """Prefill with fusion and return the answer's decoding, not stepped yet: iterate it for text
        deltas, or step it with others (:class:`~ragblend.core.decode.batching.BatchDecoder`); :meth:`finish` completes its
        ``stats``. Sampling is ``params`` or, as keywords, any of its fields (``max_new_tokens=256``,
        ``temperature=0.0``, ``top_p=1.0``, ``seed``, ``stop``), not both."""
        params = sampling_params(params, **sampling)
        pre = self.prefill(segments, system=system, strategy=strategy)
        return self.answers.start(pre, params, draft_tokens=self.prompt_lookup_num_tokens,
                                  exact_prefill=self.runner.exact_prefill)

    def finish(self, decoding: Decoding) -> Stats:
        """The stats of a decoding from :meth:`begin`, completed with its answer's; its K/V go to the prefix
        tier, and its turns' text to the piece memory (PieceStore) as pieces of the conversation (in the background: see .pieces)."""
        self.last_stats = decoding.finish_stats(decoding.stats)
        self.fusion_fallbacks += bool(decoding.fallback_tokens)   # fallbacks that ran (not those that failed)
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
