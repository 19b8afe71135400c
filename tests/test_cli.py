"""The `shiftjax generate` command, run as a user runs it (a subprocess), on the default model."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--token-buckets", "8,32",
         "--seq-buckets", "2", "--max-tokens", "12", "--json"]
PROMPTS = ["--prompt-ids", "1,504,3575,282,4649,314", "--prompt-ids", "1,378,1345,6477"]


def shiftjax(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "shiftjax.serving.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def completions(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_sp2_tp2_alternate_gives_the_single_device_tokens():
    single = completions(shiftjax("generate", *SMALL, *PROMPTS, "--cpu-devices", "1"))
    shifted_run = shiftjax("generate", *SMALL, *PROMPTS, "--cpu-devices", "4", "--sp", "2", "--tp", "2",
                           "--mode", "alternate")
    shifted = completions(shifted_run)
    assert [c["output_ids"] for c in shifted] == [c["output_ids"] for c in single]
    assert all(len(c["output_ids"]) == 12 and c["text"] for c in shifted)
    for c in shifted:  # every step of a request switched mode
        assert all(a != b for a, b in zip(c["modes"], c["modes"][1:])), c["modes"]
    assert "compile" in shifted_run.stderr and "mode switches" in shifted_run.stderr


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1", "hi"], "temperature"),
    (["--top-p", "0", "hi"], "top_p"),
    (["--model", "/nonexistent/model", "hi"], "/nonexistent/model"),
    (["--prompt-ids", "1,x,3"], "comma-separated integers"),
])
def test_bad_input_is_one_clear_sentence(args, message):
    result = shiftjax("generate", "--cpu-devices", "1", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
