"""Property: any JSON body gets 200 or a 4xx in OpenAI's error shape naming what to fix,
never a 500; a good request succeeds right after; nothing is left running."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from http_fake_service import FakeService
from shiftjax.serving.server.http_server import create_app

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)
probability = st.floats(-0.5, 1.5)
# Values near the valid range, so that the search reaches past the first refusal.
COMMON = {
    "model": st.sampled_from(["fake-model", "other"]), "max_tokens": st.integers(-1, 300),
    "temperature": st.floats(-1, 3), "top_p": probability, "seed": st.integers(-1, 2**31),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": st.text(max_size=4),
    "top_k": st.integers(-2, 50), "min_p": probability, "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-1, 0x3001), max_size=3), "n": st.integers(0, 3),
    "presence_penalty": st.sampled_from([0, 0.0, 0.5]), "frequency_penalty": st.sampled_from([0, -0.5]),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "50"]), st.integers(-100, 100), max_size=2),
}
COMPLETION_FIELDS = COMMON | {
    "prompt": st.one_of(st.text(max_size=6), st.lists(st.integers(-2, 0x3001), max_size=4),
                        st.lists(st.text(max_size=3), max_size=3),
                        st.lists(st.lists(st.integers(-1, 0x3001), max_size=3), max_size=3)),
    "logprobs": st.integers(-1, 25), "best_of": st.integers(0, 3), "echo": st.booleans(),
    "suffix": st.one_of(st.none(), st.text(max_size=2)),
}
CHAT_FIELDS = COMMON | {
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
         "content": st.one_of(st.text(max_size=10), st.none(),
                              st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                              "text": st.text(max_size=4)}), max_size=2))}),
        max_size=3),
    "max_completion_tokens": st.integers(-1, 300), "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.lists(st.just({"type": "function", "function": {"name": "f"}}), max_size=1),
    "tool_choice": st.sampled_from(["none", "auto"]), "parallel_tool_calls": st.booleans(),
}


def bodies(fields: dict, required: str):
    """Near-valid values for known fields, sometimes one field set to anything, sometimes
    an unknown field, sometimes the required field missing."""
    known = st.fixed_dictionaries({required: fields[required]},
                                  optional={name: good for name, good in fields.items() if name != required})
    anything = st.one_of(st.just({}), st.just({}), st.builds(lambda k, v: {k: v}, st.sampled_from(sorted(fields)), values),
                         st.builds(lambda k: {k: None}, st.just(required)))
    unknown = st.one_of(st.just({}), st.just({}), st.just({}),
                        st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in fields), values,
                                        min_size=1, max_size=1))
    return st.tuples(known, anything, unknown).map(
        lambda t: {k: v for k, v in (t[2] | t[0] | t[1]).items() if not (k == required and v is None)})


@pytest.fixture(scope="module")
def served():
    service = FakeService()
    with TestClient(create_app(service, model_name="fake-model")) as client:
        yield service, client


def check(service, client, path, body, good):
    r = client.post(path, json=body)
    assert r.status_code in (200, 400, 404, 429), (body, r.status_code, r.text)
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
            assert all("error" not in json.loads(line[6:]) for line in r.text.split("\n\n")
                       if line.startswith("data: {"))
    else:
        error = r.json()["error"]
        assert error["message"] and error["type"]
        if r.status_code == 400:
            assert isinstance(error["param"], str) and error["param"], body
    assert client.post(path, json=good).status_code == 200
    assert not service.live


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(COMPLETION_FIELDS, "prompt"))
def test_completions_bodies(served, body):
    service, client = served
    check(service, client, "/v1/completions", body, {"prompt": "hi", "max_tokens": 2})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(CHAT_FIELDS, "messages"))
def test_chat_bodies(served, body):
    service, client = served
    check(service, client, "/v1/chat/completions", body, {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2})
