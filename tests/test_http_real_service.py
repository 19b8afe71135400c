"""The official openai client against the real engine service on the default model
(SmolLM2-135M-Instruct, sp 2 x tp 2 on CPU devices), served by uvicorn on loopback: greedy
text equals offline ``LLM.generate``; the metrics count what was served; a repeated long
prompt's usage reports its cached tokens, another ``cache_salt`` none; a client that
disconnects mid-stream gets its pages freed at once."""

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from http_live_server import live_server
from shiftjax.serving.server.http_server import create_app
from shiftjax.serving.server.metrics import Metrics

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 16
MODEL = "smollm2-135m"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    import shiftjax
    from shiftjax import SamplingParams
    from shiftjax.serving.server.service import AsyncEngineService

    # Small buckets keep the ahead-of-time compilation short on a CPU; the threshold makes
    # single decodes run TP and prefills SP, so both modes serve.
    llm = shiftjax.LLM("default", sp=2, tp=2, dtype="float32", max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=32, token_buckets=(4, 32), seq_buckets=(4,), mode="auto",
                       shift_threshold=8)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    # Offline references first: the engine is not shared with the service thread.
    expected = {p: c.text for p, c in zip(PROMPTS, llm.generate(PROMPTS, greedy))}
    expected[QUESTION] = llm.generate([QUESTION], greedy, chat=True)[0].text
    metrics = Metrics()
    service = AsyncEngineService(llm.engine, llm.tokenizer, model_name=MODEL, observer=metrics)
    service.wait_ready(600.0)
    with live_server(create_app(service, model_name=MODEL, metrics=metrics)) as url:
        yield service, url, expected
    service.shutdown()


@pytest.fixture
def client(served):
    _, url, _ = served
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def scrape(url) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_openai_client_gets_the_offline_greedy_text(served, client):
    service, url, expected = served
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    before = scrape(url)
    served_tokens = 0
    for prompt in PROMPTS:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == expected[prompt]
        served_tokens += reply.usage.completion_tokens
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[prompt]
        served_tokens += chunks[-1].usage.completion_tokens

    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected[QUESTION]
    assert "Paris" in reply.choices[0].message.content
    served_tokens += reply.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected[QUESTION]

    def finished(samples):
        return sum(v for (name, _), v in samples.items() if name == "shiftjax_request_finished_total")

    deadline = time.monotonic() + 5  # on_finish runs on the engine thread, maybe just after the last delta
    while finished(after := scrape(url)) < finished(before) + 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert finished(after) == finished(before) + 6
    generated = after[("shiftjax_generation_tokens_total", ())] - before.get(("shiftjax_generation_tokens_total", ()), 0)
    assert generated > served_tokens  # the last stream's tokens too (it asked for no usage)
    assert sum(v for (name, _), v in after.items() if name == "shiftjax_steps_total") > 0
    assert after[("shiftjax_startup_executables", ())] > 0
    assert after[("shiftjax_kv_page_utilization", ())] == 0  # every request finished: pages back


LONG = ("In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, "
        "on Brownian motion, on special relativity, and on the equivalence of mass and energy. The")


def test_a_repeated_long_prompt_reports_cached_tokens_and_another_salt_none(served, client):
    service, url, _ = served
    before = scrape(url)

    def cached(**options) -> tuple[int, int, str]:
        reply = client.completions.create(model=MODEL, prompt=LONG, max_tokens=2, temperature=0, **options)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens, reply.choices[0].text

    first, prompt_tokens, text = cached(extra_body={"cache_salt": "first-of-this-test"})
    again = cached(extra_body={"cache_salt": "first-of-this-test"})
    other = cached(extra_body={"cache_salt": "another-tenant"})
    full_pages = (prompt_tokens - 1) // 16 * 16  # every full page but the one with the last token
    assert prompt_tokens > 32 and first == 0 and again == (full_pages, prompt_tokens, text)
    assert other == (0, prompt_tokens, text)
    stream = client.completions.create(model=MODEL, prompt=LONG, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"cache_salt": "another-tenant"})
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == full_pages
    chat = [{"role": "user", "content": LONG}]
    replies = [client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0)
               for _ in range(2)]
    assert replies[1].usage.prompt_tokens_details.cached_tokens >= 32

    after = scrape(url)
    queries, hits = (after[(f"shiftjax_prefix_cache_{name}_total", ())]
                     - before.get((f"shiftjax_prefix_cache_{name}_total", ()), 0) for name in ("queries", "hits"))
    assert queries == 4 * prompt_tokens + sum(r.usage.prompt_tokens for r in replies)
    # the first chat reply shares the chat template's opening (the default system prompt) too
    assert hits == 2 * full_pages + sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert after[("shiftjax_prefix_cache_pages", ())] >= 3 * full_pages // 16
    info = service.info()["prefix_cache"]
    assert info["enabled"] and info["hits"] >= hits and 0 < info["hit_rate"] < 1
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=1, extra_body={"cache_salt": 42})
    assert error.value.param == "cache_salt" and "string" in str(error.value)


def test_logprobs_of_the_real_model(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == reply.choices[0].message.content


def test_disconnect_mid_stream_frees_the_pages(served):
    service, url, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            assert service.stats().engine.free_pages < service.stats().engine.num_pages
    deadline = time.monotonic() + 5
    while service.stats().engine.free_pages < service.stats().engine.num_pages and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = service.stats()
    assert stats.engine.free_pages == stats.engine.num_pages and stats.engine.running == 0
