"""The engine as a service on a tiny model over a 2 x 2 CPU mesh: streams equal offline
greedy output, cancellation, deadlines and stop strings free pages at once, a deadline end
is named as one and a late cancel is not, failures stay with their request, draining, and
no compile after start-up."""

import asyncio
import gc
import json
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.errors import DeadlineExceeded, InvalidRequest, Overloaded, RequestFailed, Unavailable
from shiftjax.serving.engine.compile import JaxCompileEvents
from shiftjax.serving.engine.llm import LLM
from shiftjax.serving.server.protocol import GenerationRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.server.service import FAILED_STEPS_BEFORE_UNHEALTHY, AsyncEngineService
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(2,))
PROMPTS = [[5, 17, 33, 8, 90, 41, 7, 12, 3, 66, 71], [9, 4], [30, 31, 32, 33, 34, 35], [60] * 9]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class CharTokenizer:
    """One distinct character per token id, so text and token positions line up."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x41 + i) for i in ids)


@pytest.fixture(scope="module")
def engine():
    weights = shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(2, 2))
    # 32 tokens and 6 sequences asked, 16 and 4 run: the buckets bound them (ServerInfo says so)
    config = EngineConfig(max_model_len=64, page_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                          token_buckets=(4, 16), seq_buckets=(4,), attention="reference", mode="auto",
                          shift_threshold=8, num_pages=40, max_top_logprobs=5, max_queue=64)
    return Engine(weights, config, eos_token_ids=CONFIG.eos_token_ids)


@pytest.fixture(scope="module")
def reference(engine):
    """Offline greedy outputs, computed on the engine before any service drives it."""
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.run_until_done(requests)
    return [r.output_ids for r in requests]


@pytest.fixture
def service(engine, reference):
    service = AsyncEngineService(engine, CharTokenizer(), model_name="tiny")
    service.wait_ready(60)
    yield service
    service.shutdown()
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1, "pages leaked"


async def collect(stream):
    return [delta async for delta in stream]


def request(prompt, **params):
    return GenerationRequest(tuple(prompt), SamplingParams(**({"max_tokens": 12, "ignore_eos": True} | params)))


def test_concurrent_streams_equal_offline_greedy_output(service, reference):
    varied = [dict(temperature=0.9, top_p=0.8, seed=3), dict(temperature=1.2, min_p=0.2, top_k=7),
              dict(logprobs=True, top_logprobs=5), dict(stop=("AB", "Q"), max_tokens=30), dict(max_tokens=1)]

    steps_before = service.stats().engine.steps

    async def main():
        streams = [service.submit(request(p)) for p in PROMPTS * 3]
        others = [service.submit(request(PROMPTS[i % 4][:i + 1], **v)) for i, v in enumerate(varied)]
        results = await asyncio.gather(*(collect(s) for s in streams + others))
        return results[:len(streams)]

    with JaxCompileEvents() as probe:  # the counter does see a compile
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))
    assert probe.backend_compiles >= 1
    with JaxCompileEvents() as compiles:
        results = asyncio.run(main())
    for deltas, expected in zip(results, reference * 3):
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == expected
        assert "".join(d.text for d in deltas) == CharTokenizer().decode(expected)
        last = deltas[-1]
        assert last.finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
        usage = last.usage
        assert usage.output_tokens == 12 and usage.prompt_tokens > 0
        assert 0 <= usage.queue_seconds <= usage.ttft_seconds <= usage.e2e_seconds
        assert set(usage.modes) <= {"tp", "sp"} and len(usage.modes) >= 12
    assert {m for deltas in results for m in deltas[-1].usage.modes} == {"tp", "sp"}
    assert compiles.backend_compiles == 0  # serving never compiles, whatever the parameters
    stats = service.stats()
    engine = stats.engine
    assert stats.ready and engine.running == engine.waiting == 0 and engine.free_pages == engine.num_pages
    assert stats.engine.steps_by_mode["tp"] > 0 and stats.engine.steps_by_mode["sp"] > 0
    # The step trace holds this service's steps, each with the mode its token bucket picked
    # (buckets 4 and 16, threshold 8: SP for steps of more than 4 tokens), and the queue.
    trace = service.step_trace()
    assert len(trace) == stats.engine.steps - steps_before
    assert all(step["mode"] == ("sp" if step["num_tokens"] > 4 else "tp") for step in trace)
    assert [s["time"] for s in trace] == sorted(s["time"] for s in trace) and trace[-1]["waiting"] == 0


def test_logprobs_and_top_alternatives(service, reference):
    async def main():
        return await collect(service.submit(request(PROMPTS[0], logprobs=True, top_logprobs=5)))

    deltas = asyncio.run(main())
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in logprobs] == reference[0]
    for lp in logprobs:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id  # greedy: the most likely
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_stop_string_across_tokens_ends_the_stream(service, reference):
    text = CharTokenizer().decode(reference[2])
    stop = text[4:6]  # two tokens
    expected = text[:text.find(stop)]

    async def main():
        return await collect(service.submit(request(PROMPTS[2], stop=(stop, "never"))))

    deltas = asyncio.run(main())
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert service.stats().engine.free_pages == service.stats().engine.num_pages


def test_llm_generate_and_the_service_end_requests_alike(engine, reference):
    """One output processor for both: the same text, finish and stop reasons offline
    (LLM.generate) and streamed, for a stop string, a stop token id, max_tokens and a stop
    string that the request's last step completes."""
    texts = [CharTokenizer().decode(ids) for ids in reference]
    params = [SamplingParams(max_tokens=12, stop=(texts[0][3:5],), ignore_eos=True),
              SamplingParams(max_tokens=12, stop_token_ids=(reference[1][6],), ignore_eos=True),
              SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=6, stop=(texts[3][4:6], "never"), ignore_eos=True)]
    llm = object.__new__(LLM)  # an LLM over this engine (its constructor loads a checkpoint)
    llm.engine, llm.tokenizer = engine, CharTokenizer()
    offline = [(c.text, c.finish_reason, c.stop_reason) for c in llm.generate(PROMPTS, params)]
    service = AsyncEngineService(engine, CharTokenizer(), model_name="tiny")
    service.wait_ready(60)

    async def main():
        return await asyncio.gather(*(collect(service.submit(GenerationRequest(tuple(p), q)))
                                      for p, q in zip(PROMPTS, params)))

    try:
        streamed = [("".join(d.text for d in deltas), deltas[-1].finish_reason, deltas[-1].stop_reason)
                    for deltas in asyncio.run(main())]
    finally:
        service.shutdown()
    assert streamed == offline
    assert [reason for _, reason, _ in offline] == ["stop", "stop", "length", "stop"]
    assert offline[0] == (texts[0][:3], "stop", texts[0][3:5]) and offline[1][2] == reference[1][6]
    assert offline[3] == (texts[3][:texts[3].find(texts[3][4:6])], "stop", texts[3][4:6])
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1


def test_llm_generate_takes_cache_salts_and_reports_cached_tokens(engine):
    llm = object.__new__(LLM)  # as above
    llm.engine, llm.tokenizer = engine, CharTokenizer()
    prompt = list(range(60, 73))  # 13 tokens no other test sends: 3 pages of 4 to share
    [first] = llm.generate([prompt], GREEDY)
    again, salted = llm.generate([prompt, prompt], GREEDY, cache_salt=[None, "tenant-z"])
    assert (first.cached_tokens, again.cached_tokens, salted.cached_tokens) == (0, 12, 0)
    assert first.output_ids == again.output_ids == salted.output_ids
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-z")[0].to_json()["cached_tokens"] == 12
    with pytest.raises(ValueError, match="1 prompts but 2 cache salts"):
        llm.generate([prompt], GREEDY, cache_salt=["a", "b"])
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1


def test_cancel_close_and_deadline_free_pages_at_once(service):
    async def main():
        long = dict(max_tokens=50, ignore_eos=True)
        stream = service.submit(GenerationRequest((1, 2, 3), SamplingParams(**long), request_id="c"))
        first = await stream.__anext__()
        assert first.token_ids and service.cancel("c")
        rest = await collect(stream)
        assert rest[-1].finish_reason == "abort" and len(rest) <= 3
        freed_on_abort = service.stats().engine.free_pages == service.stats().engine.num_pages
        # closing the stream early aborts too
        stream = service.submit(GenerationRequest((4, 5, 6), SamplingParams(**long)))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if service.stats().engine.free_pages == service.stats().engine.num_pages:
                break
            await asyncio.sleep(0.01)
        freed_on_close = service.stats().engine.free_pages == service.stats().engine.num_pages
        # so does a deadline, and the stream says why it ended
        deadline = GenerationRequest((7, 8), SamplingParams(**long), deadline=time.monotonic() + 0.01)
        deltas = []
        with pytest.raises(DeadlineExceeded, match="passed its deadline"):
            async for delta in service.submit(deadline):
                deltas.append(delta)
        freed_on_deadline = service.stats().engine.free_pages == service.stats().engine.num_pages
        return freed_on_abort, freed_on_close, freed_on_deadline, deltas

    freed_on_abort, freed_on_close, freed_on_deadline, deltas = asyncio.run(main())
    assert freed_on_abort and freed_on_close and freed_on_deadline
    assert sum(len(d.token_ids) for d in deltas) < 50 and all(d.finish_reason is None for d in deltas)
    assert not service.cancel("c")  # no longer live


def test_a_stream_dropped_without_being_iterated_cancels_its_request(service):
    """An async generator that never started runs no ``finally`` when collected; the
    stream object cancels its request itself, so the pages come back."""
    tokens_before = service.engine.snapshot().tokens

    async def main():
        stream = service.submit(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=50, ignore_eos=True),
                                                  request_id="dropped"))
        del stream
        gc.collect()
        for _ in range(500):
            engine = service.stats().engine
            if engine.free_pages == engine.num_pages and engine.running == 0 and engine.waiting == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert not service.cancel("dropped")  # no longer live
    # aborted: not the 3 prompt + 49 decode tokens that running to its end takes
    assert service.engine.snapshot().tokens - tokens_before < 3 + 49


def salted(salt) -> GenerationRequest:
    """A request whose ``cache_salt`` is not a string, as an untyped caller could send it
    (set past the constructor, which the tests' type checks guard)."""
    request = GenerationRequest((1,), GREEDY)
    object.__setattr__(request, "cache_salt", salt)
    return request


@pytest.mark.parametrize("make,field", [
    (lambda: GenerationRequest((), GREEDY), "prompt_ids"),
    (lambda: GenerationRequest((1, 96), GREEDY), "prompt_ids"),
    (lambda: GenerationRequest((1,) * 60, SamplingParams(max_tokens=10)), "max_tokens"),
    (lambda: GenerationRequest((1,), SamplingParams(max_tokens=4, logprobs=True, top_logprobs=6)), "top_logprobs"),
    (lambda: GenerationRequest((1,), SamplingParams(max_tokens=4, stop_token_ids=(500,))), "stop_token_ids"),
    (lambda: salted(7), "cache_salt"),
    (lambda: salted(b"tenant"), "cache_salt"),
    (lambda: GenerationRequest((1,), GREEDY, cache_salt=""), "cache_salt"),
])
def test_bad_requests_name_the_field(service, make, field):
    async def main():
        with pytest.raises(InvalidRequest) as error:
            service.submit(make())
        assert error.value.field == field
        return await collect(service.submit(request([1, 2], max_tokens=2)))  # still serving

    assert asyncio.run(main())[-1].finish_reason == "length"


LONG = list(range(40, 53))  # 13 tokens: 3 full pages of 4 to share (the last token is always computed)


def test_a_repeated_prompt_reports_its_cached_tokens_and_a_salt_keeps_them_apart(service):
    async def cached(salt=None):
        deltas = await collect(service.submit(GenerationRequest(tuple(LONG), GREEDY, cache_salt=salt)))
        return deltas[-1].usage.cached_prompt_tokens, [t for d in deltas for t in d.token_ids]

    before = service.stats()
    (first, out), (again, out_again) = asyncio.run(cached()), asyncio.run(cached())
    (salted, out_salted), (salted_again, _) = asyncio.run(cached("tenant-a")), asyncio.run(cached("tenant-a"))
    assert (first, again, salted, salted_again) == (0, 12, 0, 12)
    assert out == out_again == out_salted  # K/V from the cache changes no token
    after = service.stats()
    assert after.engine.prefix_cache_queries - before.engine.prefix_cache_queries == 4 * len(LONG)
    assert after.engine.prefix_cache_hits - before.engine.prefix_cache_hits == 24 and after.engine.cached_pages >= 6
    assert service.cached_prefix_tokens(LONG) == service.cached_prefix_tokens(LONG, "tenant-a") == 12
    assert service.cached_prefix_tokens(LONG, "tenant-b") == 0
    cache = json.loads(json.dumps(service.info()))["prefix_cache"]
    assert cache["enabled"] is True and cache["hits"] == after.engine.prefix_cache_hits
    assert 0 < cache["hit_rate"] == pytest.approx(after.engine.prefix_cache_hits / after.engine.prefix_cache_queries)


def test_with_prefix_caching_off_nothing_is_cached_and_info_says_off():
    weights = shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(1, 1, jax.devices()[:1]))
    config = EngineConfig(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_pages=40,
                          token_buckets=(16,), seq_buckets=(4,), attention="reference", mode="tp",
                          enable_prefix_caching=False)  # one small executable: built in about 2 s
    service = AsyncEngineService(Engine(weights, config, eos_token_ids=CONFIG.eos_token_ids), CharTokenizer(),
                                 model_name="tiny")
    service.wait_ready(60)
    try:
        async def cached():
            deltas = await collect(service.submit(GenerationRequest(tuple(LONG), GREEDY)))
            return deltas[-1].usage.cached_prompt_tokens

        assert [asyncio.run(cached()) for _ in range(2)] == [0, 0]
        assert service.cached_prefix_tokens(LONG) == 0
        engine = service.stats().engine
        assert (engine.prefix_cache_hits, engine.cached_pages) == (0, 0) and engine.prefix_cache_queries == 2 * len(LONG)
        assert service.info()["prefix_cache"] | {"queries": 0} == {
            "enabled": False, "hit_rate": 0.0, "queries": 0, "hits": 0, "cached_pages": 0, "evicted_pages": 0}
    finally:
        service.shutdown()


def test_a_speculating_engine_counts_its_drafts_for_info_and_metrics_and_a_request_opts_out():
    from prometheus_client.parser import text_string_to_metric_families

    from shiftjax.serving.engine.speculative import SpeculativeConfig
    from shiftjax.serving.server.metrics import Metrics

    weights = shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(1, 1, jax.devices()[:1]))
    config = EngineConfig(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_pages=40,
                          token_buckets=(16,), seq_buckets=(4,), attention="reference", mode="tp",
                          speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    engine = Engine(weights, config, eos_token_ids=CONFIG.eos_token_ids)
    service = AsyncEngineService(engine, CharTokenizer(), model_name="tiny")
    service.wait_ready(60)

    async def tokens(**params):
        deltas = await collect(service.submit(request([30, 31, 32, 33, 34, 35], max_tokens=24, **params)))
        return [t for d in deltas for t in d.token_ids]

    class KnownContinuation:  # drafts the output the opted-out request gave, two tokens right then one wrong
        def propose(self, request, max_tokens):
            known = opted_out[len(request.output_ids):][:max_tokens]
            return known[:2] + [(t + 1) % CONFIG.vocab_size for t in known[2:]]

        def finish(self, request):
            pass

        def learn_pending(self, done):
            pass

    try:
        opted_out = asyncio.run(tokens(disable_speculation=True))
        assert service.stats().engine.speculative.num_drafts == 0
        engine.scheduler.drafter = KnownContinuation()  # the counters' path, whatever the text
        assert asyncio.run(tokens()) == opted_out  # greedy: the same tokens either way
        counters = service.stats().engine.speculative
        assert counters.num_drafts > 0 and counters.num_draft_tokens >= counters.num_drafts
        assert len(counters.accepted_per_position) == 3 and sum(counters.accepted_per_position) == \
            counters.num_accepted_tokens
        info = json.loads(json.dumps(service.info()))["speculative"]
        assert (info["enabled"], info["method"], info["num_speculative_tokens"]) == (True, "ngram", 3)
        assert (info["num_drafts"], info["num_accepted_tokens"], info["accepted_per_position"]) == \
            (counters.num_drafts, counters.num_accepted_tokens, list(counters.accepted_per_position))
        assert info["mean_accepted_length"] == pytest.approx(1 + counters.num_accepted_tokens / counters.num_drafts)
        scraped = {(sample.name, tuple(sample.labels.values())): sample.value
                   for family in text_string_to_metric_families(Metrics(stats=service.stats).render().decode())
                   for sample in family.samples}
        assert scraped[("shiftjax_spec_decode_num_drafts_total", ())] == counters.num_drafts
        assert [scraped[("shiftjax_spec_decode_num_accepted_tokens_per_pos_total", (str(i),))] for i in range(3)] \
            == list(counters.accepted_per_position)
    finally:
        service.shutdown()


class GateObserver:
    """Holds the engine thread inside a step until released."""

    def __init__(self):
        self.gate = threading.Event()
        self.stepped = threading.Event()
        self.finished = []

    def on_startup(self, **_): pass
    def on_token(self, **_): pass
    def on_preemption(self): pass

    def on_step(self, **_):
        self.stepped.set()
        self.gate.wait(30)

    def on_finish(self, *, usage, finish_reason):
        self.finished.append(finish_reason)


def test_a_full_queue_answers_overloaded(engine, reference):
    observer = GateObserver()
    service = AsyncEngineService(engine, CharTokenizer(), observer=observer, max_waiting=3)
    try:
        async def main():
            streams = [service.submit(request(PROMPTS[0]))]
            assert await asyncio.to_thread(observer.stepped.wait, 30)
            streams += [service.submit(request(p)) for p in PROMPTS[1:]]
            with pytest.raises(Overloaded):
                service.submit(request(PROMPTS[0]))
            observer.gate.set()
            return await asyncio.gather(*(collect(s) for s in streams))

        results = asyncio.run(main())
        assert [[t for d in ds for t in d.token_ids] for ds in results] == reference
        assert observer.finished == ["length"] * 4
    finally:
        observer.gate.set()
        service.shutdown()


@pytest.mark.parametrize("late, reason", [(None, "deadline"), ("cancel", "abort"), ("drain", "abort"),
                                          ("close", "deadline")])
def test_what_ends_a_request_past_its_deadline_is_named(engine, reference, late, reason):
    """The engine is held inside a step while the deadline passes; then a cancel, a drain
    or a closed stream arrives, and the engine takes it in the same pass as the expiry. A
    cancel or drain is an abort, as asked; a stream closed past its deadline (as gRPC closes
    it when the call's deadline passes) and nothing at all are the deadline's end, which the
    stream raises and the observer counts."""
    observer = GateObserver()
    service = AsyncEngineService(engine, CharTokenizer(), observer=observer)
    try:
        async def main():
            deadline = time.monotonic() + 0.3
            stream = service.submit(GenerationRequest((1, 2, 3), SamplingParams(max_tokens=50, ignore_eos=True),
                                                      request_id="late", deadline=deadline))
            consumer = asyncio.ensure_future(collect(stream))
            assert await asyncio.to_thread(observer.stepped.wait, 30)
            await asyncio.sleep(deadline - time.monotonic() + 0.01)
            assert not observer.finished  # the engine has not seen the deadline yet
            if late == "cancel":
                assert service.cancel("late")
            elif late == "drain":
                assert await service.drain(0) == 1
            elif late == "close":
                consumer.cancel()
            observer.gate.set()
            (outcome,) = await asyncio.gather(consumer, return_exceptions=True)
            for _ in range(200):  # a closed stream hears nothing; the observer does
                if observer.finished:
                    break
                await asyncio.sleep(0.01)
            return outcome

        outcome = asyncio.run(main())
        assert observer.finished == [reason]
        assert service.stats().engine.free_pages == service.stats().engine.num_pages
        if late is None:
            assert isinstance(outcome, DeadlineExceeded)
        elif late == "close":
            assert isinstance(outcome, asyncio.CancelledError)
        else:
            assert outcome[-1].finish_reason == "abort"
    finally:
        observer.gate.set()
        service.shutdown()


def test_a_failing_request_fails_alone(service, reference, monkeypatch):
    poison = next(t for t in reference[0] if t not in reference[1])
    tokenizer = CharTokenizer()

    def decode(ids, skip_special_tokens=True):
        if poison in ids:
            raise UnicodeError("a detokenizer bug")
        return CharTokenizer().decode(ids)

    monkeypatch.setattr(tokenizer, "decode", decode)
    service.tokenizer = tokenizer

    async def main():
        bad, good = service.submit(request(PROMPTS[0])), service.submit(request(PROMPTS[1]))
        return await asyncio.gather(collect(bad), collect(good), return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, RequestFailed)
    assert [t for d in good for t in d.token_ids] == reference[1]


def test_a_failing_step_fails_its_requests_and_serving_goes_on(service, engine, reference, monkeypatch):
    real_get, calls, donated = engine.executables.get, [], []

    def get(*key):
        calls.append(key)
        executable = real_get(*key)
        if len(calls) != 2:
            return executable

        def fails_after_donating(*args):
            executable(*args)  # the caches are donated, then gone
            donated.append(args[1])
            raise RuntimeError("an injected device error")

        return fails_after_donating

    monkeypatch.setattr(engine.executables, "get", get)

    async def main():
        failed = await asyncio.gather(collect(service.submit(request(PROMPTS[0]))), return_exceptions=True)
        after = await collect(service.submit(request(PROMPTS[1])))
        return failed[0], after

    failed, after = asyncio.run(main())
    assert isinstance(failed, RequestFailed)
    assert [t for d in after for t in d.token_ids] == reference[1]  # on reallocated caches
    [lost] = donated
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(lost))  # the failure did consume them
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.caches))
    assert service.ready  # one failed step, then a finished one: still serving


def test_failed_steps_in_a_row_make_the_service_unhealthy(service, engine, monkeypatch):
    """A device lost for good fails every step: after FAILED_STEPS_BEFORE_UNHEALTHY in a row
    the service says so (not ready: health NOT_SERVING) and refuses new requests, naming
    the last error; one failure followed by a finished step does not (the test above)."""
    def get(*key):
        def lost(*args):
            raise RuntimeError("an injected lost device")
        return lost
    monkeypatch.setattr(engine.executables, "get", get)

    async def main():
        outcomes = []
        for prompt in PROMPTS[:FAILED_STEPS_BEFORE_UNHEALTHY]:
            assert service.ready  # not before the last of them
            outcomes += await asyncio.gather(collect(service.submit(request(prompt))), return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(outcome, RequestFailed) for outcome in outcomes)
    stats = service.stats()
    assert not service.ready and not stats.ready and "injected lost device" in stats.error
    info = service.info()
    assert f"{FAILED_STEPS_BEFORE_UNHEALTHY} steps in a row" in info["error"] and info["ready"] is False
    with pytest.raises(Unavailable, match="restart the server"):
        service.submit(request(PROMPTS[0]))


def test_a_finished_step_resets_the_count_of_failed_ones(service, engine, reference, monkeypatch):
    """Failures that a finished step separates never add up to the limit."""
    real_get, failing = engine.executables.get, [True]

    def get(*key):
        if not failing[0]:
            return real_get(*key)

        def lost(*args):
            raise RuntimeError("an injected device error")
        return lost
    monkeypatch.setattr(engine.executables, "get", get)

    async def fail(times):
        for prompt in PROMPTS[:times]:
            [outcome] = await asyncio.gather(collect(service.submit(request(prompt))), return_exceptions=True)
            assert isinstance(outcome, RequestFailed)

    async def main():
        await fail(FAILED_STEPS_BEFORE_UNHEALTHY - 1)
        failing[0] = False
        served = await collect(service.submit(request(PROMPTS[1])))
        failing[0] = True
        await fail(FAILED_STEPS_BEFORE_UNHEALTHY - 1)
        return served

    served = asyncio.run(main())
    assert [t for d in served for t in d.token_ids] == reference[1]
    assert service.ready and service.stats().error is None


def test_drain_refuses_new_requests_then_aborts_the_rest(service):
    async def main():
        # 60 tokens (the most max_model_len allows) cannot all come within a 10 ms grace; with
        # 50 and 50 ms the request once finished in time in a full run (aborted == 0)
        stream = service.submit(request([1, 2, 3], max_tokens=60))
        await stream.__anext__()
        aborted = await service.drain(0.01)
        with pytest.raises(Unavailable):
            service.submit(request([1, 2]))
        return aborted, await collect(stream)

    aborted, rest = asyncio.run(main())
    assert aborted == 1 and rest[-1].finish_reason == "abort"
    assert service.stats().draining


def test_info_is_json_and_says_what_runs(service):
    info = json.loads(json.dumps(service.info()))
    assert info["model"] == "tiny" and info["modes"] == ["tp", "sp"]
    assert info["mesh"]["sp"] == 2 and info["mesh"]["tp"] == 2
    assert info["buckets"] == {"tokens": [4, 16], "seqs": [4]}
    assert info["page_pool"]["num_pages"] == 39 and info["page_pool"]["sized_by"] == "num_pages"
    assert info["startup"]["executables"] == 4
    # a threshold policy times no executables, and without a store there is nothing to check
    assert list(info["startup"]["phase_seconds"]) == ["kv_cache", "executables", "samplers"]
    assert info["async_scheduling"] is True
    assert info["model_config"]["vocab_size"] == 96
    # an engine that does not speculate says so; its counters stay at zero
    assert (info["speculative"]["enabled"], info["speculative"]["method"], info["speculative"]["num_drafts"]) == \
        (False, None, 0)


def test_info_reports_the_limits_that_run(service):
    limits = service.info()["limits"]
    assert (limits["max_num_batched_tokens"], limits["max_num_seqs"]) == (16, 4)  # not the 32 and 6 asked
    assert limits == {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_queue": 64,
                      "max_top_logprobs": 5}


class CountingObserver(GateObserver):
    def __init__(self):
        super().__init__()
        self.gate.set()
        self.preemptions = 0
        self.tokens = 0

    def on_preemption(self):
        self.preemptions += 1

    def on_token(self, *, first, seconds_since_previous):
        assert seconds_since_previous >= 0
        self.tokens += 1


def test_preemption_changes_no_output_and_is_counted(engine, reference):
    # 4 x (40 + 20) tokens need 60 pages of 4; the pool has 39: the scheduler must preempt.
    prompts = [[(7 * i + j) % 90 + 3 for j in range(40)] for i in range(4)]
    observer = CountingObserver()
    service = AsyncEngineService(engine, CharTokenizer(), observer=observer)
    try:
        async def main():
            alone = [await collect(service.submit(request(p, max_tokens=20))) for p in prompts]
            before = service.stats().engine.preemptions
            together = await asyncio.gather(*(collect(service.submit(request(p, max_tokens=20))) for p in prompts))
            return alone, together, service.stats().engine.preemptions - before

        alone, together, preempted = asyncio.run(main())
    finally:
        service.shutdown()
    ids = lambda deltas: [t for d in deltas for t in d.token_ids]  # noqa: E731
    assert [ids(d) for d in together] == [ids(d) for d in alone]
    assert preempted > 0 and observer.preemptions == preempted
    assert sum(d[-1].usage.preemptions for d in together) == preempted
    assert observer.tokens == 8 * 20
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1


def test_a_failing_observer_fails_no_request(engine, reference):
    class Broken(CountingObserver):
        def on_step(self, **_):
            raise RuntimeError("a metrics bug")

    service = AsyncEngineService(engine, CharTokenizer(), observer=Broken())
    try:
        async def main():
            return await collect(service.submit(request(PROMPTS[1])))

        deltas = asyncio.run(main())
    finally:
        service.shutdown()
    assert [t for d in deltas for t in d.token_ids] == reference[1]
