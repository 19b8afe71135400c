"""Prefix caching in the scheduler, on the stand-in device of test_scheduler_properties
(a real paged cache of token ids, no JAX): requests with shared prompt prefixes share
pages, never write a shared page, generate exactly what they would alone, and every page
comes back, under chunked prefill, preemption and asynchronous scheduling."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_properties import draw_config, fake_token, run_on_stand_in_device

from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import Scheduler, SchedulerConfig


def run_shared(config, specs, seed, pipelined, salts=None):
    """Runs requests whose prompts are a shared prefix (of a few variants) plus a suffix;
    checks every step; returns the scheduler and its requests."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 97, 40).tolist() for _ in range(2)]
    scheduler = Scheduler(config)
    requests, truth, expected = [], {}, []
    for i, (variant, shared, suffix, max_tokens) in enumerate(specs):
        prompt = prefixes[variant][:shared] + rng.integers(0, 97, suffix).tolist()
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(fake_token(tokens))
        salt = None if salts is None else salts[i % len(salts)]
        request = scheduler.add(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (), salt)
        requests.append(request)
        truth[id(request)] = tokens
        expected.append(tokens[len(prompt):])
    cache: dict[int, int] = {}
    in_flight = None
    for _ in range(10_000):
        if not scheduler.has_work and in_flight is None:
            break
        step = scheduler.schedule()
        scheduler.allocator.check()
        launched = None
        if step is not None:
            check_writes(scheduler, config, step)
            launched = (step, run_on_stand_in_device(step, in_flight, cache, config.page_size, truth))
        if not pipelined:
            in_flight, launched = launched, None
        if in_flight is not None:
            done, tokens = in_flight
            scheduler.commit(done, np.asarray(tokens), np.zeros(len(tokens)), "tp")
            scheduler.allocator.check()
        in_flight = launched
    assert not scheduler.has_work
    assert scheduler.allocator.num_free == config.num_pages - 1  # every page back: free or cached
    for request, outputs in zip(requests, expected):
        assert request.output_ids == outputs and request.finish_reason == "length"
    return scheduler, requests


def check_writes(scheduler, config, step):
    """Every slot a step writes is in a page its request holds alone and no hash names
    (a shared or cached page is never written)."""
    allocator = scheduler.allocator
    for b, request in enumerate(step.requests):
        lo, hi = step.batch.query_start[b], step.batch.query_start[b + 1]
        for page in set((step.batch.slot_mapping[lo:hi] // config.page_size).tolist()):
            assert page in request.pages and allocator._refs[page] == 1 and page not in allocator._hash_of_page


@st.composite
def shared_workloads(draw):
    page_size = draw(st.sampled_from([4, 8]))
    specs = draw(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(1, 12), st.integers(1, 12)),
                          min_size=1, max_size=8))
    config = draw_config(draw, page_size, max(shared + suffix + most for _, shared, suffix, most in specs),
                         4 * len(specs), enable_prefix_caching=True)
    return config, specs, draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None)
@given(shared_workloads(), st.booleans())
def test_shared_prefixes_under_random_load(workload, pipelined):
    run_shared(*workload, pipelined=pipelined)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_repeated_prompt_computes_only_its_last_page(pipelined):
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64, page_size=4, num_pages=20,
                             enable_prefix_caching=True)
    # one at a time (max_num_seqs=1): the second finds the first's full pages named
    scheduler, (first, second, third) = run_shared(config, [(0, 24, 0, 4), (0, 24, 0, 4), (0, 22, 0, 4)], 0,
                                                   pipelined)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20  # 24 tokens: 5 of 6 pages (the last token is computed)
    assert third.num_cached_tokens == 20  # 22 tokens: its 5 full pages are the first's
    assert scheduler.prefix_cache.queries == 70 and scheduler.prefix_cache.hits == 40


def test_salts_keep_prefixes_apart_and_caching_off_shares_nothing():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64, page_size=4, num_pages=20,
                             enable_prefix_caching=True)
    _, requests = run_shared(config, [(0, 24, 1, 2)] * 4, 0, False, salts=[None, "tenant-a"])
    assert [r.num_cached_tokens for r in requests] == [0, 0, 24, 24]
    off = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64, page_size=4, num_pages=20)
    scheduler, requests = run_shared(off, [(0, 24, 1, 2)] * 3, 0, False)
    assert all(r.num_cached_tokens == 0 for r in requests) and scheduler.allocator.num_cached == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_preempted_requests_find_their_own_pages_again(pipelined):
    # few pages: the newest request is preempted, and on its return its committed full
    # pages (still cached, unless evicted) spare it the recompute
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=3, max_model_len=64, page_size=4, num_pages=12,
                             enable_prefix_caching=True)
    scheduler, _ = run_shared(config, [(0, 0, 9, 20), (1, 0, 7, 20), (0, 5, 6, 20)], 1, pipelined)
    assert scheduler.num_preemptions > 0


def test_lost_caches_forget_every_name():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64, page_size=4, num_pages=20,
                             enable_prefix_caching=True)
    scheduler = Scheduler(config)
    request = scheduler.add(list(range(1, 14)), SamplingParams(max_tokens=2, ignore_eos=True))
    step = scheduler.schedule()
    scheduler.commit(step, np.array([5]), np.zeros(1), "tp")
    assert scheduler.allocator.num_cached == 3
    scheduler.preempt_all(caches_lost=True)
    scheduler.allocator.check()
    assert scheduler.allocator.num_cached == 0 and request in scheduler.waiting
    assert scheduler.prefix_cache.cached_tokens(list(range(1, 14)), b"") == 0


def test_a_request_is_counted_at_the_admission_that_gives_it_pages():
    """An admission attempt that finds no room gives its shared pages back and counts
    nothing; the admission that succeeds counts the pages it then had (they may have been
    evicted in between)."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64, page_size=4, num_pages=8,
                             enable_prefix_caching=True)
    scheduler = Scheduler(config)
    prompt = list(range(1, 14))  # 3 full pages and one token
    first = scheduler.add(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.commit(scheduler.schedule(), np.array([5]), np.zeros(1), "tp")
    assert first.finished and scheduler.allocator.num_cached == 3
    hog = scheduler.add(list(range(50, 66)), SamplingParams(max_tokens=8, ignore_eos=True))  # 4 pages, then 6
    step = scheduler.schedule()
    assert step.requests == [hog] and scheduler.allocator.num_free == 3  # 3 cached pages left, no free one
    again = scheduler.add(prompt + [20, 21, 22, 23], SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.commit(step, np.array([7]), np.zeros(1), "tp")
    assert scheduler.schedule().requests == [hog]  # its decode takes a page: a cached one is evicted
    assert again in scheduler.waiting and not again.pages and scheduler.prefix_cache.queries == 13 + 16
    scheduler.abort(hog)
    step = scheduler.schedule()
    assert step.requests == [again] and scheduler.prefix_cache.queries == 13 + 16 + 17
    assert again.num_cached_tokens == scheduler.prefix_cache.hits == again.num_computed < 12
    scheduler.allocator.check()
