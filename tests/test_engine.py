"""The engine: scheduling, buckets, shift policy, sampling and bad input, on a tiny model.

Engines are built once per set of options (``engines``) and shared by the tests of this
module: every test leaves its engine with nothing queued or running. Log-probabilities are
checked against transformers on the same weights (``test_parallel.transformers_model``).
"""

import numpy as np
import pytest
import torch
from test_parallel import transformers_model

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.engine import compile as compiling
from shiftjax.serving.engine import scheduler as scheduler_module
from shiftjax.serving.engine import transfers
from shiftjax.serving.engine.buckets import BucketLadder, NoBucket
from shiftjax.serving.engine.core import Engine, EngineConfig, StepFailed
from shiftjax.serving.engine.page_allocator import PageAllocator
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.serving.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from shiftjax.step_options import GEMM_BACKENDS, StepOptions
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                     eos_token_ids=(2,))
PROMPTS = [[5, 17, 33, 8, 90, 41, 7, 12, 3, 66, 71], [9, 4], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=5, scale=0.3)


@pytest.fixture(scope="module")
def weights(params):
    return shard_params(params, CONFIG, make_mesh(2, 2))


@pytest.fixture(scope="module")
def engines(weights):
    """``engines(**options)``: the module's engine for these options, built on first use."""
    built = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in built:
            built[key] = engine_for(weights, **options)
        return built[key]

    return get


def engine_for(weights, **options):
    base = dict(max_model_len=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                token_buckets=(4, 16), seq_buckets=(4,), attention="reference")
    return Engine(weights, EngineConfig(**(base | options)), eos_token_ids=CONFIG.eos_token_ids)


def generate(engine, prompts, params):
    requests = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done(requests)
    return requests


GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=11, ignore_eos=True)
# Preemption: 9 usable pages of 4 tokens cannot hold all three sequences at their full
# length (21 + 12 + 16 tokens): the scheduler must preempt and recompute.
# Page pressure that preempts: without the prefix cache, which would spare the shared test
# prompts their pages (test_prefix_caching_engine.py preempts with it on)
TIGHT = dict(num_pages=10, max_num_batched_tokens=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tp_requests(engines):
    return generate(engines(mode="tp"), PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def tp_outputs(tp_requests):
    return [r.output_ids for r in tp_requests]


@pytest.fixture(scope="module")
def sampled_requests(engines):
    return generate(engines(mode="tp"), PROMPTS, SAMPLED)


def transformers_logprobs(model, request) -> np.ndarray:
    """log-softmax of transformers' logits at every position that produced an output token:
    ``[output tokens, vocab]``."""
    tokens = request.prompt_ids + request.output_ids[:-1]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, len(request.prompt_ids) - 1:]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def test_logprobs_are_the_models(params, tp_requests, sampled_requests):
    model = transformers_model(params, CONFIG)
    tempered_gap = []
    for request in tp_requests + sampled_requests:
        expected = transformers_logprobs(model, request)
        chosen = expected[np.arange(len(request.output_ids)), request.output_ids]
        np.testing.assert_allclose(request.output_logprobs, chosen, atol=2e-4, rtol=0,
                                   err_msg=f"request {request.request_id}, {request.params}")
        if request.params.temperature == 0:  # greedy picked transformers' most likely token
            assert request.output_ids == expected.argmax(-1).tolist()
        else:  # what a sampler reporting the tempered distribution would have said instead
            tempered = torch.log_softmax(torch.tensor(expected) / request.params.temperature, -1).numpy()
            tempered_gap.append(np.abs(tempered[np.arange(len(chosen)), request.output_ids] - chosen).max())
    # The tolerance above is tight enough to reject logprobs of the tempered distribution.
    assert min(tempered_gap) > 100 * 2e-4, tempered_gap


@pytest.mark.parametrize("mode", ["sp", "alternate", "auto"])
def test_every_mode_gives_the_same_greedy_tokens(engines, tp_outputs, mode):
    engine = engines(mode=mode)
    requests = generate(engine, PROMPTS, GREEDY)
    assert [r.output_ids for r in requests] == tp_outputs
    assert all(len(r.output_ids) == 10 for r in requests)
    modes = [m for r in requests for m in r.modes]
    if mode == "alternate":
        assert {"tp", "sp"} <= set(modes) and engine.snapshot().switches == engine.snapshot().steps - 1
    compiled_modes = {m for m, _, _ in engine.executables.compiled}
    assert compiled_modes == ({"sp"} if mode == "sp" else {"tp", "sp"})  # a fixed mode compiles its own only
    if mode == "sp":
        assert set(modes) == {"sp"}
    if mode == "auto":  # picks per bucket from the measured executable times
        assert set(engine.executables.run_seconds) == set(engine.executables.compiled)
        assert engine.startup_seconds["policy_timing"] > 0  # a phase of its own in the start-up log


def test_auto_with_a_threshold_runs_sp_from_the_threshold_up(engines, tp_outputs):
    engine = engines(mode="auto", shift_threshold=16)
    assert not engine.executables.run_seconds  # a threshold needs no timing
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    reports = []
    engine.run_until_done(requests, on_step=reports.append)
    assert [r.output_ids for r in requests] == tp_outputs
    assert [report.mode for report in reports] == ["sp" if report.bucket[0] >= 16 else "tp" for report in reports]
    assert {report.mode for report in reports} == {"tp", "sp"}


@pytest.fixture
def preemptions(monkeypatch):
    """Preemptions counted from outside the scheduler (``Scheduler._preempt`` wrapped), to
    check the scheduler's own ``num_preemptions``: ``[(request_id, ...)]``."""
    seen = []
    preempt = scheduler_module.Scheduler._preempt

    def counting(self, request):
        seen.append(request.request_id)
        return preempt(self, request)

    monkeypatch.setattr(scheduler_module.Scheduler, "_preempt", counting)
    return seen


@pytest.mark.parametrize("mode", ["tp", "sp", "alternate"])
def test_chunked_prefill_and_preemption_do_not_change_tokens(engines, tp_outputs, sampled_requests, preemptions, mode):
    engine = engines(mode=mode, **TIGHT)
    # Sampled tokens too: a row's key derives from its seed and position, so recomputing
    # after a preemption draws the same tokens.
    for params, expected in ((GREEDY, tp_outputs), (SAMPLED, [r.output_ids for r in sampled_requests])):
        before, counted = len(preemptions), engine.scheduler.num_preemptions
        requests = generate(engine, PROMPTS, params)
        assert len(preemptions) > before, f"{mode}, {params}: nothing was preempted"
        assert engine.scheduler.num_preemptions - counted == len(preemptions) - before
        assert sum(r.preemptions for r in requests) == len(preemptions) - before
        assert [r.output_ids for r in requests] == expected, f"{mode}, {params}"
        assert engine.scheduler.allocator.num_free == 9  # everything given back
        assert set(m for r in requests for m in r.modes) == ({"tp", "sp"} if mode == "alternate" else {mode})


def test_sampling_is_reproducible_and_independent_of_the_batch(engines):
    engine = engines(mode="tp")
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=11, ignore_eos=True)
    together = generate(engine, PROMPTS, params)
    alone = generate(engine, [PROMPTS[1]], params)
    assert together[1].output_ids == alone[0].output_ids
    other_seed = generate(engine, [PROMPTS[1]], SamplingParams(**{**params.__dict__, "seed": 12}))
    assert other_seed[0].output_ids != alone[0].output_ids
    assert all(lp <= 0 for lp in together[0].output_logprobs)


def test_top_k_one_is_greedy(engines, tp_outputs):
    engine = engines(mode="tp")
    params = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert [r.output_ids for r in generate(engine, PROMPTS, params)] == tp_outputs


def test_stop_tokens_end_a_request(engines, tp_outputs):
    engine = engines(mode="tp")
    stop = tp_outputs[0][3]
    first = tp_outputs[0].index(stop)
    [request] = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    assert request.finish_reason == "stop" and request.output_ids == tp_outputs[0][:first + 1]
    eos, engine.eos_token_ids = engine.eos_token_ids, (stop,)  # the model's own EOS ends it the same way
    try:
        [request] = generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=10))
    finally:
        engine.eos_token_ids = eos
    assert request.finish_reason == "stop" and request.output_ids == tp_outputs[0][:first + 1]


@pytest.mark.parametrize("options", [dict(mode="tp"), dict(mode="alternate", **TIGHT)])
def test_async_scheduling_changes_no_token(engines, tp_outputs, options):
    """The pipelined engine (step N+1 dispatched before N's result is read, its decode
    tokens taken from N's result on the device) generates what the step-at-a-time one
    does: with sampling, stop tokens that end a request while its next step is already in
    flight, and (TIGHT) preemption of requests in the uncommitted step."""
    stop = tp_outputs[2][3]
    params = [GREEDY, SAMPLED, SamplingParams(max_tokens=10, stop_token_ids=(stop,), logprobs=True, top_logprobs=3)]

    def run(engine):
        # Both engines start from an empty prefix cache: the module's shared engines ran these
        # prompts before, and a prompt that finds pages cached is prefilled in other steps and
        # buckets (other executables, whose float32 sums round differently in the last bits).
        engine.scheduler.prefix_cache.forget()
        requests = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
        engine.run_until_done(requests)
        return [(r.output_ids, r.output_logprobs, r.output_top_logprobs, r.finish_reason) for r in requests]

    pipelined = engines(**options)
    before = pipelined.scheduler.num_preemptions
    runner = pipelined.runner
    source_of, calls = runner._sampled_token_source, []
    runner._sampled_token_source = lambda step: calls.append(step.takes_sampled_tokens) or source_of(step)
    try:
        got = run(pipelined)
    finally:
        del runner._sampled_token_source
    preempted = pipelined.scheduler.num_preemptions - before
    expected = run(engines(async_scheduling=False, **options))
    assert got == expected
    if "num_pages" in options:  # TIGHT: requests of the uncommitted step were preempted
        assert preempted > 0
    assert expected[2][3] == "stop" and len(expected[2][0]) == tp_outputs[2].index(stop) + 1
    assert sum(calls) >= 9, "decode steps did not take their tokens on the device"
    assert pipelined.scheduler.allocator.num_free == pipelined.num_pages - 1


def test_the_sampler_runs_only_for_steps_that_sample(engines, tp_outputs, sampled_requests):
    engine = engines(mode="tp")
    samplers, calls = engine.samplers, []
    engine.runner.samplers = lambda *args, **options: calls.append(1) or samplers(*args, **options)
    try:
        assert [r.output_ids for r in generate(engine, PROMPTS, GREEDY)] == tp_outputs
        assert calls == []  # greedy steps take the step's own packing
        assert [r.output_ids for r in generate(engine, PROMPTS, SAMPLED)] == [r.output_ids for r in sampled_requests]
        assert calls
    finally:
        engine.runner.samplers = samplers


@pytest.mark.parametrize("error, raised", [(RuntimeError("injected device error"), StepFailed),
                                          (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_step_that_fails_on_the_devices_is_recomputed_not_lost(engines, tp_outputs, monkeypatch, error, raised):
    """A device error surfaces when a step's result is read, with the next step already
    launched on its caches: the engine starts again from fresh caches and every request
    recomputes, generating what it would have. An interrupt while waiting (a notebook's
    Ctrl-C) leaves the engine as usable."""
    engine = engines(mode="tp")
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step().result()
    fetch, failures = transfers.packed_to_host, []

    def fails_once(host_copy):
        if not failures:
            failures.append(1)
            raise error
        return fetch(host_copy)

    monkeypatch.setattr(transfers, "packed_to_host", fails_once)
    with pytest.raises(raised):
        engine.step().result()
    engine.run_until_done(requests)
    assert [r.output_ids for r in requests] == tp_outputs
    assert all(r.preemptions >= 1 for r in requests)
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failed_launch_is_reported_with_the_step_its_turn_finished(engines, tp_outputs, monkeypatch,
                                                                     async_scheduling):
    """A turn whose launch fails still finishes (and reports) the step in flight; the failed
    launch's requests (the caller's to fail; a server does) went back to the queue, and
    recompute to what they would have generated. Both orders of a turn: the next launch
    before the finish (async) or after it."""
    engine = engines(mode="tp", async_scheduling=async_scheduling)
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step().result()
    real_get = engine.executables.get

    def fails(*key):
        raise RuntimeError("an injected launch failure")

    monkeypatch.setattr(engine.executables, "get", fails)
    turn = engine.step()
    monkeypatch.setattr(engine.executables, "get", real_get)
    [failure] = turn.failed
    assert turn.finished is not None and turn.finished.requests  # the step in flight, committed
    assert not engine.has_step_in_flight and isinstance(failure.__cause__, RuntimeError)
    assert failure.requests and all(r.preemptions == 1 and not r.finished for r in failure.requests)
    engine.run_until_done(requests)
    assert [r.output_ids for r in requests] == tp_outputs
    assert engine.scheduler.allocator.num_free == engine.num_pages - 1


def test_forget_in_flight_recomputes_what_was_in_flight(engines, tp_outputs):
    engine = engines(mode="tp")
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(4):
        engine.step().result()
    assert engine.has_step_in_flight
    engine.forget_in_flight()
    assert not engine.has_step_in_flight
    engine.run_until_done(requests)
    assert [r.output_ids for r in requests] == tp_outputs
    assert all(r.preemptions >= 1 for r in requests)


def test_bad_input_is_rejected_and_loses_nothing(engines):
    engine = engines(mode="tp")
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
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2**31),
                                         ("max_tokens", 0), ("seed", -3)])
def test_sampling_params_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bucket_ladder():
    ladder = BucketLadder.geometric(128, 8, multiple=2)
    assert ladder.token_buckets == (16, 64, 128) and ladder.seq_buckets == (8,)
    assert ladder.pick(17, 3) == (64, 8) and ladder.pick(1, 1) == (16, 8)
    served = BucketLadder.geometric(8192, 256)
    assert served.seq_buckets == (16, 64, 256)
    # a decode step of a bucket's worth of sequences runs as a step of as many tokens
    assert [served.pick(n, n) for n in (16, 64, 256)] == [(16, 16), (64, 64), (256, 256)]
    assert served.pick(40, 40) == (64, 64) and served.pick(5, 5) == (16, 16)
    # a full batch that is no token bucket gets one (else 100 sequences would decode in 256 rows)
    assert BucketLadder.geometric(8192, 100).seq_buckets == (16, 64, 100)
    assert BucketLadder.geometric(8192, 100).token_buckets == (16, 64, 100, 256, 1024, 4096, 8192)
    for max_tokens, max_seqs, multiple in [
            (8192, 100, 1), (8192, 20, 1), (8192, 300, 2), (2048, 256, 1), (128, 8, 2), (4, 8, 1), (96, 200, 8)]:
        assert BucketLadder.geometric(max_tokens, max_seqs, multiple=multiple).padded_decode_steps() == []
    assert BucketLadder.geometric(8192, 256, multiple=3).seq_buckets == (18, 66, 256)
    assert served.padded_decode_steps() == [] and ladder.padded_decode_steps() == []  # (16, 8): 2x at most
    # a hand-made ladder like the compare runs' (16/256/1024 x 1/8/64): 64 sequences decode in 256 rows
    assert BucketLadder((16, 256, 1024), (1, 8, 64)).padded_decode_steps() == [(64, 256)]
    assert BucketLadder.geometric(64, 4).seq_buckets == (4,)
    small = BucketLadder.geometric(4, 8)  # a token budget under 8 still gets a bucket pair
    assert small.pairs() == [(4, 4)] and small.max_seqs() == 4 and small.pick(3, 2) == (4, 4)
    with pytest.raises(NoBucket, match="129 tokens"):
        ladder.pick(129, 1)
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketLadder((16, 8), (1,))


def test_every_step_fits_a_bucket_of_a_sparse_ladder(engines):
    # Token bucket 2 is compiled for one sequence only (sequence bucket 4 > 2 tokens): two
    # sequences in a 2-token step would fit no executable (NoBucket), so the scheduler takes
    # one sequence per step and both requests finish.
    engine = engines(mode="tp", token_buckets=(2,), seq_buckets=(1, 4), max_num_batched_tokens=2)
    assert set(engine.executables.compiled) == {("tp", 2, 1)}  # a fixed mode compiles only its own
    assert engine.scheduler.config.max_num_seqs == 1
    with pytest.raises(NoBucket, match="2 tokens and 2 sequences"):
        engine.executables.ladder.pick(2, 2)
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS[1:3]]
    engine.run_until_done(requests)
    assert all(len(r.output_ids) == GREEDY.max_tokens for r in requests)
    assert BucketLadder((2, 16), (1, 8)).max_seqs() == 8 and BucketLadder((2,), (1, 4)).max_seqs() == 1


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


def test_large_steps_launch_without_cuda_graphs():
    """Past ``cuda_graph_max_tokens`` a GPU step is compiled without XLA's command buffers;
    at or below it, and on other platforms, the options are the same as for any step."""
    options = StepOptions()
    small = compiling.xla_compiler_options(options, "gpu", 512)
    assert "xla_gpu_enable_command_buffer" not in small
    assert compiling.xla_compiler_options(options, "gpu", 4096) == {**small, **compiling.NO_COMMAND_BUFFERS}
    assert compiling.xla_compiler_options(options.replace(cuda_graph_max_tokens=None), "gpu", 4096) == small
    assert compiling.xla_compiler_options(options, "cpu", 4096) is None
    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be at least 1"):
        StepOptions(cuda_graph_max_tokens=0)


def test_mosaic_kernels_launch_outside_cuda_graphs():
    """A step with Mosaic GPU kernels (FP8 weights) keeps XLA's own kernels and cuBLAS in its
    command buffers and launches custom calls between them, which XLA would otherwise trace
    again whenever their buffers moved; past ``cuda_graph_max_tokens`` it has no graphs at all."""
    options = StepOptions()
    plain = compiling.xla_compiler_options(options, "gpu", 16)
    mosaic = compiling.xla_compiler_options(options, "gpu", 16, mosaic_kernels=True)
    assert mosaic == {**plain, **compiling.GRAPHS_WITHOUT_CUSTOM_CALLS}
    commands = mosaic["xla_gpu_enable_command_buffer"].split(",")
    assert "CUSTOM_CALL" not in commands and "FUSION" in commands
    assert compiling.xla_compiler_options(options, "gpu", 4096, mosaic_kernels=True) == \
        compiling.xla_compiler_options(options, "gpu", 4096)
    assert compiling.xla_compiler_options(options, "cpu", 16, mosaic_kernels=True) is None
    # FP8 weights run the Mosaic kernels where asked or, by default, on Hopper GPUs only
    mesh = make_mesh(1, 1)
    assert compiling.runs_mosaic_kernels("fp8", mesh, options.replace(quantized_gemm="pallas"))
    assert not compiling.runs_mosaic_kernels("fp8", mesh, options)  # auto on the CPU: the reference
    assert not compiling.runs_mosaic_kernels("none", mesh, options.replace(quantized_gemm="pallas"))


def test_gemm_backend_options():
    """Who runs the GEMMs is an XLA compile option on GPUs only, one for every step of an
    engine (TP and SP steps must do the same arithmetic); cuBLAS unless asked."""
    cublas = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_graph_min_graph_size": 1}
    no_remat = {"xla_disable_hlo_passes": "rematerialization"}
    assert compiling.xla_compiler_options(StepOptions(gemm="triton"), "gpu") == no_remat
    assert compiling.xla_compiler_options(StepOptions(gemm="cublas"), "gpu") == {**no_remat, **cublas}
    assert all(compiling.xla_compiler_options(StepOptions(gemm=gemm), "cpu") is None for gemm in GEMM_BACKENDS)
    with pytest.raises(ValueError, match="gemm must be one of"):
        StepOptions(gemm="cutlass")
    with pytest.raises(ValueError, match="gemm must be one of"):
        EngineConfig(gemm="cutlass")
    assert EngineConfig().gemm == "cublas"

    from shiftjax.serving.engine.engine_args import engine_options
    from shiftjax.serving.server.cli import _parser

    gemm = next(a for a in _parser()._actions if a.dest == "gemm")
    assert tuple(gemm.choices) == GEMM_BACKENDS and gemm.default == EngineConfig().gemm
    assert EngineConfig(**engine_options(_parser().parse_args(["--gemm", "triton"]))).gemm == "triton"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--gemm", "cutlass"])


def test_compile_workers(monkeypatch, weights):
    """Triton's autotuning serialises concurrent compiles on a GPU, so they run one at a
    time there; cuBLAS steps and CPU steps compile at once. An explicit count wins, and is
    validated."""
    monkeypatch.setattr(compiling, "usable_cpus", lambda: 32)
    assert compiling.compile_workers("gpu", "triton") == 1
    assert compiling.compile_workers("gpu", "cublas") == 8
    assert compiling.compile_workers("cpu", "triton") == 32
    monkeypatch.setattr(compiling, "usable_cpus", lambda: 2)
    assert compiling.compile_workers("gpu", "cublas") == 1
    with pytest.raises(ValueError, match="compile_workers must be at least 1"):
        EngineConfig(compile_workers=0)

    from shiftjax.serving.engine.engine_args import engine_options
    from shiftjax.serving.server.cli import _parser

    assert EngineConfig(**engine_options(_parser().parse_args(["--compile-workers", "3"]))).compile_workers == 3
    assert EngineConfig(**engine_options(_parser().parse_args([]))).compile_workers is None

    asked = []
    compile_all = compiling.compile_all
    monkeypatch.setattr(compiling, "compile_all", lambda *a, **k: asked.append(k["workers"]) or compile_all(*a, **k))
    engine = engine_for(weights, mode="tp", token_buckets=(4,), compile_workers=1)
    assert asked == [1] and len(engine.executables.compiled) == 1
