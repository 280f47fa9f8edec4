"""`ragblend serve` decoding concurrent requests together (serving.worker + core.decode.batching), over a
tiny model on 127.0.0.1 with the official openai client: answers equal the lone ones, a client
that leaves mid-batch frees its slot without disturbing the others, and the bounds hold."""

import threading

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.servers import RunningServer, wait_idle  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

# Every request recomputes its whole prompt: the server stores the passages of plain text
# between requests, and an answer fused from reused KV may differ from a lone first one.
FULL = {"ragblend": {"strategy": "full_recompute"}}
QUESTIONS = ["Who ran the ferry between the two islands?", "When was the lighthouse first lit?",
             "How are rye loaves proofed in the village bakery, and in what kind of baskets?", "Why the bridge?"]


@pytest.fixture
def engine(tokenizer):
    return make_tiny_engine("qwen2", tokenizer)


def ask(url: str, question: str, max_tokens: int = 16, stream: bool = True) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]
    if not stream:
        reply = client.chat.completions.create(model="x", messages=messages, max_tokens=max_tokens, temperature=0,
                                               extra_body=FULL)
        return reply.choices[0].message.content
    return "".join(event.choices[0].delta.content or "" for event in client.chat.completions.create(
        model="x", messages=messages, max_tokens=max_tokens, temperature=0, stream=True, extra_body=FULL)
        if event.choices)


def ask_together(url: str, questions: list[str], **options) -> list[str]:
    answers, threads = [None] * len(questions), []

    def one(i: int) -> None:
        answers[i] = ask(url, questions[i], stream=i % 2 == 0, **options)

    for i in range(len(questions)):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout=120)
    return answers


def worker_of(running: RunningServer):
    return running.server.config.app.state.worker


def test_concurrent_requests_decode_together_and_answer_as_alone(engine):
    running = RunningServer(engine, model_name="x")
    try:
        alone = [ask(running.url, q, stream=i % 2 == 0) for i, q in enumerate(QUESTIONS)]
        batch = worker_of(running).batch
        assert batch.most_rows == 1   # one at a time so far
        together = ask_together(running.url, QUESTIONS, max_tokens=16)
        assert together == alone and all(alone)
        assert batch.most_rows >= 2   # some steps advanced several answers in one pass
        assert httpx.get(f"{running.url}/health").json()["queue_depth"] == 0
    finally:
        running.stop()


def test_a_client_that_leaves_mid_batch_frees_its_slot_and_the_others_go_on(engine):
    running = RunningServer(engine, model_name="x")
    try:
        alone = [ask(running.url, q) for q in QUESTIONS[:3]]
        batch = worker_of(running).batch
        started, gone = threading.Event(), threading.Event()

        def leaver() -> None:
            body = {"model": "x", "messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": 2000,
                    "temperature": 0, "stream": True, **FULL}
            with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if '"content"' in line and '"content": ""' not in line:
                        started.set()
                        if batch.most_rows >= 3:
                            break   # decoding together with the others: hang up
            gone.set()

        thread = threading.Thread(target=leaver)
        thread.start()
        assert started.wait(30)   # the long answer is decoding
        together = ask_together(running.url, QUESTIONS[:3], max_tokens=16)
        thread.join(timeout=60)
        assert gone.is_set() and together == alone
        wait_idle(running.url, within_s=20)   # 2,000 tokens would take far longer: its slot was freed
        assert not len(batch)
    finally:
        running.stop()


def test_the_kv_budget_makes_requests_wait_and_a_full_queue_answers_429(engine):
    running = RunningServer(engine, model_name="x", max_kv_bytes=1)   # room for one answer at a time
    try:
        alone = [ask(running.url, q, stream=i % 2 == 0) for i, q in enumerate(QUESTIONS)]
        assert ask_together(running.url, QUESTIONS) == alone   # all answered, one after another
        assert worker_of(running).batch.most_rows == 1
    finally:
        running.stop()
    busy = RunningServer(engine, model_name="x", max_batch=1, queue_size=1)
    try:
        statuses, lock = [], threading.Lock()

        def call() -> None:
            body = {"model": "x", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 64,
                    "temperature": 0}
            response = httpx.post(f"{busy.url}/v1/chat/completions", json=body, timeout=120)
            with lock:
                statuses.append((response.status_code, response.headers.get("retry-after")))

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(statuses) == 8 and {s for s, _ in statuses} == {200, 429}
        assert all(after for s, after in statuses if s == 429)
    finally:
        busy.stop()
