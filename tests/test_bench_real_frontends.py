"""bench serve against the project's real front ends (GrpcServer, the FastAPI app) over
their test services (no model): the wire formats the bench parses are the servers' own."""

import asyncio
import threading
import time

import pytest

from shiftjax.serving.bench.serve_bench import ServeBenchConfig, run_serve_bench
from loopback import free_port


class VocabOnly:
    vocab_size = 1000
    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x41 + i % 26) for i in ids)


def bench(address, backend, vocab_size, **options):
    config = ServeBenchConfig(server=address, backend=backend, vocab_size=vocab_size, progress=False, **options)
    return asyncio.run(run_serve_bench(config))


def test_grpc_backend_against_the_grpc_server():
    from grpc_harness import FakeEngineService, ServerThread

    service = FakeEngineService(VocabOnly(), step_seconds=0.005)
    thread = ServerThread(service)
    try:
        result = bench(thread.address, "grpc", 1000, num_prompts=12, input_len=20, output_len=6, request_rate=200.0,
                       max_concurrency=4)
    finally:
        thread.stop()
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (12, 0), [r["error"] for r in result["requests"]]
    assert summary["total_output_tokens"] == 72
    assert all(len(r.prompt_ids) == 20 and r.params.ignore_eos and r.params.max_tokens == 6 for r in service.submitted)
    assert all(len(r["itl"]) == 5 and r["ttft"] >= 0.004 for r in result["requests"])
    assert summary["mode_steps"] == {"tp": 72}
    assert result["server_info"]["model"] == "fake"


def test_grpc_backend_sends_the_json_schema_with_every_request():
    from grpc_harness import FakeEngineService, ServerThread

    class Checking(FakeEngineService):
        def check_structured_outputs(self, params) -> None:
            self.checked = getattr(self, "checked", 0) + 1

    service = Checking(VocabOnly(), step_seconds=0.002)
    thread = ServerThread(service)
    schema = '{"type": "object", "properties": {"text": {"type": "string"}}}'
    try:
        result = bench(thread.address, "grpc", 1000, num_prompts=4, input_len=8, output_len=3, json_schema=schema)
    finally:
        thread.stop()
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (4, 0)
    assert [r.params.structured_outputs.json for r in service.submitted] == [schema] * 4
    assert service.checked == 4 and result["config"]["json_schema"] == schema


@pytest.fixture
def http_server():
    """The FastAPI app over the HTTP tests' FakeService, served by uvicorn in a thread."""
    import uvicorn
    from http_fake_service import FakeService

    from shiftjax.serving.server.http_server import create_app

    service = FakeService(token_delay=0.003)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, model_name="fake-model"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield service, f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_openai_backend_against_the_http_server(http_server):
    service, address = http_server
    result = bench(address, "openai", 0x3000, num_prompts=8, input_len=16, output_len=10, goodput=["ttft:10000"])
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (8, 0), [r["error"] for r in result["requests"]]
    assert summary["total_output_tokens"] == 80  # from the final usage chunk
    assert all(len(r.prompt_ids) == 16 and r.params.ignore_eos and r.params.max_tokens == 10 for r in service.submitted)
    assert all(len(r["itl"]) == 9 for r in result["requests"])  # every character streams as its own chunk
    assert summary["mode_steps"] == {"tp": 80}  # shiftjax's usage extension
    assert result["config"]["model"] is None and result["server_info"]["data"][0]["id"] == "fake-model"
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])


def test_openai_backend_fails_a_request_whose_stream_reports_an_error(http_server):
    service, address = http_server
    service.raise_after = 3  # tokens stream, then the server sends an error event
    result = bench(address, "openai", 0x3000, num_prompts=2, input_len=4, output_len=10)
    assert result["summary"]["failed"] == 2
    assert all(r["error"].startswith("error event") for r in result["requests"])
