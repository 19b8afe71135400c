"""The HTTP front end against a deterministic fake service: shapes, parameters, errors."""

import json

import pytest
from fastapi.testclient import TestClient

from http_fake_service import EOS, REPLY, FakeService, logprob_of
from shiftjax.serving.server.http_server import create_app
from shiftjax.serving.server.metrics import Metrics

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CHAT_PROMPT = "[system]Be brief.\n[user]hi\n[assistant]"


@pytest.fixture
def service():
    return FakeService()


@pytest.fixture
def client(service):
    with TestClient(create_app(service, model_name="fake-model", metrics=Metrics())) as client:
        yield client


def events(response) -> list:
    """The SSE data payloads of a response, JSON-decoded, "[DONE]" kept as the string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_text_usage_and_logprobs(client, service):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 5, "logprobs": 1})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 7
    lp = choice["logprobs"]
    assert lp["tokens"] == list("Hello")
    assert lp["token_logprobs"] == [logprob_of(i) for i in range(5)]
    assert lp["top_logprobs"] == [{c: logprob_of(i)} for i, c in enumerate("Hello")]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    (submitted,) = service.submitted
    assert submitted.prompt_ids == (ord("h"), ord("i"))
    assert submitted.params.logprobs and submitted.params.top_logprobs == 1


def test_sampling_parameters_reach_the_service(client, service):
    r = client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "seed": 1234, "top_k": 5, "min_p": 0.05,
        "stop": ["xyz", "!"], "stop_token_ids": [7], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello, wörld"  # cut before the stop string
    assert r.json()["choices"][0]["stop_reason"] == "!"
    params = service.submitted[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.top_k, params.min_p) == \
        (40, 0.7, 0.9, 1234, 5, 0.05)
    assert params.stop == ("xyz", "!") and params.stop_token_ids == (7,) and params.ignore_eos
    assert service.submitted[0].cache_salt is None


def test_cache_salt_reaches_every_prompt_of_the_request(client, service):
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "cache_salt": "tenant-b"})
    assert r.status_code == 200, r.text
    assert [request.cache_salt for request in service.submitted] == ["tenant-a", "tenant-a", "tenant-b"]


def test_disable_speculation_reaches_every_prompt_of_the_request_and_defaults_to_off(client, service):
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "disable_speculation": True})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "disable_speculation": True})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "stream": True,
                                                  "disable_speculation": False})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [request.params.disable_speculation for request in service.submitted] == [True, True, True, False, False]


def test_openai_defaults(client, service):
    client.post("/v1/completions", json={"prompt": "hi", "top_k": -1, "stop": "Q"})
    client.post("/v1/completions", json={"prompt": "hi"})
    first, second = (r.params for r in service.submitted)
    assert first.max_tokens == 16  # the OpenAI API's completions default
    assert first.temperature == 1.0 and first.top_p == 1.0 and first.top_k == 0 and first.stop == ("Q",)
    assert first.seed != second.seed  # no seed given: each call samples afresh
    client.post("/v1/chat/completions", json={"messages": CHAT})
    chat = service.submitted[-1]
    assert chat.params.max_tokens == service.max_model_len - len(CHAT_PROMPT)  # chat: what the context allows


def test_token_id_prompts_and_several_prompts(client, service):
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "He"
    assert service.submitted[-1].prompt_ids == (104, 105)

    r = client.post("/v1/completions", json={"prompt": ["a", "bc", "def"], "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "Hel" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.prompt_ids for r in service.submitted[-3:]] == [(97,), (98, 99), (100, 101, 102)]

    r = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert [c["text"] for c in r.json()["choices"]] == ["H", "H"]
    assert [r.prompt_ids for r in service.submitted[-2:]] == [(1, 2), (3,)]
    assert not service.live


def test_completion_stream_matches_the_plain_reply(client):
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "logprobs": 0}).json()
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "logprobs": 0, "stream": True})
    chunks = events(r)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert all("usage" not in c for c in chunks)  # not asked for
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"] == "Hello, w"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 7 + ["length"]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == plain["choices"][0]["logprobs"]["text_offset"] == list(range(8))
    assert all(c["choices"][0]["logprobs"]["top_logprobs"] == [{}] for c in chunks)  # logprobs=0: no alternatives


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(client, service):
    """One chunk per token, as vLLM streams (the bench's ITL counts chunks): a token whose
    text the detokenizer holds back (an incomplete character) streams empty text, and the
    text arrives with the next token."""
    service.hold_back = {3}
    for path, body, text_of in [
            ("/v1/completions", {"prompt": "hi"}, lambda c: c["choices"][0]["text"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             lambda c: c["choices"][0]["delta"].get("content", ""))]:
        chunks = events(client.post(path, json=body | {"max_tokens": 6, "stream": True}))[:-1]
        texts = [text_of(c) for c in chunks if c["choices"][0].get("delta", {}).get("role") is None]
        assert texts == ["H", "e", "l", "", "lo", ","], (path, texts)


def test_stream_usage_when_asked(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 2, "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = events(r)[:-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "He", 1: "He"}


def test_chat_reply_and_logprobs(client, service):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 9, "logprobs": True,
                                                  "top_logprobs": 2})
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello, wö"}
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == list("Hello, wö")
    assert content[8]["bytes"] == list("ö".encode()) and content[8]["logprob"] == logprob_of(8)
    assert content[0]["top_logprobs"] == [{"token": "H", "logprob": logprob_of(0), "bytes": [72]},
                                          {"token": "x", "logprob": -8.0, "bytes": [120]}]
    assert service.submitted[0].prompt_ids == tuple(ord(c) for c in CHAT_PROMPT)
    assert body["usage"]["prompt_tokens"] == len(CHAT_PROMPT) and body["usage"]["completion_tokens"] == 9


def test_chat_text_parts_and_developer_role(client, service):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "hi"}]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200
    assert service.submitted[0].prompt_ids == tuple(ord(c) for c in CHAT_PROMPT)


def test_chat_stream(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "stop": ",",
                                                  "stream_options": {"include_usage": True}})
    chunks = events(r)
    assert chunks[-1] == "[DONE]"
    first, *middle, last, usage = chunks[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in middle + [last]) == "Hello"
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == ","
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


def test_eos_ends_the_reply_without_text(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
    (choice,) = r.json()["choices"]
    assert choice["text"] == REPLY and choice["finish_reason"] == "stop" and chr(EOS) not in choice["text"]
    assert r.json()["usage"]["completion_tokens"] == len(REPLY) + 1


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"logit_bias": {"50": 10}}, "logit_bias"),
    ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 255}, "max_tokens"),  # past the fake's max_model_len with the prompt
    ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"stream": 1}, "stream"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt.1"),
    ({"prompt": [[5], [1, -2]]}, "prompt.1"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"cache_salt": ["tenant"]}, "cache_salt"),
    ({"cache_salt": ""}, "cache_salt"),  # refused, as vLLM refuses it, rather than read as no salt
    ({"disable_speculation": "yes"}, "disable_speculation"),
    ({"disable_speculation": 1}, "disable_speculation"),  # strict: 1 is not a bool, as for stream
    ({"disable_speculation": None}, "disable_speculation"),
])
def test_completion_refusals_name_the_field(client, service, extra, param):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"]
    assert not service.live  # nothing left running from a refused request


@pytest.mark.parametrize("extra, param", [
    ({"n": 3}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"cache_salt": 1.5}, "cache_salt"),
    ({"cache_salt": {"tenant": "a"}}, "cache_salt"),
    ({"disable_speculation": "true"}, "disable_speculation"),
    ({"disable_speculation": [True]}, "disable_speculation"),
])
def test_chat_refusals_name_the_field(client, extra, param):
    r = client.post("/v1/chat/completions", json={"messages": CHAT} | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_neutral_values_of_unimplemented_parameters_are_accepted(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 1, "best_of": 1, "echo": False,
                                             "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                                             "suffix": None, "user": "u1"})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "tools": [],
                                                  "tool_choice": "none", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_body_and_model_errors(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = client.post("/v1/completions", json=["a list"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/nothing").status_code == 404
    assert "error" in client.get("/v1/nothing").json()


def test_overloaded_unavailable_and_failed(client, service):
    service.capacity = 2
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert not service.live
    service.capacity = None

    service.ready = False
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
    assert client.get("/health").status_code == 503
    service.ready = True
    assert client.get("/health").status_code == 200
    service.draining = True
    assert client.get("/health").json() == {"status": "draining"}
    service.draining = False
    service.ready, service.error = False, "the engine failed 3 steps in a row"
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "error", "message": service.error}
    service.ready, service.error = True, None

    service.fail_after = 3
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    chunks = events(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:3]) == "Hel"
    assert chunks[3]["error"]["type"] == "server_error" and chunks[4] == "[DONE]"
    service.fail_after, service.raise_after = None, 2
    chunks = events(client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True}))
    assert chunks[-2]["error"]["message"] == "the fake failed" and chunks[-1] == "[DONE]"
    assert client.post("/v1/chat/completions", json={"messages": CHAT}).status_code == 500
    service.raise_after = None
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()["choices"][0]["text"] == "Hel"
    assert not service.live


def test_a_refused_prompt_cancels_the_prompts_already_submitted(client, service):
    service.capacity = 2
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert r.status_code == 429
    assert len(service.submitted) == 2
    assert len(service.cancelled) == 2 and all(rid.endswith(("-0", "-1")) for rid in service.cancelled)
    assert not service.live


def test_models_health_and_metrics(client, service):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 256
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert client.get("/v1/models/other").status_code == 404
    assert client.get("/health").json() == {"status": "ok"}
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "shiftjax_kv_pages 64.0" in metrics.text  # read from the service's stats


def test_api_key(service):
    with TestClient(create_app(service, model_name="m", api_key="s3cret")) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # gRPC's rule too (validation.bearer_token_matches): the scheme in any case, the token exact
        for header, status in [("bearer s3cret", 200), ("Bearer  s3cret", 200), ("Bearer s3cret2", 401),
                               ("Bearers3cret", 401)]:
            assert client.get("/v1/models", headers={"Authorization": header}).status_code == status, header
        assert client.get("/health").status_code == 200  # open, for load balancers
        assert client.get("/metrics").status_code == 404  # no Metrics given: no route
        assert not service.submitted[1:]  # only the authorised request reached the service


def test_token_bytes_of_a_byte_level_tokenizer():
    """Pieces of one multi-byte character decode to U+FFFD alone; their bytes must still
    join into the character's UTF-8 (what OpenAI's ``bytes`` field is for)."""
    from shiftjax.checkpoints.default_model import default_model_path
    from shiftjax.checkpoints.load import load_tokenizer
    from shiftjax.serving.server.openai_schema import TokenText

    tokenizer = load_tokenizer(default_model_path())
    text = "héllo wörld ✓ 日本 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_text = TokenText(tokenizer)
    assert any("\ufffd" in token_text.text(i) for i in ids)  # the case that needs the byte table
    assert b"".join(bytes(token_text.bytes(i)) for i in ids) == text.encode()


def test_an_unexpected_error_is_a_500_in_the_openai_shape(service):
    def broken(request):
        raise RuntimeError("a bug")

    service.submit = broken
    with TestClient(create_app(service, model_name="m"), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                     "param": None, "code": None}
