"""The wire protocol, written once (ragblend.serving.protocol): strategies travel with all their
settings, content blocks and passages, one meaning of "cached tokens", any model name served.
Tiny random models behind a real server on 127.0.0.1."""

import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from ragblend import CacheBlend, Chunk, FullRecompute, FullReuse, LegoLink, QueryAware  # noqa: E402
from ragblend.serving.protocol import (  # noqa: E402
    ERROR_CODES,
    ApiError,
    ChatPrompt,
    TextLimit,
    blocks_of,
    check_prompt,
    passages,
    segments_of,
    strategy_from_json,
    strategy_to_json,
)
from tests.servers import RunningServer  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

# Every setting changed from its default.
CHANGED = [
    CacheBlend(ratio=0.4, check_layer=2, gradual=((3, 0.2),), deviation="key"),
    QueryAware(ratio=0.35, whole_chunks=True, query_tokens=4, cached_attention_scale=0.5, scale_in_decoding=True,
               neighbour_window=0.0625),
    QueryAware(ratio=0.35, sentence_runs=True),
    LegoLink(k=5),
    FullReuse(),
    FullRecompute(),
]


@pytest.mark.parametrize("strategy", CHANGED, ids=lambda s: s.name)
def test_a_strategy_crosses_the_wire_with_every_setting(strategy):
    sent = json.loads(json.dumps(strategy_to_json(strategy)))   # what a request carries
    assert strategy_from_json(sent) == strategy


def test_strategy_settings_are_checked():
    assert strategy_from_json({"strategy": "legolink", "legolink_k": 3}) == LegoLink(3)   # the integrations' name
    assert strategy_from_json({}) is None and strategy_to_json(None) == {"strategy": "default"}
    for bad, words in [({"strategy": "legolink", "check_layer": 2}, "not a setting of strategy 'legolink'"),
                       ({"strategy": "cacheblend", "check_layer": 0}, "check_layer"),
                       ({"strategy": "cacheblend", "gradual": 3}, "gradual"),
                       ({"strategy": "query_aware", "cached_attention_scale": 2}, "cached_attention_scale")]:
        with pytest.raises(ApiError, match=words) as caught:
            strategy_from_json(bad)
        assert caught.value.status == 400
    # the common case (a name and a ratio) names the field at fault too
    for bad, param in [({"strategy": "legolink", "ratio": 0.3}, "ragblend.ratio"),
                       ({"strategy": "query_aware", "ratio": 1.5}, "ragblend.ratio"),
                       ({"strategy": "no_such", "ratio": 0.3}, "ragblend.strategy"),
                       ({"strategy": "no_such"}, "ragblend.strategy")]:
        with pytest.raises(ApiError) as caught:
            strategy_from_json(bad)
        assert caught.value.status == 400 and caught.value.param == param, bad
    for bad, param, code in [({"strategy": 3}, "ragblend.strategy", "invalid_type"),
                             ({"strategy": "no_such", "k": 3}, "ragblend.strategy", "invalid_value"),
                             ({"strategy": "legolink", "check_layer": 2}, "ragblend.check_layer", "unknown_parameter"),
                             ({"strategy": "cacheblend", "gradual": 3}, "ragblend.gradual", "invalid_type"),
                             ({"strategy": "cacheblend", "check_layer": 0}, "ragblend", "invalid_value")]:
        with pytest.raises(ApiError) as caught:
            strategy_from_json(bad)
        assert (caught.value.param, caught.value.code) == (param, code), bad


def test_blocks_segments_and_passages():
    segments = [Chunk("A chunk."), "\n\n", "The question?"]
    blocks = blocks_of(segments)
    assert blocks[0] == {"type": "text", "text": "A chunk.", "cache_control": {"type": "ephemeral"}}
    assert segments_of(blocks) == segments
    # LangChain keeps unknown block fields under "extras"
    assert segments_of([{"type": "text", "text": "x", "extras": {"cache_control": {"type": "ephemeral"}}}]) == [Chunk("x")]
    text = "Use the context.\n\nFirst doc.\nStill first.\n\n\n  Second doc.  \n\nFirst doc.\nStill first."
    assert passages([text]) == ["Use the context.", "First doc.\nStill first.", "Second doc."]
    # Windows line endings: the same passages (a CRLF prompt was one passage, its documents never stored)
    assert passages([text.replace("\n", "\r\n")]) == ["Use the context.", "First doc.\r\nStill first.", "Second doc."]
    # The last passage of the question's turn (where RAG templates put the question) is not kept.
    assert passages(["Sys."], question=["Doc one.\n\nDoc two.", "\n\nQuestion: why?"]) == ["Sys.", "Doc one.",
                                                                                              "Doc two."]
    assert passages([], question=["Just a question?"]) == []
    assert passages([], question=["Doc one.\n\nQuestion: why?\n\nAnswer:"]) == ["Doc one."]   # a cue after it


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)   # a memory store of its own


def test_a_chat_keeps_every_passage_but_its_question(engine):
    chat = ChatPrompt.parse([{"role": "system", "content": "Use the context.\n\nFirst doc."},
                             {"role": "user", "content": "Earlier question?"},
                             {"role": "assistant", "content": "An answer."},
                             {"role": "user", "content": [{"type": "text", "text": "Second doc."},
                                                          {"type": "text", "text": "Question: which?"}]}],
                            TextLimit(engine))
    assert chat.passages() == ["Use the context.", "First doc.", "Earlier question?", "An answer.", "Second doc."]
    # where the engine keeps the earlier turns as history pieces, they are not stored as passages too
    assert chat.passages(history=False) == ["Use the context.", "First doc.", "Second doc."]



@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],   # empty: no template default
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Who?"}],   # in its place
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
])
def test_a_chat_is_laid_out_as_its_template_renders_its_messages_in_order(engine, messages):
    """What the model reads is what the client sent: apply_chat_template's rendering of the messages
    in their order (chat_ids), not the system messages gathered at the front."""
    layout = ChatPrompt.parse(messages, TextLimit(engine)).layout(engine, find_chunks=False)
    ordered = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    assert layout.token_ids == engine.prompts.chat_ids(ordered)


def test_a_bad_message_is_refused_naming_the_field_and_what_to_do(engine):
    for content, field in (("caf\udce9", "messages[1].content"),
                           ([{"type": "text", "text": "ok"}, {"type": "text", "text": "caf\udce9"}],
                            "messages[1].content[1].text")):
        with pytest.raises(ApiError, match="not valid Unicode") as caught:
            ChatPrompt.parse([{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
                             TextLimit(engine))
        assert caught.value.param == field and field in str(caught.value)
    with pytest.raises(ApiError, match="end `messages` with a") as caught:
        ChatPrompt.parse([{"role": "system", "content": "Be brief."}], TextLimit(engine))
    assert caught.value.param == "messages"


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("messages, param, code", [
    (None, "messages", "missing_required_parameter"),
    ("Hi", "messages", "invalid_type"),
    ([], "messages", "invalid_value"),
    ([USER] * 1025, "messages", "invalid_value"),
    (["Hi"], "messages[0]", "invalid_type"),
    ([{"content": "Hi"}], "messages[0].role", "missing_required_parameter"),
    ([{"role": "robot", "content": "Hi"}], "messages[0].role", "invalid_value"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[0]", "unsupported_parameter"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": []}], "messages[0].content", "invalid_value"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}],
     "messages[0].content[0]", "unsupported_parameter"),
    ([{"role": "user", "content": ["Hi"]}], "messages[0].content[0]", "invalid_type"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0]", "invalid_type"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "forever"}}]}],
     "messages[0].content[0].cache_control", "invalid_value"),
    ([{"role": "user", "content": "caf\udce9"}], "messages[0].content", "invalid_value"),
    ([{"role": "user", "content": "word " * 200_000}], "messages", "context_length_exceeded"),
    ([USER, {"role": "assistant", "content": "Hello."}], "messages", "invalid_value"),
])
def test_every_bad_message_has_an_openai_code_and_names_its_field(engine, messages, param, code):
    with pytest.raises(ApiError) as caught:
        ChatPrompt.parse(messages, TextLimit(engine))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)
    assert code in ERROR_CODES


@pytest.mark.parametrize("prompt, code", [
    (None, "missing_required_parameter"), (5, "invalid_type"), ("", "invalid_value"), ([], "invalid_value"),
    ([1, "x"], "invalid_type"), ([10**9], "invalid_value"), ("caf\udce9", "invalid_value"),
    ([1] * 100_000, "context_length_exceeded"),
])
def test_every_bad_completions_prompt_has_an_openai_code(engine, prompt, code):
    with pytest.raises(ApiError) as caught:
        check_prompt(prompt, TextLimit(engine), engine.entry_spec.vocab_size, engine.context_window)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "prompt", code)


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(engine) as running:
        yield running


DOCS = [" ".join(f"alpha{i} beta{i} gamma{i}" for i in range(12)), " ".join(f"delta{i} eps{i}" for i in range(14))]


@pytest.mark.parametrize("strategy", CHANGED[:3], ids=lambda s: s.name)
def test_a_remote_strategy_fuses_as_the_local_one(server, engine, strategy):
    """Same prompt, same strategy: the server's fusion (reached through RemoteEngine) equals the
    local engine's: the same stats and greedy answer; and the strategy the server decodes fuses
    to the same logits."""
    from ragblend.serving.client import RemoteEngine

    engine.precompute(DOCS)
    remote = RemoteEngine(server.url)
    prompt = remote.build_prompt([Chunk(d) for d in DOCS] + ["Which words come first?"], system="Be brief.")
    far = remote.generate(prompt, strategy=strategy, max_new_tokens=6, temperature=0)
    layout = engine.build_prompt(prompt.segments, system="Be brief.", separator="")
    near = engine.generate(layout, strategy=strategy, max_new_tokens=6, temperature=0)
    assert far.text == near.text
    for name in ("strategy", "ratio", "cached_attention_scale", "recomputed_tokens", "reused_tokens",
                 "cache_hit_tokens", "prompt_tokens"):
        assert getattr(far.stats, name) == getattr(near.stats, name), name
    decoded = strategy_from_json(json.loads(json.dumps(strategy_to_json(strategy))))
    assert torch.allclose(engine.prefill(layout, strategy=decoded).logits, engine.prefill(layout, strategy=strategy).logits)


def test_cached_tokens_mean_the_same_for_the_server_and_blend_chat_model(server, engine):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import HumanMessage

    from ragblend import BlendChatModel

    engine.precompute(DOCS)
    content = [{"type": "text", "text": d, "cache_control": {"type": "ephemeral"}} for d in DOCS]
    content.append({"type": "text", "text": "\n\nWhich words come first?"})
    local = BlendChatModel(engine=engine, max_tokens=2, strategy="cacheblend", ratio=0.3).invoke(
        [HumanMessage(content=content)])
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 2,
        "ragblend": {"strategy": "cacheblend", "ratio": 0.3}}).json()
    served = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert local.usage_metadata["input_token_details"]["cache_read"] == served > 0
    stats = response["ragblend"]
    assert served == stats["cache_hit_tokens"] > stats["reused_tokens"]   # the fusion recomputed some of them


def test_any_model_name_is_served_and_only_the_served_one_listed(server, engine):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
    assert reply.choices[0].message.content is not None and reply.model == engine.name
    listed = client.models.list().data
    # the served model alone: a name one client sent is no other client's business (trial 45)
    assert [m.id for m in listed] == [engine.name] and listed[0].model_extra["root"] == engine.name
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": 5, "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_a_stream_carries_usage_on_its_last_chunk(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:") and "[DONE]" not in line]
    assert events[-1]["choices"][0]["finish_reason"] and events[-1]["usage"]["completion_tokens"] >= 1
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream_options": {"include_usage": True}}) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:") and "[DONE]" not in line]
    assert sum("usage" in e for e in events) == 1 and events[-1]["choices"] == []   # counted once, the OpenAI way


def test_chat_openai_stream_shows_usage_without_stream_usage(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_tokens=3, max_retries=0, timeout=60)
    total = None
    for chunk in chat.stream("hi"):
        total = chunk if total is None else total + chunk
    usage = total.usage_metadata
    assert usage and usage["input_tokens"] >= 1
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # The random tiny model can end at once (its end token near-tied with others: a busy run's
    # kernel choice flipped it once); the usage must then say 0, else count what streamed.
    assert (usage["output_tokens"] >= 1) == bool(total.content)
    assert "cache_read" in usage["input_token_details"]


def test_one_log_line_per_request(server, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="ragblend.server")
    httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={"messages": []})
    lines = [r.getMessage() for r in caplog.records if r.name == "ragblend.server" and r.levelno == logging.INFO]
    assert len(lines) == 2, lines
    assert lines[0].startswith("/v1/chat/completions 200: ") and "cached" in lines[0] and "TTFT" in lines[0]
    assert lines[1].startswith("/v1/chat/completions 400: messages must be a non-empty list")
