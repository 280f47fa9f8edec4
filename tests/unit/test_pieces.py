"""History pieces (ragblend.core.store.pieces): a conversation's earlier turns are stored like chunks once
answered and fused like chunks in its later turns, even where the prompt's front changed; never
across namespaces, models or K/V dtypes."""

import contextlib
import dataclasses
import threading
import time

import pytest

from ragblend import Chunk, FullRecompute
from ragblend.core.errors import InvalidInputError
from ragblend.core.options import EngineOptions
from ragblend.core.prompt import ChunkSpan, PromptLayout
from ragblend.core.store import pieces
from ragblend.core.store.pieces import FIRST_TURN_QUESTION_TOKENS, is_piece, piece_namespace, piece_runs
from ragblend.core.store.tiers import MemoryStore

from ..conftest import PASSAGES, make_tiny_engine

QUESTIONS = ["Tell me about the ferry and the people who ran it across the river, in some detail please.",
             "And what about the harbour, the breakwater and the lighthouse at the end of it, when was it built?",
             "Summarise what we have talked about so far in a few sentences for me please, thanks."]


def chat(engine, turns: int, namespace: str = "", history: list | None = None, **options) -> list:
    """A conversation as chat engines hold it: each turn's system message holds new context (another
    passage, a known chunk) and the earlier turns follow it. The stats of each turn (and, in
    ``history`` when given, the turns)."""
    history, prefills = [] if history is None else history, []
    for turn in range(turns):
        system = "Context:\n\n" + PASSAGES[turn] + "\n\n" + PASSAGES[(turn + 1) % 4]
        layout = engine.find_chunks(QUESTIONS[turn], system=system, history=history, namespace=namespace)
        out = engine.generate(layout, max_new_tokens=40, stop=None, **options)
        engine.flush()   # the pieces are stored in the background
        prefills.append(out.stats)
        history += [("user", QUESTIONS[turn]), ("assistant", out.text)]
    return prefills


def pieces_engine(tokenizer, arch="qwen2", **options):
    engine = make_tiny_engine(arch, tokenizer, history_pieces=True, **options)
    engine.precompute(PASSAGES)
    return engine


def test_a_turn_after_a_changed_front_reuses_the_earlier_turns(tokenizer):
    engine = pieces_engine(tokenizer)
    stats = chat(engine, 3)
    assert stats[0].history_tokens == 0
    # turn 3: turn 1 (question and answer), kept once it was history, and turn 2, kept once answered:
    # every token between the context and the question is a piece's but the template's control tokens
    spans = [s for s in engine.last_prompt.chunk_spans if is_piece(s)]
    assert len(spans) >= 2 and {s.namespace for s in spans} == {piece_namespace("")}
    ids = engine.last_prompt.token_ids
    question = engine.runner.last_message_start(ids)
    last_chunk = max(s.end for s in engine.last_prompt.chunk_spans if not is_piece(s))
    control = sum(t in engine.prompts.text_encoder.control_ids for t in ids[last_chunk:question])
    assert sum(s.end - s.start for s in spans) >= question - last_chunk - control - 8   # + short template text
    assert stats[2].history_tokens >= sum(len(engine.prompts.tokenize(q)) for q in QUESTIONS[:2])
    assert stats[2].reused_tokens > 0 and stats[2].prefix_tokens == 0   # the front changed: no prefix


def test_short_questions_are_kept_with_their_answers(tokenizer):
    """A question shorter than a piece can be (16 tokens) is kept with its turn: by turn 3, no earlier
    question is computed again; only the template's control tokens are (never reused)."""
    engine = pieces_engine(tokenizer)
    history, short = [], ["Who ran it?", "When?", "Why?"]
    for turn, question in enumerate(short):
        system = "Context:\n\n" + PASSAGES[turn] + "\n\n" + PASSAGES[(turn + 1) % 4]
        layout = engine.find_chunks(question, system=system, history=history)
        out = engine.generate(layout, max_new_tokens=24, stop=None)
        engine.flush()
        history += [("user", question), ("assistant", out.text)]
    layout = engine.last_prompt
    covered = [False] * len(layout.token_ids)
    for span in layout.chunk_spans:
        covered[span.start:span.end] = [True] * (span.end - span.start)
    question = engine.runner.last_message_start(layout.token_ids)
    last_chunk = max(s.end for s in layout.chunk_spans if not is_piece(s))
    control = engine.prompts.text_encoder.control_ids
    between = range(last_chunk, question)
    computed = [i for i in between if not covered[i]]
    assert sum(layout.token_ids[i] not in control for i in computed) <= 1   # the system message's end at most
    assert not any(covered[i] for i in between if layout.token_ids[i] in control)   # never reused
    assert out.stats.history_tokens >= len(between) - len(computed) > 2 * len(engine.prompts.tokenize("Who ran it?"))


def test_a_chats_first_turn_keeps_its_turn(tokenizer):
    """A chat request's first turn (PromptLayout.chat, as the server's chat completions lay it out)
    keeps its turn, so its second turn reuses it; a stuffed first message (context and question in
    one, longer than FIRST_TURN_QUESTION_TOKENS) keeps none."""
    engine = pieces_engine(tokenizer)
    system = "Context:\n\n" + PASSAGES[0] + "\n\n" + PASSAGES[1]
    first = dataclasses.replace(engine.find_chunks("Who ran it?", system=system), chat=True)
    answer = engine.generate(first, max_new_tokens=24, stop=None)
    engine.flush()
    assert len(engine.runner.piece_store) == 1
    history = [("user", "Who ran it?"), ("assistant", answer.text)]
    second = engine.find_chunks("When?", system="Context:\n\n" + PASSAGES[2], history=history)
    assert engine.prefill(second).stats.history_tokens >= len(engine.prompts.tokenize(answer.text))
    stuffed = pieces_engine(tokenizer)
    text = " ".join(QUESTIONS * 12)   # no chunk in it: over 256 tokens to compute again as a piece
    assert len(stuffed.prompts.tokenize(text)) > FIRST_TURN_QUESTION_TOKENS
    stuffed.generate(dataclasses.replace(stuffed.find_chunks(text), chat=True), max_new_tokens=8, stop=None)
    stuffed.flush()
    assert len(stuffed.runner.piece_store) == 0


def test_a_library_chats_first_turn_keeps_its_turn(tokenizer):
    """BlendLLM's chat (LlamaIndex's chat engines) and BlendChatModel mark a first turn as a chat's
    (PromptLayout.chat), as the server does, so its turn is kept; BlendLLM's completions (a query
    engine's single-shot prompt) keep none."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from llama_index.core.llms import ChatMessage

    from ragblend import BlendChatModel, BlendLLM

    system = "Context:\n\n" + PASSAGES[0] + "\n\n" + PASSAGES[1]
    engine = pieces_engine(tokenizer)
    llm = BlendLLM(engine=engine, max_new_tokens=16)
    llm.complete("Who ran it?")
    engine.flush()
    assert len(engine.runner.piece_store) == 0
    llm.chat([ChatMessage(role="system", content=system), ChatMessage(role="user", content="Who ran it?")])
    engine.flush()
    assert len(engine.runner.piece_store) == 1
    engine = pieces_engine(tokenizer)
    BlendChatModel(engine=engine, max_tokens=16).invoke([SystemMessage(system), HumanMessage("Who ran it?")])
    engine.flush()
    assert len(engine.runner.piece_store) == 1
    # a single-shot chain can say so: no background pass, no piece
    single = BlendChatModel(engine=engine, max_tokens=16, keep_first_turns=False)
    single.invoke([SystemMessage(system), HumanMessage("When did it stop?")])
    BlendLLM(engine=engine, max_new_tokens=16, keep_first_turns=False).chat(
        [ChatMessage(role="system", content=system), ChatMessage(role="user", content="Why did it stop?")])
    engine.flush()
    assert len(engine.runner.piece_store) == 1


def test_a_library_chat_through_a_server_is_marked_by_the_server(tokenizer):
    """With base_url, BlendLLM.chat and BlendChatModel send the chat as it is: the server marks its
    chat requests itself (its prompt has no layout to mark), and keeps the first turn."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from llama_index.core.llms import ChatMessage

    from ragblend import BlendChatModel, BlendLLM
    from tests.servers import RunningServer

    system = "Context:\n\n" + PASSAGES[0] + "\n\n" + PASSAGES[1]
    engine = pieces_engine(tokenizer)
    with RunningServer(engine) as server:
        llm = BlendLLM(base_url=server.url, max_new_tokens=8)
        answer = llm.chat([ChatMessage(role="system", content=system), ChatMessage(role="user", content="Who?")])
        assert answer.message.content is not None
        engine.flush()   # as while a user reads the answer (a request arriving meanwhile stops the storing)
        chat = BlendChatModel(base_url=server.url, max_tokens=8)
        assert "".join(c.content for c in chat.stream([SystemMessage(system), HumanMessage("When?")])) is not None
        engine.flush()
    assert len(engine.runner.piece_store) == 2


@pytest.mark.parametrize("spans, history, expect", [
    # the turn from the gap before the question (too short to be a piece) through the answer; the system text
    ([ChunkSpan(30, 60, tuple(range(30)))], True, [list(range(10, 30)), list(range(60, 100))]),
    ([ChunkSpan(30, 60, tuple(range(30)))], False, [list(range(60, 100))]),   # a first turn: the turn alone
    # a gap of 16 or more is a piece of its own; the turn starts at the question
    ([ChunkSpan(30, 40, tuple(range(10)))], True, [list(range(10, 30)), list(range(40, 62)), list(range(62, 100))]),
    ([], True, [list(range(10, 62)), list(range(62, 100))]),
    ([], False, [list(range(62, 100))]),
])
def test_turn_runs(spans, history, expect, monkeypatch):
    monkeypatch.setattr(pieces, "FIRST_TURN_QUESTION_TOKENS", 20)
    ids = list(range(100))   # prompt 0-79 (opening 0-9, question from 62), answer 80-99
    assert pieces.turn_runs(ids, spans, question=62, prompt_tokens=80, start=10, history=history) == expect
    # a first question of over FIRST_TURN_QUESTION_TOKENS (patched to 20) no chunk covers: none
    assert pieces.turn_runs(ids, [], question=40, prompt_tokens=80, start=10, history=False) == []
    # no message boundary after the opening (the plain layout): none
    assert pieces.turn_runs(ids, spans, question=1, prompt_tokens=80, start=10, history=history) == []



def test_turn_runs_keep_control_tokens_that_fusion_never_reuses():
    # A turn is kept whole, control tokens (turn markers) and all, so a short question is kept with its
    # answer; at fusion a piece's span is split around them: their K/V, computed with only the piece
    # before them, strays most from the full prefill's, so they are computed in every prompt.
    ids = list(range(100))   # prompt 0-79 (opening 0-9, question from 62), answer 80-99
    control = frozenset({61, 78, 79})   # the user turn's opening, the question's end, the assistant's opening
    runs = pieces.turn_runs(ids, [], question=62, prompt_tokens=80, start=10, history=True, min_tokens=4)
    assert runs == [list(range(10, 62)), list(range(62, 100))]

    class Finder:   # the turn found in the next prompt at position 200
        MIN_RUN = 4

        def find(self, token_ids, namespaces, start):
            return [ChunkSpan(200, 238, tuple(runs[1]), 0, namespaces[0])]

    layout = pieces.with_pieces(PromptLayout([0] * 200 + runs[1] + [0] * 10, []), Finder(), start=10, end=238,
                                control_ids=control)
    assert [(s.start, s.end, s.offset) for s in layout.chunk_spans] == [(200, 216, 0), (218, 238, 18)]
    assert all(layout.token_ids[s.start:s.end] == list(s.token_ids[s.offset:s.offset + s.end - s.start])
               for s in layout.chunk_spans)


def test_storing_pieces_yields_to_a_request_waiting_for_the_model(tokenizer, monkeypatch, caplog):
    """The pieces of a long turn take seconds to compute on a real model, holding the engine's lock
    pass after pass: a request waiting for the model (a server's next answer) stops them before their
    next layer instead; nothing is stored then, nothing is logged as a failure, and the storing is
    tried again a little later, when nobody waits: the same pieces are stored."""
    engine = pieces_engine(tokenizer)
    monkeypatch.setattr(engine.runner.history, "RETRY_AFTER_S", 0.05)
    history: list = []
    chat(engine, 1, history=history)
    submitted = []
    monkeypatch.setattr(engine.runner.history.background, "submit", lambda fn, *args: submitted.append((fn, args)))
    chat(engine, 1, history=history)   # turn 2: its pieces are handed to the background, here kept aside
    (store, args), = submitted
    before = len(engine.runner.history.piece_store)
    engine.lock.acquire()
    waiter = threading.Thread(target=lambda: (engine.lock.acquire(), engine.lock.release()))
    waiter.start()
    while not engine.lock.waited_for():
        time.sleep(0.001)
    with caplog.at_level("DEBUG", logger="ragblend"):
        store(*args)   # as the background thread would, while a request waits
    engine.lock.release()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and not engine.lock.waited_for()
    assert len(engine.runner.history.piece_store) == before and "yielded" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    deadline = time.monotonic() + 30
    while len(submitted) < 2 and time.monotonic() < deadline:   # the retry, handed to the background
        time.sleep(0.01)
    retry, retry_args = submitted[1]
    assert retry_args[-1] == 1
    retry(*retry_args)
    assert len(engine.runner.history.piece_store) > before
    # A retry due while the interpreter exits (the background thread shut down) is dropped quietly.
    monkeypatch.undo()
    engine.runner.history.background._writer.shutdown()
    engine.runner.history._retry(*retry_args)


def test_background_work_waiting_for_the_model_stops_no_other():
    """Only a request's wait counts (EngineLock.waited_for): a server storing passages, or the KV
    filler, waiting for the model inside ``background()`` does not stop a conversation's pieces
    (else the two starved each other and the pieces were dropped)."""
    from ragblend.core.cancel import EngineLock

    lock = EngineLock()
    lock.acquire()
    for quiet in (True, False):
        def wait():
            with lock.background() if quiet else contextlib.nullcontext():
                with lock:
                    pass

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)   # the waiter blocks on the lock
        assert lock.waited_for() is not quiet
        lock.release()
        waiter.join(timeout=30)
        lock.acquire()
    lock.release()
    assert not lock.waited_for()


def test_a_question_is_never_a_piece_so_a_repeat_is_fused_as_the_first_time(tokenizer):
    engine = pieces_engine(tokenizer)
    segments = [Chunk(PASSAGES[0]), Chunk(PASSAGES[1]), QUESTIONS[0]]   # the question: its last message
    first = engine.generate(segments, max_new_tokens=8, stop=None)
    engine.flush()
    again = engine.generate(segments, max_new_tokens=8, stop=None)
    assert again.stats.history_tokens == 0 and again.text == first.text
    assert (again.logits - first.logits).abs().max() <= 1e-4


def test_another_namespace_never_reuses_a_conversations_pieces(tokenizer):
    engine = pieces_engine(tokenizer)
    history = []
    chat(engine, 2, namespace="tenant-a", history=history)
    for namespace, expect in (("tenant-b", False), ("", False), ("tenant-a", True)):
        layout = engine.find_chunks(QUESTIONS[2], system=f"Context:\n\n{PASSAGES[2]}\n\n{PASSAGES[3]}", history=history,
                                    namespace=namespace)
        pre = engine.prefill(layout)
        assert (pre.stats.history_tokens > 0) is expect, namespace


def test_pieces_of_another_model_or_kv_dtype_are_never_reused(tokenizer):
    store, history = MemoryStore(), []
    llama = pieces_engine(tokenizer, "llama", store=store)
    assert chat(llama, 3, history=history)[2].history_tokens > 0
    pieces = [(ns, ids) for ns, ids in llama.index.finder._chunks if ns == piece_namespace("")]
    # pieces live in the engine's own piece memory, never in the (shared) KV store
    assert pieces and all(llama.ingestion.key_for(ids, namespace=ns) in llama.runner.piece_store for ns, ids in pieces)
    assert not any(llama.ingestion.key_for(ids, namespace=ns) in store for ns, ids in pieces)
    system = f"Context:\n\n{PASSAGES[2]}\n\n{PASSAGES[3]}"
    for other in (pieces_engine(tokenizer, "qwen2", store=store),
                  pieces_engine(tokenizer, "llama", store=store, kv_dtype="int8")):
        # the same ids are other keys: another model's or dtype's pieces are never read
        assert not any(other.ingestion.key_for(ids, namespace=ns) in store for ns, ids in pieces)
        assert not any(other.ingestion.key_for(ids, namespace=ns) in llama.runner.piece_store for ns, ids in pieces)
        layout = other.find_chunks(QUESTIONS[2], system=system, history=history)
        assert other.prefill(layout).stats.history_tokens == 0


def test_pieces_are_off_for_a_named_strategy_or_when_switched_off(tokenizer):
    assert chat(pieces_engine(tokenizer), 3, strategy=FullRecompute())[2].history_tokens == 0
    assert chat(make_tiny_engine("qwen2", tokenizer), 3)[2].history_tokens == 0
    no_memory, submitted = pieces_engine(tokenizer, history_pieces_bytes=0), []   # no memory for them: no pass either
    no_memory.runner.background.submit = lambda fn, *args: submitted.append(fn)
    assert chat(no_memory, 3)[2].history_tokens == 0 and no_memory.runner.history.store_pieces not in submitted
    assert EngineOptions().history_pieces is True   # on by default: only conversations keep any
    read_only = pieces_engine(tokenizer, write_back=False)   # a store kept read-only gets no pieces either
    entries = len(read_only.store)
    assert chat(read_only, 3)[2].history_tokens == 0 and len(read_only.store) == entries


def test_the_pieces_namespace_is_the_engines_own(tokenizer):
    engine = pieces_engine(tokenizer)
    for namespace in (piece_namespace(""), piece_namespace("x")):
        with pytest.raises(InvalidInputError, match="history pieces"):
            engine.find_chunks("Who ran the ferry?", namespace=namespace)
        with pytest.raises(InvalidInputError, match="history pieces"):
            engine.precompute(["a planted piece of someone's conversation"], namespace=namespace)


@pytest.mark.parametrize("spans, expect", [
    ([], [list(range(10, 60))]),
    ([ChunkSpan(35, 50, tuple(range(15)))], [list(range(10, 35))]),   # 50-59: too short
])
def test_piece_runs_are_the_uncovered_text(spans, expect):
    ids = list(range(60))
    assert piece_runs(ids, spans, start=10) == expect
    assert piece_runs(ids, [], start=10, max_tokens=20) == [list(range(10, 30)), list(range(30, 50))]


def test_through_the_server_another_tenant_never_reuses_a_conversations_pieces(tokenizer):
    pytest.importorskip("fastapi")
    import httpx
    import openai

    from tests.servers import RunningServer, wait_idle

    engine = pieces_engine(tokenizer, "llama")
    keys = {"tenant-a-key": "a", "tenant-b-key": "b"}
    with RunningServer(engine, tenants=keys, operator_key="operator-key") as server:
        clients = {name: openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
                   for key, name in keys.items()}

        def ask(name, messages):
            reply = clients[name].chat.completions.create(model="ragblend", messages=messages, max_tokens=24,
                                                          temperature=0)
            wait_idle(server.url)
            engine.flush()   # the pieces are stored in the background
            return reply

        history = []
        for turn in range(2):   # tenant a's conversation, new context in its system message each turn
            messages = [{"role": "system", "content": f"Context:\n\n{PASSAGES[turn]}\n\n{PASSAGES[turn + 1]}"}, *history,
                        {"role": "user", "content": QUESTIONS[turn]}]
            reply = ask("a", messages)
            assert len(engine.runner.piece_store) > 0   # a chat's first turn keeps its turn too
            history += [messages[-1], {"role": "assistant", "content": reply.choices[0].message.content}]
        stored = {namespace for namespace, _ in engine.index.finder._chunks if namespace.startswith("turns:")}
        assert len(stored) == 1 and piece_namespace("") not in stored   # a's own piece namespace only
        third = [{"role": "system", "content": f"Context:\n\n{PASSAGES[2]}\n\n{PASSAGES[3]}"}, *history,
                 {"role": "user", "content": QUESTIONS[2]}]
        b = ask("b", third)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30, headers={"Authorization": "Bearer operator-key"}).text
    # a's second turn found its first (a chat's first turn keeps its turn); /metrics says so
    assert f"ragblend_history_tokens_total {reply.model_extra['ragblend']['history_tokens']}" in metrics
    assert reply.model_extra["ragblend"]["history_tokens"] > 0
    assert f"ragblend_history_pieces_entries {len(engine.runner.piece_store)}" in metrics
    assert "ragblend_history_pieces_bytes" in metrics
    assert b.model_extra["ragblend"]["history_tokens"] == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0


def test_a_single_shot_query_keeps_no_piece_and_costs_no_background_pass(tokenizer):
    engine = pieces_engine(tokenizer)
    submitted = []
    submit = engine.runner.background.submit
    engine.runner.background.submit = lambda fn, *args: (submitted.append(fn), submit(fn, *args))
    system = f"Context:\n\n{PASSAGES[0]}\n\n{PASSAGES[1]}"
    for layout in (engine.find_chunks(QUESTIONS[0], system=system),            # no earlier turn
                   engine.build_prompt([Chunk(PASSAGES[2]), QUESTIONS[1]]),    # segments
                   # context and question as two user messages: still one question, no answer before it
                   engine.find_chunks(QUESTIONS[1], history=[("user", system)])):
        assert layout.conversation is False
        engine.generate(layout, max_new_tokens=16, stop=None)
        engine.flush()
    assert len(engine.runner.piece_store) == 0 and submitted == []
    assert not any(ns.startswith("turns:") for ns, _ in engine.index.finder._chunks)
    # the same question with an earlier turn is a conversation: its turns are kept
    layout = engine.find_chunks(QUESTIONS[1], system=system, history=[("user", QUESTIONS[0]), ("assistant", QUESTIONS[2])])
    assert layout.conversation is True
    engine.generate(layout, max_new_tokens=16, stop=None)
    engine.flush()
    assert len(engine.runner.piece_store) > 0


def test_pieces_never_evict_a_documents_kv_and_the_finder_forgets_evicted_ones(tokenizer):
    probe = pieces_engine(tokenizer)
    chat(probe, 3)
    sizes = [e.nbytes for e in probe.runner.piece_store._entries.values()]
    budget = max(sizes) * 2 + 1   # room for two pieces: a conversation of three turns evicts some
    store = MemoryStore(sum(probe.store.get(k).nbytes for k in probe.store.keys()))   # full with the documents
    engine = pieces_engine(tokenizer, store=store, history_pieces_bytes=budget)
    documents = set(store.keys())
    chat(engine, 3)
    pieces = engine.runner.piece_store
    assert set(store.keys()) == documents   # no document evicted, no piece in the KV store
    assert pieces.evictions > 0 and 0 < pieces.nbytes <= budget
    known = {(ns, ids) for ns, ids in engine.index.finder._chunks if ns.startswith("turns:")}
    assert known == {(e.namespace, tuple(e.token_ids)) for e in pieces._entries.values()}   # evicted ones forgotten


def test_a_forgotten_chunk_is_no_longer_found():
    from ragblend.core.prompt import ChunkFinder

    finder, chunk, other = ChunkFinder(), list(range(100, 140)), list(range(300, 340))
    finder.add(chunk, "turns:")
    finder.add(other, "turns:")
    prompt = [1, 2, *chunk, 3, *other]
    assert len(finder.find(prompt, ["turns:"])) == 2
    finder.remove(chunk, "turns:")
    assert [s.token_ids for s in finder.find(prompt, ["turns:"])] == [tuple(other)] and len(finder) == 1


def test_a_question_before_an_assistants_prefill_is_the_question(tokenizer):
    engine = pieces_engine(tokenizer)
    turns = [{"role": "system", "content": "Context:\n\n" + PASSAGES[0]}, {"role": "user", "content": QUESTIONS[0]},
             {"role": "assistant", "content": QUESTIONS[2]}, {"role": "user", "content": QUESTIONS[1]}]
    question = engine.prompts.tokenize(QUESTIONS[1])

    def start_of(ids, part):
        return next(i for i in range(len(ids)) if ids[i:i + len(part)] == part)

    asked = engine.prompts.chat_ids(turns)
    prefilled = engine.prompts.chat_ids([*turns, {"role": "assistant", "content": "Answer:"}], add_generation_prompt=False)
    for ids in (asked, prefilled):
        assert engine.runner.last_message_start(ids) <= start_of(ids, question)
        assert engine.runner.last_message_start(ids) > start_of(ids, engine.prompts.tokenize(QUESTIONS[2]))
    # answered, the pre-filled prompt's question is kept with its turn, but never found in a repeat of
    # the prompt, where it is the question (the repeat is fused as the first time)
    engine.generate(engine.find_chunks_in_ids(prefilled, conversation=True), max_new_tokens=8, stop=None)
    engine.flush()
    assert any(tuple(question[:16]) == ids[k:k + 16] for ns, ids in engine.index.finder._chunks
               if ns.startswith("turns:") for k in range(len(ids)))
    engine.prefill(engine.find_chunks_in_ids(prefilled, conversation=True))
    start = engine.runner.last_message_start(prefilled)
    assert all(s.end <= start for s in engine.last_prompt.chunk_spans if is_piece(s))


def test_pieces_an_older_version_left_in_the_kv_store_do_not_hide_new_ones(tokenizer):
    """Before pieces had their own memory they were stored in the KV store: such entries are passed
    over, and the same pieces computed into the pieces' memory are still found."""
    fresh = chat(pieces_engine(tokenizer, "llama"), 3)
    reference = pieces_engine(tokenizer, "llama")
    chat(reference, 3)
    store = MemoryStore()
    planter = pieces_engine(tokenizer, "llama", store=store)
    for entry in reference.runner.piece_store._entries.values():   # as the older version stored them
        planter.ingestion.precompute_ids([list(entry.token_ids)], store, batch_tokens=4096, namespace=entry.namespace)
    engine = pieces_engine(tokenizer, "llama", store=store)
    stats = chat(engine, 3)
    assert fresh[2].history_tokens > 0
    assert stats[2].history_tokens == fresh[2].history_tokens


def test_describe_reports_the_history_pieces(tokenizer, capsys):
    from ragblend.cli.info import _print_history_pieces

    engine = pieces_engine(tokenizer)
    chat(engine, 2)
    pieces = engine.describe().history_pieces
    assert pieces["entries"] == len(engine.runner.piece_store) > 0
    assert 0 < pieces["bytes"] <= pieces["max_bytes"] == engine.options.history_pieces_bytes
    _print_history_pieces(pieces)
    assert f"{pieces['entries']} entries" in capsys.readouterr().out
    assert make_tiny_engine("llama", tokenizer, history_pieces=True, history_pieces_bytes=0).describe().history_pieces == {}


def test_a_turn_the_prefix_tier_served_keeps_only_its_own_piece(tokenizer):
    """Where the prefix tier serves a turn up to its question (the context stayed), no piece is
    marked in it and its earlier turns were kept when answered: only the new turn is computed,
    not the unmarked history cut into new runs (more of them every turn)."""
    engine = pieces_engine(tokenizer, "qwen3", prefix_cache_bytes=64 << 20)   # its answers are text it can read back
    computed = []
    compute = engine.ingestion.compute_entries
    engine.ingestion.compute_entries = lambda runs, *args: computed.append(sum(map(len, runs))) or compute(runs, *args)
    system, history = "Context:\n\n" + PASSAGES[0], []
    for turn in range(3):
        layout = engine.find_chunks(QUESTIONS[turn], system=system, history=history)
        layout = layout if history else dataclasses.replace(layout, chat=True)
        out = engine.generate(layout, max_new_tokens=4, stop=None)
        engine.flush()
        assert engine.prompts.tokenize(out.text) == out.token_ids   # what the next prompt holds
        history += [("user", QUESTIONS[turn]), ("assistant", out.text)]
    assert out.stats.prefix_tokens >= engine.runner.last_message_start(layout.token_ids)   # the tier served the history
    question_and_answer = len(layout.token_ids) - out.stats.prefix_tokens + len(out.token_ids)
    assert 0 < computed[-1] <= question_and_answer + 8, computed   # + a few template tokens
