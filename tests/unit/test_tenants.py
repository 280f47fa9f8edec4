"""Tenants: what one client's requests store is found only in that client's prompts (namespaces in
the chunk key, the store's headers, the chunk index and the server), the template's opening is
never a chunk, token ids a client sends are stored only where they are the server's own
tokenization, and an entry whose header disagrees with its key is a miss. Tiny models; the real
server and the official openai client with two keys are in tests/integration/test_tenants.py."""


import httpx
import pytest
import torch

from ragblend import Chunk, InvalidInputError
from ragblend.core.fusion.strategies import CacheBlend, FullReuse
from ragblend.core.prompt import ChunkFinder
from ragblend.core.store.kv import ChunkKV, chunk_key, key_matches
from ragblend.core.store.tiers import DiskStore, encode_entry

from ..conftest import PASSAGES, make_tiny_engine
from ..robustness.faults import relabel_dtype

QUESTION = "Question: who ran the ferry, and for how long?"


# ---------------------------------------------------------------------------- keys and the chunk index


def test_the_shared_namespace_keeps_todays_keys_and_a_namespace_makes_other_ones(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    ids = engine.tokenize(PASSAGES[0])
    today = chunk_key(engine.fingerprint, engine.sink_ids, ids, str(engine.kv_dtype))
    assert engine.key_of(PASSAGES[0]) == engine.key_of(PASSAGES[0], namespace="") == today
    a, b = engine.key_of(PASSAGES[0], namespace="a"), engine.key_of(PASSAGES[0], namespace="b")
    assert len({today, a, b}) == 3
    for bad in ("x" * 129, 'has"quote', "sp ace", "[", 7):
        with pytest.raises(InvalidInputError, match="namespace"):
            engine.key_of(PASSAGES[0], namespace=bad)


def test_the_chunk_finder_searches_only_the_namespaces_it_is_given_and_never_before_start():
    finder = ChunkFinder()
    mine, theirs = tuple(range(100, 140)), tuple(range(300, 340))
    finder.add(mine, "a")
    finder.add(theirs, "b")
    prompt = [1, 2] + list(mine) + [7] + list(theirs)
    assert finder.find(prompt) == []                                   # shared only: neither
    spans = finder.find(prompt, ("", "a"))
    assert [(s.start, s.end, s.namespace) for s in spans] == [(2, 42, "a")]
    assert [(s.start, s.end, s.offset) for s in finder.find(prompt, ("a",), start=10)] == [(10, 42, 8)]
    assert finder.find(prompt, ("a",), start=30) == []                 # 12 tokens left: below MIN_RUN
    # One namespace's chunks cannot crowd another's out of an n-gram's bounded list.
    for extra in range(40):
        finder.add([5] * (60 + extra), "b")
    finder.add([5] * 50, "a")
    assert finder.find([5] * 50, ("a",))[0].token_ids == (5,) * 50


def test_a_tenants_chunks_are_found_only_in_its_own_prompts_also_after_a_restart(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    engine.store = DiskStore(tmp_path / "kv", engine.entry_spec)
    engine.precompute(PASSAGES[:2], namespace="tenant-a")
    engine.precompute(PASSAGES[2:3])                                    # the operator's: shared
    prompt = "\n\n".join(PASSAGES[:3]) + "\n\n" + QUESTION
    chunks = {(s.namespace, s.token_ids) for s in engine.find_chunks(prompt, namespace="tenant-a").chunk_spans}
    assert {ns for ns, _ in chunks} == {"tenant-a", ""} and len(chunks) == 3
    for namespace in ("tenant-b", ""):
        spans = engine.find_chunks(prompt, namespace=namespace).chunk_spans
        assert [s.namespace for s in spans] == [""] and list(spans[0].token_ids) == engine.tokenize(PASSAGES[2])
    # Another process on the same store learns each entry's namespace from its header.
    again = make_tiny_engine("llama", tokenizer)
    again.store = DiskStore(tmp_path / "kv", again.entry_spec)
    assert len(again.find_chunks(prompt, namespace="tenant-b").chunk_spans) == 1
    assert len(again.find_chunks(prompt, namespace="tenant-a").chunk_spans) == 3
    header = again.store.open(again.key_of(PASSAGES[0], namespace="tenant-a"))
    assert header.namespace == "tenant-a" and again.store.open(again.key_of(PASSAGES[2])).namespace == ""
    # A marked chunk the shared namespace holds is read from there, whoever marks it.
    pre = again.prefill(again.build_prompt([Chunk(PASSAGES[2]), QUESTION], namespace="tenant-b"), strategy=FullReuse())
    assert pre.stats.chunks_reused == 1 and pre.stats.chunks_computed == 0
    assert again.key_of(PASSAGES[2], namespace="tenant-b") not in again.store


def test_no_span_covers_the_templates_opening(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    engine.precompute([PASSAGES[1]])
    ids = engine.tokenize(PASSAGES[1])
    # The chunk's ids as a whole prompt: its first token is the prompt's attention sink.
    (span,) = engine.find_chunks_in_ids(ids).chunk_spans
    assert span.start == 1 and span.offset == 1
    layout = engine.find_chunks(PASSAGES[1] + "\n\n" + QUESTION, system="Be brief.")
    opening = engine.prompts.opening_length(layout.token_ids)
    assert opening >= 3 and all(s.start >= opening for s in layout.chunk_spans) and layout.chunk_spans


# ---------------------------------------------------------------------------- token ids a client sends


def test_only_the_engines_own_tokenization_of_a_text_counts_as_such(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    ids = engine.tokenize(PASSAGES[0])
    assert engine.is_own_tokenization(ids)
    chat = engine.prompts.chat_ids([{"role": "user", "content": PASSAGES[0]}])
    assert not engine.is_own_tokenization(chat[:-8])                    # the template's markup
    spelled = [t for ch in PASSAGES[0] for t in engine.tokenize(ch)]   # the text, letter by letter
    assert engine.tokenize(tokenizer.decode(spelled)) != spelled and not engine.is_own_tokenization(spelled)
    assert not engine.is_own_tokenization([])


# ---------------------------------------------------------------------------- a header that disagrees with its key


def test_a_float16_entry_relabelled_bfloat16_is_a_miss_and_verify_flags_it(tokenizer, tmp_path):
    from .test_store import entry_path

    engine = make_tiny_engine("llama", tokenizer, kv_dtype="float16")
    engine.store = store = DiskStore(tmp_path / "kv", engine.entry_spec)
    engine.precompute_batch_tokens = 0   # one chunk a pass, as a query's recompute: bit-identical entries
    refs = engine.precompute(PASSAGES[:3])
    segments = [Chunk(p) for p in PASSAGES[:3]] + [QUESTION]
    clean = engine.prefill(segments, strategy=CacheBlend(0.3))
    victim = refs[1].key
    assert store.verify(victim) is None
    relabel_dtype(entry_path(store, victim), "bfloat16")
    assert "disagrees with its key" in store.verify(victim)
    again = engine.prefill(segments, strategy=CacheBlend(0.3))
    assert torch.equal(again.logits, clean.logits)
    assert again.stats.chunks_computed == 1 and store.rejected == 1
    engine.flush()
    assert store.verify(victim) is None   # written back, sound
    # A header naming another namespace than its key was made for is refused the same way.
    entry = store.get(victim)
    entry_path(store, victim).write_bytes(encode_entry(
        ChunkKV(victim, entry.token_ids, entry.keys, entry.values, namespace="someone"), engine.fingerprint))
    assert "disagrees with its key" in store.verify(victim)


def test_a_uint4_entry_relabelled_or_rewritten_as_another_dtype_is_a_miss(tokenizer, tmp_path):
    from .test_store import entry_path

    engine = make_tiny_engine("llama", tokenizer, kv_dtype="uint4")
    engine.store = store = DiskStore(tmp_path / "kv", engine.entry_spec)
    engine.precompute_batch_tokens = 0
    refs = engine.precompute(PASSAGES[:3])
    segments = [Chunk(p) for p in PASSAGES[:3]] + [QUESTION]
    clean = engine.prefill(segments, strategy=CacheBlend(0.3))
    assert clean.stats.chunks_computed == 0 and store.entries_by_dtype().keys() == {"uint4"}
    victim = refs[1].key
    entry = store.get(victim)
    assert entry.storage_dtype == torch.uint4 and store.verify(victim) is None
    # Its bytes decoded to float16 and written as a sound float16 file under the uint4 key: a miss.
    k, v = zip(*(entry.layer(i) for i in range(entry.keys.shape[0])))
    entry_path(store, victim).write_bytes(encode_entry(
        ChunkKV(victim, entry.token_ids, torch.stack(k), torch.stack(v)), engine.fingerprint))
    assert "disagrees with its key (dtype float16" in store.verify(victim)
    again = engine.prefill(segments, strategy=CacheBlend(0.3))
    assert torch.equal(again.logits, clean.logits) and again.stats.chunks_computed == 1
    engine.flush()
    assert store.verify(victim) is None and store.get(victim).storage_dtype == torch.uint4   # written back
    relabel_dtype(entry_path(store, victim), "int8")   # the header alone edited: a miss as well
    assert "disagrees with its key (dtype int8" in store.verify(victim)


def test_key_matches_accepts_a_float32_fallback_and_lead_entries_only():
    sink, lead, ids = [1, 2], [1], list(range(10, 30))
    own = chunk_key("fp", sink, ids, "torch.float16")
    kwargs = dict(fingerprint="fp", sink_ids=sink, lead_sink_ids=lead, token_ids=ids)
    from ragblend.core.store.kv import lead_key

    assert key_matches(own, dtype="float16", **kwargs) and key_matches(own, dtype="float32", **kwargs)
    assert key_matches(lead_key(own, lead), dtype="float16", **kwargs)
    assert not key_matches(own, dtype="bfloat16", **kwargs) and not key_matches(own, dtype="int8", **kwargs)
    assert not key_matches(own, dtype="float16", namespace="x", **kwargs)


# ---------------------------------------------------------------------------- the server with two tenants

A_KEY, B_KEY, OPERATOR_KEY = "tenant-a-key", "tenant-b-key", "operator-key"
KNOWN = "According to the office manager, the door code for the north entrance this month is "
CODE = "7319"
A_SYSTEM = ("Office notes for the staff of the north building, kept by the front desk.\n\n"
            f"{KNOWN}{CODE}, and it changes on the first day of every month.")


def chat(url, key, messages, **extra):
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def guesses(url, key, **extra) -> list[int]:
    """cached_tokens of one probe per guess of the code's first digit (B's attack)."""
    from tests.servers import wait_idle

    out = []
    for digit in "0123456789":
        out.append(cached(chat(url, key, [{"role": "user", "content": f"Repeat this.\n\n{KNOWN}{digit}"}],
                               max_tokens=1, **extra)))
        wait_idle(url)
    return out


def a_asks(url, key=A_KEY):
    return chat(url, key, [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": "When does it change?"}])


@pytest.fixture
def tenant_server(tokenizer):
    pytest.importorskip("fastapi")
    from tests.servers import RunningServer

    def start(**options):
        engine = make_tiny_engine("llama", tokenizer)
        return engine, RunningServer(engine, tenants={A_KEY: "a", B_KEY: "b"}, operator_key=OPERATOR_KEY, **options)

    return start


def test_another_tenant_reads_no_digit_of_a_system_prompt_through_cached_tokens(tenant_server):
    from tests.servers import wait_idle

    for shared, leak in ((False, False), (True, True)):   # --shared-cache: the side channel, as documented
        engine, server = tenant_server(shared_cache=shared)
        try:
            a_asks(server.url)
            wait_idle(server.url)
            assert cached(a_asks(server.url)) > 0            # A reuses its own system prompt
            probes = guesses(server.url, B_KEY)
            if leak:
                assert probes[int(CODE[0])] > max(p for d, p in enumerate(probes) if d != int(CODE[0]))
            else:
                assert probes == [0] * 10
                # A salted request of A's is its own namespace: it finds nothing A stored unsalted.
                assert guesses(server.url, A_KEY, cache_salt="other")[int(CODE[0])] == 0
        finally:
            server.stop()


def test_chunks_the_operator_registers_are_shared_and_a_tenants_are_its_own(tenant_server):
    engine, server = tenant_server()
    try:
        post = lambda key, texts: httpx.post(f"{server.url}/v1/chunks", json={"texts": texts}, timeout=60,  # noqa: E731
                                             headers={"Authorization": f"Bearer {key}"}).json()["data"]
        shared, own = " ".join(f"alpha{i}" for i in range(40)), " ".join(f"beta{i}" for i in range(40))
        assert post(OPERATOR_KEY, [shared])[0]["key"] == engine.key_of(shared)
        assert post(B_KEY, [own])[0]["key"] != engine.key_of(own)
        for text, a_hits in ((shared, True), (own, False)):
            prompt = [{"role": "user", "content": f"{text}\n\nWhich number is last?"}]
            a, b = cached(chat(server.url, A_KEY, prompt)), cached(chat(server.url, B_KEY, prompt))
            assert b >= engine.count_tokens(text) - 2 and a == (b if a_hits else 0)
    finally:
        server.stop()


def test_the_token_id_warm_up_attack_stores_nothing_and_changes_no_answer(tokenizer, tmp_path):
    """B tokenizes a one-message chat, drops its last 8 ids and sends them as a token-id prompt
    (LMCache's warm-up): nothing is stored, and A's greedy answers are those of a server B never
    talked to, also after a restart on the same store."""
    pytest.importorskip("fastapi")
    from tests.servers import RunningServer, wait_idle

    questions = ["What is the capital of France?", "How warm is boiling water?", "Name a colour.", "Count to three."]

    def answers(url):
        return [chat(url, A_KEY, [{"role": "user", "content": q}])["choices"][0]["message"]["content"]
                for q in questions]

    def server_on(folder, **options):
        engine = make_tiny_engine("llama", tokenizer)
        engine.store = DiskStore(folder, engine.entry_spec)
        return engine, RunningServer(engine, tenants={A_KEY: "a", B_KEY: "b"}, **options)

    engine, baseline = server_on(tmp_path / "baseline")
    try:
        expected = answers(baseline.url)
    finally:
        baseline.stop()
    for keys in ({"Authorization": f"Bearer {B_KEY}"},):
        engine, server = server_on(tmp_path / "attacked")
        try:
            ids = httpx.post(f"{server.url}/tokenize", headers=keys, timeout=60, json={
                "messages": [{"role": "user", "content": questions[0]}]}).json()["tokens"]
            before = set(engine.store.keys())
            for attack in (ids[:-8], [t for t in ids[:-8] if t not in engine.prompts.text_encoder.control_ids]):
                response = httpx.post(f"{server.url}/v1/completions", headers=keys, timeout=60,
                                      json={"prompt": attack, "max_tokens": 1})
                assert response.status_code == 200   # answered, not stored where anyone else finds it
            wait_idle(server.url)
            engine.flush()
            b_namespace = server.server.config.app.state.server.tenants.namespace("b", {})
            # The ids with their markup are stored nowhere; without it they are text, B's own at most.
            assert all(engine.store.open(k).namespace == b_namespace for k in set(engine.store.keys()) - before)
            assert answers(server.url) == expected
        finally:
            server.stop()
        engine, restarted = server_on(tmp_path / "attacked")
        try:
            assert answers(restarted.url) == expected
        finally:
            restarted.stop()


def test_cache_salt_must_be_a_short_string(tenant_server):
    engine, server = tenant_server()
    try:
        for salt in ("", 7, "x" * 2000):
            response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {A_KEY}"},
                                  json={"messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
            assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
    finally:
        server.stop()


def test_keys_files_and_tenants_are_checked(tmp_path):
    from ragblend.serving.tenants import OPERATOR, Tenants, read_keys_file

    path = tmp_path / "keys"
    path.write_text("# tenants\nalice  key-one\n\nbob key-two\n")
    assert read_keys_file(path) == {"key-one": "alice", "key-two": "bob"}
    path.write_text("alice key-one extra\n")
    with pytest.raises(InvalidInputError, match="line 1"):
        read_keys_file(path)
    path.write_text("alice k\nbob k\n")
    with pytest.raises(InvalidInputError, match="also tenant 'alice'"):
        read_keys_file(path)
    with pytest.raises(InvalidInputError, match="operator"):
        Tenants.of(operator_key="k", tenants={"k": "alice"})
    tenants = Tenants.of(api_key="op", tenants={"k1": "alice", "k2": "alice", "k3": "bob"}, partition_by_user=True)
    assert tenants.tenant_of(b"Bearer op") == OPERATOR and tenants.tenant_of(b"Bearer k2") == "alice"
    assert tenants.tenant_of(b"Bearer nope") is None and tenants.tenant_of(b"") is None
    assert tenants.namespace(OPERATOR, {}) == "" and tenants.namespace("alice", {}) == tenants.namespace("alice", {})
    assert len({tenants.namespace("alice", {}), tenants.namespace("bob", {}),
                tenants.namespace("alice", {"user": "u1"}), tenants.namespace("alice", {"cache_salt": "s"}),
                tenants.namespace(OPERATOR, {"cache_salt": "s"})}) == 5
    shared = Tenants.of(tenants={"k": "alice", "j": "bob"}, shared_cache=True)
    assert shared.namespace("alice", {}) == ""
    # --shared-cache shares passages; prompts and answers in the prefix tier stay each tenant's own
    assert shared.namespace("alice", {}, own=True) not in ("", shared.namespace("bob", {}, own=True))
    assert Tenants().tenant_of(b"") == OPERATOR   # no key needed: one user, the shared namespace


def test_the_cli_makes_a_lone_key_the_operators_and_several_keys_tenants(tmp_path, monkeypatch):
    from ragblend.cli import _serve_keys, build_parser

    def keys(*argv):
        return _serve_keys(build_parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("RAGBLEND_API_KEY", raising=False)
    assert keys() == {"api_key": None, "tenants": {}, "operator_key": None}
    assert keys("--api-key", "k1") == {"api_key": None, "tenants": {}, "operator_key": "k1"}
    several = keys("--api-key", "k1", "--api-key", "k2")
    assert several["operator_key"] is None and set(several["tenants"]) == {"k1", "k2"}
    assert len(set(several["tenants"].values())) == 2 and not any("k1" in n for n in several["tenants"].values())
    assert keys("--api-key", "k1", "--operator-key", "op")["tenants"].keys() == {"k1"}
    path = tmp_path / "keys"
    path.write_text("alice ka\nbob kb\n")
    both = keys("--api-keys-file", str(path), "--api-key", "k1")
    assert both["tenants"] == {"ka": "alice", "kb": "bob", "k1": both["tenants"]["k1"]}
    monkeypatch.setenv("RAGBLEND_API_KEY", "from-env")
    assert keys()["operator_key"] == "from-env" and keys("--api-key", "k9")["operator_key"] == "k9"


def test_the_prefix_tier_serves_a_tenants_repeat_and_never_another_tenants(tokenizer):
    pytest.importorskip("fastapi")
    """The official openai client: A's repeat is answered from A's prefix tier (all but its last
    token cached, the same answer); B's identical prompt finds nothing of A's, then B's own repeat hits."""
    from openai import OpenAI

    from tests.servers import RunningServer

    engine = make_tiny_engine("llama", tokenizer, prefix_cache_bytes=64 << 20)
    server = RunningServer(engine, tenants={A_KEY: "a", B_KEY: "b"}, operator_key=OPERATOR_KEY)
    try:
        a, b = (OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60).chat.completions
                for key in (A_KEY, B_KEY))
        messages = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": "When does it change?"}]

        def ask(chat):
            answer = chat.create(model="m", messages=messages, max_tokens=4, temperature=0)
            return answer, answer.usage.prompt_tokens_details.cached_tokens, answer.model_extra["ragblend"]

        first, first_cached, _ = ask(a)
        n = first.usage.prompt_tokens
        repeat, repeat_cached, repeat_stats = ask(a)
        assert first_cached == 0 and repeat_cached == repeat_stats["prefix_tokens"] == n
        assert repeat.choices[0].message.content == first.choices[0].message.content
        other, other_cached, other_stats = ask(b)
        assert other_cached == other_stats["prefix_tokens"] == other_stats["reused_tokens"] == 0
        assert other.choices[0].message.content == first.choices[0].message.content
        assert ask(b)[1] == n   # B's own repeat
        metrics = httpx.get(f"{server.url}/metrics", timeout=30, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).text
        assert "ragblend_prefix_hits_total 2" in metrics and f"ragblend_prefix_hit_tokens_total {2 * n}" in metrics
        assert "ragblend_prefix_misses_total" in metrics and "ragblend_prefix_evictions_total 0" in metrics
        assert "ragblend_prefix_faults_total 0" in metrics
    finally:
        server.stop()
