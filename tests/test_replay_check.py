"""benchmarks/replay_check.py's step tables, by hand (its whole run is smoke-tested in
test_benchmark_smoke.py on the committed 2-GPU report)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import replay_check as rc
finally:
    sys.path.pop(0)

TOKENS, SEQS = (16, 256, 4096), (1, 16, 256)


def step(time, seconds, tokens, seqs):
    return {"time": time, "seconds": seconds, "num_tokens": tokens, "num_seqs": seqs}


def test_step_table_takes_medians_per_bucket_pair_seen_often_enough():
    trace = [step(i, 0.010 + 0.001 * i, 5, 3) for i in range(5)]  # (16, 16): 5 steps, median 12 ms
    trace += [step(10 + i, 0.5, 300, 3) for i in range(4)]  # (4096, 16): 4 steps, below MIN_STEPS
    table = rc.step_table(trace, TOKENS, SEQS)
    assert table == {(16, 16): pytest.approx(0.012)}


def test_host_gap_is_the_median_of_back_to_back_gaps():
    # ends at 1.000, 1.012 (10 ms step: 2 ms gap), 1.025 (12 ms: 1 ms), 2.0 (idle: left out)
    trace = [step(1.000, 0.01, 5, 1), step(1.012, 0.010, 5, 1), step(1.025, 0.012, 5, 1), step(2.0, 0.01, 5, 1)]
    assert rc.host_gap_seconds(trace) == pytest.approx(0.0015)
    with pytest.raises(SystemExit, match="no back-to-back steps"):
        rc.host_gap_seconds([step(1.0, 0.01, 5, 1), step(5.0, 0.01, 5, 1)])


def test_step_seconds_falls_back_to_the_token_bucket_and_refuses_an_unseen_one():
    tables = {"tp": {(4096, 16): 0.068, (4096, 256): 0.076, (16, 1): 0.007}}
    step_seconds = rc.make_step_seconds(tables, TOKENS)
    assert step_seconds("tp", 4096, 256, []) == 0.076
    assert step_seconds("tp", 4096, 1, []) == pytest.approx(0.072)  # the median of its token bucket
    with pytest.raises(SystemExit, match="no 256-token step"):
        step_seconds("tp", 256, 16, [])
