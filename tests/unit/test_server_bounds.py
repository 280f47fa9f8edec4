"""Bounds a client cannot push past (issue 58, items 5 and 7b): a request's head is bounded in
bytes and fields before the API key is checked, and a text that cannot fit the context window is
refused after tokenizing a bounded start of it, by every server route and the engine's own entry
points. Real servers on 127.0.0.1 over tiny random models; the engine's own tokenizer."""

import contextlib
import json
import re
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ragblend import Chunk  # noqa: E402
from ragblend.core.errors import PromptTooLongError  # noqa: E402
from ragblend.core.prompt import PromptBuilder  # noqa: E402
from ragblend.serving.app import MAX_HEADER_BYTES, MAX_HEADERS, create_app  # noqa: E402
from tests.servers import HealthPoller, RunningServer, free_port, header_flood, wait_until_up  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

KEY = "bounds-test-key"
TABLE = "|---|---:|---:|---:|---:|---:|"   # one token of the tests' tokenizer: 30 characters
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("qwen2", tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    with RunningServer(engine, api_key=KEY) as running:
        yield running


def cjk(chars: int) -> str:
    """CJK text without spaces: one pre-token, several byte tokens a character for this tokenizer."""
    return "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(chars))


def timed(fn):
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as err:   # the refusal is the result
        result = err
    return result, time.perf_counter() - t0


# ---------------------------------------------------------------------------- the request head


def test_a_flood_of_header_bytes_is_cut_off_before_the_key_and_health_stays_up(server):
    with HealthPoller(server.url, interval_s=0.01) as poller:
        flood = header_flood(server.url, 64 << 20, time_limit_s=30)
        time.sleep(0.2)
    assert flood["sent"] >= 64 << 20   # every byte was tried, over as many connections as it took
    # every connection was answered 400 and closed at the head's bound (plus what the kernel buffered)
    assert set(flood["statuses"]) <= {"HTTP/1.1 400 Bad Request", "reset", "closed"}
    assert flood["statuses"].get("HTTP/1.1 400 Bad Request", 0) >= 1 and flood["connections"] >= 4
    assert poller.failures == 0 and len(poller.latencies) >= 5
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path, auth", [("/health", {}), ("/v1/models", {}), ("/v1/models", AUTH)],
                         ids=["health", "no key", "with key"])
def test_too_many_header_fields_get_a_431_before_the_key(server, path, auth):
    many = {f"x-field-{i}": "v" for i in range(MAX_HEADERS + 1)}
    response = httpx.get(f"{server.url}{path}", headers={**many, **auth})
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    few = {f"x-field-{i}": "v" for i in range(MAX_HEADERS - 10)}
    assert httpx.get(f"{server.url}{path}", headers={**few, **auth}).status_code == (401 if path != "/health"
                                                                                     and not auth else 200)


@contextlib.contextmanager
def httptools_server(engine):
    """The app under uvicorn's default parser (httptools), which takes a head of any size: there
    the Guard alone bounds it. Yields the server's URL."""
    import uvicorn

    port = free_port()
    running = uvicorn.Server(uvicorn.Config(create_app(engine, api_key=KEY), host="127.0.0.1", port=port,
                                            log_level="warning"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    try:
        wait_until_up(lambda: running.started, "the server", timeout_s=30, interval_s=0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        running.should_exit = True
        thread.join(timeout=30)


def raw_request(url: str, head: bytes) -> tuple[str, bytes]:
    """Send ``head`` (a whole request head) in one write; the response's status code and body,
    or "reset" (the server closed the connection with bytes of it unread)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        response = b""
        try:
            conn.sendall(head)
            while not _complete(response) and (piece := conn.recv(65536)):
                response += piece
        except ConnectionResetError:
            return "reset", b""
    status, _, rest = response.partition(b"\r\n")
    return status.split()[1].decode(), rest.partition(b"\r\n\r\n")[2]


def _complete(response: bytes) -> bool:
    """Whether ``response`` holds a whole response with a Content-Length (otherwise read to the close)."""
    head, blank, body = response.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    return bool(blank) and length is not None and len(body) >= int(length.group(1))


def test_under_another_http_parser_the_guard_bounds_the_head_bytes(engine):
    """uvicorn's default parser (httptools) takes any head; the Guard still refuses a big one."""
    with httptools_server(engine) as url:
        big = {"x-big": "a" * (MAX_HEADER_BYTES + 1)}
        response = httpx.get(f"{url}/v1/models", headers=big)
        assert response.status_code == 431   # not 401: the key is not even looked at


def test_the_guard_counts_the_target_and_says_which_bound_a_head_broke(engine):
    """The Guard's byte bound is on the target (path and query) and the header fields' names and
    values together: exactly MAX_HEADER_BYTES passes on to the key check (401), one more is a
    431 that gives the bytes; too many fields is a 431 that gives the count of fields."""
    path, host = b"/v1/models", b"host: x\r\n"   # the header field counts 4 + 1 bytes
    with httptools_server(engine) as url:
        for extra, status in ((0, "401"), (1, "431")):
            query = b"q=" + b"a" * (MAX_HEADER_BYTES - len(path) - 5 - 2 + extra)
            got, body = raw_request(url, b"GET " + path + b"?" + query + b" HTTP/1.1\r\n" + host + b"\r\n")
            assert got == status, body[:200]
        message = json.loads(body)["error"]["message"]
        assert f"hold {MAX_HEADER_BYTES + 1} bytes ({MAX_HEADER_BYTES + 1 - 5} in the target)" in message
        assert "header fields;" not in message
        many = b"".join(b"x-f%d: v\r\n" % i for i in range(MAX_HEADERS))   # with host: one too many
        got, body = raw_request(url, b"GET /v1/models HTTP/1.1\r\n" + host + many + b"\r\n")
        assert got == "431"
        message = json.loads(body)["error"]["message"]
        assert f"has {MAX_HEADERS + 1} header fields; at most {MAX_HEADERS} are accepted" in message
        assert "bytes" not in message


def test_a_long_url_sent_in_one_write_is_refused_by_serve(server):
    """h11 bounds only a head still arriving: a 60 KB URL that comes in one write completes the
    head at once (it was answered 200). The Guard counts the target, so it is refused, with the
    key or without."""
    for auth in (b"", f"authorization: Bearer {KEY}\r\n".encode()):
        got, _ = raw_request(server.url, b"GET /v1/models?" + b"q" * 60000 + b" HTTP/1.1\r\nhost: x\r\n"
                             + auth + b"\r\n")
        # the Guard's 431; h11's 400 and close if the head came in pieces (was: 200)
        assert got in ("431", "400", "reset")
    assert httpx.get(f"{server.url}/v1/models", params={"q": "a" * 1000}, headers=AUTH).status_code == 200


def test_ragblend_serve_runs_the_bounded_parser():
    from ragblend.serving.app import uvicorn_config

    config = uvicorn_config(None, "127.0.0.1", 1)
    assert config.http == "h11" and config.h11_max_incomplete_event_size == MAX_HEADER_BYTES


# ---------------------------------------------------------------------------- tokenizing in bounds


@settings(max_examples=60, deadline=5_000, derandomize=True)
@given(text=st.one_of(st.text(max_size=400), st.text(alphabet="ab \u4e00\u4e01.", max_size=400),
                      st.builds(lambda w, n: (w + " ") * n, st.text(min_size=1, max_size=12), st.integers(0, 60)),
                      st.builds(lambda n, tail: TABLE * n + tail, st.integers(0, 40), st.text(max_size=5))),
       max_tokens=st.integers(0, 80))
def test_tokenize_within_is_tokenize_or_none(tokenizer, text, max_tokens):
    builder = PromptBuilder(tokenizer)
    ids = builder.tokenize(text)
    assert builder.tokenize_within(text, max_tokens) == (ids if len(ids) <= max_tokens else None)


def test_a_long_text_is_refused_after_tokenizing_its_start_only(engine):
    text = cjk(120_000)   # under the character bound of a 2,048-token window, ~360k tokens
    assert len(text) <= engine.context_window * engine.prompts.max_chars_per_token
    whole, whole_s = timed(lambda: engine.tokenize(text))
    assert len(whole) > engine.context_window
    refused, refused_s = timed(lambda: engine.prompts.tokenize_within(text, engine.context_window))
    assert refused is None and refused_s < whole_s / 5, (refused_s, whole_s)
    for call in (lambda: engine.generate([text], max_new_tokens=1), lambda: engine.prefill([Chunk(text), "Q?"]),
                 lambda: engine.find_chunks(text), lambda: engine.generate(["Q?"], system=text, max_new_tokens=1),
                 lambda: engine.build_prompt(["Q?"], history=[("user", text), ("assistant", "A.")]),
                 lambda: engine.precompute([text])):
        err, seconds = timed(call)
        assert isinstance(err, PromptTooLongError) and seconds < whole_s / 3, (err, seconds, whole_s)
    assert engine.precompute([text, "A short passage about the ferry to Hallow Holm."], skip_unusable=True)[0] is None


def test_a_prompt_that_fits_is_tokenized_as_before(engine):
    table = TABLE * 400   # 12,000 characters, 400 tokens: longer than the first prefix, yet it fits
    builder = PromptBuilder(engine.tokenizer)     # no window: no bounds
    for segments in ([table], [Chunk(table), "Q?"], ["Q?"], [Chunk(" ".join(["lighthouse"] * 300)), table]):
        layout = engine.build_prompt(segments, system="Be brief.")
        assert layout == builder.build(segments, "Be brief.") and len(layout.token_ids) < engine.context_window
    assert len(engine.tokenize(table)) == 400


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": cjk(100_000)}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": cjk(100_000)},
                                           {"role": "user", "content": "Q?"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": cjk(100_000), "cache_control": {"type": "ephemeral"}}]}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": cjk(100_000), "max_tokens": 1}),
    ("/tokenize", {"prompt": cjk(100_000)}),
    ("/tokenize", {"messages": [{"role": "user", "content": cjk(100_000)}]}),
], ids=["chat", "system", "marked chunk", "completions", "tokenize", "tokenize messages"])
def test_every_route_refuses_an_overflowing_text_without_tokenizing_it_whole(server, engine, path, body):
    response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert "context window" in response.json()["error"]["message"]


def test_chunks_route_refuses_or_skips_an_overflowing_text(server):
    texts = [cjk(100_000), "A short passage about the ferry to Hallow Holm and its timetable."]
    refused = httpx.post(f"{server.url}/v1/chunks", json={"texts": texts}, headers=AUTH, timeout=60)
    assert refused.status_code == 400 and "Split it" in refused.json()["error"]["message"]   # not the char bound
    skipped = httpx.post(f"{server.url}/v1/chunks", json={"texts": texts, "skip_unusable": True}, headers=AUTH,
                         timeout=60)
    assert skipped.status_code == 200 and [d["stored"] for d in skipped.json()["data"]] == [False, True]


def test_a_refusal_gives_the_tokens_where_the_text_was_tokenized_whole(server, engine):
    """A text short enough to be tokenized whole (under the first prefix) is refused with its
    token count; a long one, refused by its start, with "more than" the bound."""
    window = engine.context_window
    words = "word " * (window // 2 + 50)   # ~window + 100 tokens in 2.5 characters a token
    n = len(engine.tokenize(words))
    unbounded = PromptBuilder(engine.tokenizer, separator=engine.prompts.separator,
                              use_chat_template=engine.prompts.use_chat_template)
    assert n > window and len(words) < 4 * (window - len(engine.sink_ids))
    cases = [("/tokenize", {"prompt": words}, f"prompt has {n} tokens, more than the model's context window"),
             ("/v1/completions", {"prompt": words, "max_tokens": 1}, f"The prompt has {n} tokens and fills"),
             ("/v1/chunks", {"texts": [words]}, f"chunk 0 has {n} tokens; at most"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 1},
              f"The prompt has {len(unbounded.build([words]).token_ids)} tokens; the model's context window"),
             ("/tokenize", {"prompt": cjk(100_000)}, f"prompt has more than {window} tokens"),
             ("/v1/chunks", {"texts": [cjk(100_000)]}, f"chunk 0 has more than {window - len(engine.sink_ids)} tokens")]
    for path, body, message in cases:
        response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert message in response.json()["error"]["message"], (path, response.json())
