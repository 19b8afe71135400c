"""bench serve's reading of a server's speculative decoding: the counters out of a real
metrics scrape and out of ServerInfo, and the run's share of them (after less before)."""

import dataclasses

import pytest

from shiftjax.serving.bench.speculation import (SpeculationReading, counted_between, reading_from_metrics,
                                                reading_from_server_info, run_speculation)
from shiftjax.serving.engine.speculative import SpecDecodeCounters
from shiftjax.serving.engine.stats import EngineSnapshot
from shiftjax.serving.server.metrics import Metrics
from shiftjax.serving.server.protocol import ServiceStats

COUNTERS = SpecDecodeCounters(num_drafts=40, num_draft_tokens=120, num_accepted_tokens=70,
                              accepted_per_position=(35, 22, 13), draft_seconds=0.25)


def scrape(counters: SpecDecodeCounters) -> str:
    stats = ServiceStats(EngineSnapshot(num_pages=8, free_pages=8, speculative=counters), ready=True, draining=False)
    metrics = Metrics(stats=lambda: stats)
    metrics.on_preemption()  # other counters in the same scrape are left alone
    return metrics.render().decode()


def test_the_counters_come_back_out_of_the_servers_scrape():
    reading = reading_from_metrics(scrape(COUNTERS))
    assert reading == SpeculationReading(speculates=True, counters=COUNTERS)


def test_a_server_that_does_not_speculate_reads_as_such_and_reports_nothing():
    reading = reading_from_metrics(scrape(SpecDecodeCounters()))
    assert reading == SpeculationReading(speculates=False, counters=SpecDecodeCounters())
    assert run_speculation(reading, reading) is None
    assert reading_from_metrics("# a scrape of some other server\nup 1\n") is None


def test_a_speculating_server_that_has_not_drafted_yet_speculates():
    idle = SpecDecodeCounters(accepted_per_position=(0, 0, 0))  # the engine's K positions, all zero
    assert reading_from_metrics(scrape(idle)).speculates


def test_server_info_reading():
    from shiftjax.serving.proto.shiftjax.v1 import inference_pb2 as pb

    reply = pb.ServerInfoResponse(speculative=pb.SpeculativeInfo(
        enabled=True, method="ngram", num_speculative_tokens=3, num_drafts=40, num_draft_tokens=120,
        num_accepted_tokens=70, accepted_per_position=[35, 22, 13], draft_seconds=0.25))
    assert reading_from_server_info(reply) == SpeculationReading(True, COUNTERS)
    assert reading_from_server_info(pb.ServerInfoResponse()) is None


def test_the_run_is_after_less_before():
    before = SpecDecodeCounters(10, 30, 15, (8, 5), 0.05)  # a narrower reading subtracts position by position
    run = counted_between(before, COUNTERS)
    assert dataclasses.replace(run, draft_seconds=0.0) == SpecDecodeCounters(30, 90, 55, (27, 17, 13))
    assert run.draft_seconds == pytest.approx(0.2)
    summary = run_speculation(SpeculationReading(True, before), SpeculationReading(True, COUNTERS))
    assert summary == {"acceptance_rate": pytest.approx(55 / 90), "mean_accepted_length": pytest.approx(1 + 55 / 30),
                       "num_drafts": 30, "num_draft_tokens": 90, "num_accepted_tokens": 55,
                       "accepted_per_position": [27, 17, 13], "draft_seconds": pytest.approx(0.2)}
    assert run_speculation(None, SpeculationReading(True, COUNTERS)) is None  # a reading failed
    assert run_speculation(SpeculationReading(True, before), None) is None


def test_nothing_drafted_during_the_run_reads_zero_not_a_division_by_zero():
    reading = SpeculationReading(True, COUNTERS)
    summary = run_speculation(reading, dataclasses.replace(reading))
    assert (summary["num_drafts"], summary["acceptance_rate"], summary["mean_accepted_length"]) == (0, 0.0, 0.0)
