"""The engine: scheduling, buckets, shift policy, sampling and bad input, on a tiny model."""

import numpy as np
import pytest

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.allocator import PageAllocator
from shiftjax.serving.engine import Engine, EngineConfig
from shiftjax.serving.executables import BucketLadder, NoBucket
from shiftjax.serving.sampling_params import SamplingParams
from shiftjax.serving.scheduler import QueueFull, Scheduler, SchedulerConfig
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(2,))
PROMPTS = [[5, 17, 33, 8, 90, 41, 7, 12, 3, 66, 71], [9, 4], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def weights():
    return shard_params(random_params(CONFIG, seed=5, scale=0.3), CONFIG, make_mesh(2, 2))


def engine_for(weights, **options):
    base = dict(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                token_buckets=(4, 16), seq_buckets=(4,), attention="reference")
    return Engine(weights, EngineConfig(**(base | options)), eos_token_ids=CONFIG.eos_token_ids)


def generate(engine, prompts, params):
    requests = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done(requests)
    return requests


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_outputs(weights):
    return [r.output_ids for r in generate(engine_for(weights, mode="tp"), PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode", ["sp", "alternate", "auto"])
def test_every_mode_gives_the_same_greedy_tokens(weights, tp_outputs, mode):
    engine = engine_for(weights, mode=mode)
    requests = generate(engine, PROMPTS, GREEDY)
    assert [r.output_ids for r in requests] == tp_outputs
    assert all(len(r.output_ids) == 10 for r in requests)
    modes = [m for r in requests for m in r.modes]
    if mode == "alternate":
        assert {"tp", "sp"} <= set(modes) and engine.stats["switches"] == engine.stats["steps"] - 1
    if mode == "sp":
        assert set(modes) == {"sp"}
    if mode == "auto":  # picks per bucket from the measured executable times
        assert set(engine.executables.run_seconds) == set(engine.executables.compiled)


def test_chunked_prefill_and_preemption_do_not_change_tokens(weights, tp_outputs):
    # 9 usable pages of 4 tokens cannot hold all three sequences at their full length
    # (21 + 12 + 16 tokens): the scheduler must preempt and recompute.
    engine = engine_for(weights, mode="tp", num_pages=10, max_num_batched_tokens=4)
    requests = generate(engine, PROMPTS, GREEDY)
    assert [r.output_ids for r in requests] == tp_outputs
    assert engine.scheduler.allocator.num_free == 9  # everything given back


def test_sampling_is_reproducible_and_independent_of_the_batch(weights):
    engine = engine_for(weights, mode="tp")
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=11, ignore_eos=True)
    together = generate(engine, PROMPTS, params)
    alone = generate(engine, [PROMPTS[1]], params)
    assert together[1].output_ids == alone[0].output_ids
    other_seed = generate(engine, [PROMPTS[1]], SamplingParams(**{**params.__dict__, "seed": 12}))
    assert other_seed[0].output_ids != alone[0].output_ids
    assert all(lp <= 0 for lp in together[0].output_logprobs)


def test_top_k_one_is_greedy(weights, tp_outputs):
    engine = engine_for(weights, mode="tp")
    params = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert [r.output_ids for r in generate(engine, PROMPTS, params)] == tp_outputs


def test_stop_tokens_end_a_request(weights, tp_outputs):
    engine = engine_for(weights, mode="tp")
    stop = tp_outputs[0][3]
    first = tp_outputs[0].index(stop)
    [request] = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    assert request.finish_reason == "stop" and request.output_ids == tp_outputs[0][:first + 1]
    engine.eos_token_ids = (stop,)  # the model's own EOS ends it the same way
    [request] = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=10))
    assert request.finish_reason == "stop" and request.output_ids == tp_outputs[0][:first + 1]


def test_bad_input_is_rejected_and_loses_nothing(weights):
    engine = engine_for(weights, mode="tp")
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 96], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    assert not engine.scheduler.has_work
    [request] = generate(engine, [PROMPTS[1]], GREEDY)  # the engine still serves
    assert len(request.output_ids) == 10


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                         ("max_tokens", 0), ("seed", -3)])
def test_sampling_params_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bucket_ladder():
    ladder = BucketLadder.geometric(128, 8, multiple=2)
    assert ladder.token_buckets == (16, 64, 128) and ladder.seq_buckets == (1, 4, 8)
    assert ladder.pick(17, 3) == (64, 4)
    with pytest.raises(NoBucket, match="129 tokens"):
        ladder.pick(129, 1)
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketLadder((16, 8), (1,))


def test_sp_buckets_must_divide(weights):
    with pytest.raises(ValueError, match="multiple of sp=2"):
        engine_for(weights, token_buckets=(5, 16))


def test_queue_is_bounded_and_abort_frees_pages():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32,
                                          page_size=4, num_pages=9, max_queue=2))
    a = scheduler.add([1, 2, 3, 4, 5], GREEDY)
    scheduler.add([6], GREEDY)
    with pytest.raises(QueueFull):
        scheduler.add([7], GREEDY)
    step = scheduler.schedule()
    assert step.num_tokens == 6 and step.batch.query_start.tolist() == [0, 5, 6]
    assert scheduler.allocator.num_free == 8 - 3
    scheduler.abort(a)
    assert scheduler.allocator.num_free == 8 - 1 and a.finish_reason == "aborted"


def test_decodes_go_first_then_prefill_chunks_fill_the_budget():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64,
                                          page_size=4, num_pages=32))
    first = scheduler.add([1] * 3, GREEDY)
    step = scheduler.schedule()
    scheduler.commit(step, np.array([9]), np.array([-0.1]), "tp")
    assert first.output_ids == [9]
    scheduler.add([2] * 20, GREEDY)
    step = scheduler.schedule()
    assert step.requests[0] is first and step.batch.query_start.tolist() == [0, 1, 8]
    assert step.samples == [True, False]  # the long prompt's first chunk samples nothing


def test_allocator_never_hands_out_the_scratch_page():
    allocator = PageAllocator(5)
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and allocator.num_free == 0
