"""The other half of tests/test_benchmark_smoke.py's runs (its docstring says why they run):
the scripts of ``SCRIPTS`` with ``--smoke``, each checked as that file checks its own."""

from __future__ import annotations

import pytest
from test_benchmark_smoke import SLOW, smoke_script

# script -> (arguments, the JSON file it must write into --out); test_every_script_is_smoke_tested
# (tests/test_benchmark_smoke.py) reads this table
SCRIPTS = {"shift_x2.py": (["--smoke", "--engine-variants", "shipped,in_step_sampler"], "shift_x2.json"),  # (cublaslt: a GPU flag)
           "startup.py": (["--smoke"], "startup.json"),
           "dummy_start.py": (["--smoke"], "dummy_start.json"),
           "replay_check.py": (["--smoke"], "replay_check.json")}
# startup.py measures cold starts: each start configures an empty cache folder of its own,
# and it runs without the test run's compilation cache all the same
COLD = {"startup.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SCRIPTS])
def test_script_smoke(script, tmp_path):
    data = smoke_script(script, SCRIPTS[script], tmp_path, compilation_cache=script not in COLD)
    if script == "shift_x2.py":  # every engine variant decodes the same greedy tokens (same arithmetic)
        assert data["engine"]["same_tokens_everywhere"] is True, data.get("engine")
        assert set(data["xla_options"]) >= {"skip_temp", "no_command_buffers"}, data["xla_options"]
        assert data["collectives"]["one_shot_lowered"] is True  # the kernels' chains lower (GPU-only to run)
