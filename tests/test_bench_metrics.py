"""The bench's metric code against values worked out by hand (vLLM's definitions)."""

import math

import pytest

from shiftjax.serving.bench.metrics import (
    RequestRecord,
    StreamClock,
    latency_statistics,
    parse_goodput,
    summarize,
)


def record(index, prompt_len, output_tokens, ttft, e2el, itl, success=True):
    return RequestRecord(index=index, prompt_len=prompt_len, output_len=output_tokens, success=success,
                         ttft=ttft, e2el=e2el, itl=list(itl), output_tokens=output_tokens if success else 0)


@pytest.fixture
def run():
    """Three completed requests and one failed one over a 2 s run.

    r0: 5 tokens, TTFT 100 ms, E2EL 500 ms -> TPOT (500 - 100) / 4 = 100 ms
    r1: 3 tokens, TTFT 300 ms, E2EL 700 ms -> TPOT (700 - 300) / 2 = 200 ms
    r2: 1 token, TTFT 200 ms, E2EL 200 ms -> no TPOT (out <= 1), 0 against an SLO
    r3: failed; its prompt counts nowhere
    """
    return [
        record(0, 10, 5, 0.1, 0.5, [0.1, 0.1, 0.1, 0.1]),
        record(1, 20, 3, 0.3, 0.7, [0.2, 0.2]),
        record(2, 30, 1, 0.2, 0.2, []),
        record(3, 40, 0, 0.0, 0.0, [], success=False),
    ]


def test_counts_and_throughputs(run):
    s = summarize(run, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["request_goodput"] is None


def test_ttft_statistics(run):
    ttft = summarize(run, 2.0)["ttft"]  # [100, 300, 200] ms
    assert ttft["mean_ms"] == pytest.approx(200.0)
    assert ttft["median_ms"] == pytest.approx(200.0)
    assert ttft["std_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std
    assert ttft["p90_ms"] == pytest.approx(280.0)  # linear: 200 + 0.8 * 100
    assert ttft["p99_ms"] == pytest.approx(298.0)


def test_tpot_leaves_out_single_token_requests(run):
    tpot = summarize(run, 2.0)["tpot"]  # [100, 200] ms; r2 excluded
    assert tpot["mean_ms"] == pytest.approx(150.0)
    assert tpot["std_ms"] == pytest.approx(50.0)
    assert tpot["p90_ms"] == pytest.approx(190.0)
    assert run[2].tpot is None
    assert run[1].tpot == pytest.approx(0.2)


def test_itl_is_pooled_over_requests(run):
    itl = summarize(run, 2.0)["itl"]  # [100]*4 + [200]*2: a per-request mean would give 150
    assert itl["mean_ms"] == pytest.approx(800 / 6)
    assert itl["median_ms"] == pytest.approx(100.0)
    assert itl["p90_ms"] == pytest.approx(200.0)  # index 4.5 between two 200s
    assert itl["p50_ms"] == pytest.approx(100.0)


def test_e2el(run):
    e2el = summarize(run, 2.0)["e2el"]
    assert e2el["mean_ms"] == pytest.approx(1400 / 3)
    assert e2el["median_ms"] == pytest.approx(500.0)


@pytest.mark.parametrize(
    "slos, good",
    [
        (["ttft:250", "tpot:150"], 2),  # r1 misses TTFT; r2's TPOT counts as 0
        (["tpot:120"], 2),  # r1's 200 ms TPOT misses
        (["ttft:150"], 1),  # only r0
        (["e2el:600"], 2),  # r1's 700 ms misses
        (["ttft:50"], 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(run, slos, good):
    s = summarize(run, 2.0, parse_goodput(slos))
    assert s["request_goodput"] == pytest.approx(good / 2.0)


def test_parse_goodput_refuses_what_it_cannot_read():
    assert parse_goodput(["ttft:500", "tpot:12.5"]) == {"ttft": 500.0, "tpot": 12.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_empty_metrics_read_zero_like_vllm():
    stats = latency_statistics([])
    assert stats == {"mean_ms": 0.0, "median_ms": 0.0, "std_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}


def test_custom_percentiles():
    stats = latency_statistics([0.001, 0.002, 0.003, 0.004], percentiles=(25, 75))
    assert stats["p25_ms"] == pytest.approx(1.75)
    assert stats["p75_ms"] == pytest.approx(3.25)


def test_duration_must_be_positive(run):
    with pytest.raises(ValueError, match="duration"):
        summarize(run, 0.0)


def test_mode_steps_are_counted(run):
    run[0].modes = ["sp", "tp", "tp"]
    run[1].modes = ["sp"]
    run[3].modes = ["tp"]  # failed: not counted
    assert summarize(run, 2.0)["mode_steps"] == {"sp": 2, "tp": 2}


class FakeClock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_stream_clock_times_chunks_as_vllm_does():
    rec = RequestRecord(index=0, prompt_len=4, output_len=5)
    timer = StreamClock(rec, FakeClock([10.0, 11.0, 11.5, 12.5]))
    timer.output_chunk()  # TTFT 1.0
    timer.output_chunk(2)  # gap 0.5, a chunk of two tokens
    timer.output_chunk()  # gap 1.0
    timer.finish(server_output_tokens=5)
    assert rec.success
    assert rec.ttft == pytest.approx(1.0)
    assert rec.itl == pytest.approx([0.5, 1.0])
    assert rec.e2el == pytest.approx(2.5)
    assert rec.output_tokens == 5
    assert rec.tpot == pytest.approx(1.5 / 4)


def test_stream_clock_counts_streamed_tokens_without_usage_and_fails_empty_streams():
    rec = RequestRecord(index=0, prompt_len=4, output_len=2)
    timer = StreamClock(rec, FakeClock([0.0, 0.1, 0.3]))
    timer.output_chunk(2)
    timer.output_chunk(1)
    timer.finish(None)
    assert rec.output_tokens == 3
    empty = RequestRecord(index=1, prompt_len=4, output_len=2)
    StreamClock(empty, FakeClock([0.0])).finish(None)
    assert not empty.success and "TTFT" in empty.error
