"""DataParallelService (``shiftjax serve --dp P``): routing to the replica with the fewest
queued tokens, cancel and refusals, on fake replicas; then two real one-device engines of
the default model behind the gRPC server: greedy outputs equal offline generate's,
concurrent requests spread over both, a cancel or a deadline frees pages in the replica
that held the request, and ``bench serve`` drives it."""

import asyncio
import dataclasses
import json
import subprocess
import sys

import grpc
import pytest

from grpc_harness import FakeEngineService, with_engine
from shiftjax.serving.server.data_parallel import DataParallelService, StartupSummer, pick_replica
from shiftjax.serving.engine.errors import InvalidRequest, Overloaded, Unavailable
from shiftjax.serving.server.protocol import GenerationRequest
from shiftjax.serving.engine.sampling_params import SamplingParams
from loopback import wait_for


class VocabOnly:
    vocab_size = 5000
    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x41 + i % 26) for i in ids)


def request(prompt_len: int, max_tokens: int, request_id: str | None = None) -> GenerationRequest:
    return GenerationRequest(tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             request_id=request_id)


def fake_dp(*max_running: int):
    replicas = [FakeEngineService(VocabOnly(), max_running=m, step_seconds=0.0) for m in max_running]
    return DataParallelService(replicas, VocabOnly(), devices=[f"fake:{i}" for i in range(len(replicas))]), replicas


def replica_of(replicas, request_id: str) -> int:
    [index] = [i for i, r in enumerate(replicas) if request_id in r.live]
    return index


def test_pick_replica_takes_fewest_tokens_then_fewest_requests_then_lowest_index():
    assert pick_replica([30, 10, 20], [1, 1, 1]) == 1
    assert pick_replica([10, 10, 10], [3, 2, 2]) == 1
    assert pick_replica([10, 10], [1, 1]) == 0
    assert pick_replica([0, 50, 40], [0, 1, 1], candidates=[1, 2]) == 2


def test_pick_replica_takes_a_cached_prefix_off_what_the_request_would_owe():
    assert pick_replica([0, 0], [0, 0], cached_tokens=[0, 32]) == 1  # equally loaded: the longest prefix
    assert pick_replica([20, 0], [1, 0], cached_tokens=[32, 0]) == 0  # busier by less than the prefix saves
    assert pick_replica([40, 0], [1, 0], cached_tokens=[32, 0]) == 1  # busier by more: the load decides
    assert pick_replica([0, 0, 0], [0, 0, 0], candidates=[0, 2], cached_tokens=[0, 64, 16]) == 2


def test_routes_each_request_to_the_replica_with_the_fewest_queued_tokens():
    dp, replicas = fake_dp(64, 64)
    long = dp.submit(request(10, 50, "long"))  # tie at 0: replica 0
    short = dp.submit(request(3, 2, "short"))  # 0 < 60: replica 1
    assert (replica_of(replicas, "long"), replica_of(replicas, "short")) == (0, 1)
    assert dp.queued_tokens() == [60, 5]
    dp.submit(request(100, 4, "big"))  # 5 < 60: replica 1, though it holds more requests
    assert replica_of(replicas, "big") == 1 and dp.queued_tokens() == [60, 109]
    dp.submit(request(1, 1, "next"))  # 60 < 109
    assert replica_of(replicas, "next") == 0

    async def drain_some():
        first = await long.__anext__()  # the prefill is done and one token is out: 49 left
        assert len(first.token_ids) == 1
        assert dp.queued_tokens() == [49 + 2, 109]
        async for _ in short:  # a finished request owes nothing
            pass
        assert dp.queued_tokens() == [51, 104]
        info = dp.info()
        assert [r["routed_requests"] for r in info["replicas"]] == [2, 2]
        assert [r["queued_tokens"] for r in info["replicas"]] == [51, 104]
        assert [r["device"] for r in info["replicas"]] == ["fake:0", "fake:1"]
        await long.aclose()  # closed early: forgotten here, cancelled in its replica
        assert dp.queued_tokens() == [2, 104] and "long" not in replicas[0].live

    asyncio.run(drain_some())


class CachingFake(FakeEngineService):
    """A fake replica whose prefix cache holds ``cached[(prompt, salt)]`` tokens of a prompt."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cached: dict[tuple, int] = {}
        self.probes: list[tuple] = []

    def cached_prefix_tokens(self, prompt_ids, cache_salt=None) -> int:
        self.probes.append((tuple(prompt_ids), cache_salt))
        return self.cached.get((tuple(prompt_ids), cache_salt), 0)


def test_routes_to_the_replica_holding_the_prompts_prefix_and_counts_only_the_rest():
    replicas = [CachingFake(VocabOnly(), step_seconds=0.0) for _ in range(3)]
    dp = DataParallelService(replicas, VocabOnly(), devices=["fake:0", "fake:1", "fake:2"])
    prompt = tuple(range(1, 41))
    replicas[2].cached[(prompt, "tenant")] = 32
    dp.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4), request_id="salted", cache_salt="tenant"))
    assert replica_of(replicas, "salted") == 2 and dp.queued_tokens() == [0, 0, 8 + 4]  # 32 prompt tokens cached
    assert all(r.probes == [(prompt, "tenant")] for r in replicas)
    dp.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4), request_id="unsalted"))
    assert replica_of(replicas, "unsalted") == 0  # another salt's prefix is not this request's
    dp.submit(request(2, 2, "short"))  # 0, 44, 12 queued: the fewest, nothing cached anywhere
    assert replica_of(replicas, "short") == 1
    info = dp.info()
    assert "prefix cache" in info["routing"] and info["replicas"][2]["prefix_cache_hits"] == 0
    with pytest.raises(InvalidRequest, match="cache_salt"):  # refused before any replica is probed
        dp.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4), cache_salt=""))
    assert len(replicas[0].probes) == 3


def test_a_full_replica_passes_the_request_on_and_all_full_is_overloaded():
    dp, replicas = fake_dp(8, 1)
    dp.submit(request(50, 50, "a"))
    dp.submit(request(2, 2, "b"))
    dp.submit(request(2, 2, "c"))  # replica 1 has fewer tokens but is full
    assert [replica_of(replicas, r) for r in "abc"] == [0, 1, 0]
    dp, replicas = fake_dp(1, 1)
    dp.submit(request(2, 2, "a")), dp.submit(request(2, 2, "b"))
    with pytest.raises(Overloaded, match="every replica"):
        dp.submit(request(2, 2, "c"))
    assert dp.queued_tokens() == [4, 4]  # the refused request left nothing behind


def test_refusals_of_the_request_itself_are_raised_and_forgotten():
    dp, replicas = fake_dp(8, 8)
    dp.submit(request(2, 2, "same"))
    with pytest.raises(InvalidRequest, match="already in flight"):
        dp.submit(request(2, 2, "same"))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        dp.submit(request(500, 100, "too-long"))  # the fake's max_model_len is 512
    assert dp.queued_tokens() == [4, 0] and dp.cancel("too-long") is False


def test_closing_a_stream_never_started_forgets_it_and_frees_its_pages():
    dp, replicas = fake_dp(8, 8)
    stream = dp.submit(request(20, 20, "idle"))
    assert replicas[0].free_pages < replicas[0].num_pages
    asyncio.run(stream.aclose())
    assert dp.queued_tokens() == [0, 0] and replicas[0].free_pages == replicas[0].num_pages


def test_cancel_reaches_the_replica_that_holds_the_request():
    dp, replicas = fake_dp(8, 8)
    dp.submit(request(20, 20, "on-0"))
    dp.submit(request(2, 2, "on-1"))
    assert dp.cancel("on-1") is True
    assert replicas[1].live["on-1"].cancelled and not replicas[0].live["on-0"].cancelled
    assert dp.cancel("nobody") is False


def test_stats_are_summed_and_info_says_dp():
    dp, replicas = fake_dp(8, 8)
    dp.submit(request(20, 20, "x"))
    stats = dp.stats()
    assert (stats.engine.running, stats.engine.num_pages, stats.engine.free_pages) == (1, 512, 512 - 3)
    assert stats.engine.tokens_by_mode == {"tp": 0} and stats.ready and stats.error is None
    replicas[1].stats = lambda real=replicas[1].stats: dataclasses.replace(real(), ready=False, error="lost GPU")
    stats = dp.stats()
    assert not stats.ready and stats.error == "replica 1: lost GPU"
    info = dp.info()  # the error named by replica, replica 0's info (the base of dp's) or not
    assert info["error"] == "replica 1: lost GPU" and info["replicas"][1]["error"] == "lost GPU"
    assert "error" not in info["replicas"][0] and not info["ready"]
    with pytest.raises(Unavailable, match="replica 1: lost GPU"):  # not "still starting"
        dp.submit(request(2, 2, "after"))
    info = dp.info()
    assert info["mesh"]["dp"] == 2 and info["page_pool"]["num_pages"] == 512
    assert info["startup"]["executables"] == 8


def test_prefix_cache_counts_are_summed_over_the_replicas_caches():
    dp, replicas = fake_dp(8, 8)
    for replica, (queries, hits) in zip(replicas, [(100, 40), (50, 10)]):
        replica.stats = lambda real=replica.stats, q=queries, h=hits: with_engine(
            real(), prefix_cache_queries=q, prefix_cache_hits=h, cached_pages=h // 10, evicted_pages=1)
        replica.info = lambda real=replica.info: real() | {"prefix_cache": {"enabled": True}}
    summed = dp.stats().engine
    assert (summed.prefix_cache_queries, summed.prefix_cache_hits, summed.cached_pages, summed.evicted_pages) == \
        (150, 50, 5, 2)
    assert dp.info()["prefix_cache"] == {"enabled": True, "hit_rate": 50 / 150, "queries": 150, "hits": 50,
                                         "cached_pages": 5, "evicted_pages": 2}
    assert [r["prefix_cache_hits"] for r in dp.info()["replicas"]] == [40, 10]


def test_info_startup_phases_are_the_slowest_replicas():
    dp, replicas = fake_dp(8, 8)
    for replica, loaded, phases in ((replicas[0], 1, {"kv_cache": 0.4, "executables": 2.0}),
                                    (replicas[1], 3, {"kv_cache": 0.1, "executables": 9.0, "check_stored": 1.0})):
        info = replica.info()
        info["startup"].update(loaded_from_store=loaded, phase_seconds=phases)
        replica.info = lambda info=info: info
    startup = dp.info()["startup"]
    assert startup["loaded_from_store"] == 4
    assert startup["phase_seconds"] == {"kv_cache": 0.4, "executables": 9.0, "check_stored": 1.0}


def test_step_trace_merges_the_replicas_in_time_order_and_names_each():
    dp, replicas = fake_dp(8, 8)
    replicas[0].steps[:] = [{"time": 1.0, "mode": "tp", "waiting": 3}, {"time": 3.0, "mode": "tp", "waiting": 1}]
    replicas[1].steps[:] = [{"time": 2.0, "mode": "tp", "waiting": 5}]
    assert [(s["time"], s["replica"], s["waiting"]) for s in dp.step_trace()] == [(1.0, 0, 3), (2.0, 1, 5), (3.0, 0, 1)]
    assert "replica" not in replicas[0].steps[0]  # the replicas' own traces are left alone


def test_startup_reports_are_summed_over_replicas():
    seen = []

    class Observer:
        def on_startup(self, **report):
            seen.append(report)

        def on_preemption(self):
            seen.append("preempted")

    summed = StartupSummer(Observer())
    summed.on_startup(compile_seconds=3.0, executables=2, cache_hits=1)
    summed.on_startup(compile_seconds=2.0, executables=2, cache_hits=0)
    summed.on_preemption()
    assert seen[-2:] == [dict(compile_seconds=3.0, executables=4, cache_hits=1), "preempted"]


def test_serve_refuses_dp_with_sp_or_tp():
    result = subprocess.run([sys.executable, "-m", "shiftjax.serving.cli", "serve", "--dp", "2", "--sp", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--dp 2 runs engines of one device each and cannot be combined with --sp 2 --tp 1" in result.stderr


def test_the_builder_refuses_what_the_command_line_refuses():
    from shiftjax.serving.server.service_args import build_data_parallel_service
    from shiftjax.serving.server.cli import _parser

    for argv, message in ((["--dp", "2", "--tp", "2"], "cannot be combined with --sp 1 --tp 2"),
                          (["--dp", "2", "--num-processes", "2"], "in one process"),
                          (["--dp", "0"], "at least 1")):
        with pytest.raises(RuntimeError, match=message):
            build_data_parallel_service(_parser().parse_args(argv))


def test_dp_needs_as_many_devices_as_replicas():
    from shiftjax.serving.server.service_args import build_data_parallel_service
    from shiftjax.serving.server.cli import _parser

    args = _parser().parse_args(["--dp", "16", "--no-compilation-cache"])
    with pytest.raises(RuntimeError, match="--dp 16 needs 16 devices but JAX sees 8"):
        build_data_parallel_service(args)


# --- two real replicas of the default model ------------------------------------------

ENGINE = dict(max_model_len=128, page_size=16, num_pages=24, max_num_seqs=4, max_num_batched_tokens=64,
              token_buckets=(16, 64), seq_buckets=(4,))
PROMPTS = [[1, 2, 3], [5, 6, 7, 8], [100, 200], [4000, 17, 9, 9, 12], [42], [7, 7, 7, 7, 7, 7, 7]]
WAIT_SECONDS = 30.0
STEP_RACE = 1  # the info read before close() may come just before a step ends


SERVE_ARGS = ["--dp", "2", "--max-model-len", "128", "--page-size", "16", "--num-pages", "24", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "64", "--token-buckets", "16,64", "--seq-buckets", "4",
              "--no-compilation-cache"]


@pytest.fixture(scope="module")
def served():
    """The service ``shiftjax serve --dp 2`` builds (replicas on devices 0 and 1, building on
    their engine threads), with the offline expectations from an LLM on device 2 built
    meanwhile, behind the gRPC server."""
    import jax
    from grpc_harness import ServerThread

    from shiftjax.serving.server.service_args import build_data_parallel_service
    from shiftjax.serving.engine.llm import LLM
    from shiftjax.serving.server.metrics import Metrics
    from shiftjax.serving.server.cli import _parser

    metrics = Metrics()
    dp = build_data_parallel_service(_parser().parse_args(SERVE_ARGS), observer=metrics, report=lambda line: None)
    llm = LLM("default", devices=[jax.devices()[2]], **ENGINE)
    offline = [c.output_ids for c in llm.generate(PROMPTS, SamplingParams(max_tokens=6))]
    assert dp.wait_ready(300)
    thread = ServerThread(dp)
    yield {"dp": dp, "address": thread.address, "offline": offline, "metrics": metrics}
    thread.stop()
    dp.shutdown()


def replicas_info(client) -> list[dict]:
    return json.loads(client.info().info_json)["replicas"]


@pytest.mark.slow
def test_concurrent_greedy_outputs_equal_offline_and_use_both_replicas(served):
    from shiftjax.serving.client.grpc_client import AsyncClient

    async def run():
        async with AsyncClient(served["address"], timeout=300.0) as client:
            completions = await asyncio.gather(*(client.complete(prompt_ids=p, max_tokens=6) for p in PROMPTS))
            return [list(c.token_ids) for c in completions]

    assert asyncio.run(run()) == served["offline"]
    replicas = served["dp"].info()["replicas"]
    assert [r["device"] for r in replicas] == ["cpu:0", "cpu:1"]
    assert served["metrics"].registry.get_sample_value("shiftjax_startup_executables") == 4  # 2 per replica
    assert all(r["routed_requests"] >= 2 and r["steps"] > 0 for r in replicas), replicas
    assert all(r["free_pages"] == r["num_pages"] == ENGINE["num_pages"] - 1 for r in replicas)
    # ServerInfo's step trace over gRPC carries both replicas' steps (bench compare's time line)
    import grpc

    from shiftjax.serving.proto.shiftjax.v1 import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(served["address"]) as channel:
        info = inference_pb2_grpc.InferenceServiceStub(channel).ServerInfo(
            inference_pb2.ServerInfoRequest(include_step_trace=True), timeout=60)
    trace = json.loads(info.info_json)["step_trace"]
    assert {s["replica"] for s in trace} == {0, 1} and all(s["mode"] == "tp" and s["seconds"] > 0 for s in trace)


@pytest.mark.slow
def test_cancel_and_deadline_free_pages_in_the_replica_that_held_the_request(served):
    """"At once" counted in steps, not seconds (this 2-core machine is shared): the engine
    takes cancellations and deadlines before every schedule, so at most the step already
    running goes by before the pages are free."""
    from shiftjax.serving.client.grpc_client import Client

    def freed_within_a_step(client, index: int, steps_before: int) -> bool:
        assert wait_for(lambda: replicas_info(client)[index]["free_pages"] == ENGINE["num_pages"] - 1, WAIT_SECONDS)
        return replicas_info(client)[index]["steps"] - steps_before <= 1 + STEP_RACE

    with Client(served["address"], timeout=300.0) as client:
        held = client.generate(prompt_ids=[11, 12, 13], max_tokens=100, ignore_eos=True)  # idle: replica 0
        next(held)
        cancelled = client.generate(prompt_ids=[21, 22], max_tokens=60, ignore_eos=True)  # fewer tokens: replica 1
        next(cancelled)
        before = replicas_info(client)
        assert [r["live_requests"] for r in before] == [1, 1]
        assert all(r["free_pages"] < r["num_pages"] for r in before)
        cancelled.close()
        assert freed_within_a_step(client, 1, before[1]["steps"])
        assert replicas_info(client)[0]["free_pages"] < before[0]["num_pages"]  # replica 0's request runs on
        steps = replicas_info(client)[0]["steps"]
        held.close()
        assert freed_within_a_step(client, 0, steps)

        with pytest.raises(grpc.RpcError) as caught:
            client.complete(prompt_ids=[31, 32], max_tokens=100, ignore_eos=True, timeout=0.5)  # idle: replica 0
        steps = replicas_info(client)[0]["steps"]
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert freed_within_a_step(client, 0, steps)
        assert all(r["live_requests"] == 0 for r in replicas_info(client))


@pytest.mark.slow
def test_bench_serve_drives_it(served, tmp_path, capsys):
    from shiftjax.serving.bench.serve_bench import serve_main

    routed_before = [r["routed_requests"] for r in served["dp"].info()["replicas"]]
    result_file = tmp_path / "dp.json"
    assert serve_main(["--server", served["address"], "--num-prompts", "8", "--input-len", "12", "--output-len", "4",
                       "--max-concurrency", "4", "--vocab-size", "5000", "--no-progress",
                       "--result-file", str(result_file)]) == 0
    result = json.loads(result_file.read_text())
    summary = result["summary"]
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (8, 0, 32)
    assert result["server_info"]["mesh"]["dp"] == 2
    routed = [r["routed_requests"] - b for r, b in zip(served["dp"].info()["replicas"], routed_before)]
    assert sum(routed) == 8 and min(routed) >= 2, routed


LONG = list(range(300, 340))  # 40 tokens: 2 full pages of 16 to share; no other test sends it


@pytest.mark.slow
def test_a_repeated_long_prompt_goes_to_the_replica_that_served_it_first(served):
    """Replica 1 serves the prompt first (replica 0 is busy then); asked again with both idle,
    where the tie alone would pick replica 0, the router picks the replica holding its prefix,
    and gRPC's usage says how many prompt tokens came from the cache."""
    from shiftjax.serving.client.grpc_client import Client

    def routed(client) -> list[int]:
        return [r["routed_requests"] for r in replicas_info(client)]

    with Client(served["address"], timeout=300.0) as client:
        held = client.generate(prompt_ids=[51, 52, 53], max_tokens=100, ignore_eos=True)  # idle: replica 0
        next(held)
        before = routed(client)
        first = client.complete(prompt_ids=LONG, max_tokens=4, ignore_eos=True)  # fewer queued: replica 1
        assert [a - b for a, b in zip(routed(client), before)] == [0, 1]
        held.close()
        assert wait_for(lambda: [r["live_requests"] for r in replicas_info(client)] == [0, 0], WAIT_SECONDS)
        before = routed(client)
        again = client.complete(prompt_ids=LONG, max_tokens=4, ignore_eos=True)
        assert [a - b for a, b in zip(routed(client), before)] == [0, 1]
        assert (first.usage.cached_prompt_tokens, again.usage.cached_prompt_tokens) == (0, 32)
        assert again.token_ids == first.token_ids
        salted = client.complete(prompt_ids=LONG, max_tokens=4, ignore_eos=True, cache_salt="tenant-a")
        assert salted.usage.cached_prompt_tokens == 0 and salted.token_ids == first.token_ids
        cache = json.loads(client.info().info_json)["prefix_cache"]
    assert cache["enabled"] and cache["hits"] >= 32 and 0 < cache["hit_rate"] < 1
    assert served["dp"].info()["replicas"][1]["prefix_cache_hits"] >= 32
