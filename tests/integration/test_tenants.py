"""Tenants of one `ragblend serve` over the real default model, driven by the official openai client
with two keys on 127.0.0.1: one tenant cannot read the other's system prompt through
cached_tokens, nor change its answers with LMCache's token-id warm-up, also across a restart on the
same KV store; the operator's chunks are shared."""

import httpx
import pytest

pytest.importorskip("fastapi")
pytestmark = pytest.mark.slow

from tests.servers import RunningServer, wait_idle  # noqa: E402

A_KEY, B_KEY, OPERATOR_KEY = "tenant-a-1234", "tenant-b-5678", "operator-9999"
KNOWN = ("Notes for the staff of the north building, kept by the front desk and read out at the Monday meeting. "
         "Deliveries come to the loading bay behind the canteen, never to the main entrance. "
         "The door code for the north entrance this month is ")
CODE = "7319"
SYSTEM = f"{KNOWN}{CODE}, and it changes on the first of every month."
QUESTIONS = ["What is the capital of France?", "At what temperature does water boil at sea level?",
             "Name three colours of the rainbow.", "What do bees make?"]


def client(server, key):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def answers(server, key=A_KEY) -> list[str]:
    chat = client(server, key).chat.completions
    return [chat.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0)
            .choices[0].message.content for q in QUESTIONS]


def tenant_server(engine, **options):
    return RunningServer(engine, tenants={A_KEY: "a", B_KEY: "b"}, operator_key=OPERATOR_KEY, **options)


@pytest.fixture
def engine(tmp_path):
    from ragblend import BlendEngine

    return BlendEngine.from_pretrained(kv_dir=tmp_path / "kv")


def test_a_tenant_reads_no_digit_of_anothers_system_prompt(engine):
    server = tenant_server(engine)
    try:
        a, b = client(server, A_KEY).chat.completions, client(server, B_KEY).chat.completions
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does it change?"}]
        a.create(model="m", messages=messages, max_tokens=1)
        wait_idle(server.url, within_s=600, headers={"Authorization": f"Bearer {A_KEY}"})
        assert cached(a.create(model="m", messages=messages, max_tokens=1)) > 0    # A reuses its own prompt
        probes = [cached(b.create(model="m", max_tokens=1, extra_body={"cache_salt": f"probe-{digit}"},
                                  messages=[{"role": "user", "content": f"Repeat this.\n\n{KNOWN}{digit}"}]))
                  for digit in "0123456789"]
        assert probes == [0] * 10
        # The operator's chunks are everyone's.
        shared = " ".join(SYSTEM.split()[:30]) + " and the canteen opens at noon."
        httpx.post(f"{server.url}/v1/chunks", json={"texts": [shared]}, timeout=120,
                   headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).raise_for_status()
        hit = b.create(model="m", max_tokens=1, messages=[{"role": "system", "content": shared},
                                                          {"role": "user", "content": "When does the canteen open?"}])
        assert cached(hit) >= 0.8 * engine.count_tokens(shared)
    finally:
        server.stop()


def test_the_token_id_warm_up_attack_changes_no_answer_also_after_a_restart(engine, tmp_path):
    from ragblend import BlendEngine

    server = tenant_server(engine)
    try:
        expected = answers(server)
        for key in (B_KEY, OPERATOR_KEY):
            ids = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                             json={"messages": [{"role": "user", "content": QUESTIONS[0]}]}).json()["tokens"]
            warm_up = client(server, key).completions.create(model="m", prompt=ids[:-8], max_tokens=1)
            assert warm_up.choices[0].finish_reason
        wait_idle(server.url, within_s=600, headers={"Authorization": f"Bearer {A_KEY}"})
        engine.flush()
        assert answers(server) == expected
    finally:
        server.stop()
    restarted = tenant_server(BlendEngine.from_pretrained(kv_dir=tmp_path / "kv"))
    try:
        assert answers(restarted) == expected
    finally:
        restarted.stop()


def test_a_shared_chunk_is_found_alike_by_every_tenants_first_request(tmp_path):
    """A passage the operator stored before the server started is found by each tenant's first
    request, and one tenant asking first changes nothing the next one sees (else ``cached_tokens``
    would say that someone asked about it)."""
    from ragblend import BlendEngine, Chunk

    passage = ("The keeper of the Marrow Point light logs every passing ship in a green ledger; the ledger for "
               "the winter of 1931 records forty-two vessels, the last a grain barge named Osprey that ran "
               "aground on the sandbar two miles south of the point in the February storm. The crew of six "
               "walked ashore at low tide, and the barge's cargo of oats was sold where it lay to farmers from "
               "the villages inland, who carted it away over the sand for a week before the next gale broke "
               "the hull apart. ")   # long enough beside the prompt that fusing it computes less than a prefill
    BlendEngine.from_pretrained(kv_dir=tmp_path / "kv").generate([Chunk(passage), "Which barge?"], max_new_tokens=1)
    server = tenant_server(BlendEngine.from_pretrained(kv_dir=tmp_path / "kv"))
    prompt = f"Context information is below.\n---------------------\n{passage}\n---------------------\nQuery: Which barge?"
    try:
        seen = {}
        for key in (A_KEY, B_KEY):
            chat = client(server, key).chat.completions
            seen[key] = cached(chat.create(model="m", max_tokens=1, messages=[{"role": "user", "content": prompt}]))
            wait_idle(server.url, within_s=600, headers={"Authorization": f"Bearer {key}"})
        assert seen[A_KEY] == seen[B_KEY] > 0
    finally:
        server.stop()
