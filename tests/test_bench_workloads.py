"""What the bench sends and when: lengths, gamma arrivals, trace replay, prompt ids."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shiftjax.serving.bench.workloads import (
    TraceRow,
    allowed_token_ids,
    clip_lengths,
    arrival_offsets,
    prompt_token_ids,
    random_requests,
    read_trace,
    tokenizer_token_ids,
    window_trace,
)

AZURE_CODE = Path(__file__).resolve().parents[1] / "benchmarks/traces/azure2023_code.csv"


def test_random_lengths_exact_without_range_ratio():
    requests = random_requests(50, 128, 16, 0.0, np.random.default_rng(0))
    assert {(r.prompt_len, r.output_len) for r in requests} == {(128, 16)}
    assert all(r.arrival_s is None for r in requests)


def test_random_lengths_cover_the_range():
    requests = random_requests(2000, 100, 10, 0.5, np.random.default_rng(0))
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert (min(prompt_lens), max(prompt_lens)) == (50, 150)
    assert (min(output_lens), max(output_lens)) == (5, 15)
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, 1.0, np.random.default_rng(0))


def gaps(times):
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_shape(burstiness):
    rate, n = 4.0, 4000
    times = arrival_offsets(n, rate, burstiness, np.random.default_rng(7))
    assert times[-1] == pytest.approx(n / rate)  # rescaled to the exact offered rate
    assert np.all(np.diff(times) >= 0)
    g = gaps(times)
    assert g.mean() == pytest.approx(1 / rate, rel=1e-9)
    # coefficient of variation of gamma(shape=b) gaps is 1/sqrt(b): Poisson 1, bursty 2, smooth 0.5
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_arrivals_repeat_with_the_seed_and_differ_without():
    a = arrival_offsets(100, 2.0, 1.0, np.random.default_rng(3))
    b = arrival_offsets(100, 2.0, 1.0, np.random.default_rng(3))
    c = arrival_offsets(100, 2.0, 1.0, np.random.default_rng(4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_infinite_rate_and_infinite_burstiness():
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    assert np.allclose(arrival_offsets(4, 2.0, math.inf, np.random.default_rng(0)), [0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(4, 2.0, 0.0, np.random.default_rng(0))


ROWS = [TraceRow(100.0, 10, 1), TraceRow(101.0, 20, 2), TraceRow(103.0, 30, 0), TraceRow(110.0, 40, 4),
        TraceRow(130.0, 50, 5)]


def test_trace_window_and_time_scale():
    replay = window_trace(ROWS, start_s=1.0, duration_s=9.0, time_scale=0.5)
    # the window is [101, 110): the request at 110 is out; times from 101, halved
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in replay] == [(20, 2, 0.0), (30, 1, 1.0)]


def test_trace_whole_and_capped():
    replay = window_trace(ROWS, time_scale=2.0)
    assert [r.arrival_s for r in replay] == [0.0, 2.0, 6.0, 20.0, 60.0]
    assert len(window_trace(ROWS, max_requests=2)) == 2
    with pytest.raises(ValueError, match="no requests"):
        window_trace(ROWS, start_s=31.0)
    with pytest.raises(ValueError, match="time-scale"):
        window_trace(ROWS, time_scale=0.0)


def test_clip_lengths():
    clipped = clip_lengths(window_trace(ROWS), max_input_len=25, max_output_len=None)
    assert [(r.prompt_len, r.output_len) for r in clipped] == [(10, 1), (20, 2), (25, 1), (25, 4), (25, 5)]
    assert [r.arrival_s for r in clipped] == [0.0, 1.0, 3.0, 10.0, 30.0]
    with pytest.raises(ValueError, match="max-output-len"):
        clip_lengths(clipped, None, 0)


def test_read_azure_csv(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:04.5000000,300,7\n"
                    "2023-11-16 18:17:03.9799600,4808,10\n")
    rows = read_trace(path)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(4808, 10), (300, 7)]  # sorted by time
    assert rows[1].timestamp_s - rows[0].timestamp_s == pytest.approx(0.52004, abs=1e-6)


def test_read_jsonl_trace_in_milliseconds(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 1500, "input_length": 8, "output_length": 3},
             {"timestamp": 0, "input_length": 4, "output_length": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    replay = window_trace(read_trace(path))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in replay] == [(4, 2, 0.0), (8, 3, 1.5)]


def test_read_trace_names_the_problem(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        read_trace(bad)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(bad_jsonl)


def test_azure_code_trace_replays():
    rows = read_trace(AZURE_CODE)
    assert len(rows) == 8819
    assert (rows[0].prompt_len, rows[0].output_len) == (4808, 10)
    replay = window_trace(rows, duration_s=300.0, time_scale=0.1)
    assert replay[-1].arrival_s < 30.0
    assert len(replay) == sum(1 for r in rows if r.timestamp_s < rows[0].timestamp_s + 300.0)


def test_prompts_have_exact_lengths_and_no_special_ids():
    requests = random_requests(20, 64, 4, 0.5, np.random.default_rng(1))
    allowed = allowed_token_ids(100, special_ids=[0, 1, 2, 99])
    prompts = prompt_token_ids(requests, allowed, np.random.default_rng(5))
    assert [len(p) for p in prompts] == [r.prompt_len for r in requests]
    used = {t for p in prompts for t in p}
    assert used.isdisjoint({0, 1, 2, 99}) and used <= set(range(100))
    assert prompt_token_ids(requests, allowed, np.random.default_rng(5)) == prompts


def test_default_tokenizer_special_tokens_are_left_out():
    from shiftjax.checkpoints.default_model import default_cache_dir
    from shiftjax.checkpoints.format import is_complete_checkpoint

    if not is_complete_checkpoint(default_cache_dir()):
        pytest.skip("the default model is not prepared")
    allowed = tokenizer_token_ids(default_cache_dir())
    assert allowed.size == 49152 - 17  # SmolLM2: 17 special added tokens, ids 0..16
    assert allowed.min() == 17 and allowed.max() == 49151


def test_a_rate_sweep_sends_the_same_prompts_at_every_rate():
    from shiftjax.serving.bench.serve_bench import ServeBenchConfig, build_workload

    def workload(rate, seed=0):
        return build_workload(ServeBenchConfig(server="", num_prompts=5, input_len=8, output_len=2, range_ratio=0.5,
                                               request_rate=rate, vocab_size=1000, seed=seed))

    at_inf, at_two = workload(float("inf")), workload(2.0)
    assert at_inf.prompts == at_two.prompts and at_inf.requests == at_two.requests
    assert at_inf.send_offsets == [0.0] * 5 and at_two.send_offsets[-1] == pytest.approx(2.5)
    assert workload(2.0, seed=1).prompts != at_two.prompts
