"""LlamaIndex's chat engines over a real index with the real default model: a turn's answer is
the assistant's words, never a role label ("user: ...") copied from a flattened conversation."""

import re

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.chat_engine import CondensePlusContextChatEngine  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402

from ragblend import BlendLLM, KVPrecompute  # noqa: E402
from ragblend.data import sample_dir  # noqa: E402
from ragblend.integrations.local_index import default_embed_model, read_text_files  # noqa: E402

pytestmark = pytest.mark.slow

ROLE_LABEL = re.compile(r"^\s*(user|assistant|system|human|ai)\s*:", re.I | re.M)
TURNS = ["What is the name of the passenger ferry that goes to Hallow Holm?",
         "How long does its crossing take?"]   # turn 2: history, a condensed question (the case)


def test_condense_plus_context_turns_have_no_role_labels(smol_engine):
    documents, _ = read_text_files([sample_dir()])
    index = VectorStoreIndex.from_documents(documents, embed_model=default_embed_model(),
                                            transformations=[SentenceSplitter(chunk_size=256),
                                                             KVPrecompute(smol_engine)])
    llm = BlendLLM(engine=smol_engine, max_new_tokens=32)
    chat = CondensePlusContextChatEngine.from_defaults(index.as_retriever(similarity_top_k=2), llm=llm)
    answers = []
    for i, question in enumerate(TURNS):
        # the second turn streams: the synthesizer's stream() path as well as predict()
        response = chat.stream_chat(question) if i == 1 else chat.chat(question)
        text = "".join(response.response_gen) if i == 1 else str(response)
        answers.append(text)
        assert text.strip(), (question, text)
        assert not ROLE_LABEL.search(text), (question, text)
    # the history reached the model as the chat template's turns, not as labelled lines
    prompt = smol_engine.tokenizer.decode(smol_engine.last_prompt.token_ids)
    assert not ROLE_LABEL.search(prompt), prompt
    assert prompt.count("<|im_start|>assistant") == len(TURNS), prompt
    assert smol_engine.last_stats.reused_tokens > 0   # the retrieved chunks' KV still fused
