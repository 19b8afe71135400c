"""The load generator end to end on loopback, against the fake server's gRPC and SSE front
ends (fixed delays, so the measured times have known lower bounds)."""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time

import pytest

from shiftjax.serving.bench.cli import bench_main
from shiftjax.serving.bench.fake_server import FakeEngine, FakeServer
from shiftjax.serving.bench.serve_bench import ServeBenchConfig, build_workload, run_serve_bench
from loopback import free_port

PREFILL, TOKEN = 0.05, 0.02


def run_against_fake(config_kwargs: dict, *, http: bool = False, engine_kwargs: dict | None = None):
    """Starts a fake server, runs one bench against it, returns (result, engine, workload)."""

    async def go():
        engine = FakeEngine(prefill_delay=PREFILL, token_delay=TOKEN, **(engine_kwargs or {}))
        server = FakeServer(engine, http_port=free_port() if http else None)
        await server.start()
        try:
            address = f"127.0.0.1:{server.http_port if http else server.grpc_port}"
            config = ServeBenchConfig(server=address, backend="openai" if http else "grpc", vocab_size=1000,
                                      progress=False, **config_kwargs)
            workload = build_workload(config)
            result = await run_serve_bench(config, workload)
            return result, engine, workload
        finally:
            await server.stop()

    return asyncio.run(go())


def check_timings(result, output_len):
    for request in result["requests"]:
        assert request["success"], request["error"]
        assert request["output_tokens"] == output_len
        assert PREFILL * 0.9 <= request["ttft"] < 2.0
        assert len(request["itl"]) == output_len - 1
        # the client may read two chunks in one go on a busy machine, so single gaps can be
        # short; their sum cannot be much shorter than the server's sleeps between sends
        assert sum(request["itl"]) >= (output_len - 1) * TOKEN * 0.5
        assert request["e2el"] >= PREFILL * 0.9 + (output_len - 1) * TOKEN * 0.5
        assert request["e2el"] == pytest.approx(request["ttft"] + sum(request["itl"]), abs=1e-6)
    tpot = result["summary"]["tpot"]
    assert TOKEN * 1000 * 0.5 <= tpot["median_ms"] < TOKEN * 1000 * 10


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "openai"])
def test_burst_sends_exact_prompts_and_measures_the_stream(http):
    result, engine, workload = run_against_fake(
        dict(num_prompts=8, input_len=32, output_len=5, goodput=["ttft:2000", "tpot:1000"]), http=http)
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_output_tokens"] == 40 and summary["total_input_tokens"] == 256
    # the server saw exactly the seeded prompts, each of the asked length, all at once
    assert sorted(r["prompt_ids"] for r in engine.requests) == sorted(workload.prompts)
    assert all(len(r["prompt_ids"]) == 32 and r["max_tokens"] == 5 for r in engine.requests)
    assert engine.peak_in_flight == 8
    check_timings(result, 5)
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
    assert 0.0 < summary["client_cpu_fraction"] < 2.0
    assert summary["mode_steps"].get("sp", 0) > 0  # 8 in flight >= sp_from: the usage's modes came back
    assert sum(summary["mode_steps"].values()) == 40


def test_max_concurrency_caps_requests_in_flight():
    result, engine, _ = run_against_fake(dict(num_prompts=6, input_len=8, output_len=3, max_concurrency=2))
    assert engine.peak_in_flight == 2
    assert result["summary"]["completed"] == 6
    waited = [r["sent_at"] - r["scheduled_at"] for r in result["requests"]]
    assert max(waited) >= 2 * (PREFILL + 2 * TOKEN) * 0.9  # the last pair waited for two rounds
    assert engine.step_trace and {s["mode"] for s in engine.step_trace} == {"tp"}


def test_warmup_requests_are_sent_first_and_not_recorded():
    result, engine, workload = run_against_fake(dict(num_prompts=3, input_len=8, output_len=2, warmup_requests=2))
    assert len(engine.requests) == 5 and len(result["requests"]) == 3
    assert [r["prompt_ids"] for r in engine.requests[:2]] == workload.prompts[:2]
    assert result["summary"]["completed"] == 3


def test_request_rate_spreads_the_sends():
    result, _, _ = run_against_fake(dict(num_prompts=6, input_len=8, output_len=2, request_rate=20.0))
    scheduled = [r["scheduled_at"] for r in result["requests"]]
    assert scheduled[-1] == pytest.approx(6 / 20.0)
    assert all(r["sent_at"] >= r["scheduled_at"] - 1e-3 for r in result["requests"])
    assert result["summary"]["duration_s"] >= 6 / 20.0


def test_trace_replay_keeps_lengths_and_scaled_times(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [(0, 12, 3), (200, 20, 2), (400, 7, 4)]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o}) + "\n"
                             for t, i, o in rows))
    result, engine, _ = run_against_fake(dict(dataset="trace", trace=str(trace), time_scale=0.5))
    records = result["requests"]
    assert [(r["prompt_len"], r["output_len"], r["output_tokens"]) for r in records] == [(12, 3, 3), (20, 2, 2), (7, 4, 4)]
    assert [r["scheduled_at"] for r in records] == pytest.approx([0.0, 0.1, 0.2])
    assert sorted(len(r["prompt_ids"]) for r in engine.requests) == [7, 12, 20]


def test_unreachable_server_fails_every_request_and_says_why():
    config = ServeBenchConfig(server=f"127.0.0.1:{free_port()}", backend="grpc", num_prompts=3, input_len=4,
                              output_len=2, vocab_size=100, progress=False)
    result = asyncio.run(run_serve_bench(config))
    assert result["summary"]["completed"] == 0 and result["summary"]["failed"] == 3
    assert all("UNAVAILABLE" in r["error"] for r in result["requests"])


def test_cli_writes_result_file_and_table(tmp_path, capsys):
    grpc_port, http_port = free_port(), free_port()
    out = tmp_path / "result.json"
    with fake_server_process(["--port", str(grpc_port), "--http-port", str(http_port), "--token-delay", "0.005"],
                             http_port):
        code = bench_main(["serve", "--server", f"127.0.0.1:{http_port}", "--backend", "openai", "--num-prompts", "4",
                           "--input-len", "16", "--output-len", "3", "--vocab-size", "500", "--request-rate", "inf",
                           "--goodput", "ttft:5000", "--label", "fake", "--device", "loopback", "--no-progress",
                           "--result-file", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result (fake)" in table and "Request goodput (req/s):" in table
    assert "P99 TPOT (ms):" in table
    result = json.loads(out.read_text())
    assert result["device"] == "loopback" and result["label"] == "fake"
    assert result["config"]["request_rate"] == "inf"  # JSON has no infinity
    assert result["summary"]["completed"] == 4 and len(result["requests"]) == 4
    assert result["server_info"]["data"][0]["id"] == "fake"


@contextlib.contextmanager
def fake_server_process(args: list[str], wait_port: int):
    """The fake server as a subprocess with ``args``, once ``wait_port`` listens; it must
    exit 0 on SIGTERM."""
    server = subprocess.Popen([sys.executable, "-m", "shiftjax.serving.bench.fake_server", *args])
    try:
        _wait_for_port(wait_port)
        yield server
    finally:
        server.terminate()
        assert server.wait(timeout=20) == 0


def _wait_for_port(port, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


def test_bad_options_are_refused_with_a_sentence(capsys):
    assert bench_main(["serve", "--server", "127.0.0.1:1", "--dataset", "trace", "--vocab-size", "10"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert bench_main(["serve", "--server", "127.0.0.1:1", "--goodput", "ttft", "--vocab-size", "10"]) == 2
    assert bench_main(["nonsense"]) == 2
