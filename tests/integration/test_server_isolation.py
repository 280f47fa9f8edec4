"""`ragblend serve --api-key` over the embedded model, in its own process, driven by the official
openai client and a raw socket on 127.0.0.1 (issue 58, items 3, 5 and 7b): one request's bad
sampling values or hang-up never fail the answers decoding beside it, an endless request head
is cut off before the key is checked while /health answers, and a huge prompt is refused fast."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

from tests.servers import HealthPoller, header_flood, ragblend_serve, wait_idle  # noqa: E402

KEY = "isolation-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FULL = {"ragblend": {"strategy": "full_recompute"}}   # no reuse between runs: answers comparable
QUESTIONS = ["When does the Sanderling ferry leave?", "Name a colour of the sea.", "What is a pier?",
             "Say hello in French."]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    server = ragblend_serve(str(tmp_path_factory.mktemp("kv")), "--api-key", KEY)
    try:
        yield server
    finally:
        server.stop()


def client_of(serve):
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(serve, question: str, **options) -> str:
    reply = client_of(serve).chat.completions.create(model="x", extra_body=FULL, messages=[
        {"role": "user", "content": question}], **{"max_tokens": 8, "temperature": 0, **options})
    return reply.choices[0].message.content


def together(serve, bad) -> tuple[list, object]:
    """The four questions asked at once (openai clients in threads), and ``bad()`` run while they decode."""
    answers, threads = [None] * len(QUESTIONS), []

    def one(i):
        answers[i] = ask(serve, QUESTIONS[i])

    for i in range(len(QUESTIONS)):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    time.sleep(0.3)
    outcome = bad()
    for t in threads:
        t.join(timeout=120)
    return answers, outcome


@pytest.fixture(scope="module")
def alone(serve):
    return [ask(serve, q) for q in QUESTIONS]


@pytest.mark.parametrize("options, param", [({"temperature": 1, "top_p": 1e-300}, "top_p"),
                                            ({"temperature": 1e-300}, "temperature")])
def test_a_bad_sampling_value_fails_only_its_own_request(serve, alone, options, param):
    def bad():
        try:
            ask(serve, "Tell me about the harbour.", **options)
        except openai.BadRequestError as err:
            return err
        return None

    answers, err = together(serve, bad)
    assert answers == alone and all(alone)
    assert err is not None and err.status_code == 400 and err.body["param"] == param


def test_a_client_that_leaves_mid_batch_leaves_the_others_unchanged(serve, alone):
    def leave():
        body = {"model": "x", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
                "stream": True, **FULL}
        with httpx.stream("POST", f"{serve.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in response.iter_lines():
                if '"content"' in line and '"content": ""' not in line:
                    return True
        return False

    answers, left = together(serve, leave)
    assert left and answers == alone
    wait_idle(serve.url, 30)   # the 400-token story stopped with its client


def test_a_256_mb_request_head_is_cut_off_while_health_answers(serve):
    with HealthPoller(serve.url, interval_s=0.005) as poller:
        flood = header_flood(serve.url, 256 << 20, time_limit_s=60)
        time.sleep(0.3)
    print(f"header flood: {flood}; {poller.summary()}")
    assert flood["sent"] >= 256 << 20   # all of it was tried; each connection was cut off at the bound
    assert set(flood["statuses"]) <= {"HTTP/1.1 400 Bad Request", "reset", "closed"}
    assert poller.failures == 0 and len(poller.latencies) >= 20
    assert poller.percentile(0.99) < 0.100
    assert ask(serve, QUESTIONS[0])   # and the model still answers


def test_a_huge_cjk_prompt_is_refused_without_tokenizing_it_whole(serve, default_model_dir):
    from transformers import AutoTokenizer

    text = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(1_300_000))   # 3.9 MB in UTF-8
    raw = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}, ensure_ascii=False).encode()
    t0 = time.perf_counter()
    response = httpx.post(f"{serve.url}/v1/chat/completions", content=raw, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    refused_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    t0 = time.perf_counter()
    tokenizer(text, add_special_tokens=False)
    whole_s = time.perf_counter() - t0
    print(f"3.9 MB CJK prompt: 400 in {refused_s:.2f} s; tokenizing it whole {whole_s:.2f} s")
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert refused_s < whole_s / 3
