"""LangChain with the real default model: BlendChatModel against langchain-tests' integration suite, the
vector-store ingestion hook and RAG chains on a real Chroma store (the unit suite and construction checks
are in tests/unit/test_langchain.py)."""

import pytest

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from ragblend import BlendChatModel, BlendEngine  # noqa: E402

from ..conftest import reused_floor  # noqa: E402
from ..unit.test_langchain import NoToolCalling  # noqa: E402

_ENGINE = None


def shared_engine():
    """One engine (KV in a temp dir) for the many model instances the suites create."""
    global _ENGINE
    if _ENGINE is None:
        import tempfile

        _ENGINE = BlendEngine.from_pretrained(kv_dir=tempfile.mkdtemp(prefix="ragblend-lc-kv-"))
    return _ENGINE


# Long enough that fusing it computes less than a full prefill of the prompt around it (a short
# passage beside the chat template runs as a plain prefill: see QuestionAttention.cheaper_than_a_prefill).
PASSAGE = ("The Sanderling is a small passenger ferry that crosses from the north pier of Lowenmark "
           "to the island of Hallow Holm four times a day in summer and twice a day in winter. "
           "She was built in 1962 at the Corran yard, carries up to eighty passengers and a dozen "
           "bicycles, and has been skippered by the same family for three generations. In rough "
           "weather the crossing takes fifty minutes instead of thirty, and when the wind rises above "
           "force eight the sailings are cancelled and a notice is pinned to the harbour office door.")


@pytest.mark.slow
class TestBlendChatModelIntegration(NoToolCalling, ChatModelIntegrationTests):
    """The standard integration tests on the real default model (SmolLM2-135M-Instruct).

    Not applicable, and so switched off through the suite's own capability flags: tool
    calling (and everything built on it: tool choice, tool messages, agent loops, runnables
    as tools), structured output and JSON mode, image / audio / video / PDF inputs, Anthropic
    message formats, per-call model override, and VCR-recorded network timing.
    """

    @property
    def chat_model_class(self):
        return BlendChatModel

    @property
    def chat_model_params(self):
        return {"temperature": 0.0, "engine": shared_engine()}

    @property
    def standard_chat_model_params(self):
        return {**super().standard_chat_model_params, "max_tokens": 24}

    @property
    def supports_json_mode(self):
        return False

    @property
    def supports_model_override(self):
        return False

    @property
    def returns_usage_metadata(self):
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        shared_engine().precompute([PASSAGE])  # so its KV is read from the store
        model = BlendChatModel(engine=shared_engine(), max_tokens=16)
        message = HumanMessage(content=[
            {"type": "text", "text": PASSAGE, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Which ferry goes to Hallow Holm?"},
        ])
        if not stream:
            reply = model.invoke([message])
        else:
            reply = None
            for chunk in model.stream([message]):
                reply = chunk if reply is None else reply + chunk
        assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
        return reply


# ---------------------------------------------------------------------------- RAG on Chroma


@pytest.fixture(scope="module")
def chroma_store(tmp_path_factory):
    pytest.importorskip("langchain_chroma")
    import chromadb
    from langchain_chroma import Chroma

    from ragblend.data import load_sample
    from ragblend.vectorstore_hooks.langchain import KVPrecomputeVectorStore, MiniLMEmbeddings

    chroma = Chroma("lowenmark", embedding_function=MiniLMEmbeddings(),
                    persist_directory=str(tmp_path_factory.mktemp("chroma")),
                    client_settings=chromadb.Settings(anonymized_telemetry=False, is_persistent=True))
    store = KVPrecomputeVectorStore(chroma, shared_engine())
    paragraphs = [p.strip() for doc in load_sample()["chunks"] for p in doc.split("\n\n") if len(p.strip()) > 200]
    store.add_texts(paragraphs, metadatas=[{"n": i} for i in range(len(paragraphs))],
                    ids=[f"p{i}" for i in range(len(paragraphs))])
    return store


def rag_chain(store, chat):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])

    def format_docs(docs):
        return "\n\n".join(doc.page_content for doc in docs)  # the standard stuff-documents separator

    retriever = store.as_retriever(search_kwargs={"k": 3})
    return retriever, {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat


@pytest.mark.slow
@pytest.mark.parametrize("context_in", ["system", "human"])
def test_create_retrieval_chain_reuses_the_retrieved_chunks(chroma_store, context_in):
    """The chain most LangChain RAG tutorials build: create_stuff_documents_chain inside
    create_retrieval_chain (langchain-classic), context in the system or the human message."""
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate

    engine = shared_engine()
    chat = BlendChatModel(engine=engine, max_tokens=32)
    messages = ([("system", "Answer the question using only this context:\n\n{context}"), ("human", "{input}")]
                if context_in == "system" else
                [("system", "Answer using only the context."), ("human", "Context:\n{context}\n\nQuestion: {input}")])
    chain = create_retrieval_chain(chroma_store.as_retriever(search_kwargs={"k": 3}),
                                   create_stuff_documents_chain(chat, ChatPromptTemplate.from_messages(messages)))
    question = {"input": "What is the name of the passenger ferry that goes to Hallow Holm?"}
    result = chain.invoke(question)
    chunk_tokens = sum(engine.count_tokens(d.page_content) for d in result["context"])
    assert len(result["context"]) == 3
    assert engine.last_stats.reused_tokens >= reused_floor(engine, chunk_tokens)
    # The answer starts as a full prefill's does (with the context in the system message the
    # 135M model misnames the ferry either way, so the name is checked only in the other case).
    full = BlendChatModel(engine=engine, max_tokens=32, strategy="full_recompute")
    reference = create_retrieval_chain(chroma_store.as_retriever(search_kwargs={"k": 3}), create_stuff_documents_chain(
        full, ChatPromptTemplate.from_messages(messages))).invoke(question)["answer"]
    assert result["answer"].split()[:8] == reference.split()[:8]
    if context_in == "human":
        assert "Sanderling" in result["answer"]


@pytest.mark.slow
def test_adding_documents_precomputes_their_kv(chroma_store):
    engine = shared_engine()
    docs = chroma_store.get_by_ids(["p0", "p1"])
    for doc in docs:
        assert doc.metadata["ragblend_kv_key"] == engine.key_of(doc.page_content)
        assert doc.metadata["ragblend_kv_key"] in engine.store


@pytest.mark.slow
def test_stuff_documents_chain_reuses_the_retrieved_chunks(chroma_store):
    engine = shared_engine()
    chat = BlendChatModel(engine=engine, max_tokens=32)
    retriever, chain = rag_chain(chroma_store, chat)
    question = "What is the name of the passenger ferry that goes to Hallow Holm?"
    docs = retriever.invoke(question)
    reply = chain.invoke(question)
    chunk_tokens = sum(engine.count_tokens(d.page_content) for d in docs)
    usage = reply.usage_metadata
    assert usage["input_token_details"]["cache_read"] >= reused_floor(engine, chunk_tokens)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert reply.response_metadata["model_name"] == "SmolLM2-135M-Instruct"
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert "Sanderling" in reply.content
    streamed = "".join(chunk.content for chunk in chain.stream(question))
    assert streamed == reply.content


@pytest.mark.slow
def test_deleting_documents_drops_their_kv(chroma_store):
    engine = shared_engine()
    ids = chroma_store.add_texts(["A short-lived note about the harbour crane, repainted red in the spring of 2019 "
                                  "after twenty years of rust."], ids=["tmp-note"])
    key = chroma_store.get_by_ids(ids)[0].metadata["ragblend_kv_key"]
    assert key in engine.store
    chroma_store.delete(ids)
    assert key not in engine.store and chroma_store.get_by_ids(ids) == []


@pytest.mark.slow
def test_documents_too_short_to_find_get_no_kv(chroma_store):
    engine = shared_engine()
    # (metadata given: langchain-chroma cannot read back a document stored with none)
    (doc_id,) = chroma_store.add_texts(["Gulls nest here."], [{"source": "note"}], ids=["short-note"])
    assert engine.count_tokens("Gulls nest here.") < engine.min_chunk_tokens
    assert "ragblend_kv_key" not in chroma_store.get_by_ids([doc_id])[0].metadata


@pytest.mark.slow
def test_deleting_one_of_two_identical_documents_keeps_their_shared_kv(chroma_store):
    engine = shared_engine()
    text = "A note written twice: the harbour crane's night lamp is switched off at dawn."
    chroma_store.add_texts([text, text], ids=["twice-a", "twice-b"])
    key = chroma_store.get_by_ids(["twice-a"])[0].metadata["ragblend_kv_key"]
    chroma_store.delete(["twice-a"])
    assert key in engine.store          # "twice-b" still needs it
    chroma_store.delete(["twice-b"])
    assert key not in engine.store


@pytest.mark.slow
@pytest.mark.parametrize("where", ["top-level", "extras"])
def test_cache_control_blocks_and_kv_chunks_are_fused_as_chunks(where):
    engine = shared_engine()
    engine.precompute([PASSAGE])
    chat = BlendChatModel(engine=engine, max_tokens=16)
    marker = {"cache_control": {"type": "ephemeral"}}
    block = {"type": "text", "text": PASSAGE, **(marker if where == "top-level" else {"extras": marker})}
    reply = chat.invoke([HumanMessage(content=[block, {"type": "text", "text": "Which ferry goes to Hallow Holm?"}])])
    passage_tokens = engine.count_tokens(PASSAGE)
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= reused_floor(engine, passage_tokens)

    text = f"Context: {PASSAGE}\n\nWhich ferry goes to Hallow Holm?"
    plain = chat.invoke(text, kv_chunks=[PASSAGE])
    assert plain.usage_metadata["input_token_details"]["cache_read"] >= reused_floor(engine, passage_tokens)
    with pytest.raises(ValueError, match="kv_chunks"):
        chat.invoke(text, kv_chunks=["not in the message"])


@pytest.mark.slow
def test_async_calls_do_not_block_the_event_loop():
    from ..conftest import run_with_ticker

    chat = BlendChatModel(engine=shared_engine(), max_tokens=16)

    async def both():
        reply = await chat.ainvoke("Name a colour.")
        return reply, [c async for c in chat.astream("Name a fruit.")]

    (reply, chunks), ticks, elapsed = run_with_ticker(both)
    assert reply.content and len(chunks) > 1
    assert ticks >= 0.3 * elapsed / 0.01
