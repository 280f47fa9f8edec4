"""LlamaIndex end to end: real default model, real Chroma directory, stock query engines."""

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("chromadb")

from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402

from ragblend import BlendLLM, InvalidInputError  # noqa: E402
from ragblend.data import load_sample, sample_dir  # noqa: E402
from ragblend.integrations import local_index  # noqa: E402
from ragblend.integrations.local_index import LocalIndex, read_text_files  # noqa: E402
from ragblend.vectorstore_hooks.llamaindex import KV_KEY, llm_text  # noqa: E402

from ..conftest import ran_as_a_full_prefill, reused_floor  # noqa: E402

pytestmark = pytest.mark.slow

QUESTION = "What is the name of the passenger ferry that goes to Hallow Holm?"


@pytest.fixture(scope="module")
def rag(smol_engine, tmp_path_factory):
    index = LocalIndex(tmp_path_factory.mktemp("index"), engine=smol_engine)
    report = index.ingest([sample_dir()], show_progress=False)
    assert len(report.files) == 6 and report.nodes == len(index) > 6
    return index


def chunk_tokens(engine, source_nodes) -> int:
    return sum(engine.count_tokens(llm_text(n.node)) for n in source_nodes)


def test_ingestion_stores_kv_and_keeps_the_key_out_of_prompts(rag):
    nodes = rag.vector_store.get_nodes()
    assert len(nodes) == len(rag)
    for node in nodes:
        key = node.metadata[KV_KEY]
        assert key in rag.engine.store
        assert KV_KEY in node.excluded_llm_metadata_keys and KV_KEY in node.excluded_embed_metadata_keys
        assert key not in llm_text(node) and KV_KEY not in llm_text(node)
        assert rag.engine.key_of(llm_text(node)) == key


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "simple_summarize"])
def test_stock_synthesizers_reuse_the_chunks_with_plain_prefill_ids(rag, mode):
    engine = rag.engine
    llm = BlendLLM(engine=engine, max_new_tokens=24)
    query_engine = rag.index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3)
    response = query_engine.query(QUESTION)
    calls = llm.calls
    assert calls, "the LLM was not called"
    for call in calls:
        # The prompt ids are exactly what a plain full prefill of the same prompt text uses.
        plain = engine.prompts.build([call.prompt]).token_ids
        assert call.layout.token_ids == plain
    # A call whose chunk is short beside its template (refine's later prompts) runs as a plain
    # prefill, which computes less there; the others fuse and reuse their chunks.
    fused = [c for c in calls if not ran_as_a_full_prefill(c.stats)]
    assert fused and all(c.stats.compute_fraction == 1.0 for c in calls if c not in fused)
    reused = sum(c.stats.reused_tokens for c in fused)
    in_fused = [n for n in response.source_nodes if any(llm_text(n.node) in c.prompt for c in fused)]
    assert reused >= reused_floor(engine, chunk_tokens(engine, in_fused))
    assert len(response.source_nodes) == 3
    # distinct chunks, however many runs of their tokens the prompt splits them into (the
    # session's engine also knows other tests' chunks, so this counts what the layout holds)
    for call in fused:
        distinct = {span.token_ids for span in call.layout.chunk_spans}
        assert call.stats.chunks_reused >= 1
        assert call.stats.chunks_reused + call.stats.chunks_missing == len(distinct)

    full = BlendLLM(engine=engine, strategy="full_recompute", max_new_tokens=24)
    rag.index.as_query_engine(llm=full, response_mode=mode, similarity_top_k=3).query(QUESTION)
    # Refine puts the previous answer into later prompts, so only its first prompt is the same.
    compare = 1 if mode == "refine" else len(calls)
    assert [c.layout.token_ids for c in full.calls][:compare] == [c.layout.token_ids for c in calls][:compare]
    assert len(full.calls) == len(calls)
    assert all(c.stats.reused_tokens == 0 for c in full.calls)
    if mode == "compact":
        assert "Sanderling" in str(response)


def test_blend_synthesizer_passes_nodes_as_chunks(rag):
    answer = rag.ask(QUESTION, mode="blend", top_k=3, max_new_tokens=24)
    stats = answer.stats
    assert stats.chunks_reused == 3 and stats.chunks_missing == 0
    assert stats.reused_tokens >= reused_floor(rag.engine, chunk_tokens(rag.engine, answer.sources))
    assert "Sanderling" in answer.text


def test_streaming_matches_non_streaming(rag):
    llm = BlendLLM(engine=rag.engine, max_new_tokens=24)
    plain = str(rag.index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION))
    streaming = rag.index.as_query_engine(llm=llm, similarity_top_k=3, streaming=True).query(QUESTION)
    assert "".join(streaming.response_gen) == plain
    deltas = [r.delta for r in llm.stream_complete("Say hello.")]
    assert len(deltas) > 1


def test_async_query_does_not_block_the_event_loop(rag):
    from ..conftest import run_with_ticker

    llm = BlendLLM(engine=rag.engine, max_new_tokens=24)
    query_engine = rag.index.as_query_engine(llm=llm, similarity_top_k=3)

    async def both():
        response = await query_engine.aquery(QUESTION)
        chunks = [r.delta async for r in await llm.astream_complete("Say hello.")]
        return response, chunks

    (response, chunks), ticks, elapsed = run_with_ticker(both)
    assert "Sanderling" in str(response)
    assert ticks >= 0.3 * elapsed / 0.01  # the loop kept running while the model worked
    assert len(chunks) > 1


def test_llm_interface_chat_usage_and_metadata(rag):
    llm = BlendLLM(engine=rag.engine, max_new_tokens=12, system_prompt="You are terse.")
    meta = llm.metadata
    assert meta.context_window == 8192 and meta.num_output == 12 and not meta.is_chat_model
    out = llm.complete("Name a colour.")
    usage = out.raw["usage"]
    stats = out.additional_kwargs["ragblend_stats"]
    assert usage["prompt_tokens"] == stats.prompt_tokens > 0
    assert usage["completion_tokens"] == stats.generated_tokens > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # the system prompt goes through the chat template, not in front of the text
    prefix, _ = rag.engine.prompts.template_parts("You are terse.")
    assert llm.calls[-1].layout.token_ids[:len(prefix)] == prefix
    assert "You are terse." in rag.engine.tokenizer.decode(prefix)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Answer in one word."),
                ChatMessage(role=MessageRole.USER, content="Hi"),
                ChatMessage(role=MessageRole.ASSISTANT, content="Hello."),
                ChatMessage(role=MessageRole.USER, content="Name a fruit.")]
    reply = llm.chat(messages)
    assert reply.message.role == MessageRole.ASSISTANT and reply.message.content
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == reply.message.content
    # chat is implemented once and completion derived: all four paths carry the same payload
    finals = [out, list(llm.stream_complete("Name a colour."))[-1], reply, streamed[-1]]
    for final in finals:
        assert set(final.raw) == {"usage", "ragblend"} and set(final.additional_kwargs) == {"ragblend_stats"}
        assert final.raw["usage"]["completion_tokens"] == final.additional_kwargs["ragblend_stats"].generated_tokens
    assert finals[0].text == finals[1].text


def test_missing_kv_is_computed_on_the_fly_and_saved(rag):
    engine = rag.engine
    llm = BlendLLM(engine=engine, max_new_tokens=8)
    nodes = rag.index.as_retriever(similarity_top_k=3).retrieve(QUESTION)
    victim = nodes[0].node.metadata[KV_KEY]
    engine.forget([victim])
    assert victim not in engine.store
    rag.index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION)
    assert llm.calls[-1].stats.chunks_computed == 1
    engine.flush()
    # saved as the prompt used it: the first retrieved chunk, so its lead entry
    assert engine.ingestion.lead_key(victim) in engine.store


def test_retrieval_larger_than_the_window_is_repacked_and_still_reused(rag):
    # a window that still splits the six chunks over several calls, each with enough of them cached that
    # fusing computes less than a full prefill (QueryAware's per-chunk floor: Selection.cheaper_than_a_prefill)
    answer_engine = rag.query_engine(mode="compact", top_k=6, context_window=1000, max_new_tokens=16)
    llm = answer_engine._response_synthesizer._llm
    answer_engine.query(QUESTION)
    assert len(llm.calls) > 1  # the synthesizer split the context over several calls
    assert all(c.stats.prompt_tokens <= 1000 for c in llm.calls)
    assert sum(c.stats.reused_tokens for c in llm.calls) > 0


def test_deleting_a_document_drops_its_kv(smol_engine, tmp_path):
    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The blue heron nests in the reed beds north of the old mill every spring.\n")
    (docs / "b.md").write_text("The harbour master keeps a logbook of every ship that enters the port at night.\n")
    rag.ingest([docs], show_progress=False)
    keys = {n.metadata["file_name"]: n.metadata[KV_KEY] for n in rag.vector_store.get_nodes()}
    assert set(keys) == {"a.md", "b.md"} and all(k in smol_engine.store for k in keys.values())
    rag.delete(docs / "a.md")
    assert [n.metadata["file_name"] for n in rag.vector_store.get_nodes()] == ["b.md"]
    assert keys["a.md"] not in smol_engine.store and keys["b.md"] in smol_engine.store
    # re-ingesting an edited file replaces its nodes (docstore upsert) and its KV
    (docs / "b.md").write_text("The harbour master keeps two logbooks now: one for ships, one for weather.\n")
    rag.ingest([docs / "b.md"], show_progress=False)
    nodes = rag.vector_store.get_nodes()
    assert len(nodes) == 1 and "two logbooks" in nodes[0].text
    assert keys["b.md"] not in smol_engine.store and nodes[0].metadata[KV_KEY] in smol_engine.store


def test_an_interrupted_ingest_resumes_without_duplicates(smol_engine, tmp_path, monkeypatch):
    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"{i}.md").write_text(f"Ferry number {i} leaves the north pier at {i + 6} o'clock each morning "
                                      f"and returns from the island before the evening tide turns.\n")
    documents, _ = read_text_files([docs])
    persist, calls = local_index._persist_atomically, []

    def interrupted(docstore, path):    # Ctrl-C after the second batch reached Chroma, before the docstore
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        persist(docstore, path)

    monkeypatch.setattr(local_index, "_persist_atomically", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rag.ingest_documents(documents, show_progress=False, batch_size=2)
    assert len(rag) == 4                 # two batches reached Chroma; the docstore knows one
    keys = {n.metadata[KV_KEY] for n in rag.vector_store.get_nodes()}
    monkeypatch.setattr(local_index, "_persist_atomically", persist)
    report = rag.ingest_documents(documents, show_progress=False, batch_size=2)
    assert report.unchanged == 2 and report.nodes == 3 and len(rag) == 5     # no duplicates
    nodes = rag.vector_store.get_nodes()
    assert sorted(n.metadata["file_name"] for n in nodes) == [f"{i}.md" for i in range(5)]
    assert keys <= {n.metadata[KV_KEY] for n in nodes} and all(k in smol_engine.store for k in keys)
    assert not (tmp_path / "index" / "ingest-in-progress").exists()


def test_deleting_one_of_two_identical_documents_keeps_their_shared_kv(smol_engine, tmp_path):
    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    docs = tmp_path / "docs"
    docs.mkdir()
    for folder in ("original", "copy"):   # same name and text: the LLM sees the same chunk
        (docs / folder).mkdir()
        (docs / folder / "notes.md").write_text("The lighthouse keeper winds the clockwork lamp at dusk.\n")
    rag.ingest([docs], show_progress=False)
    keys = {n.metadata[KV_KEY] for n in rag.vector_store.get_nodes()}
    assert len(rag) == 2 and len(keys) == 1   # one entry for both
    rag.delete(docs / "original" / "notes.md")
    assert keys <= set(smol_engine.store.keys())       # the copy still needs it
    rag.delete(docs / "copy" / "notes.md")
    assert not keys & set(smol_engine.store.keys())    # the last user is gone


def test_sentence_window_retrieval_reuses_the_windows_the_llm_is_shown(smol_engine, tmp_path):
    import chromadb
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceWindowNodeParser
    from llama_index.core.postprocessor import MetadataReplacementPostProcessor
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from ragblend.integrations.local_index import default_embed_model
    from ragblend.vectorstore_hooks.llamaindex import KVAwareVectorStore, KVPrecompute

    embed = default_embed_model()
    client = chromadb.PersistentClient(str(tmp_path / "chroma"), settings=chromadb.Settings(anonymized_telemetry=False))
    store = KVAwareVectorStore(ChromaVectorStore(chroma_collection=client.get_or_create_collection("windows")), smol_engine)
    documents, _ = read_text_files([sample_dir() / "04-buses-and-ferries.md"])
    pipeline = IngestionPipeline(transformations=[SentenceWindowNodeParser.from_defaults(window_size=2),
                                                  KVPrecompute(smol_engine, metadata_key="window"), embed],
                                 vector_store=store)
    pipeline.run(documents=documents)
    llm = BlendLLM(engine=smol_engine, max_new_tokens=8)
    query_engine = VectorStoreIndex.from_vector_store(store, embed_model=embed).as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[MetadataReplacementPostProcessor(target_metadata_key="window")])
    response = query_engine.query(QUESTION)
    shown = [llm_text(n.node) for n in response.source_nodes]
    assert all(n.node.text == n.node.metadata["window"] for n in response.source_nodes)   # the LLM saw windows
    engine = smol_engine
    assert all(engine.key_of(text) in engine.store for text in shown)  # precomputed as shown
    unique = sum(smol_engine.count_tokens(text) for text in set(shown))   # neighbouring windows may repeat
    assert llm.last_stats.reused_tokens >= reused_floor(smol_engine, unique)   # reused on the first query


def test_chunks_too_short_to_find_are_not_stored_and_are_reported(smol_engine, tmp_path, capsys):
    from ragblend.cli import _print_ingest_report

    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tiny.md").write_text("Gulls nest here.\n")
    report = rag.ingest([docs], show_progress=False)
    (node,) = rag.vector_store.get_nodes()
    assert smol_engine.count_tokens(llm_text(node)) < smol_engine.min_chunk_tokens
    assert report.nodes == 1 and report.without_kv == 1 and KV_KEY not in node.metadata
    assert smol_engine.key_of(llm_text(node)) not in smol_engine.store
    _print_ingest_report(report, rag)
    assert "1 chunk(s) got no stored KV: shorter than 16 tokens" in capsys.readouterr().out


def test_ingestion_cache_keeps_the_keys(smol_engine):
    from llama_index.core import Document
    from llama_index.core.ingestion import IngestionCache, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from ragblend import KVPrecompute

    cache = IngestionCache()
    doc = Document(text="Gulls circle the fish market at dawn, waiting for the first boats to unload.")
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=8), KVPrecompute(smol_engine)],
                                 cache=cache)
    first = pipeline.run(documents=[doc])
    smol_engine.forget([first[0].metadata[KV_KEY]])
    second = pipeline.run(documents=[doc])  # served from the ingestion cache: the transform does not run
    assert second[0].metadata[KV_KEY] == first[0].metadata[KV_KEY]
    assert KV_KEY in second[0].excluded_llm_metadata_keys


def test_unreadable_binary_and_unsupported_files_are_skipped(tmp_path):
    (tmp_path / "ok.md").write_text("# Title\n\nSome text.\n")
    (tmp_path / "notes.txt").write_text("More text.\n")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.md").write_text("   \n")
    (tmp_path / "paper.pdf").write_bytes(b"%PDF-1.4")
    (tmp_path / "windows.txt").write_bytes("Caf\u00e9 notes, saved as UTF-16.\n".encode("utf-16"))   # with a BOM
    (tmp_path / "bom.md").write_bytes("\ufeffUTF-8 with a byte-order mark.\n".encode("utf-8"))
    documents, report = read_text_files([tmp_path, tmp_path / "missing.md"])
    texts = {d.metadata["file_name"]: d.text for d in documents}
    assert sorted(texts) == ["bom.md", "notes.txt", "ok.md", "windows.txt"]
    assert texts["windows.txt"].startswith("Caf\u00e9 notes") and texts["bom.md"].startswith("UTF-8 with")
    reasons = {p.rsplit("/", 1)[-1]: r for p, r in report.skipped}
    assert reasons["blob.txt"] == "binary content"
    assert reasons["latin1.txt"] == "neither UTF-8 nor UTF-16/32 with a byte-order mark"
    assert reasons["empty.md"] == "empty" and reasons["paper.pdf"].startswith("not a readable PDF")
    assert reasons["missing.md"] == "no such file or folder"


def test_question_before_ingestion_says_what_to_do(smol_engine, tmp_path):
    empty = LocalIndex(tmp_path / "empty", engine=smol_engine)
    with pytest.raises(InvalidInputError, match="ingest documents first"):
        empty.ask(QUESTION)
    report = empty.ingest([tmp_path / "nothing-here"], show_progress=False)
    assert report.files == [] and report.skipped


def test_cli_ingest_and_ask(tmp_path, capsys):
    from ragblend.cli import main

    index = str(tmp_path / "cli-index")
    assert main(["ingest", str(sample_dir()), "--index", index]) == 0
    assert "Ingested 6 new or changed file(s)" in capsys.readouterr().out
    assert main(["ask", load_sample()["demo"][0]["question"], "--index", index, "--compare",
                 "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "[default] TTFT" in out and "[full prefill] TTFT" in out and "1987" in out
    assert "reused" in out


def test_chunk_hints_let_an_unknown_node_be_computed_and_written_back(smol_engine, tmp_path):
    """A fresh engine (another process) whose store lost a node's KV: with KVChunkHints the
    node is still treated as a chunk, computed in isolation, and saved."""
    from ragblend import BlendEngine
    from ragblend.vectorstore_hooks.llamaindex import KVChunkHints

    rag = LocalIndex(tmp_path / "index", engine=smol_engine)
    rag.ingest([sample_dir()], show_progress=False)
    # knows no chunk at all; no prefix tier, which would answer the repeated query instead of the store
    fresh = BlendEngine.from_pretrained(kv_dir=tmp_path / "other-kv", prefix_cache_bytes=0)
    llm = BlendLLM(engine=fresh, max_new_tokens=8)
    plain = rag.index.as_query_engine(llm=llm, similarity_top_k=2)
    plain.query(QUESTION)
    assert llm.calls[-1].stats.chunks_missing == 0 and llm.calls[-1].layout.chunk_spans == []
    hinted = rag.index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[KVChunkHints(fresh)])
    hinted.query(QUESTION)
    stats = llm.calls[-1].stats
    assert stats.chunks_computed == 2 and stats.reused_tokens == 0
    fresh.flush()
    hinted.query(QUESTION)
    assert llm.calls[-1].stats.chunks_reused == 2 and llm.calls[-1].stats.reused_tokens > 0
