"""The 8-GPU projection (benchmarks/projection.py) and the simulated-time replay through the
real scheduler and shift policy (serving/bench/simulate.py), on hand-computed cases."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shiftjax.serving.bench import simulate as sim
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.policy import ShiftPolicy
from shiftjax.serving.engine.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import projection as pj  # noqa: E402

MS = 1e-3


# ---- collectives: NCCL's ring model -------------------------------------------------------

def test_ring_formulas_by_hand():
    ar = pj.CollectiveFit("all_reduce", latency_s=10e-6, bus_Bps=100e9, hop_s=1e-6)
    a2a = pj.CollectiveFit("all_to_all", latency_s=10e-6, bus_Bps=100e9, hop_s=1e-6)
    mb = 1e6
    # n = 2: all-reduce moves 2(n-1)/n = 1 byte per byte, all-to-all (n-1)/n = 1/2
    assert ar.seconds(mb, 2) == pytest.approx(10e-6 + 10e-6)
    assert a2a.seconds(mb, 2) == pytest.approx(10e-6 + 5e-6)
    # n = 8: 14 ring steps instead of 2 (+12 hops), 1.75 bytes per byte; all-to-all 7 steps (+6), 7/8
    assert ar.seconds(mb, 8) == pytest.approx(10e-6 + 12e-6 + 17.5e-6)
    assert a2a.seconds(mb, 8) == pytest.approx(10e-6 + 6e-6 + 8.75e-6)
    assert ar.seconds(mb, 1) == 0.0 and a2a.seconds(0, 8) == 0.0


def test_fit_recovers_latency_and_bus_bandwidth():
    sizes = [1 << k for k in range(12, 28, 2)]
    ar = pj.fit_collective("all_reduce", sizes, [15e-6 + s / 250e9 for s in sizes])
    a2a = pj.fit_collective("all_to_all", sizes, [12e-6 + s * 0.5 / 200e9 for s in sizes])
    assert ar.latency_s == pytest.approx(15e-6, rel=1e-6) and ar.bus_Bps == pytest.approx(250e9, rel=1e-6)
    assert a2a.latency_s == pytest.approx(12e-6, rel=1e-6) and a2a.bus_Bps == pytest.approx(200e9, rel=1e-6)


def test_load_collectives_reads_the_shift_x2_schema(tmp_path):
    path = tmp_path / "collectives.json"  # a placeholder made here, never a measurement
    data = pj.synthetic_collectives()
    for kind in ("all_reduce_s", "all_to_all_s"):  # plus the chain's x * 0.5 pass, which loading takes out
        data[kind] = [t + 2 * b / pj.Hardware().copy_Bps for t, b in zip(data[kind], data["bytes_per_device"])]
    path.write_text(json.dumps({"device": "test", "collectives": data}))
    ar, a2a = pj.load_collectives(path)
    assert ar.latency_s == pytest.approx(20e-6) and ar.bus_Bps == pytest.approx(300e9)
    assert a2a.bus_Bps == pytest.approx(300e9)
    path.write_text(json.dumps({"collectives": {"error": "RuntimeError: boom"}}))
    with pytest.raises(ValueError, match="failed on the device"):
        pj.load_collectives(path)


# ---- the step model -------------------------------------------------------------------------

def test_shape_weights_and_what_fits():
    assert pj.LLAMA3_70B.weight_bytes == pytest.approx(141.1e9, rel=2e-3)  # 70.55B params in bf16
    model = _model()
    assert model.kv_capacity_tokens(pj.Deployment("sp8", 8, 1)) < 0  # all weights on every device
    assert model.kv_capacity_tokens(pj.Deployment("sp4tp2", 4, 2)) > 1_000_000
    # 80 layers x 1 KV slot per device (8 KV heads over 8 devices) x 128 x (K, V) x 2 bytes
    per_token = 80 * 1 * 128 * 2 * 2
    free = 0.9 * 141e9 - pj.LLAMA3_70B.weight_bytes / 8 - 5e9
    assert model.kv_capacity_tokens(pj.Deployment("tp", 1, 8)) == int(free // per_token)


def test_gemm_ratio_reproduces_the_layer_bench_at_its_points():
    model = _model()
    for tokens, us in pj.LAYER_BENCH_US["tp"].items():
        bench_attention = pj.BENCH_ATTENTION_FIXED_S + pj.causal_flops(tokens, tokens, 8, 128) / pj.CUDNN_FLOPS
        assert model.gemm_s(tokens, 1 / 8, "tp") + bench_attention == pytest.approx(us * 1e-6, rel=1e-9)


def test_causal_flops_by_hand():
    # 3 new tokens at the end of 10: they see 8, 9 and 10 keys; 4 FLOPs x head_dim x heads per key
    assert pj.causal_flops(3, 10, heads=2, head_dim=4) == 4 * 4 * 2 * (8 + 9 + 10)
    assert pj.causal_flops(1, 100, 1, 1) == 4 * 100  # a decode token sees its whole context


def test_a_tp_step_of_known_components():
    ar = pj.CollectiveFit("all_reduce", 10e-6, 100e9, hop_s=1e-6)
    a2a = pj.CollectiveFit("all_to_all", 10e-6, 100e9, hop_s=1e-6)
    attention = pj.AttentionFit(fixed_s=5e-6, kv_Bps=1e12, flops_per_s=1e14)
    model = pj.StepModel(pj.LLAMA3_70B, pj.Hardware(), attention, ar, a2a)
    dep = pj.Deployment("tp", 1, 8)
    seqs = [(1, 1000)] * 64  # 64 decodes of 1000-token contexts
    parts = model.breakdown(dep, "tp", 64, 64, seqs)
    kv_bytes = 64 * 1000 * 1 * 128 * 2 * 2  # one KV slot per device
    assert parts["attention"] == pytest.approx(80 * (5e-6 + kv_bytes / 1e12))
    row = 64 * 8192 * 2  # a [64, 8192] bf16 activation
    assert parts["collectives"] == pytest.approx(80 * 2 * (10e-6 + 12e-6 + row * 1.75 / 100e9))
    assert parts["gemm"] == pytest.approx(80 * model.gemm_s(64, 1 / 8, "tp"))
    assert parts["embed_allreduce"] == pytest.approx(10e-6 + 12e-6 + row * 1.75 / 100e9)
    lm = 16032 * 8192 * 2 / pj.Hardware().read_Bps + 10e-6 + 6e-6 + 64 * 128256 * 4 * 7 / 8 / 100e9
    assert parts["lm_head"] == pytest.approx(lm)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


def test_sp_step_collectives_by_hand():
    ar = pj.CollectiveFit("all_reduce", 10e-6, 100e9, hop_s=0.0)
    a2a = pj.CollectiveFit("all_to_all", 20e-6, 100e9, hop_s=0.0)
    model = pj.StepModel(pj.LLAMA3_70B, pj.Hardware(), pj.AttentionFit(0, 1e12, 1e14), ar, a2a)
    parts = model.breakdown(pj.Deployment("shift", 4, 2), "sp", 4096, 1, [(4096, 4096)])
    local = 1024  # tokens per device
    qkv = local * (64 + 2 * 8) / 2 * 128 * 2  # the TP shard's q heads and K, V slots
    out = local * 64 / 2 * 128 * 2
    per_layer = (20e-6 + qkv * 0.75 / 100e9) + (20e-6 + out * 0.75 / 100e9) + 2 * (10e-6 + local * 8192 * 2 / 100e9)
    assert parts["collectives"] == pytest.approx(80 * per_layer)
    with pytest.raises(ValueError, match="does not run"):
        model.breakdown(pj.Deployment("tp", 1, 8), "sp", 64, 1, [(64, 64)])


def test_two_gpu_check_runs_on_the_committed_measurements():
    steps = json.loads((ROOT / "benchmarks/results/x2_run2/steps_1gpu.json").read_text())["steps_1gpu"]
    data = pj.synthetic_collectives()
    rows = pj.check_two_gpu(steps, pj.fit_collective("all_reduce", data["bytes_per_device"], data["all_reduce_s"]),
                            pj.fit_collective("all_to_all", data["bytes_per_device"], data["all_to_all_s"]))
    assert {r["step"] for r in rows} == set(pj.MEASURED_X2_MS)
    assert all(math.isfinite(r["predicted_ms"]) and r["predicted_ms"] > 0 for r in rows)


def _model():
    steps = json.loads((ROOT / "benchmarks/results/x2_run2/steps_1gpu.json").read_text())["steps_1gpu"]
    data = pj.synthetic_collectives()
    fits = [pj.fit_collective(k, data["bytes_per_device"], data[f"{k}_s"]) for k in ("all_reduce", "all_to_all")]
    return pj.StepModel(pj.LLAMA3_70B, pj.Hardware(), pj.fit_attention(steps), *fits)


# ---- the simulator: real scheduler, constant step time -------------------------------------

def _run(requests, *, budget=64, step_s=10 * MS, policy="tp", threshold=None, modes=("tp",), replicas=1,
         concurrency=None, seen=None):
    ladder = BucketLadder((16, 64, 128), (1, 4))
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=256, page_size=16,
                             num_pages=64)

    def step(mode, tokens, seqs, shape):
        if seen is not None:
            seen.append((mode, tokens, seqs, shape))
        return step_s

    return sim.simulate(requests, scheduler_config=config, ladder=ladder, step_seconds=step, replicas=replicas,
                        make_policy=lambda: ShiftPolicy(policy, modes, {}, threshold=threshold),
                        max_concurrency=concurrency)


def test_one_request_chunked_prefill_by_hand():
    seen = []
    result = _run([sim.SimRequest(0.0, 100, 5)], seen=seen)
    # budget 64: the 100-token prompt takes two steps (64, then 36 and the first token), then 4 decodes
    assert [(tokens, shape) for _, tokens, _, shape in seen] == [
        (64, [(64, 64)]), (64, [(36, 100)]), (16, [(1, 101)]), (16, [(1, 102)]), (16, [(1, 103)]), (16, [(1, 104)])]
    record = result.records[0]
    assert record.ttft == pytest.approx(20 * MS)
    assert record.e2el == pytest.approx(60 * MS)
    assert record.tpot == pytest.approx(10 * MS)
    assert record.itl == pytest.approx([10 * MS] * 4)
    summary = result.summary()
    assert summary["duration_s"] == pytest.approx(60 * MS)
    assert summary["total_token_throughput"] == pytest.approx(105 / 0.060)
    assert summary["ttft"]["mean_ms"] == pytest.approx(20.0)


def test_a_larger_budget_prefills_in_one_step():
    result = _run([sim.SimRequest(0.0, 100, 5)], budget=128)
    assert result.records[0].ttft == pytest.approx(10 * MS)
    assert len(result.steps) == 5


def test_arrivals_wait_for_their_time_and_for_the_concurrency_limit():
    requests = [sim.SimRequest(0.0, 10, 3), sim.SimRequest(0.0, 10, 3), sim.SimRequest(1.0, 10, 3)]
    result = _run(requests, concurrency=1)
    first, second, third = result.records
    assert first.sent_at == 0.0 and first.e2el == pytest.approx(30 * MS)
    assert second.sent_at == pytest.approx(30 * MS)  # held back until the first finished
    assert third.sent_at == pytest.approx(1.0)  # its own arrival time, the system idle before it
    assert all(r.ttft == pytest.approx(10 * MS) and r.tpot == pytest.approx(10 * MS) for r in result.records)
    assert result.duration_s == pytest.approx(1.030)


def test_decodes_and_prefill_share_steps():
    # two requests at once: step 1 prefills both (20 tokens), then both decode together
    result = _run([sim.SimRequest(0.0, 10, 3), sim.SimRequest(0.0, 10, 3)])
    assert [s.num_tokens for s in result.steps] == [20, 2, 2]
    assert all(r.ttft == pytest.approx(10 * MS) for r in result.records)


def test_threshold_policy_picks_sp_for_large_steps():
    result = _run([sim.SimRequest(0.0, 100, 3)], policy="auto", threshold=32, modes=("tp", "sp"))
    assert [s.mode for s in result.steps] == ["sp", "sp", "tp", "tp"]
    assert result.records[0].modes == ["sp", "sp", "tp", "tp"]


def test_measured_policy_picks_the_faster_modelled_mode():
    ladder = BucketLadder((16, 64), (1, 4))
    run_seconds = sim.measured_run_seconds(ladder, ("tp", "sp"),
                                           lambda mode, t, b, shape: t * (1.0 if mode == "tp" else 0.5) + 10 * (mode == "sp"))
    assert run_seconds[("sp", 16, 1)] == 18 and run_seconds[("tp", 64, 4)] == 64
    policy = ShiftPolicy("auto", ("tp", "sp"), run_seconds)
    assert policy.choose(16, 1) == "tp" and policy.choose(64, 4) == "sp"


def test_data_parallel_routes_to_the_least_loaded_replica():
    result = _run([sim.SimRequest(0.0, 10, 3), sim.SimRequest(0.0, 10, 3)], replicas=2)
    assert sorted(s.replica for s in result.steps) == [0, 0, 0, 1, 1, 1]
    assert all(r.e2el == pytest.approx(30 * MS) for r in result.records)  # side by side, no sharing


def test_data_parallel_routes_by_the_tokens_each_replica_still_owes():
    # A (100 in, 50 out) goes to replica 0; B and C (10 in, 40 out) to replica 1, whose 50 + 50
    # tokens are still fewer than A's 150 (a router by request count would send C to 0). E
    # arrives at 0.35 s, when B and C owe 5 tokens each and A 15: it goes to replica 1 again
    # (with output tokens not counted down, 80 against 50, it would go to 0).
    requests = [sim.SimRequest(0.0, 100, 50), sim.SimRequest(0.0, 10, 40), sim.SimRequest(0.0, 10, 40),
                sim.SimRequest(0.35, 10, 3)]
    result = _run(requests, budget=128, replicas=2)
    first_on = {r: next(s for s in result.steps if s.replica == r) for r in (0, 1)}
    assert first_on[0].num_tokens == 100 and first_on[1].num_tokens == 20  # A; B and C together
    e_prefill = [s for s in result.steps if s.start_s >= 0.35 - 1e-9 and s.num_tokens >= 10]
    assert [(s.replica, s.num_tokens) for s in e_prefill] == [(1, 12)]  # with B's and C's decodes


def test_routed_load_accounting_by_hand():
    from shiftjax.serving.server.data_parallel import RoutedLoad, replica_loads

    a, b, unplaced = RoutedLoad(0, 100, 50), RoutedLoad(1, 60, 3), RoutedLoad(-1, 5, 5)
    assert replica_loads([a, b, unplaced], 2) == ([150, 63], [1, 1])
    a.streamed(1, finished=False)  # the first token ends the prefill
    b.streamed(2, finished=True)  # a stop before max_tokens owes nothing more
    assert (a.queued_tokens, b.queued_tokens) == (49, 0)
    assert replica_loads([a, b], 2) == ([49, 0], [1, 1])  # live until the router forgets it


def test_preemption_under_a_small_page_pool_still_finishes():
    ladder = BucketLadder((16, 64), (1, 4))
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, page_size=16, num_pages=7)
    result = sim.simulate([sim.SimRequest(0.0, 40, 20), sim.SimRequest(0.0, 40, 20)], scheduler_config=config,
                          ladder=ladder, step_seconds=lambda *a: 1e-3,
                          make_policy=lambda: ShiftPolicy("tp", ("tp",), {}))
    assert result.preemptions >= 1
    assert all(r.success and r.output_tokens == 20 for r in result.records)


def test_projection_smoke_writes_its_report(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/projection.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "projection.json").read_text())
    assert report["projected"] and report["synthetic_collectives"]
    assert set(next(iter(report["simulations"].values()))) == set(pj.DEPLOYMENTS)


def test_a_full_admission_queue_fails_the_request_as_the_bench_counts_it():
    ladder = BucketLadder((16, 64), (1, 4))
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=256, page_size=16,
                             num_pages=64, max_queue=1)
    requests = [sim.SimRequest(0.0, 10, 2)] * 3  # all at once: one queued, the others refused
    result = sim.simulate(requests, scheduler_config=config, ladder=ladder, step_seconds=lambda *a: 1e-3,
                          make_policy=lambda: ShiftPolicy("tp", ("tp",), {}))
    assert [r.success for r in result.records] == [True, False, False]
    assert "queue is full" in result.records[1].error
    assert result.summary()["failed"] == 2


def test_trace_requests_window_and_scale(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:00.0000000,100,5\n"
                     "2023-11-16 18:17:02.0000000,200,0\n2023-11-16 18:17:10.0000000,300,7\n")
    requests = sim.trace_requests(trace, duration_s=5.0, time_scale=0.5)
    assert requests == [sim.SimRequest(0.0, 100, 5), sim.SimRequest(1.0, 200, 1)]
