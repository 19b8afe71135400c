"""bench serve against the project's real front ends (GrpcServer, the FastAPI app) over
their test services (no model): the wire formats the bench parses are the servers' own."""

import asyncio
import dataclasses
import threading
import time

import pytest

from shiftjax.serving.bench.report import summary_lines
from shiftjax.serving.bench.serve_bench import ServeBenchConfig, run_serve_bench
from shiftjax.serving.engine.speculative import SpecDecodeCounters, SpeculativeConfig
from shiftjax.serving.server.service_info import speculative_info
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
    assert "speculative" not in summary  # a server that says nothing of speculation


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
    assert "speculative" not in summary  # no /metrics on this app


def test_openai_backend_fails_a_request_whose_stream_reports_an_error(http_server):
    service, address = http_server
    service.raise_after = 3  # tokens stream, then the server sends an error event
    result = bench(address, "openai", 0x3000, num_prompts=2, input_len=4, output_len=10)
    assert result["summary"]["failed"] == 2
    assert all(r["error"].startswith("error event") for r in result["requests"])


# What the server had counted before the run: the run's report must leave it out.
EARLIER = SpecDecodeCounters(num_drafts=100, num_draft_tokens=300, num_accepted_tokens=50,
                             accepted_per_position=(30, 15, 5), draft_seconds=1.0)


def speculating(service_class):
    """``service_class`` (a fake service) with speculative counters of its own, which count each
    request that does not opt out as one 3-token draft with its first two tokens accepted, and
    (gRPC) ServerInfo's section."""

    class Speculating(service_class):
        counters = EARLIER

        def submit(self, request):
            stream = super().submit(request)
            if not request.params.disable_speculation:
                self.counters = self.counters + SpecDecodeCounters(1, 3, 2, (1, 1, 0), 0.001)
            return stream

        def stats(self):
            stats = super().stats()
            return dataclasses.replace(stats, engine=dataclasses.replace(stats.engine, speculative=self.counters))

        def info(self) -> dict:
            return super().info() | {"speculative": speculative_info(SpeculativeConfig("ngram"), self.counters)}

    return Speculating


def check_the_runs_speculation(result, requests: int) -> None:
    speculative = result["summary"]["speculative"]
    assert speculative == {"acceptance_rate": pytest.approx(2 / 3), "mean_accepted_length": pytest.approx(3.0),
                           "num_drafts": requests, "num_draft_tokens": 3 * requests,
                           "num_accepted_tokens": 2 * requests, "accepted_per_position": [requests, requests, 0],
                           "draft_seconds": pytest.approx(0.001 * requests)}
    text = "\n".join(summary_lines(result))
    assert "Speculative Decoding" in text and "Acceptance rate (%):" in text and "66.67" in text
    assert "Mean accepted length:" in text and "3.00" in text
    assert "Accepted at position 0 (% of drafts):" in text and "100.00" in text


@pytest.mark.parametrize("disable", [False, True])
def test_grpc_backend_reports_the_runs_speculation_and_sends_the_opt_out(disable):
    from grpc_harness import FakeEngineService, ServerThread

    service = speculating(FakeEngineService)(VocabOnly(), step_seconds=0.002)
    thread = ServerThread(service)
    try:
        result = bench(thread.address, "grpc", 1000, num_prompts=6, input_len=8, output_len=3, warmup_requests=1,
                       disable_speculation=disable)
    finally:
        thread.stop()
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (6, 0)
    assert [r.params.disable_speculation for r in service.submitted] == [disable] * 7  # the warm-up's too
    assert result["config"]["disable_speculation"] is disable
    if disable:  # the server speculates, none of the run's requests did
        assert result["summary"]["speculative"]["num_drafts"] == 0
        assert result["summary"]["speculative"]["mean_accepted_length"] == 0.0
    else:  # the warm-up's draft counted before the run
        check_the_runs_speculation(result, 6)


@pytest.mark.parametrize("disable", [False, True])
def test_openai_backend_reads_the_runs_speculation_from_metrics_and_sends_the_opt_out(disable):
    import uvicorn
    from http_fake_service import FakeService

    from shiftjax.serving.server.http_server import create_app
    from shiftjax.serving.server.metrics import Metrics

    service = speculating(FakeService)(token_delay=0.001)
    app = create_app(service, model_name="fake-model", metrics=Metrics(stats=service.stats))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        result = bench(f"127.0.0.1:{port}", "openai", 0x3000, num_prompts=5, input_len=8, output_len=4,
                       disable_speculation=disable)
    finally:
        server.should_exit = True
        thread.join(10)
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (5, 0)
    assert [r.params.disable_speculation for r in service.submitted] == [disable] * 5
    if disable:
        assert result["summary"]["speculative"]["num_drafts"] == 0
    else:
        check_the_runs_speculation(result, 5)
