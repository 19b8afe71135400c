"""The official ``openai`` package against a real uvicorn server (fake service behind it),
and client disconnects: each must cancel its request at once."""

import json
import time

import httpx
import openai
import pytest

from http_fake_service import REPLY, FakeService, logprob_of
from http_live_server import live_server
from shiftjax.serving.server.http_server import create_app
from loopback import wait_for

KEY = "test-key"
# A disconnect cancels "at once": well before the fake's 20 s reply would end, with room for
# a loaded machine's slow event loop
AT_ONCE_SECONDS = 5.0
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    service = FakeService()
    with live_server(create_app(service, model_name="fake-model", api_key=KEY)) as url:
        yield service, url


@pytest.fixture
def client(served):
    service, url = served
    service.token_delay, service.echo = 0.0, False
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_completions(client):
    reply = client.completions.create(model="fake-model", prompt="hi", max_tokens=7, temperature=0, logprobs=2)
    assert reply.choices[0].text == REPLY[:7] and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens == 7
    assert reply.choices[0].logprobs.tokens == list(REPLY[:7])
    assert reply.choices[0].logprobs.token_logprobs[3] == logprob_of(3)
    assert reply.choices[0].logprobs.top_logprobs[0] == {"H": logprob_of(0), "x": -8.0}

    batch = client.completions.create(model="fake-model", prompt=[[104], [105, 106]], max_tokens=2, temperature=0)
    assert [c.text for c in batch.choices] == ["He", "He"] and batch.usage.prompt_tokens == 3


def test_completions_stream(client):
    stream = client.completions.create(model="fake-model", prompt="hi", max_tokens=100, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": False})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(REPLY) + 1


def test_chat(client):
    reply = client.chat.completions.create(model="fake-model", messages=CHAT, max_completion_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=1, seed=7)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "Hello"
    assert [e.token for e in choice.logprobs.content] == list("Hello")
    assert choice.logprobs.content[1].top_logprobs[0].logprob == logprob_of(1)
    assert reply.usage.completion_tokens == 5


def test_chat_stream(client):
    stream = client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=13, stream=True,
                                            stop=["!"], extra_body={"top_k": 3, "min_p": 0.1})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, wörld"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors_reach_the_client_as_its_exceptions(served, client):
    service, url = served
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="fake-model", prompt="hi", n=2)
    assert error.value.param == "n"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="fake-model", messages=CHAT, frequency_penalty=0.3)
    assert error.value.param == "frequency_penalty"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    service.capacity = 0
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="fake-model", prompt="hi")
    finally:
        service.capacity = None
    service.fail_after = 2
    try:
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="fake-model", messages=CHAT)
        with pytest.raises(openai.APIError):  # the error event inside a stream
            list(client.chat.completions.create(model="fake-model", messages=CHAT, stream=True))
    finally:
        service.fail_after = None
    assert [m.id for m in client.models.list()] == ["fake-model"]


def test_disconnect_mid_stream_cancels_the_request(served):
    service, url = served
    service.token_delay = 1.0  # the whole reply would take about 20 s
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 20, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            request_id = first.split('"id":"')[1].split('"')[0]
            assert request_id in service.live
    gone = time.monotonic()
    assert wait_for(lambda: request_id in service.cancelled and request_id in service.closed, AT_ONCE_SECONDS)
    assert time.monotonic() - gone < AT_ONCE_SECONDS  # at once, not when the reply would have ended
    assert request_id not in service.live


def test_disconnect_while_waiting_for_a_plain_reply_cancels_it(served):
    service, url = served
    service.token_delay = 1.0  # the whole reply would take about 20 s
    before = len(service.submitted)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 20}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    gone = time.monotonic()
    assert len(service.submitted) == before + 1
    assert wait_for(lambda: not service.live, AT_ONCE_SECONDS)
    assert time.monotonic() - gone < AT_ONCE_SECONDS
    assert len(service.cancelled) > 0 and service.cancelled[-1] == service.closed[-1]


def test_200_concurrent_streams_all_complete_once(served):
    """Every stream gets its whole reply exactly once, however the 200 interleave."""
    import asyncio

    service, url = served
    service.token_delay, service.echo = 0.005, True
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http, i):
        chat = i % 2 == 1
        body = {"model": "fake-model", "max_tokens": 5 + i % 10, "stream": True,
                "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": f"#{i}"}]} if chat else {"prompt": f"#{i}"}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = f"[user]#{i}\n[assistant]" if chat else f"#{i}"
        expected = (prompt + REPLY)[:5 + i % 10]
        text, ids, usage = "", set(), None
        async with http.stream("POST", f"{url}{path}", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                ids.add(chunk["id"])
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or "" if chat else choice["text"]
                usage = chunk.get("usage") or usage
        return i, text == expected, ids, usage

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(main())
    assert [i for i, *_ in results] == list(range(200))
    service.echo = False
    for i, correct, ids, usage in results:
        assert correct, i
        assert len(ids) == 1 and usage["completion_tokens"] == 5 + i % 10
    assert len({next(iter(ids)) for _, _, ids, _ in results}) == 200  # no reply went to two clients
    assert not service.live
