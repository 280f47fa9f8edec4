"""`ragblend serve` over the real default model, driven by clients nobody here wrote (the
official openai SDK, LangChain's ChatOpenAI, LlamaIndex's OpenAILike) and by ragblend's own
remote backends, on 127.0.0.1."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

from tests.servers import RunningServer, free_port, wait_idle  # noqa: E402

KEY = "test-key-1234"


@pytest.fixture(scope="module")
def server(smol_engine):
    with RunningServer(smol_engine) as running:
        yield running


@pytest.fixture(scope="module")
def chunks(bench_prompt, server, smol_engine):
    """Two ~250-token pieces of the benchmark's chunks, precomputed through the server."""
    texts = [t[:1200] for t in bench_prompt[0][:2]]
    response = httpx.post(f"{server.url}/v1/chunks", json={"texts": texts}, timeout=120)
    assert response.status_code == 200
    data = response.json()["data"]
    assert [d["tokens"] for d in data] == [smol_engine.count_tokens(t) for t in texts]
    assert all(d["stored"] and d["key"] == smol_engine.key_of(t) for d, t in zip(data, texts))
    return texts


def chunk_tokens(engine, texts) -> int:
    return sum(engine.count_tokens(t) for t in texts)


QUESTION = "Which ferry goes to Hallow Holm? Answer in a few words."


def openai_client(server, **kwargs):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=120,
                  **kwargs)


# ---------------------------------------------------------------------------- the openai SDK


def test_openai_sdk_chat_with_marked_chunks(server, chunks, smol_engine):
    client = openai_client(server)
    (model,) = [m.id for m in client.models.list()]
    content = []
    for c in chunks:   # each chunk its own marked block, exactly the text that was precomputed
        content += [{"type": "text", "text": c, "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "\n\n"}]
    content.append({"type": "text", "text": QUESTION})
    response = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Answer from the passages."},
                               {"role": "user", "content": content}],
        max_tokens=16, temperature=0)
    assert response.choices[0].message.content.strip()
    assert response.choices[0].finish_reason in ("stop", "length")
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.8 * chunk_tokens(smol_engine, chunks)
    stats = response.model_extra["ragblend"]
    assert stats["chunks_reused"] == 2 and stats["reused_tokens"] + stats["recomputed_tokens"] == stats["prompt_tokens"]


def test_openai_sdk_streams_chat_and_completions(server, chunks, smol_engine):
    client = openai_client(server)
    prompt = "\n\n".join(chunks) + "\n\n" + QUESTION   # plain text: the server finds the stored chunks
    stream = client.chat.completions.create(model=smol_engine.name, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            pieces.append(event.choices[0].delta.content)
        if event.usage:
            usage = event.usage
    whole = client.chat.completions.create(model=smol_engine.name, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content        # greedy: the same answer both ways
    assert usage.prompt_tokens_details.cached_tokens >= 0.8 * chunk_tokens(smol_engine, chunks)

    completion = client.completions.create(model=smol_engine.name, prompt=prompt + "\nAnswer:", max_tokens=8,
                                           temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0.8 * chunk_tokens(smol_engine, chunks)
    # The server stores the passages it had not seen after an answer (never the question's own,
    # the last one), so a later call may reuse more and answer otherwise: compare the streamed
    # answer with a plain one made once the store has settled.
    for _ in range(3):
        settled = client.completions.create(model=smol_engine.name, prompt=prompt + "\nAnswer:", max_tokens=8,
                                            temperature=0)
        if settled.usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens_details.cached_tokens:
            break
        completion = settled
    texts = [e.choices[0].text for e in client.completions.create(
        model=smol_engine.name, prompt=prompt + "\nAnswer:", max_tokens=8, temperature=0, stream=True) if e.choices]
    assert "".join(texts) == settled.choices[0].text


# ---------------------------------------------------------------------------- framework clients


def test_langchain_chat_openai(server, chunks, smol_engine):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=smol_engine.name, temperature=0,
                      max_tokens=12, max_retries=0, timeout=120)
    reply = chat.invoke([SystemMessage("Answer from the passages."),
                         HumanMessage("\n\n".join(chunks) + "\n\n" + QUESTION)])
    assert reply.content.strip()
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= 0.8 * chunk_tokens(smol_engine, chunks)


def test_llamaindex_openai_like(server, chunks, smol_engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=smol_engine.name, api_base=f"{server.url}/v1", api_key="unused", is_chat_model=True,
                     context_window=8192, max_tokens=12, temperature=0, max_retries=0, timeout=120)
    response = llm.chat([ChatMessage(role="user", content="\n\n".join(chunks) + "\n\n" + QUESTION)])
    assert response.message.content.strip()
    assert response.raw.usage.prompt_tokens_details.cached_tokens >= 0.8 * chunk_tokens(smol_engine, chunks)


# ---------------------------------------------------------------------------- ragblend's remote backends


def test_blend_llm_and_chat_model_against_the_server(server, bench_prompt, smol_engine):
    from langchain_core.messages import HumanMessage
    from llama_index.core.schema import TextNode

    from ragblend import BlendChatModel, BlendLLM, KVPrecompute
    from ragblend.serving.client import RemoteEngine

    texts = bench_prompt[0][3:5]                       # not yet on the server
    nodes = KVPrecompute(RemoteEngine(server.url))([TextNode(text=t) for t in texts])   # ingestion warms it
    assert all(n.metadata["ragblend_kv_key"] == smol_engine.key_of(t) for n, t in zip(nodes, texts))
    prompt = "\n\n".join(texts) + "\n\n" + "What is baked at the smokehouse? Answer briefly."

    llm = BlendLLM(base_url=server.url, max_new_tokens=8)
    answer = llm.complete(prompt)
    assert answer.text.strip() and llm.last_stats.cache_hit_tokens >= 0.8 * chunk_tokens(smol_engine, texts)
    assert llm.last_stats.strategy == "query_aware"      # the server's stats come back whole

    chat = BlendChatModel(base_url=server.url, max_tokens=8, strategy="cacheblend", ratio=0.5)
    marked = [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}} for t in texts]
    reply = chat.invoke([HumanMessage(content=marked + [{"type": "text", "text": "\n\nWhat is baked?"}])])
    stats = reply.response_metadata["ragblend"]
    assert stats["strategy"] == "cacheblend" and stats["ratio"] == 0.5 and stats["chunks_reused"] == 2


@pytest.mark.parametrize("local_tokenizer", [True, False], ids=["local tokenizer", "server /tokenize"])
def test_vllm_lmcache_backend_against_ragblend_serve(server, bench_prompt, smol_engine, local_tokenizer):
    """The LMCache wire format (token ids, " # # " separators, max_tokens=1 warm-up) against
    `ragblend serve`, which speaks it too."""
    from ragblend import Chunk
    from ragblend.serving.client import RemoteEngine

    remote = RemoteEngine(server.url, backend="vllm-lmcache",
                          tokenizer=smol_engine.tokenizer if local_tokenizer else None)
    texts = [t[:900] for t in bench_prompt[0][:2]] if local_tokenizer else [t[:700] for t in bench_prompt[0][4:6]]
    refs = remote.precompute(texts)
    assert [r.num_tokens for r in refs] == [smol_engine.count_tokens(t) for t in texts]
    answer = remote.generate(remote.build_prompt([Chunk(t) for t in texts] + [QUESTION],
                                                 system="Answer from the passages."), max_new_tokens=8)
    assert answer.stats.cache_hit_tokens >= 0.8 * sum(r.num_tokens for r in refs)
    assert answer.stats.chunks_reused == 2


def test_remote_errors_are_ragblend_errors(server):
    from ragblend import InvalidInputError
    from ragblend.serving.client import RemoteEngine, RemoteError

    with pytest.raises(RemoteError, match="Cannot reach"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}")
    assert RemoteEngine(server.url, model="gpt-4").name == "gpt-4"   # any name is served by the one model
    with pytest.raises(InvalidInputError, match="base_url"):
        RemoteEngine("localhost:8000")


# ---------------------------------------------------------------------------- bad input, limits, security


def post(server, path, body=None, raw=None, headers=None, timeout=60):
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("path, body, status, words, param, code", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON", None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object", None, "invalid_type"),
    ("/v1/chat/completions", {"model": ["gpt-4"], "messages": [{"role": "user", "content": "hi"}]}, 400, "model",
     "model", "invalid_type"),
    ("/v1/chat/completions", {"model": "m"}, 400, "non-empty list", "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "non-empty list", "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "context window",
     "messages", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}, 400, "text blocks only",
     "messages[0].content[0]", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
     "temperature", "temperature", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, 400, "top_p", "top_p",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ragblend": {"strategy": "magic"}},
     400, "strategy", "ragblend.strategy", "invalid_value"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt must be", "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": [1, 2, "x"]}, 400, "token ids", "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "token ids must be in", "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "max_completion_tokens": 8}, 400, "differ",
     "max_tokens", "invalid_value"),
    ("/v1/chunks", {"texts": "one text"}, 400, "texts", "texts", "invalid_type"),
    ("/tokenize", {"add_special_tokens": True}, 400, "prompt must be", "prompt", "missing_required_parameter"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, path, body, status, words, param, code):
    response = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and error["type"] and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    assert error["code"] == code   # never null: a client tells failures apart by code
    ok = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_sdk_sees_each_400s_code_and_param(server, smol_engine):
    from openai import BadRequestError

    client = openai_client(server)
    user = [{"role": "user", "content": "Say hi."}]
    for kwargs, param, code in [
            (dict(messages=[]), "messages", "invalid_value"),
            (dict(messages=user, temperature=3), "temperature", "invalid_value"),
            (dict(messages=user, n=2), "n", "unsupported_parameter"),
            (dict(messages=user, logprobs=True), "logprobs", "unsupported_parameter"),
            (dict(messages=user, max_tokens=4, max_completion_tokens=8), "max_tokens", "invalid_value")]:
        with pytest.raises(BadRequestError) as caught:
            client.chat.completions.create(model=smol_engine.name, **kwargs)
        assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, param, code), kwargs
    assert "send one of them" in caught.value.message   # says which to send


def test_max_tokens_and_max_completion_tokens_alike_or_alone(server, smol_engine):
    """Both sent with one value is fine; sent alone, either is read (max_tokens is the legacy
    completions' name, max_completion_tokens the chat API's newer one)."""
    client = openai_client(server)
    user = [{"role": "user", "content": "Count from one to twenty: one, two,"}]
    both = client.chat.completions.create(model=smol_engine.name, messages=user, max_tokens=3,
                                          max_completion_tokens=3, temperature=0)
    newer = client.chat.completions.create(model=smol_engine.name, messages=user, max_completion_tokens=3,
                                           temperature=0)
    older = client.chat.completions.create(model=smol_engine.name, messages=user, max_tokens=3, temperature=0)
    assert both.choices[0].message.content == newer.choices[0].message.content == older.choices[0].message.content
    assert both.usage.completion_tokens == newer.usage.completion_tokens == older.usage.completion_tokens <= 3
    legacy = client.completions.create(model=smol_engine.name, prompt="One, two, three,", max_tokens=3, temperature=0)
    assert 1 <= legacy.usage.completion_tokens <= 3


def test_separator_prompt_with_an_empty_segment(server, smol_engine):
    separator = smol_engine.tokenize(" # # ")
    words = smol_engine.tokenize("Some system text")
    response = post(server, "/v1/completions", {"prompt": words + separator + separator + words, "max_tokens": 2})
    assert response.status_code == 400 and "empty segment" in response.json()["error"]["message"]


def test_an_unknown_path_gets_an_openai_error(server):
    response = httpx.get(f"{server.url}/v1/engines")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_a_ten_megabyte_body_is_refused(server):
    response = post(server, "/v1/chat/completions", raw=b'{"messages": "' + b"x" * (10 << 20) + b'"}')
    assert response.status_code == 413 and response.json()["error"]["message"]


def test_api_key_guards_everything_but_health(smol_engine):
    guarded = RunningServer(smol_engine, api_key=KEY)
    try:
        assert httpx.get(f"{guarded.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.get(f"{guarded.url}/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{guarded.url}/metrics").status_code == 401
        client = openai_client(guarded, api_key=KEY)
        assert [m.id for m in client.models.list()] == [smol_engine.name]
        from openai import AuthenticationError

        with pytest.raises(AuthenticationError):
            openai_client(guarded, api_key="nope").models.list()
    finally:
        guarded.stop()


def test_a_full_queue_answers_429_and_loses_nothing(smol_engine):
    busy = RunningServer(smol_engine, queue_size=1, max_batch=1)   # one answer at a time: the queue fills
    body = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24, "temperature": 0}
    results = []

    def call(stream: bool):
        with httpx.stream("POST", f"{busy.url}/v1/chat/completions", json={**body, "stream": stream},
                          timeout=120) as response:
            response.read()
            results.append(response)

    try:
        threads = [threading.Thread(target=call, args=(i % 2 == 1,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
        statuses = sorted(r.status_code for r in results)
        assert len(results) == 6 and set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
        for refused in (r for r in results if r.status_code == 429):   # streaming or not: a real 429
            assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "rate_limit_error"
        for answered in (r for r in results if r.status_code == 200):   # and every accepted one answered
            assert '"content"' in answered.text and ("data: [DONE]" in answered.text or answered.json()["choices"])
    finally:
        busy.stop()


def test_a_client_that_disconnects_stops_its_generation(server):
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if '"content"' in line and '"content": ""' not in line:
                break   # the first token arrived; hang up
    wait_idle(server.url, within_s=20)   # the generation stopped: 400 tokens would take far longer on this CPU


def test_metrics_and_health(server, chunks):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ragblend_requests_total", "ragblend_errors_total", "ragblend_queue_depth",
                 "ragblend_ttft_seconds_bucket", "ragblend_reused_tokens_total", "ragblend_recomputed_tokens_total",
                 'ragblend_store_bytes{tier="memory"}', 'ragblend_store_bytes{tier="disk"}'):
        assert name in text
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_non_loopback_bind_without_a_key_warns(smol_engine, caplog, monkeypatch):
    import uvicorn

    from ragblend.serving.app import is_loopback, serve

    bound = []
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **_: bound.append(host))  # never bind 0.0.0.0 here
    serve(smol_engine, host="0.0.0.0", port=free_port())
    assert bound == ["0.0.0.0"] and "without an API key" in caplog.text
    caplog.clear()
    serve(smol_engine, host="0.0.0.0", port=free_port(), api_key=KEY)
    assert "without an API key" not in caplog.text
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


def test_against_a_real_vllm_lmcache_server(bench_prompt):
    """Runs when RAGBLEND_VLLM_URL names a vLLM server with LMCache blending (see
    docs/scale-out.md); this project's CI has no GPU, so it skips there."""
    import os

    from ragblend import Chunk
    from ragblend.serving.client import RemoteEngine

    url = os.environ.get("RAGBLEND_VLLM_URL")
    if not url:
        pytest.skip("set RAGBLEND_VLLM_URL to a vLLM + LMCache server to run this")
    remote = RemoteEngine(url, backend="vllm-lmcache", api_key=os.environ.get("RAGBLEND_VLLM_API_KEY"))
    texts = bench_prompt[0][:3]
    refs = remote.precompute(texts)
    answer = remote.generate(remote.build_prompt([Chunk(t) for t in texts] + [QUESTION]), max_new_tokens=16,
                             temperature=0)
    assert answer.text.strip() and answer.stats.prompt_tokens > sum(r.num_tokens for r in refs)


def test_langchain_ingestion_warms_the_server(server, bench_prompt, smol_engine):
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from ragblend.serving.client import RemoteEngine
    from ragblend.vectorstore_hooks.langchain import KVPrecomputeVectorStore

    store = KVPrecomputeVectorStore(InMemoryVectorStore(DeterministicFakeEmbedding(size=16)), RemoteEngine(server.url))
    text = bench_prompt[0][5][:800]
    store.add_documents([Document(page_content=text), Document(page_content="Too short.")])
    stored = {d["text"]: d["metadata"].get("ragblend_kv_key") for d in store.inner.store.values()}
    assert stored[text] == smol_engine.key_of(text) and stored["Too short."] is None   # under 16 tokens: no KV
    assert smol_engine.key_of(text) in smol_engine.store


def test_timeouts_and_the_window_cap(smol_engine):
    from ragblend.serving.requests import sampling

    assert sampling({"max_tokens": 10**6}, smol_engine, 8000).max_new_tokens == smol_engine.context_window - 8000
    assert sampling({}, smol_engine, 100).max_new_tokens == smol_engine.context_window - 100
    slow = RunningServer(smol_engine, request_timeout_s=0.5)
    try:
        response = httpx.post(f"{slow.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 300})
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        wait_idle(slow.url, within_s=20)   # the timed-out generation stops too
    finally:
        slow.stop()
