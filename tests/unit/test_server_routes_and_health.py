"""What no route answers (a path the server lacks: 404; a method its route lacks: 405) has the
OpenAI error shape with a code and says what to send instead. A tiny model behind a real server
on 127.0.0.1, asked with httpx and the openai SDK."""

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.servers import RunningServer  # noqa: E402

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
