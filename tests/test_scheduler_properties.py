"""Scheduler invariants under random load, with a stand-in model (no JAX): budgets hold, pages
are never shared or leaked, preemption and chunking never change what a request generates."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftjax.serving.sampling_params import SamplingParams
from shiftjax.serving.scheduler import Scheduler, SchedulerConfig


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([4, 8, 16]))
    requests = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=8))
    longest = max(p + m for p, m in requests)
    min_pages = -(-longest // page_size) + 1
    num_pages = draw(st.integers(min_pages, min_pages + 3 * len(requests) * 4))
    config = SchedulerConfig(max_num_batched_tokens=draw(st.integers(1, 32)), max_num_seqs=draw(st.integers(1, 4)),
                             max_model_len=64, page_size=page_size, num_pages=num_pages)
    return config, requests, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_load(workload):
    run_workload(*workload)


def test_memory_pressure_preempts_and_still_finishes():
    # A small budget chunks the recompute of a preempted request that already has output.
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=3, max_model_len=64, page_size=4, num_pages=9)
    assert run_workload(config, [(6, 20), (5, 20), (7, 20)], seed=0) > 0


def run_workload(config, specs, seed) -> int:
    """Runs the requests to the end, checking every step; returns how many preemptions."""
    rng = np.random.default_rng(seed)
    preemptions = 0
    scheduler = Scheduler(config)
    requests = []
    for prompt_len, max_tokens in specs:
        prompt = rng.integers(0, 97, prompt_len).tolist()
        requests.append(scheduler.add(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    for _ in range(10_000):
        if not scheduler.has_work:
            break
        computed = {id(r): r.num_computed for r in requests}
        step = scheduler.schedule()
        preemptions += sum(r.num_computed < computed[id(r)] for r in requests)
        assert step is not None, "work remains but nothing was scheduled"
        batch = step.batch
        assert step.num_tokens <= config.max_num_batched_tokens
        assert len(step.requests) <= config.max_num_seqs
        owners = {}
        for request in scheduler.running:
            for page in request.pages:
                assert page != 0 and page not in owners, "a page is held twice (or the scratch page is)"
                owners[page] = request
        for b, request in enumerate(step.requests):
            lo, hi = batch.query_start[b], batch.query_start[b + 1]
            positions = batch.positions[lo:hi]
            assert positions.tolist() == list(range(request.num_computed, request.num_computed + hi - lo))
            assert batch.token_ids[lo:hi].tolist() == request.tokens[request.num_computed:request.num_computed + hi - lo]
            pages = batch.slot_mapping[lo:hi] // config.page_size
            assert all(owners.get(int(p)) is request for p in pages)
        tokens = [fake_token(r.tokens[:int(batch.seq_lens[b])]) for b, r in enumerate(step.requests)]
        scheduler.commit(step, np.asarray(tokens), np.zeros(len(tokens)), "tp")
    assert not scheduler.has_work
    assert scheduler.allocator.num_free == config.num_pages - 1
    for request, (_, max_tokens) in zip(requests, specs):
        expected = []
        for _ in range(max_tokens):
            expected.append(fake_token(request.prompt_ids + expected))
        assert request.output_ids == expected and request.finish_reason == "length"
    return preemptions


def test_token_slice_equals_slicing_the_whole_list():
    from shiftjax.serving.scheduler import Request

    request = Request(0, [1, 2, 3, 4, 5], SamplingParams(), (), output_ids=[6, 7, 8])
    for first in range(9):
        for size in range(9 - first):
            assert request.token_slice(first, size) == request.tokens[first:first + size]
