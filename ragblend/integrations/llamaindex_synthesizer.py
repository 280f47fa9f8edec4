"""BlendSynthesizer: a LlamaIndex response synthesizer that hands the retrieved nodes to the
fusion engine as chunks, instead of one flat prompt to search.

Every retrieved node becomes a :class:`ragblend.Chunk`; the instructions and the query are
plain text. No repacking: all nodes go into one prompt (the engine refuses prompts over the
context window, so retrieve a ``similarity_top_k`` that fits)::

    from llama_index.core.query_engine import RetrieverQueryEngine
    from ragblend import BlendLLM, BlendSynthesizer

    llm = BlendLLM(engine=engine)
    query_engine = RetrieverQueryEngine(index.as_retriever(similarity_top_k=4),
                                        response_synthesizer=BlendSynthesizer(llm=llm))
"""

from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.types import RESPONSE_TEXT_TYPE

from ragblend.core.errors import InvalidTypeError
from ragblend.core.prompt import Chunk

from .llamaindex_llm import BlendLLM

DEFAULT_PROMPT = PromptTemplate(
    "Context information is below.\n---------------------\n{context_str}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\nQuery: {query_str}\nAnswer: "
)


class BlendSynthesizer(BaseSynthesizer):
    """Answer from retrieved nodes with their KV reused chunk by chunk.

    ``qa_template`` must contain ``{context_str}`` (where the chunks go, one per node,
    separated by a blank line) and ``{query_str}``.
    """

    def __init__(self, llm: BlendLLM, qa_template: PromptTemplate | None = None, streaming: bool = False,
                 **kwargs: Any):
        if not isinstance(llm, BlendLLM):
            raise InvalidTypeError(f"BlendSynthesizer needs a BlendLLM, got {type(llm).__name__}.")
        super().__init__(llm=llm, streaming=streaming, **kwargs)
        self._qa_template = qa_template or DEFAULT_PROMPT

    def _get_prompts(self) -> PromptDictType:
        return {"qa_template": self._qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "qa_template" in prompts:
            self._qa_template = prompts["qa_template"]

    def segments(self, query_str: str, text_chunks: Sequence[str]) -> list:
        """The prompt as segments: template text, one Chunk per node, the query."""
        marker = "\x00CONTEXT\x00"
        before, _, after = self._qa_template.format(context_str=marker, query_str=query_str).partition(marker)
        chunks = [Chunk(t.strip()) for t in text_chunks if t.strip()]
        return [s for s in (before.rstrip("\n"), *chunks, after.lstrip("\n")) if s != ""]

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        llm: BlendLLM = self._llm
        answer = llm.stream_answer(self.segments(query_str, text_chunks), label=query_str, **kwargs)
        deltas = (delta for delta, _ in answer)
        return deltas if self._streaming else "".join(deltas)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        import asyncio

        if self._streaming:
            from .common import iterate_in_thread

            return iterate_in_thread(lambda: self.get_response(query_str, text_chunks, **kwargs))
        return await asyncio.to_thread(self.get_response, query_str, text_chunks, **kwargs)
