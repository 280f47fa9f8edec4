"""What a request waits for on the shared server, and what it may ask for (session 45's new-user
trial): the TTFT a server reports counts from the request's arrival, its queue included; the
passages stored between requests yield to a request that arrives; an answer asks for at most the
server's completion-token limit; /v1/models shows one tenant nothing of another's. Real servers
on 127.0.0.1 over tiny random models, driven by the official openai client."""

import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from ragblend.core.prompt import PromptLayout  # noqa: E402
from ragblend.serving.reuse import PassageKeeper  # noqa: E402
from ragblend.serving.worker import Job  # noqa: E402
from tests.servers import RunningServer, wait_idle  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


def client(running: RunningServer, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=key, max_retries=0, timeout=60)


def streamed_stats(chat, **request) -> dict:
    """The ``ragblend`` stats a streamed answer ends with."""
    stats = None
    for chunk in chat.chat.completions.create(model="x", stream=True, **request):
        stats = (chunk.model_extra or {}).get("ragblend") or stats
    return stats


# ---------------------------------------------------------------------------- TTFT and the queue


def test_the_reported_ttft_counts_the_wait_in_the_queue(engine):
    with RunningServer(engine) as running:
        worker = running.server.config.app.state.worker
        busy, held_until = threading.Event(), []

        def hold(job: Job) -> None:   # another request's work, holding the one model thread
            busy.set()
            time.sleep(1.0)
            held_until.append(time.perf_counter())

        chat = client(running)
        chat.models.list()   # the client's connection opened: the request below arrives as it is sent
        worker.submit(Job(hold, lambda outcome: None))
        assert busy.wait(10)
        sent = time.perf_counter()
        stats = streamed_stats(chat, messages=HELLO, max_tokens=2)
        waited = held_until[0] - sent   # at least this long in the queue
        assert waited > 0.3
        assert stats["queued_s"] >= waited - 0.05, (stats, waited)
        assert stats["ttft_s"] >= stats["queued_s"]
        text = httpx.get(f"{running.url}/metrics", timeout=10).text
        total = float(next(line.split()[1] for line in text.splitlines() if line.startswith("ragblend_ttft_seconds_sum")))
        assert total >= stats["ttft_s"] - 1e-6   # /metrics' histogram counts the same TTFT


def test_storing_passages_yields_to_a_request_that_arrives(engine):
    """A storing job that finds a request waiting stops before its next layer and keeps its
    passages for later, unless that request's prompt holds the passages (it will read them);
    with no request waiting it stores them."""
    queued: list[Job] = []   # the worker's queue, as the storing job sees it
    keeper = PassageKeeper(engine, submit=lambda job: None, load=lambda: 1 + len(queued), queued=lambda: list(queued))
    texts = [" ".join(f"yield{i}w{j}" for j in range(50)) for i in range(3)]
    keeper.add(texts, "tenant-a")
    job = Job(keeper._run, lambda outcome: None)
    assert keeper.awaits(texts[1:2], "tenant-a") and not keeper.awaits(texts, "tenant-b")
    queued.append(Job(lambda job: None, lambda outcome: None))   # another tenant's request
    keeper._run(job)
    assert keeper.stored == keeper.failed == 0
    assert [text for _, text in keeper.pending] == texts   # put back, in order, for the next idle moment
    queued[0] = Job(lambda job: None, lambda outcome: None, awaits_storing=True)   # one that reads them
    keeper._run(job)
    assert keeper.stored == 3 and keeper.pending_count() == 0
    assert not keeper.awaits(texts, "tenant-a")


def test_a_turn_whose_passages_the_prefix_tier_holds_does_not_wait_for_their_storing(tokenizer):
    """A conversation's next turn reads its passages from the prefix tier (only its last tokens
    are computed): it lets the storing of those passages yield. A prompt that has them in the part
    it computes, or whose tenant's tier holds no prefix of it (another tenant's is never looked
    into), lets the storing finish."""
    engine = make_tiny_engine("llama", tokenizer, prefix_cache_bytes=64 << 20)
    texts = [" ".join(f"held{i}w{j}" for j in range(40)) for i in range(2)]
    keeper = PassageKeeper(engine, submit=lambda job: None, load=lambda: 1, queued=lambda: [])
    turn = engine.tokenize("Context: " + texts[0] + "\n\nQuestion one?")
    engine.prefill(PromptLayout(turn, [], namespace="tenant-a"))   # turn 1, now in tenant-a's tier
    assert keeper.awaited_by(texts, "tenant-a", lambda: turn, "tenant-a") is False   # nothing waits to be stored
    keeper.add(texts, "tenant-a")
    asked: list[int] = []
    counted = {k: engine.prefix_info()[k] for k in ("hits", "misses")}

    def decision(ids: list[int], own: str, reads_tier: bool = True) -> bool:
        ask = keeper.awaited_by(texts, "tenant-a", lambda: asked.append(1) or ids, own, reads_tier)
        job = Job(lambda job: None, lambda outcome: None, awaits_storing=ask)
        return job.awaits() and job.awaits() and job.awaits()   # asked once, remembered

    next_turn = turn + engine.tokenize(" Question two?")
    assert engine.prefix_held(next_turn, "tenant-a") == len(turn)
    assert decision(next_turn, "tenant-a") is False and len(asked) == 1
    # the rest after a held prefix is computed in full, a pending passage in it too: nothing to wait for
    assert decision(turn + engine.tokenize(" " + texts[1] + " Question two?"), "tenant-a") is False
    assert engine.prefix_held(next_turn, "tenant-b") == 0
    assert decision(next_turn, "tenant-b")   # the prefix is tenant-a's: tenant-b's prompt computes the passage
    assert decision(next_turn, "tenant-a", reads_tier=False)   # a named strategy reads no tier
    assert {k: engine.prefix_info()[k] for k in counted} == counted   # the server's look-ups count no hit or miss


def test_a_decision_that_fails_lets_the_storing_yield(engine):
    def broken() -> bool:
        raise ValueError("no prompt")

    job = Job(lambda job: None, lambda outcome: None, awaits_storing=broken)
    assert job.awaits() is False and job.awaits_storing is False


# ---------------------------------------------------------------------------- the completion-token limit


def test_a_request_above_the_completion_token_limit_is_a_400_naming_it(engine):
    with RunningServer(engine, max_completion_tokens=8) as running:
        chat = client(running)
        for field in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(openai.BadRequestError) as refused:
                chat.chat.completions.create(model="x", messages=HELLO, **{field: 10**9})
            error = refused.value.body
            assert error["param"] == field and error["code"] == "invalid_value"
            assert "at most 8 tokens" in error["message"] and "--max-completion-tokens" in error["message"]
        with pytest.raises(openai.BadRequestError):   # streamed: a real 400 too, before any event
            streamed_stats(chat, messages=HELLO, max_tokens=9)
        with pytest.raises(openai.BadRequestError):
            client(running).completions.create(model="x", prompt="Say hello.", max_tokens=9)
        answer = chat.chat.completions.create(model="x", messages=HELLO, max_tokens=8, temperature=1.0, seed=1)
        assert answer.usage.completion_tokens <= 8
        unasked = chat.chat.completions.create(model="x", messages=HELLO, temperature=1.0, seed=2)
        assert unasked.usage.completion_tokens <= 8   # a request naming no max_tokens gets the limit at most
        assert httpx.get(f"{running.url}/v1/models", timeout=10).json()["data"][0]["max_completion_tokens"] == 8


def test_the_default_limit_is_4096_or_the_window_whichever_is_smaller(engine):
    from ragblend.serving.app import create_app

    limit = create_app(engine).state.server.max_completion_tokens
    assert limit == min(4096, engine.context_window)


# ---------------------------------------------------------------------------- /v1/models


def test_models_lists_the_served_model_only_never_the_names_clients_sent(engine):
    tenants = {"key-a": "research", "key-b": "support"}
    with RunningServer(engine, tenants=tenants, model_name="served-name") as running:
        client(running, "key-a").chat.completions.create(model="research-secret-model", messages=HELLO, max_tokens=1)
        wait_idle(running.url, headers={"authorization": "Bearer key-a"})
        for key in tenants:
            listed = [model.id for model in client(running, key).models.list().data]
            assert listed == ["served-name"]
