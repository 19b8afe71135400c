"""bench serve against the real engine service on the default model (SmolLM2-135M, sp 2 x
tp 2 CPU mesh, threshold policy), through both front ends: every request gets exactly the
asked number of tokens (ignore_eos), and the modes the steps ran in come back in usage."""

import asyncio
import time

import pytest

from shiftjax.serving.bench.serve_bench import ServeBenchConfig, run_serve_bench
from loopback import free_port

pytestmark = pytest.mark.slow

# 8 prompts of 24 tokens arriving at once: prefill batches pass the 32-token threshold (SP),
# the 8-token decode steps stay below it (TP)
# (23 usable pages hold the 8 requests' 2 pages each; the CPU's layer scan carries the whole
# cache each step, so a larger pool only slows every step)
ENGINE = dict(max_model_len=128, page_size=16, num_pages=24, max_num_seqs=8, max_num_batched_tokens=64,
              token_buckets=(16, 64), seq_buckets=(8,), mode="auto", shift_threshold=32)


@pytest.fixture(scope="module")
def served():
    from grpc_harness import ServerThread

    from shiftjax.serving.server.http_server import create_app, uvicorn_server
    from shiftjax.serving.engine.llm import LLM
    from shiftjax.serving.server.service import AsyncEngineService

    llm = LLM("default", sp=2, tp=2, **ENGINE)
    service = AsyncEngineService(llm.engine, llm.tokenizer, model_name="default")
    thread = ServerThread(service)
    http = uvicorn_server(create_app(service, model_name="default"), host="127.0.0.1", port=free_port())
    thread.call_soon(lambda: asyncio.ensure_future(http.serve()))
    deadline = time.monotonic() + 60
    while not http.started:
        assert time.monotonic() < deadline, "the HTTP server did not start"
        time.sleep(0.05)
    yield {"grpc": thread.address, "openai": f"127.0.0.1:{http.config.port}"}
    http.should_exit = True
    thread.stop()
    service.shutdown()


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_serve_on_the_default_model(served, backend):
    config = ServeBenchConfig(server=served[backend], backend=backend, num_prompts=8, input_len=24, output_len=6,
                              seed=1, progress=False, goodput=["ttft:60000"])
    result = asyncio.run(run_serve_bench(config))
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0), [r["error"] for r in result["requests"]]
    assert [r["output_tokens"] for r in result["requests"]] == [6] * 8  # ignore_eos: exactly the asked length
    assert summary["total_input_tokens"] == 8 * 24
    steps = summary["mode_steps"]
    assert steps.get("sp", 0) > 0 and steps.get("tp", 0) > 0, steps
    assert all(r["ttft"] > 0 and r["e2el"] >= r["ttft"] for r in result["requests"])
    assert summary["tpot"]["median_ms"] > 0
