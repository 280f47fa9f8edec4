"""A conversation's turns kept as pieces fused like chunks (:mod:`ragblend.core.store.pieces`), as
the prefill runner uses them: marking the stored pieces of a prompt's earlier turns, and storing,
in the background, the pieces of a finished answer's prompt and answer for the next turn."""

from __future__ import annotations

import logging
import threading

from .background import Background
from .cancel import Cancelled, cancellable
from .decode.prefix_cache import PrefixHit, is_bypassed
from .fusion.ingest import Ingestion, packs
from .model.adapter import ModelAdapter
from .plan import StrategyPlan
from .prefix_reuse import PrefixReuse
from .prompt import PromptLayout
from .store.pieces import PieceStore, is_piece, last_message_start, piece_namespace, turn_runs, with_pieces

log = logging.getLogger("ragblend")


class HistoryPieces:
    """The pieces of one engine's conversations: ``enabled`` switches them on, in ``max_bytes`` of
    their own memory (``piece_store``); ``index`` learns each piece stored (and forgets an evicted
    one), ``background`` computes and stores them off the TTFT path, and ``prefix`` (the runner's
    use of the prefix tier) says where the tier already serves a prompt's history."""

    def __init__(self, adapter: ModelAdapter, ingestion: Ingestion, index, background: Background,
                 prefix: PrefixReuse, enabled: bool, max_bytes: int):
        self.adapter, self.ingestion, self.index, self.background, self.prefix = \
            adapter, ingestion, index, background, prefix
        self.enabled = enabled
        # an evicted piece is no longer looked for: a prompt holding its text computes it as text
        self.piece_store = PieceStore(max_bytes, lambda entry: index.forget(entry.key, entry.token_ids, entry.namespace))
        self._question_bounds: tuple | None = None   # the template's closing and user-turn opening, made once
        self._retries: list[threading.Timer] = []   # storings that yielded to a request, due again (their timers)

    @property
    def keeps(self) -> bool:
        """Whether conversations' turns are kept as pieces (switched on, with memory for them)."""
        return self.enabled and self.piece_store.max_bytes > 0

    def mark(self, layout: PromptLayout, plan: StrategyPlan, found: PrefixHit | None) -> tuple[PromptLayout, bool]:
        """``layout`` with the stored pieces of its conversation's earlier turns marked (.pieces), and
        whether this turn's are to be kept once answered. Only a conversation's turns (chat messages
        with earlier turns), and a chat request's first turn, are worth keeping: a single-shot query
        would pay a background pass for text that is never asked again. ``found``: the prefix tier's
        longest prefix of the prompt (:meth:`.PrefixReuse.lookup`); where it covers the history, the
        tier serves all a piece could."""
        pieces = self.keeps and (layout.conversation or layout.chat) and plan.engine_default and plan.reuses \
            and not is_bypassed()
        if pieces and layout.conversation:   # a first turn has no earlier one to find
            end = self.last_message_start(layout.token_ids)
            if not self.prefix.reaches(layout, plan, end, found):
                prompts = self.ingestion.prompts
                layout = with_pieces(layout, self.index.finder, start=prompts.opening_length(layout.token_ids),
                                     end=end, control_ids=prompts.text_encoder.control_ids)
        return layout, pieces

    def last_message_start(self, token_ids) -> int:
        """Where a prompt's last message begins (:func:`ragblend.core.store.pieces.last_message_start`)."""
        prompts = self.ingestion.prompts
        control = prompts.text_encoder.control_ids
        if self._question_bounds is None:   # rendering the template takes milliseconds: once
            before, closing = prompts.template_parts(None)
            last = max((i for i, t in enumerate(before) if t in control), default=None)
            self._question_bounds = (closing, [] if last is None else before[last:])
        closing, user_opening = self._question_bounds
        return last_message_start(token_ids, control, closing, user_opening)

    def remember(self, decoding, batch_tokens: int) -> None:
        """Store, in the background, the pieces of a finished answer's prompt and answer that no
        chunk or stored piece covers, for the next turn of its conversation."""
        pre = decoding.prefill
        if pre is not None and getattr(pre, "keeps_pieces", False):
            self.background.submit(self.store_pieces, pre.token_ids, pre.layout, decoding.text, batch_tokens)

    RETRIES = 3            # a storing that yielded to requests is tried again this many times,
    RETRY_AFTER_S = 1.0    # after this long (twice as long the second time...): requests come in bursts

    def store_pieces(self, prompt_ids: list[int], layout: PromptLayout, answer: str, batch_tokens: int,
                     attempt: int = 0) -> None:
        """Compute and keep the pieces of one answered turn (runs on the background thread)."""
        prompts = self.ingestion.prompts
        try:
            question = self.last_message_start(prompt_ids)
            if layout.conversation and not any(is_piece(span) for span in layout.chunk_spans):
                # The prefix tier served its history (no piece was marked for the prefill): the pieces kept
                # before are marked now, so that only what none covers is computed (unmarked, the whole
                # history was cut into new runs and computed again, more every turn).
                layout = with_pieces(layout, self.index.finder, start=prompts.opening_length(prompt_ids),
                                     end=question, control_ids=prompts.text_encoder.control_ids)
            # The answer as the next prompt will hold it: its text tokenized (the ids generated need not
            # be the ids of their own text).
            ids = list(prompt_ids) + (prompts.tokenize(answer) if answer else [])
            runs = turn_runs(ids, layout.chunk_spans, question=question,
                             prompt_tokens=len(prompt_ids), start=prompts.opening_length(ids),
                             history=layout.conversation, max_tokens=self.ingestion.max_chunk_tokens)
            namespace = piece_namespace(layout.namespace)
            keys = {self.ingestion.key_for(run, namespace=namespace): run for run in runs}
            new = [(key, run) for key, run in keys.items() if key not in self.piece_store]
            # Each piece's own entry only (no lead entry: a piece is never fused from one, see
            # ChunkReads.lead_spans), in the pieces' memory; the finder learns it once stored.
            # A request that wants the model meanwhile stops the pass before its next layer (pieces
            # are a cache): the engine's lock is not fair, and these passes would keep it for seconds.
            lock = self.ingestion.lock
            with cancellable(lock.waited_for), lock.background():
                for pack in packs(new, max(batch_tokens, 1), size=lambda item: len(item[1])):
                    entries = self.ingestion.compute_entries([run for _, run in pack], False, namespace)
                    for (key, run), entry in zip(pack, entries):
                        if self.piece_store.put(entry):
                            self.index.add(key, run, namespace)
        except Cancelled:   # the pieces stored so far stay; the rest is tried again a little later
            log.debug("storing a conversation's pieces yielded to a request (attempt %d)", attempt + 1)
            if attempt < self.RETRIES:
                retry = threading.Timer(self.RETRY_AFTER_S * (attempt + 1), self._retry,
                                        (prompt_ids, layout, answer, batch_tokens, attempt + 1))
                retry.daemon = True
                self._retries = [*(timer for timer in self._retries if timer.is_alive()), retry]
                retry.start()
        except Exception as err:   # pieces are a cache: the next turn computes their text instead
            log.warning("ragblend: could not store a conversation's pieces (%s: %s)", type(err).__name__, err)

    def _retry(self, *args) -> None:
        """Submit a storing that yielded again (on a timer's thread)."""
        try:
            self.background.submit(self.store_pieces, *args)
        except RuntimeError:   # the background thread is shut down (the interpreter is exiting): a cache, dropped
            log.debug("a conversation's pieces were not stored again: the background thread has shut down")

    @property
    def retries_due(self) -> int:
        """Storings that yielded to a request and will be submitted again (their timers running)."""
        return sum(timer.is_alive() for timer in self._retries)
