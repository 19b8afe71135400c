"""Scheduler invariants under random load, with a stand-in model (no JAX): budgets hold, pages
are never shared or leaked, preemption and chunking never change what a request generates."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import Scheduler, SchedulerConfig


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([4, 8, 16]))
    requests = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24), st.integers(-1, 23)),
                             min_size=1, max_size=8))
    config = draw_config(draw, page_size, max(p + m for p, m, _ in requests), 3 * len(requests) * 4)
    return config, requests, draw(st.integers(0, 2**16))


def draw_config(draw, page_size: int, longest: int, extra_pages: int, **options) -> SchedulerConfig:
    """A scheduler under random load: a page pool from just enough for the longest request
    (``longest`` tokens) to ``extra_pages`` more, a random token budget and sequence limit."""
    min_pages = -(-longest // page_size) + 1
    num_pages = draw(st.integers(min_pages, min_pages + extra_pages))
    return SchedulerConfig(max_num_batched_tokens=draw(st.integers(1, 32)), max_num_seqs=draw(st.integers(1, 4)),
                           max_model_len=64, page_size=page_size, num_pages=num_pages, **options)


@settings(max_examples=150, deadline=None)
@given(workloads(), st.booleans())
def test_random_load(workload, pipelined):
    run_workload(*workload, pipelined=pipelined)


@pytest.mark.parametrize("pipelined", [False, True])
def test_memory_pressure_preempts_and_still_finishes(pipelined):
    # A small budget chunks the recompute of a preempted request that already has output.
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=3, max_model_len=64, page_size=4, num_pages=9)
    assert run_workload(config, [(6, 20, -1), (5, 20, -1), (7, 20, -1)], seed=0, pipelined=pipelined) > 0


def test_pipelined_steps_take_the_tokens_of_the_step_before():
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32, page_size=4, num_pages=9)
    scheduler = Scheduler(config)
    request = scheduler.add([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    first = scheduler.schedule()  # the prompt, sampling the first token
    second = scheduler.schedule()  # its decode, before the first is committed
    assert second.source_step == first.step_id and second.token_source.tolist() == [0]
    assert second.batch.positions.tolist() == [3] and request.num_pending == 2
    scheduler.commit(first, np.array([7]), np.zeros(1), "tp")
    assert request.output_ids == [7] and request.num_computed == 3 and request.num_in_flight == 1
    third = scheduler.schedule()  # decodes what the second samples
    assert third.source_step == second.step_id and third.batch.positions.tolist() == [4]
    scheduler.abort(request)
    scheduler.commit(second, np.array([8]), np.zeros(1), "tp")  # an ended request takes nothing
    assert request.output_ids == [7] and second.delivered == [False]


def run_workload(config, specs, seed, pipelined=False) -> int:
    """Runs the requests to the end on a stand-in device that keeps a real paged cache of
    token ids, checking every step; returns how many preemptions. ``pipelined``: each step
    is scheduled and run before the previous one is committed (asynchronous scheduling),
    its unknown tokens taken from that step's result as the engine's token fill does."""
    rng = np.random.default_rng(seed)
    preemptions = 0
    scheduler = Scheduler(config)
    requests, truth, expected = [], {}, []
    for prompt_len, max_tokens, stop_at in specs:
        prompt = rng.integers(0, 97, prompt_len).tolist()
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(fake_token(tokens))
        outputs = tokens[prompt_len:]
        # stop_at >= 0: the output token there is a stop token, so the request ends at its
        # first occurrence, maybe while its next step is already in flight
        stop = (outputs[stop_at],) if 0 <= stop_at < max_tokens else ()
        if stop:
            outputs = outputs[:outputs.index(stop[0]) + 1]
        expected.append((outputs, "stop" if stop else "length"))
        request = scheduler.add(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop))
        requests.append(request)
        truth[id(request)] = tokens
    cache: dict[int, int] = {}  # slot -> the token id whose "K/V" the device wrote there
    in_flight = None  # (step, sampled tokens): run, not yet committed
    for _ in range(10_000):
        if not scheduler.has_work and in_flight is None:
            break
        scheduled_before = {id(r): r.num_scheduled for r in requests}
        preempted_before = {id(r): r.preemptions for r in requests}
        step = scheduler.schedule()
        preemptions += sum(r.preemptions - preempted_before[id(r)] for r in requests)
        assert step is not None or in_flight is not None, "work remains but nothing was scheduled"
        launched = None
        if step is not None:
            check_step(scheduler, config, step, scheduled_before, preempted_before, truth)
            launched = (step, run_on_stand_in_device(step, in_flight, cache, config.page_size, truth))
        if not pipelined:
            in_flight, launched = launched, None
        if in_flight is not None:
            done, tokens = in_flight
            scheduler.commit(done, np.asarray(tokens), np.zeros(len(tokens)), "tp")
        in_flight = launched
    assert not scheduler.has_work
    assert scheduler.allocator.num_free == config.num_pages - 1
    for request, (outputs, reason) in zip(requests, expected):
        assert request.output_ids == outputs and request.finish_reason == reason
    return preemptions


def check_step(scheduler, config, step, scheduled_before, preempted_before, truth) -> None:
    batch = step.batch
    assert step.num_tokens <= config.max_num_batched_tokens
    assert len(step.requests) <= config.max_num_seqs
    assert all(r in scheduler.running for r in step.requests), "a scheduled request is not running"
    owners = {}
    for request in scheduler.running:
        for page in request.pages:
            assert page != 0 and page not in owners, "a page is held twice (or the scratch page is)"
            owners[page] = request
    for b, request in enumerate(step.requests):
        lo, hi = batch.query_start[b], batch.query_start[b + 1]
        first = scheduled_before[id(request)] if request.preemptions == preempted_before[id(request)] else 0
        assert batch.positions[lo:hi].tolist() == list(range(first, first + hi - lo))
        expected = truth[id(request)][first:first + hi - lo]
        for token, source, want in zip(batch.token_ids[lo:hi].tolist(), step.token_source[lo:hi].tolist(), expected):
            assert token == want or source >= 0, "a known token is wrong"
        pages = batch.slot_mapping[lo:hi] // config.page_size
        assert all(owners.get(int(p)) is request for p in pages)


def run_on_stand_in_device(step, previous, cache, page_size, truth) -> list[int]:
    """Writes the step's tokens into the cache and 'samples' each row from what the cache
    holds for its sequence, as the real step reads K/V through the page table."""
    batch = step.batch
    token_ids = batch.token_ids.copy()
    taken = step.token_source >= 0
    if taken.any():
        assert previous is not None and previous[0].step_id == step.source_step
        token_ids[taken] = np.asarray(previous[1])[step.token_source[taken]]
    for slot, token in zip(batch.slot_mapping.tolist(), token_ids.tolist()):
        cache[slot] = token
    sampled = []
    for b, request in enumerate(step.requests):
        lo, hi = batch.query_start[b], batch.query_start[b + 1]
        assert token_ids[lo:hi].tolist() == truth[id(request)][batch.positions[lo]:batch.positions[lo] + hi - lo]
        pages = batch.page_table[b]
        context = [cache[int(pages[p // page_size]) * page_size + p % page_size] for p in range(batch.seq_lens[b])]
        sampled.append(fake_token(context))
    return sampled


def test_token_slice_equals_slicing_the_whole_list():
    from shiftjax.serving.engine.scheduler import Request

    request = Request(0, [1, 2, 3, 4, 5], SamplingParams(), (), output_ids=[6, 7, 8])
    for first in range(10):
        for size in range(10 - first):  # past the known tokens too: a decode of a pending one
            assert request.token_slice(first, size) == request.tokens[first:first + size]


def test_requests_ending_in_flight_are_not_preempted_in_turn_for_ever():
    """Async scheduling under page pressure: a request whose step in flight samples its last
    token is no preemption victim (it frees its pages at that commit). Preempting it threw
    that token away, and two such requests took turns preempting each other for ever."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=48,
                                          page_size=8, num_pages=7))
    shapes = [(18, 1), (17, 16), (3, 26), (6, 17), (6, 23), (9, 21), (2, 30)]  # (prompt, max_tokens)
    requests = [scheduler.add([5 + i] * prompt, SamplingParams(max_tokens=most, ignore_eos=True), ())
                for i, (prompt, most) in enumerate(shapes)]
    in_flight, steps = None, 0
    while not all(r.finished for r in requests) and steps < 1000:
        step = scheduler.schedule()  # step N+1 before N is committed
        if in_flight is not None:
            n = len(in_flight.requests)
            scheduler.commit(in_flight, np.full(n, 7, np.int32), np.zeros(n, np.float32), "tp")
        in_flight, steps = step, steps + 1
    assert all(r.finished for r in requests), f"{scheduler.num_preemptions} preemptions in {steps} steps"
    assert [len(r.output_ids) for r in requests] == [most for _, most in shapes]


def test_a_step_refuses_empty_chunks_and_repeated_requests():
    """The batch is filled by whole-array operations that need every chunk non-empty and every
    request once; schedule() keeps both, and _build says so if a change breaks either."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                                          page_size=4, num_pages=16))
    first = scheduler.add([1, 2, 3], SamplingParams(max_tokens=4), ())
    second = scheduler.add([4, 5], SamplingParams(max_tokens=4), ())
    with pytest.raises(RuntimeError, match="at least one"):
        scheduler._build([(first, 2), (second, 0)])
    with pytest.raises(RuntimeError, match="twice"):
        scheduler._build([(first, 1), (first, 1)])
    step = scheduler.schedule()  # the refused _build calls changed nothing
    assert step is not None and [r is first or r is second for r in step.requests] == [True, True]
