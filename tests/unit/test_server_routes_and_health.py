"""What no route answers (a path the server lacks: 404; a method its route lacks: 405) has the
OpenAI error shape with a code and says what to send instead; /health's queue_depth counts the
clients' requests only, the passages the server stores after its answers apart (background_jobs).
Tiny models behind a real server on 127.0.0.1, asked with httpx and the openai SDK."""

import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.servers import RunningServer, wait_idle  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

ENDPOINTS = ("GET /health, GET /v1/models, GET /metrics, POST /v1/chat/completions, POST /v1/completions, "
             "POST /v1/chunks, POST /tokenize")


@pytest.fixture(scope="module")
def server(tokenizer):
    with RunningServer(make_tiny_engine("llama", tokenizer)) as running:
        yield running


def error_of(response: httpx.Response) -> dict:
    (error,) = response.json().values()
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    return error


def test_an_unknown_path_is_a_404_listing_the_endpoints(server):
    response = httpx.get(f"{server.url}/v1/engines")
    error = error_of(response)
    assert response.status_code == 404 and error["code"] == "not_found" and error["type"] == "invalid_request_error"
    assert error["message"] == f"No endpoint at /v1/engines. This server has: {ENDPOINTS}."


def test_a_base_url_without_v1_is_told_to_add_it(server):
    """The openai SDK with base_url missing /v1 posts to /chat/completions: a NotFoundError whose
    code and message say what to fix."""
    import openai

    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="ragblend", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert err.value.status_code == 404 and err.value.code == "not_found"
    assert "base_url ends in /v1: did you mean /v1/chat/completions?" in err.value.message


def test_a_route_outside_v1_asked_under_v1_is_told_where_it_is(server):
    """/tokenize (vLLM's, outside /v1) asked through a client whose base_url ends in /v1."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as err:
        client.post("/tokenize", body={"prompt": "Hi"}, cast_to=dict)
    assert err.value.code == "not_found" and "/tokenize has no /v1 prefix" in err.value.message


def test_a_wrong_method_is_a_405_naming_the_one_to_send(server):
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
                                  ("DELETE", "/v1/models", "GET")):
        response = httpx.request(method, f"{server.url}{path}")
        error = error_of(response)
        assert response.status_code == 405 and response.headers["allow"] == allowed
        assert error["code"] == "method_not_allowed"
        assert error["message"] == f"{path} does not take {method}; send {allowed}."


def test_a_path_quoted_in_a_404_cannot_start_a_log_line(server, caplog):
    for sent, shown in (("/v1/x%0aINFO%20forged", r"'/v1/x\nINFO forged'"), ("/v1/%1b[2J", r"'/v1/\x1b[2J'")):
        with caplog.at_level("INFO", logger="ragblend.server"):
            response = httpx.get(f"{server.url}{sent}")
        message = error_of(response)["message"]
        assert response.status_code == 404 and f"No endpoint at {shown}." in message
    logged = [record.getMessage() for record in caplog.records if "other 404" in record.getMessage()]
    assert len(logged) == 2 and not any(c in line for line in logged for c in "\n\x1b")


# ---------------------------------------------------------------------------- queue_depth


def test_queue_depth_counts_requests_not_the_passages_stored_after_them(tokenizer, monkeypatch):
    """After an answer the server stores its passages' KV as a job of its worker. That job is
    background_jobs on /health and /metrics, never queue_depth; a request waiting behind it is."""
    engine = make_tiny_engine("llama", tokenizer)
    storing, go_on = threading.Event(), threading.Event()
    precompute = engine.precompute

    def held_precompute(*args, **kwargs):   # the storing job waits here, running, until the test has looked
        storing.set()
        assert go_on.wait(60)
        return precompute(*args, **kwargs)

    monkeypatch.setattr(engine, "precompute", held_precompute)
    documents = [" ".join(f"alpha{i}" for i in range(40)), " ".join(f"beta{i}" for i in range(40))]
    body = {"messages": [{"role": "user", "content": "\n\n".join(documents) + "\n\nWhich list comes first?"}],
            "max_tokens": 2}
    with RunningServer(engine) as running:
        def health() -> dict:
            return httpx.get(f"{running.url}/health", timeout=10).json()

        def gauges() -> tuple[str, str]:
            lines = httpx.get(f"{running.url}/metrics", timeout=10).text.splitlines()
            return tuple(next(line for line in lines if line.startswith(f"{name} "))
                         for name in ("ragblend_queue_depth", "ragblend_background_jobs", "ragblend_kv_fill_pending"))

        assert httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert storing.wait(30)   # the answer is back and its passages are being stored
        assert health()["queue_depth"] == 0 and health()["background_jobs"] == 1
        # the passages being stored are still pending: a gauge at 0 means stored (it read 0 here)
        assert gauges() == ("ragblend_queue_depth 0", "ragblend_background_jobs 1", "ragblend_kv_fill_pending 2")

        other = dict(body, messages=[{"role": "user", "content": "Say one word."}])
        answered: list[int] = []
        asking = threading.Thread(target=lambda: answered.append(
            httpx.post(f"{running.url}/v1/chat/completions", json=other, timeout=60).status_code))
        asking.start()   # waits in the queue behind the held storing job: a request, so counted
        deadline = time.monotonic() + 30
        while health()["queue_depth"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        now = health()
        assert (now["queue_depth"], now["background_jobs"]) == (1, 1)
        go_on.set()
        asking.join(60)
        assert answered == [200]
        wait_idle(running.url)
        assert health()["queue_depth"] == health()["background_jobs"] == 0
        assert running.server.config.app.state.keeper.stored == 2   # both documents, stored after all
        assert gauges()[2] == "ragblend_kv_fill_pending 0"


def test_background_jobs_count_a_conversations_pieces_being_stored(tokenizer, monkeypatch):
    """A chat's turn is kept as history pieces by the engine's own background thread, outside the
    worker's queue: /health's background_jobs counts it until it is stored, and a test (or an operator)
    waiting for an idle server waits for it too."""
    engine = make_tiny_engine("qwen2", tokenizer, history_pieces=True)   # a chat template: a turn to keep
    storing, go_on = threading.Event(), threading.Event()
    store_pieces = engine.runner.history.store_pieces

    def held_store_pieces(*args, **kwargs):   # the pieces' storing waits here, running, until the test has looked
        storing.set()
        assert go_on.wait(60)
        return store_pieces(*args, **kwargs)

    monkeypatch.setattr(engine.runner.history, "store_pieces", held_store_pieces)
    document = " ".join(f"river{i}" for i in range(40))
    engine.precompute([document])   # found whole: nothing for the worker to store after the answer
    body = {"messages": [{"role": "system", "content": document},
                         {"role": "user", "content": "Which river comes first?"}], "max_tokens": 8}
    with RunningServer(engine) as running:
        def health() -> dict:
            return httpx.get(f"{running.url}/health", timeout=10).json()

        assert httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert storing.wait(30)
        assert (health()["queue_depth"], health()["background_jobs"]) == (0, 1)
        go_on.set()
        wait_idle(running.url)
        assert health()["background_jobs"] == 0 and engine.pieces_info()["entries"] >= 1
