"""Reuse for any client, with no setup (ragblend.serving.reuse), over the real default model: real clients
(LangChain's create_retrieval_chain over ChatOpenAI, LlamaIndex's OpenAILike, the openai SDK) send their
retrieved passages as plain text, and the same question asked again reuses their KV (the tiny-model cases
are in tests/unit/test_serving_reuse.py)."""


import pytest

pytest.importorskip("fastapi")

from tests.servers import RunningServer  # noqa: E402

QUESTION = "What is the name of the passenger ferry that goes to Hallow Holm?"


# ---------------------------------------------------------------------------- bad input (tiny model)


# ---------------------------------------------------------------------------- real clients, real model


@pytest.fixture(scope="module")
def fresh_engine():
    """SmolLM2 with an empty memory store of its own: nothing registered, nothing precomputed."""
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained(kv_dir=False)


@pytest.fixture(scope="module")
def server(fresh_engine):
    with RunningServer(fresh_engine) as running:
        yield running


@pytest.fixture(scope="module")
def paragraphs():
    from ragblend.data import load_sample

    return [p.strip() for doc in load_sample()["chunks"] for p in doc.split("\n\n") if len(p.strip()) > 200][:8]


def cached(usage_by_model: dict) -> tuple[int, int]:
    (usage,) = usage_by_model.values()
    return usage["input_token_details"].get("cache_read", 0), usage["input_tokens"]


@pytest.mark.slow
def test_plain_chat_openai_retrieval_chain_reuses_on_the_second_ask(server, fresh_engine, paragraphs):
    """The LangChain tutorial chain, no ragblend code and no `model=`: the second ask of the same
    question finds >= 80% of the retrieved chunks' tokens cached."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.callbacks import get_usage_metadata_callback
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=32))
    store.add_documents([Document(page_content=p) for p in paragraphs])
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_tokens=16, temperature=0, max_retries=0)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer the question using only this context:\n\n{context}"),
                                               ("human", "{input}")])
    chain = create_retrieval_chain(store.as_retriever(search_kwargs={"k": 3}), create_stuff_documents_chain(llm, prompt))
    asks = []
    for _ in range(2):
        with get_usage_metadata_callback() as usage:
            result = chain.invoke({"input": QUESTION})
        assert result["answer"].strip()
        asks.append(cached(usage.usage_metadata))
    chunk_tokens = sum(fresh_engine.count_tokens(d.page_content) for d in result["context"])
    assert len(result["context"]) == 3
    assert asks[0][0] < 0.2 * chunk_tokens                     # nothing was registered
    assert asks[1][0] >= 0.8 * chunk_tokens, (asks, chunk_tokens)


@pytest.mark.slow
def test_openai_like_and_the_openai_sdk_reuse_on_the_second_ask(server, fresh_engine, paragraphs):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike
    from openai import OpenAI

    docs = paragraphs[3:6]
    chunk_tokens = sum(fresh_engine.count_tokens(d) for d in docs)
    llm = OpenAILike(model="anything", api_base=f"{server.url}/v1", api_key="unused", is_chat_model=True,
                     context_window=8192, max_tokens=8, temperature=0, max_retries=0)
    messages = [ChatMessage(role="system", content="Answer from the context."),
                ChatMessage(role="user", content="Context:\n" + "\n\n".join(docs) + "\n\nQuestion: " + QUESTION)]
    hits = [llm.chat(messages).raw.usage.prompt_tokens_details.cached_tokens for _ in range(2)]
    assert hits[0] < 0.2 * chunk_tokens and hits[1] >= 0.8 * chunk_tokens, (hits, chunk_tokens)

    docs = paragraphs[6:8] + paragraphs[:1]   # content blocks: each block a passage
    chunk_tokens = sum(fresh_engine.count_tokens(d) for d in docs)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    content = [{"type": "text", "text": d + "\n\n"} for d in docs] + [{"type": "text", "text": QUESTION}]
    hits = [client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0).usage.prompt_tokens_details.cached_tokens
            for _ in range(2)]
    # paragraphs[0] was stored by the chain test when it ran first; the other two are new here
    assert hits[1] >= 0.8 * chunk_tokens and hits[1] > hits[0], (hits, chunk_tokens)
