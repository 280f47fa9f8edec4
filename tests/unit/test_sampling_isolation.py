"""One request's failure is its own (issue 58, item 3): random sampling settings thrown at the
server's batched worker (serving.worker over a tiny random model, the server's own request path
without HTTP), beside fixed greedy answers decoding in the same batch. Every setting either
answers or gets a clear 400 naming its field, and the greedy answers never change. Settings that
slip past the checks (forced onto SamplingParams) may fail their own answer, never another's."""

import queue

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ragblend.core.decode.batching import kv_bytes_for  # noqa: E402
from ragblend.core.decode.generate import MIN_SAMPLING_VALUE, SamplingParams  # noqa: E402
from ragblend.core.errors import InvalidInputError  # noqa: E402
from ragblend.core.fusion.strategies import FullRecompute  # noqa: E402
from ragblend.serving.app import Server, _decode_job  # noqa: E402
from ragblend.serving.protocol import ApiError, ChatPrompt  # noqa: E402
from ragblend.serving.requests import check_options, sampling_fields  # noqa: E402
from ragblend.serving.worker import Decode, Job  # noqa: E402

from ..conftest import make_tiny_engine  # noqa: E402

FULL = {"strategy": "full_recompute"}   # every answer computes its whole prompt: no reuse between examples
GREEDY = ["Who ran the ferry between the two islands?", "When was the lighthouse first lit?",
          "How are rye loaves proofed in the village bakery?"]
BAD_QUESTION = "Tell me about the harbour."
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "max_tokens", "max_completion_tokens", "stop", "n",
                   "presence_penalty", "frequency_penalty")

# Values at the edges of what float32 (where sampling computes) and the protocol can hold.
EDGE_FLOATS = [0, 0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e-39, MIN_SAMPLING_VALUE, MIN_SAMPLING_VALUE * 0.999,
               1e-30, 1e-7, 0.5, 1, 1.0, 1.0000001, 2, 2.0000001, -1, 1e300, float("inf"), float("nan"), True]
numbers = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(0, 2), st.integers(-3, 3))
odd_values = st.sampled_from(["1", [1], {"a": 1}, None])
# Anything in the fields, and (so that many examples reach the worker) values the checks accept.
wild = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(numbers, odd_values),
    "top_p": st.one_of(numbers, odd_values),
    "seed": st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 2**63 - 1, 2**63, -1, 1.5, True]), odd_values),
    "max_tokens": st.one_of(st.integers(-2, 40), st.sampled_from([0, True, 2.5]), odd_values),
    "max_completion_tokens": st.one_of(st.integers(-1, 8), odd_values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20), odd_values),
    "n": st.one_of(st.integers(0, 2), odd_values),
    "presence_penalty": st.one_of(numbers, odd_values),
    "frequency_penalty": st.one_of(numbers, odd_values),
})
valid = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.sampled_from([0, MIN_SAMPLING_VALUE, 1e-30, 2]), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([MIN_SAMPLING_VALUE, 1e-30, 1]), st.floats(MIN_SAMPLING_VALUE, 1)),
    "seed": st.integers(0, 2**63 - 1),
    "max_tokens": st.integers(1, 40),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "presence_penalty": st.just(0),
})
bodies = st.integers(0, 2).flatmap(lambda k: wild if k == 0 else valid)   # two in three valid
# Sampling values set on SamplingParams past its checks, as a value that slipped through would be.
forced_values = st.fixed_dictionaries({
    "temperature": st.sampled_from([1.0, 1e-300, 5e-324, 1e-45, float("nan"), float("inf"), 2.0]),
    "top_p": st.sampled_from([1.0, 1e-300, 5e-324, 1e-45, 0.0, -1.0, float("nan"), 0.5]),
})
forced = st.integers(0, 3).flatmap(lambda k: forced_values if k == 0 else st.none())   # one in four


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = make_tiny_engine("qwen2", tokenizer)
    return Server(engine, queue_size=16, request_timeout_s=60, max_body_bytes=1 << 20, model_name="x",
                  max_batch=8, max_kv_bytes=None)


class Outcome:
    """A job's events, as the request handler would see them."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.text = ""

    def wait(self, timeout: float = 60):
        """("done", stats) or ("error", exception), with the text streamed before."""
        while True:
            kind, value = self.events.get(timeout=timeout)
            if kind == "item":
                self.text += value
            elif kind in ("done", "error"):
                return kind, value


def submit(server: Server, run) -> Outcome:
    outcome = Outcome()
    server.worker.submit(Job(run, outcome.events.put))
    return outcome


def chat_job(server: Server, body: dict, question: str):
    """The chat endpoint's job for ``body`` (serving.app._decode_job: sampling checked in the worker)."""
    prompt = ChatPrompt.parse([{"role": "user", "content": question}], server.limit)
    return _decode_job(server, {**body, "ragblend": FULL}, lambda: prompt.layout(server.engine))


def forced_job(server: Server, values: dict):
    """A job whose SamplingParams carry ``values`` past their checks (max 8 tokens)."""
    engine = server.engine
    prompt = ChatPrompt.parse([{"role": "user", "content": BAD_QUESTION}], server.limit)

    def run(job):
        layout = prompt.layout(engine)
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        for name, value in values.items():
            object.__setattr__(params, name, value)
        positions = len(layout.token_ids) + params.max_new_tokens
        return Decode(lambda: engine.begin(layout, strategy=FullRecompute(), params=params),
                      kv_bytes_for(engine.adapter, positions), engine.finish)
    return run


def greedy_body() -> dict:
    return {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def alone(server):
    """Each greedy answer decoded on its own."""
    answers = []
    for question in GREEDY:
        kind, _ = (outcome := submit(server, chat_job(server, greedy_body(), question))).wait()
        assert kind == "done"
        answers.append(outcome.text)
    assert all(answers)
    return answers


@settings(max_examples=25, deadline=30_000, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies, force=forced)
def test_random_sampling_settings_never_fail_a_batch_mate(server, alone, body, force):
    if force is None:
        try:   # the handler's checks, before any job is queued
            check_options(body)
        except ApiError as err:
            assert err.status == 400 and err.param in SAMPLING_FIELDS and err.param in err.message, err.message
            event("refused by the checks")
            return
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body = {**body, "max_tokens": 16}   # not the window's room: ~2,000 tokens here
        run = chat_job(server, body, BAD_QUESTION)
    else:
        run = forced_job(server, force)
    greedy = [submit(server, chat_job(server, greedy_body(), q)) for q in GREEDY]
    bad = submit(server, run)
    assert [(g.wait(), g.text)[1] for g in greedy] == alone   # every batch-mate answers as alone
    kind, value = bad.wait()
    event(f"{'forced past the checks' if force is not None else 'accepted'}: {kind}")
    if force is not None:   # past the checks: it may fail, but only itself (checked above)
        assert kind == "done" or isinstance(value, Exception)
    else:   # accepted by the checks: it answers
        assert kind == "done", f"{body} was accepted, then failed: {type(value).__name__}: {value}"
        assert value.finish_reason in ("stop", "length")
        # An unseeded sample may draw the end token first: no tokens, stopped -- still an answer.
        assert value.generated_tokens >= 1 or value.finish_reason == "stop"


def test_the_batches_really_held_several_answers(server, alone):
    # Three greedy answers and a sampled one submitted together decode in one batch.
    outcomes = [submit(server, chat_job(server, greedy_body(), q)) for q in GREEDY]
    outcomes.append(submit(server, chat_job(server, {"temperature": 1, "top_p": 0.9, "max_tokens": 12}, BAD_QUESTION)))
    assert [o.wait()[0] for o in outcomes] == ["done"] * 4
    assert server.worker.batch.most_rows >= 3


@pytest.mark.parametrize("values", [{"top_p": 1e-300}, {"temperature": 1e-300}, {"top_p": 0.0}],
                         ids=["top_p rounds to 0", "temperature rounds to 0", "top_p 0"])
def test_a_draw_that_fails_mid_batch_ends_only_its_answer(server, alone, values):
    """The issue's case, past the checks: sampling raises in the batch step; the others go on."""
    greedy = [submit(server, chat_job(server, greedy_body(), q)) for q in GREEDY]
    bad = submit(server, forced_job(server, values))
    texts = [(g.wait(), g.text) for g in greedy]
    assert [kind for (kind, _), _ in texts] == ["done"] * 3 and [t for _, t in texts] == alone
    kind, err = bad.wait()
    assert kind == "error" and isinstance(err, RuntimeError)   # torch.multinomial refused the distribution
    assert server.worker.depth == 0 and not len(server.worker.batch)


@pytest.mark.parametrize("field, value", [("top_p", 1e-300), ("temperature", 1e-300), ("top_p", 5e-324),
                                          ("temperature", 1e-39), ("top_p", MIN_SAMPLING_VALUE * 0.999)])
def test_values_that_round_to_zero_or_subnormal_in_float32_are_a_400(field, value):
    with pytest.raises(ApiError, match="rounds to zero or to a subnormal number in float32") as caught:
        sampling_fields({"temperature": 1, field: value})
    assert caught.value.status == 400 and caught.value.param == field
    sampling_fields({"temperature": 1, field: MIN_SAMPLING_VALUE})   # the smallest accepted


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_sampling_params_refuse_what_rounds_to_zero_in_float32(field):
    for value in (1e-300, 5e-324, 1e-46):
        with pytest.raises(InvalidInputError, match="rounds to zero in float32"):
            SamplingParams(**{"temperature": 1, field: value})
    SamplingParams(**{"temperature": 1, field: 1e-40})   # subnormal, not zero: a tiny temperature samples greedily
    SamplingParams(temperature=1e300)   # past float32's range: no overflow in the check
