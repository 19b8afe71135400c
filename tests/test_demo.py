"""``make demo`` (serving/demo.py) against a real ``shiftjax serve``: it exits 0 only when
the lone request's decode steps ran TP, the burst's steps mostly SP, and the server
exited 0 after SIGTERM."""

import subprocess
import sys

import pytest
from subprocess_env import environ_without_device_count

from shiftjax.serving.demo import _runs


def test_step_trace_in_one_line():
    assert _runs(["sp", "sp", "tp", "tp", "tp", "sp"]) == "sp x2, tp x3, sp x1"
    assert _runs([]) == "none"


@pytest.mark.slow
def test_demo_runs_and_its_checks_hold():
    env = environ_without_device_count()  # the demo asks for 4 devices with --cpu-devices
    result = subprocess.run([sys.executable, "-m", "shiftjax.serving.demo", "--max-tokens", "8"],
                            capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for line in ("== one request", "== a burst of 8 concurrent requests", 'shiftjax_steps_total{mode="sp"}',
                 "shiftjax_mode_switches_total", "shiftjax serve exited 0"):
        assert line in output, output[-4000:]
