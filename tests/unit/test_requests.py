"""The server's request bodies as pydantic models (serving.requests): each bad field an
OpenAI-shaped 400 naming it, worded as before; one conversion to SamplingParams; the server's
limits declared once (serving.options) and used by ``ragblend serve``'s flags."""

import pytest

pytest.importorskip("pydantic")

from ragblend.core.decode.generate import SamplingParams, sampling_params  # noqa: E402
from ragblend.core.errors import InvalidInputError  # noqa: E402
from ragblend.core.fusion.strategies import STRATEGY_NAMES, strategy_from_name, takes_ratio  # noqa: E402
from ragblend.serving.options import SERVER_DEFAULTS  # noqa: E402
from ragblend.serving.protocol import ERROR_CODES, ApiError  # noqa: E402
from ragblend.serving.requests import ChunksRequest, CompletionOptions, TokenizeRequest, cache_salt  # noqa: E402

BAD = [
    ({"stream": 1}, "stream", "invalid_type", "stream must be true or false."),
    ({"stream_options": 3}, "stream_options", "invalid_type",
     "stream_options must be an object such as {\"include_usage\": true}."),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_type",
     "stream_options.include_usage must be true or false."),
    ({"user": 7}, "user", "invalid_type", "user must be a string."),
    ({"cache_salt": ""}, "cache_salt", "invalid_value",
     "cache_salt must be a non-empty string of at most 1024 characters."),
    ({"max_tokens": 0}, "max_tokens", "invalid_value", "max_tokens must be an integer >= 1, got 0."),
    ({"max_tokens": True}, "max_tokens", "invalid_type", "max_tokens must be an integer >= 1, got True."),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens", "invalid_type",
     "max_completion_tokens must be an integer >= 1, got 2.5."),
    ({"n": 2}, "n", "unsupported_parameter", "n must be 1: this server answers one choice per request (got 2)."),
    ({"n": "2"}, "n", "invalid_type", "n must be 1: this server answers one choice per request (got '2')."),
    ({"temperature": float("inf")}, "temperature", "invalid_value",
     "temperature must be a number from 0 to 2, got inf."),
    ({"temperature": "1"}, "temperature", "invalid_type", "temperature must be a number from 0 to 2, got '1'."),
    ({"top_p": 0}, "top_p", "invalid_value", "top_p must be a number in (0, 1], got 0."),
    ({"seed": 2**63}, "seed", "invalid_value", f"seed must be an integer in [0, 2**63), got {2**63}."),
    ({"stop": 5}, "stop", "invalid_type",
     "stop must be a non-empty string or a list of at most 16 non-empty strings."),
    ({"stop": ["a", ""]}, "stop", "invalid_value",
     "stop must be a non-empty string or a list of at most 16 non-empty strings."),
    ({"stop": ["a"] * 17}, "stop", "invalid_value",
     "stop must be a non-empty string or a list of at most 16 non-empty strings."),
    ({"logprobs": True}, "logprobs", "unsupported_parameter",
     "logprobs is not supported: this server does not implement log probabilities. Leave the field out."),
    ({"max_tokens": 8, "max_completion_tokens": 16}, "max_tokens", "invalid_value",
     "max_tokens (8) and max_completion_tokens (16) differ; send one of them (max_completion_tokens: OpenAI's chat "
     "API deprecates max_tokens for it) or the same value in both."),
]


@pytest.mark.parametrize("body, param, code, message", BAD, ids=[f"{param}-{code}" for _, param, code, _ in BAD])
def test_each_bad_field_is_a_400_naming_it_and_its_openai_code(body, param, code, message):
    with pytest.raises(ApiError) as caught:
        CompletionOptions.of({"model": "x", "messages": [], **body})   # fields read elsewhere are left to their readers
    assert (caught.value.status, caught.value.param, caught.value.code, caught.value.message) == \
        (400, param, code, message)
    assert caught.value.body()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": code}
    assert code in ERROR_CODES


def test_max_tokens_and_max_completion_tokens_alike_or_alone():
    assert CompletionOptions.of({"max_tokens": 7, "max_completion_tokens": 7}).requested_tokens == 7
    assert CompletionOptions.of({"max_tokens": 7}).requested_tokens == 7            # the legacy name, alone
    assert CompletionOptions.of({"max_completion_tokens": 7}).requested_tokens == 7
    assert CompletionOptions.of({"max_tokens": None, "max_completion_tokens": 7}).requested_tokens == 7
    with pytest.raises(ApiError, match="max_tokens must be an integer"):   # checked even beside the newer name
        CompletionOptions.of({"max_tokens": "ignored", "max_completion_tokens": 5})


def test_a_value_that_rounds_to_zero_in_float32_is_refused_by_its_own_check():
    with pytest.raises(ApiError, match="rounds to zero or to a subnormal number in float32") as caught:
        CompletionOptions.of({"temperature": 1, "top_p": 1e-300})
    assert caught.value.param == "top_p"


def test_to_sampling_params_is_the_one_conversion():
    options = CompletionOptions.of({"max_completion_tokens": 5, "stop": "END", "seed": 3})
    assert options.to_sampling_params(room=100) == SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1.0,
                                                                  seed=3, stop=("END",))
    assert CompletionOptions.of({}).to_sampling_params(room=40).max_new_tokens == 40   # the window's room
    assert CompletionOptions.of({"max_tokens": 500}).to_sampling_params(room=40).max_new_tokens == 40
    assert CompletionOptions.of({"stream_options": {"include_usage": True}}).include_usage
    assert CompletionOptions.of({"ragblend": {"strategy": "cacheblend", "ratio": 0.4}}).strategy() == \
        strategy_from_name("cacheblend", 0.4)
    with pytest.raises(ApiError, match="ragblend must be an object") as caught:
        CompletionOptions.of({"ragblend": 3}).strategy()
    assert caught.value.code == "invalid_type"


def test_chunks_and_tokenize_bodies():
    assert ChunksRequest.of({"texts": ["a", "b"], "cache_salt": "s"}).texts == ["a", "b"]
    for body, code, message in (
            ({}, "missing_required_parameter", "texts must be a non-empty list"),
            ({"texts": None}, "missing_required_parameter", "texts must be a non-empty list"),
            ({"texts": []}, "invalid_value", "texts must be a non-empty list"),
            ({"texts": ["a", 3]}, "invalid_type", "texts must be"),
            ({"texts": ["a"] * 1025}, "invalid_value", "texts has 1025 texts; send at most 1024"),
            ({"texts": ["a"], "skip_unusable": 1}, "invalid_type", "skip_unusable must be true or false.")):
        with pytest.raises(ApiError, match=message) as caught:
            ChunksRequest.of(body)
        assert (caught.value.param, caught.value.code) == ("texts" if "texts" in message else "skip_unusable", code)
    with pytest.raises(ApiError, match="tools is not supported by this server's /tokenize") as caught:
        TokenizeRequest.of({"prompt": "x", "tools": [{"type": "function"}]})
    assert caught.value.code == "unsupported_parameter"
    with pytest.raises(ApiError, match="add_special_tokens must be true or false."):
        TokenizeRequest.of({"prompt": "x", "add_special_tokens": "no"})
    assert cache_salt({}) == "" and cache_salt({"cache_salt": "tenant-a"}) == "tenant-a"


def test_sampling_keywords_are_samplingparams_fields():
    assert sampling_params(max_new_tokens=3, stop="x") == SamplingParams(max_new_tokens=3, stop=("x",))
    with pytest.raises(InvalidInputError, match="'top_k' is not a sampling option; SamplingParams takes"):
        sampling_params(top_k=3)
    with pytest.raises(InvalidInputError, match="not both"):
        sampling_params(SamplingParams(), temperature=0.5)


def test_which_strategies_take_a_ratio_is_said_once():
    for name in STRATEGY_NAMES:
        if takes_ratio(name):   # the strategy built carries the ratio (the app's slider sets it)
            assert strategy_from_name(name, 0.5).ratio == 0.5
        else:
            with pytest.raises(InvalidInputError, match="takes no ratio"):
                strategy_from_name(name, 0.5)


def test_serve_flags_default_to_the_server_options():
    from ragblend.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.queue_size, args.timeout, args.max_batch) == (SERVER_DEFAULTS.queue_size,
                                                              SERVER_DEFAULTS.request_timeout_s,
                                                              SERVER_DEFAULTS.max_batch)
    assert int(args.max_kv_mb * 2**20) == SERVER_DEFAULTS.max_kv_bytes
    assert int(args.max_body_mb * 2**20) == SERVER_DEFAULTS.max_body_bytes


@pytest.mark.parametrize("salt", [5, ""])
def test_tokenize_refuses_a_bad_cache_salt_as_completions_do(salt):
    with pytest.raises(ApiError) as caught:
        TokenizeRequest.of({"cache_salt": salt})
    assert caught.value.status == 400 and caught.value.param == "cache_salt"
