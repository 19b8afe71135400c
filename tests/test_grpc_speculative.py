"""Speculative decoding's interfaces over real gRPC loopback, on the fake service of
tests/grpc_harness.py: the per-request opt-out reaching SamplingParams, ServerInfo's
``speculative`` (the configuration from ``service.info()``, the counters from
``service.stats()``, read at each call), summed over --dp replicas, and ``shiftjax client``."""

import dataclasses
import json

import pytest

from grpc_harness import FakeEngineService, ServerThread, serving_client, with_engine
from shiftjax.checkpoints.default_model import default_model_path
from shiftjax.checkpoints.tokenizer import Tokenizer
from shiftjax.serving.client.cli import client_main
from shiftjax.serving.engine.speculative import SpecDecodeCounters, SpeculativeConfig
from shiftjax.serving.server.data_parallel import DataParallelService
from shiftjax.serving.server.service_info import speculative_info

SUFFIX = SpeculativeConfig("suffix", num_speculative_tokens=4, disable_by_batch_size=16)
COUNTERS = SpecDecodeCounters(num_drafts=50, num_draft_tokens=180, num_accepted_tokens=90,
                              accepted_per_position=(40, 25, 15, 10), draft_seconds=0.125)


class SpeculatingService(FakeEngineService):
    """The fake, with the speculative section the real service's info() has and live counters."""

    def __init__(self, tokenizer, config: SpeculativeConfig | None, counters: SpecDecodeCounters, **options):
        super().__init__(tokenizer, **options)
        self.config, self.counters = config, counters

    def stats(self):
        return with_engine(super().stats(), speculative=self.counters)

    def info(self) -> dict:
        return super().info() | {"speculative": speculative_info(self.config, self.stats().engine.speculative)}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_path())


@pytest.fixture(scope="module")
def service(tokenizer):
    return SpeculatingService(tokenizer, SUFFIX, COUNTERS)


@pytest.fixture(scope="module")
def server(service):
    thread = ServerThread(service)
    yield thread
    thread.stop()


@pytest.fixture
def client(server):
    with serving_client(server.address) as c:
        yield c


def test_disable_speculation_reaches_the_sampling_params_and_defaults_to_off(client, service):
    client.complete(prompt_ids=[5, 6], max_tokens=2, disable_speculation=True)
    assert service.submitted[-1].params.disable_speculation is True
    client.complete(prompt_ids=[5, 6], max_tokens=2)
    assert service.submitted[-1].params.disable_speculation is False


def test_the_opt_out_is_field_19_of_generate_request():
    from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert fields["disable_speculation"].number == 19
    numbers = [f.number for f in pb.GenerateRequest.DESCRIPTOR.fields]
    assert len(numbers) == len(set(numbers)) and max(numbers) == 19


def test_server_info_reports_how_the_server_speculates_and_what_it_accepted(client, service):
    speculative = client.info().speculative
    assert (speculative.enabled, speculative.method, speculative.num_speculative_tokens) == (True, "suffix", 4)
    assert speculative.HasField("disable_by_batch_size") and speculative.disable_by_batch_size == 16
    assert (speculative.num_drafts, speculative.num_draft_tokens, speculative.num_accepted_tokens) == (50, 180, 90)
    assert list(speculative.accepted_per_position) == [40, 25, 15, 10]
    assert speculative.acceptance_rate == pytest.approx(0.5)
    assert speculative.mean_accepted_length == pytest.approx(1.0 + 90 / 50)
    assert speculative.draft_seconds == pytest.approx(0.125)
    section = json.loads(client.info().info_json)["speculative"]
    assert section == {"enabled": True, **dataclasses.asdict(SUFFIX), "acceptance_rate": 0.5,
                       "mean_accepted_length": 2.8, "num_drafts": 50, "num_draft_tokens": 180,
                       "num_accepted_tokens": 90, "accepted_per_position": [40, 25, 15, 10], "draft_seconds": 0.125}


def test_server_info_counters_are_read_at_each_call(client, service):
    try:
        service.counters = COUNTERS + SpecDecodeCounters(10, 30, 30, (10, 10, 10, 0))
        speculative = client.info().speculative
        assert (speculative.num_drafts, speculative.num_accepted_tokens) == (60, 120)
        assert list(speculative.accepted_per_position) == [50, 35, 25, 10]
        assert speculative.acceptance_rate == pytest.approx(120 / 210)
    finally:
        service.counters = COUNTERS


def test_server_info_of_a_server_without_a_batch_limit_or_without_speculation(tokenizer):
    for config, enabled in ((dataclasses.replace(SUFFIX, disable_by_batch_size=None), True), (None, False)):
        thread = ServerThread(SpeculatingService(tokenizer, config, SpecDecodeCounters()))
        try:
            with serving_client(thread.address) as client:
                speculative = client.info().speculative
        finally:
            thread.stop()
        assert speculative.enabled is enabled
        assert not speculative.HasField("disable_by_batch_size")  # no limit, or no speculation
        assert (speculative.num_drafts, speculative.acceptance_rate, speculative.mean_accepted_length) == (0, 0.0, 0.0)
        assert speculative.method == ("suffix" if enabled else "")


def test_a_service_without_the_section_leaves_it_unset(tokenizer):
    thread = ServerThread(FakeEngineService(tokenizer))
    try:
        with serving_client(thread.address) as client:
            assert not client.info().HasField("speculative")
    finally:
        thread.stop()


def test_data_parallel_server_info_sums_the_replicas_counters(tokenizer):
    replicas = [SpeculatingService(tokenizer, SUFFIX, COUNTERS),
                SpeculatingService(tokenizer, SUFFIX, SpecDecodeCounters(10, 40, 30, (10, 10, 6, 4), 0.5))]
    dp = DataParallelService(replicas, tokenizer, devices=["fake:0", "fake:1"])
    assert dp.stats().engine.speculative == SpecDecodeCounters(60, 220, 120, (50, 35, 21, 14), 0.625)
    thread = ServerThread(dp)
    try:
        with serving_client(thread.address) as client:
            info = client.info()
    finally:
        thread.stop()
    assert (info.speculative.num_drafts, info.speculative.num_accepted_tokens) == (60, 120)
    assert list(info.speculative.accepted_per_position) == [50, 35, 21, 14]
    assert info.speculative.acceptance_rate == pytest.approx(120 / 220)
    section = json.loads(info.info_json)["speculative"]
    assert (section["method"], section["num_drafts"], section["mean_accepted_length"]) == ("suffix", 60, 3.0)


def test_the_client_sends_the_opt_out_and_prints_the_section(server, service, capsys):
    assert client_main(["generate", "--server", server.address, "--prompt-ids", "1,2", "--max-tokens", "1",
                        "--disable-speculation"]) == 0
    assert service.submitted[-1].params.disable_speculation is True
    capsys.readouterr()
    assert client_main(["info", "--server", server.address]) == 0
    speculative = json.loads(capsys.readouterr().out)["speculative"]
    assert speculative["num_drafts"] == 50 and speculative["accepted_per_position"] == [40, 25, 15, 10]
    assert (speculative["enabled"], speculative["method"], speculative["disable_by_batch_size"]) == (True, "suffix", 16)


def test_the_start_up_log_says_how_the_server_speculates(service, caplog):
    import logging

    from shiftjax.serving.server.cli import _log_startup

    with caplog.at_level(logging.INFO, logger="shiftjax.serve"):
        _log_startup(service, 1.0)
    assert "speculative decoding: suffix, drafts of up to 4 tokens, none in steps with more than 16 running " \
           "requests" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shiftjax.serve"):
        _log_startup(FakeEngineService(service.tokenizer), 1.0)
    assert "page pool" in caplog.text and "speculative" not in caplog.text
