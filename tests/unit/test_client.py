"""RemoteEngine (ragblend.serving.client): the engine's interface over HTTP, against a real
`ragblend serve` app over a tiny model on 127.0.0.1. The real default model's runs (the OpenAI
clients, BlendLLM and BlendChatModel through a server, the vLLM + LMCache backend) are in
tests/integration/test_server.py; remote fusion equal to local is in test_serving_protocol.py."""

import hashlib
import json

import pytest

pytest.importorskip("fastapi")

from ragblend import Chunk  # noqa: E402
from ragblend.core.errors import InvalidInputError, PromptTooLongError  # noqa: E402
from ragblend.serving.client import RemoteEngine, RemoteError  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

from ..conftest import PASSAGES, make_tiny_engine  # noqa: E402

KEY = "client-test-key"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(engine, api_key=KEY, model_name="tiny") as running:
        yield running


def test_bad_settings_are_clear_errors_before_any_request():
    with pytest.raises(InvalidInputError, match="backend must be one of"):
        RemoteEngine("http://127.0.0.1:1", backend="openai")
    with pytest.raises(InvalidInputError, match="base_url must be an http"):
        RemoteEngine("127.0.0.1:8000")
    with pytest.raises(InvalidInputError, match="api_key must be a str"):
        RemoteEngine("http://127.0.0.1:1", api_key=1234)


def test_a_server_that_does_not_answer_is_a_remote_error():
    with pytest.raises(RemoteError, match="Is the server running"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}")


def test_the_key_is_sent_and_a_wrong_one_is_a_remote_error(server):
    from pydantic import SecretStr

    with pytest.raises(RemoteError, match="401"):
        RemoteEngine(server.url, api_key="wrong")
    # a pydantic SecretStr (what LangChain holds) is unwrapped, not sent as "**********"
    remote = RemoteEngine(server.url + "/v1/", api_key=SecretStr(KEY))
    assert remote.base_url == server.url and remote.name == "tiny"
    assert RemoteEngine(server.url, api_key=KEY, model="any-name").name == "any-name"


def test_tokens_come_from_the_server_or_the_local_tokenizer_alike(server, engine, tokenizer):
    remote, local = RemoteEngine(server.url, api_key=KEY), RemoteEngine(server.url, api_key=KEY, tokenizer=tokenizer)
    for text in PASSAGES:
        assert remote.tokenize(text) == local.tokenize(text) == engine.tokenize(text)
        assert remote.count_tokens(text) == len(engine.tokenize(text))


def test_precompute_stores_on_the_server_and_a_fused_answer_reuses_it(server, engine):
    remote = RemoteEngine(server.url, api_key=KEY)
    refs = remote.precompute(PASSAGES[:2] + ["hi"], skip_unusable=True)
    assert refs[2] is None   # too short to find: skipped, as BlendEngine.precompute does
    for ref, text in zip(refs[:2], PASSAGES):
        assert ref.key == engine.key_of(text) and ref.num_tokens == engine.count_tokens(text)
        assert ref.key in engine.store
    out = remote.generate([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), "Who ran the ferry?"], max_new_tokens=4)
    assert out.stats.reused_tokens > 0 and out.stats.finish_reason == out.finish_reason == "length"
    assert out.stats.generated_tokens == 4 and remote.last_stats is out.stats
    assert "".join(remote.stream([Chunk(PASSAGES[0]), "Who ran the ferry?"], max_new_tokens=4)) == (
        engine.generate([Chunk(PASSAGES[0]), "Who ran the ferry?"], max_new_tokens=4).text)


def test_a_prompt_past_the_window_is_a_prompt_too_long_error(server):
    remote = RemoteEngine(server.url, api_key=KEY)
    with pytest.raises(PromptTooLongError):
        remote.generate([" ".join(f"w{i}" for i in range(4000))], max_new_tokens=2)


def test_the_lmcache_backend_keys_chunks_by_their_ids_and_answers_over_completions(server, tokenizer):
    """The vLLM + LMCache backend: a chunk's key is the hash of its own token ids, and answers go
    to /v1/completions as token ids (ragblend serve takes the same requests)."""
    remote = RemoteEngine(server.url, api_key=KEY, backend="vllm-lmcache", tokenizer=tokenizer)
    ids = tokenizer(PASSAGES[0], add_special_tokens=False)["input_ids"]
    (ref,) = remote.precompute([PASSAGES[0]])
    assert ref.key == hashlib.sha256(json.dumps(ids).encode()).hexdigest() and ref.num_tokens == len(ids)
    out = remote.generate([Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), "Who ran the ferry?"], max_new_tokens=3)
    assert out.stats.generated_tokens == 3 and out.finish_reason == "length"


def test_a_tool_result_mid_chat_goes_to_the_server_from_a_remote_engine(server):
    """A remote engine has no local template: a tool result in mid-chat is the server's to lay out or
    refuse (review: the integrations' check read ``engine.prompts``, which a RemoteEngine lacks)."""
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from ragblend import BlendChatModel

    remote = RemoteEngine(server.url, api_key=KEY)
    chat = [HumanMessage("Weather?"), AIMessage("I asked the tool."), ToolMessage("Sunny.", tool_call_id="1"),
            HumanMessage("Ferry?")]
    try:
        BlendChatModel(engine=remote, max_tokens=1).invoke(chat)
    except (InvalidInputError, RemoteError) as refused:   # the tiny model's layout has no tool role
        assert "tool" in str(refused)
