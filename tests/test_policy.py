"""The shift policy: which mode runs a step of a given bucket (serving/engine/policy.py).

``test_the_threshold_check_rejects_a_policy_that_ignores_it`` keeps the proof that the
threshold check can fail: a policy that picks by measured time and ignores the threshold
is rejected by it.
"""

import pytest

from shiftjax.serving.engine.policy import ShiftPolicy

MODES = ("tp", "sp")
BUCKETS = [(4, 1), (16, 4), (64, 4), (256, 8)]
# Measured step times that disagree with any threshold: SP faster at the smallest and the
# largest bucket, TP in between, and no SP measurement at all for (64, 4).
RUN_SECONDS = {
    ("tp", 4, 1): 2.0, ("sp", 4, 1): 1.0,
    ("tp", 16, 4): 1.0, ("sp", 16, 4): 3.0,
    ("tp", 64, 4): 1.0,
    ("tp", 256, 8): 5.0, ("sp", 256, 8): 4.0,
}


def check_threshold_rule(policy_class):
    """With a threshold, ``auto`` runs SP from ``threshold`` tokens up and TP below it,
    whatever the measured times say."""
    for threshold in (16, 17, 64):
        policy = policy_class("auto", MODES, RUN_SECONDS, threshold=threshold)
        for tokens, seqs in BUCKETS + [(threshold - 1, 1), (threshold, 1), (threshold + 1, 1)]:
            want = "sp" if tokens >= threshold else "tp"
            got = policy.choose(tokens, seqs)
            assert got == want, f"threshold {threshold}, {tokens} tokens: chose {got}, the rule says {want}"


class IgnoresThreshold(ShiftPolicy):
    """Broken on purpose: picks by measured time even when a threshold is set."""

    def choose(self, num_tokens, num_seqs):
        threshold, self.threshold = self.threshold, None
        try:
            return super().choose(num_tokens, num_seqs)
        finally:
            self.threshold = threshold


def test_auto_with_a_threshold_follows_the_rule():
    check_threshold_rule(ShiftPolicy)


def test_the_threshold_check_rejects_a_policy_that_ignores_it():
    with pytest.raises(AssertionError, match="the rule says"):
        check_threshold_rule(IgnoresThreshold)


def test_auto_without_threshold_picks_the_faster_measured_mode():
    policy = ShiftPolicy("auto", MODES, RUN_SECONDS)
    assert [policy.choose(t, b) for t, b in BUCKETS] == ["sp", "tp", "tp", "sp"]
    # A bucket measured in neither mode, and equal times, run TP.
    assert policy.choose(1024, 8) == "tp"
    assert ShiftPolicy("auto", MODES, {("tp", 4, 1): 1.0, ("sp", 4, 1): 1.0}).choose(4, 1) == "tp"
    # The sequence bucket is part of the key: same tokens, other seqs, other answer.
    times = {("tp", 16, 1): 2.0, ("sp", 16, 1): 1.0, ("tp", 16, 4): 1.0, ("sp", 16, 4): 2.0}
    policy = ShiftPolicy("auto", MODES, times)
    assert (policy.choose(16, 1), policy.choose(16, 4)) == ("sp", "tp")


def test_auto_reads_times_measured_after_it_was_made():
    times = {}
    policy = ShiftPolicy("auto", MODES, times)
    assert policy.choose(16, 4) == "tp"
    times.update({("tp", 16, 4): 2.0, ("sp", 16, 4): 1.0})
    assert policy.choose(16, 4) == "sp"


@pytest.mark.parametrize("mode", MODES)
def test_fixed_modes_ignore_bucket_times_and_threshold(mode):
    policy = ShiftPolicy(mode, MODES, RUN_SECONDS, threshold=16)
    assert {policy.choose(t, b) for t, b in BUCKETS} == {mode}


def test_alternate_switches_every_step_starting_with_tp():
    policy = ShiftPolicy("alternate", MODES, RUN_SECONDS, threshold=16)
    assert [policy.choose(16, 4) for _ in range(5)] == ["tp", "sp", "tp", "sp", "tp"]


@pytest.mark.parametrize("mode,threshold", [("auto", None), ("auto", 1), ("tp", None)])
def test_a_mesh_without_sp_always_runs_tp(mode, threshold):
    policy = ShiftPolicy(mode, ("tp",), {("sp", 4, 1): 0.0}, threshold=threshold)
    assert {policy.choose(t, b) for t, b in BUCKETS} == {"tp"}


@pytest.mark.parametrize("mode", ["sp", "alternate"])
def test_modes_needing_sp_are_refused_without_it(mode):
    with pytest.raises(ValueError, match="needs sp > 1"):
        ShiftPolicy(mode, ("tp",), {})


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        ShiftPolicy("fastest", MODES, {})
