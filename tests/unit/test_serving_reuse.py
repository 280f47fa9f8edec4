"""Reuse for any client, with no setup (ragblend.serving.reuse): clients that know nothing of
ragblend send their retrieved passages as plain text, the server stores their KV after the
answer, and the same question asked again reuses it. Real clients (LangChain's
create_retrieval_chain over ChatOpenAI, LlamaIndex's OpenAILike, the openai SDK) against a
real server on 127.0.0.1."""


import httpx
import pytest

pytest.importorskip("fastapi")

from tests.servers import RunningServer, wait_idle  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

# ---------------------------------------------------------------------------- bad input (tiny model)


def test_a_passage_that_cannot_be_stored_is_a_miss_not_a_failed_answer(tokenizer):
    from ragblend.core.store.tiers import MemoryStore

    engine = make_tiny_engine("llama", tokenizer, store=MemoryStore(max_bytes=1024))   # no entry fits
    running = RunningServer(engine)
    try:
        text = " ".join(f"word{i}" for i in range(60)) + "\n\n" + " ".join(f"other{i}" for i in range(60))
        body = {"messages": [{"role": "user", "content": text + "\n\nWhich word comes first?"}], "max_tokens": 2}
        for _ in range(2):
            response = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            wait_idle(running.url)
        keeper = running.server.config.app.state.keeper
        assert keeper.failed >= 2 and keeper.stored == 0
    finally:
        running.stop()


QUESTION = "Which of the two lists of words above comes first, the alpha words or the beta words, and why?"


def test_stored_passages_are_reused_and_storing_waits_for_requests(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    running = RunningServer(engine)
    try:
        docs = [" ".join(f"alpha{i}" for i in range(40)), " ".join(f"beta{i}" for i in range(40))]
        body = {"messages": [{"role": "system", "content": "Answer from the context."},
                             {"role": "user", "content": [{"type": "text", "text": docs[0]},
                                                          {"type": "text", "text": "\n\n" + docs[1]},
                                                          {"type": "text", "text": "\n\n" + QUESTION}]}],
                "max_tokens": 2}
        first = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).json()
        second = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).json()
        doc_tokens = sum(engine.count_tokens(d) for d in docs)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * doc_tokens
        assert all(engine.key_of(d) in engine.store for d in docs)
        assert engine.count_tokens(QUESTION) >= engine.min_chunk_tokens   # long enough to be kept, were it a document
        assert engine.key_of(QUESTION) not in engine.store   # the question's passage is not kept
    finally:
        running.stop()


def test_documents_with_windows_line_endings_are_stored_and_reused_in_another_order(tokenizer):
    """A prompt read from a CRLF file has "\r\n\r\n" between its documents, no "\n\n": each is
    still a passage of its own, so the same documents in another order find their KV."""
    engine = make_tiny_engine("llama", tokenizer)
    docs = [" ".join(f"alpha{i}" for i in range(40)), " ".join(f"beta{i}" for i in range(40))]
    with RunningServer(engine) as running:
        cached = []
        for order in (docs, docs[::-1]):
            content = "\r\n\r\n".join(["Context:", *order, QUESTION])
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
            cached.append(httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
                          .json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            wait_idle(running.url)
        assert cached[0] == 0
        assert cached[1] >= 0.8 * sum(engine.count_tokens(d) for d in docs)   # was 0: one passage, the question's


def metric_values(running) -> dict[str, float]:
    """The samples of the server's /metrics, by name with labels."""
    text = httpx.get(f"{running.url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_show_the_background_kv_fill_and_the_store_entries(tokenizer):
    from ragblend.core.store.tiers import MemoryStore

    docs = [" ".join(f"gamma{i}" for i in range(40)), " ".join(f"delta{i}" for i in range(40))]
    body = {"messages": [{"role": "user", "content": "\n\n".join(docs) + "\n\nWhat comes first?"}], "max_tokens": 2}
    for store, stored, failed in ((None, 2, 0), (MemoryStore(max_bytes=1024), 0, 2)):   # the second: no entry fits
        running = RunningServer(make_tiny_engine("llama", tokenizer, store=store))
        try:
            before = metric_values(running)
            assert before["ragblend_kv_fill_pending"] == before["ragblend_kv_fill_stored_total"] == 0
            assert before['ragblend_store_entries{tier="memory"}'] == 0
            assert httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
            wait_idle(running.url)
            after = metric_values(running)
            assert after["ragblend_kv_fill_pending"] == 0
            assert after["ragblend_kv_fill_stored_total"] == stored
            assert after["ragblend_kv_fill_failed_total"] == failed
            assert after['ragblend_store_entries{tier="memory"}'] == 2 * stored   # each chunk's own and lead entries
        finally:
            running.stop()


def test_a_passage_with_only_its_own_entry_stored_is_still_taken_for_its_lead_entry(tokenizer):
    from ragblend.serving.reuse import PassageKeeper

    engine = make_tiny_engine("llama", tokenizer)
    without_lead = make_tiny_engine("llama", tokenizer, lead_chunk_kv=False, store=engine.store)
    text = " ".join(f"gamma{i}" for i in range(40))
    keeper = PassageKeeper(engine, submit=lambda job: None, load=lambda: 1)   # busy: nothing runs by itself
    without_lead.precompute([text])   # a store filled before lead entries: the own entry only
    keeper.add([text])
    assert keeper._take() == [text]
    engine.precompute([text])
    keeper.add([text])
    assert keeper._take() == []   # both entries stored: nothing to do


def test_paragraphs_of_a_document_found_whole_are_not_stored_again(tokenizer):
    # A stored document of two paragraphs, sent with a new one: the new one is stored after the answer;
    # the stored one's paragraphs (passages of the split text) are not computed again one by one.
    engine = make_tiny_engine("llama", tokenizer)
    paragraphs = [" ".join(f"alpha{i}" for i in range(40)), " ".join(f"beta{i}" for i in range(40))]
    stored_doc, new_doc = "\n\n".join(paragraphs), " ".join(f"gamma{i}" for i in range(40))
    engine.precompute([stored_doc])
    running = RunningServer(engine)
    try:
        # "Context:" on the document's first line, as many RAG prompts put it: a label, not a passage of its own
        body = {"messages": [{"role": "system", "content": f"Context:\n{stored_doc}\n\n{new_doc}"},
                             {"role": "user", "content": QUESTION}], "max_tokens": 2}
        answer = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= engine.count_tokens(stored_doc) - 2
        wait_idle(running.url)
        assert all(engine.count_tokens(p) >= engine.min_chunk_tokens for p in paragraphs)   # else never stored anyway
        assert engine.key_of(new_doc) in engine.store
        assert not any(engine.key_of(p) in engine.store for p in paragraphs)
        assert running.server.config.app.state.keeper.stored == 1
    finally:
        running.stop()


def test_a_documents_last_paragraph_counts_as_found_where_its_last_token_merged_with_the_break():
    # Qwen2's and Llama 3's pre-tokenizers keep ".\n\n" as one token: in the prompt, the stored document's
    # last "." merges with the break after it, so the chunk is found a token short of its end. Its last
    # paragraph is still inside the chunk read, and is not stored again on its own.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ragblend.core.prompt import ChunkFinder, PromptLayout
    from ragblend.serving.protocol import passages
    from ragblend.serving.reuse import outside_found_chunks

    qwen2_split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(qwen2_split), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    paragraphs = [" ".join(f"alpha{i}" for i in range(30)) + ".", " ".join(f"beta{i}" for i in range(30)) + "."]
    document, new = "\n\n".join(paragraphs), " ".join(f"gamma{i}" for i in range(30)) + "."
    prompt = f"Context:\n\n{document}\n\n{new}\n\nWhich list comes first?"
    bpe.train_from_iterator([prompt] * 4, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    finder = ChunkFinder()
    finder.add(tokenizer(document)["input_ids"])
    ids = tokenizer(prompt)["input_ids"]
    (span,) = finder.find(ids)
    assert span.end - span.start == len(span.token_ids) - 1   # the "." before the break is the prompt's own
    texts = passages([prompt.rsplit("\n\n", 1)[0]])
    assert outside_found_chunks(texts, PromptLayout(ids, [span]), tokenizer.decode) == ["Context:", new]
