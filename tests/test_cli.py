"""The `shiftjax generate` command, run as a user runs it (a subprocess), on the default model."""

import json
import os
import re
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
    (["--regex", "[0-9", "hi"], "structured_outputs.regex: does not compile"),
    (["--json-schema", "/nonexistent/schema.json", "hi"], "--json-schema: cannot read"),
])
def test_bad_input_is_one_clear_sentence(args, message):
    result = shiftjax("generate", "--cpu-devices", "1", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_structured_output_flags_constrain_the_output(tmp_path):
    """A schema file (one start of generate; regexes and choices are served end to end in
    test_grpc_structured_outputs.py and test_openai_structured_e2e.py)."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False}))
    small = [a if a != "12" else "24" for a in SMALL]
    [record] = completions(shiftjax("generate", *small, "--cpu-devices", "1", "--json-schema", str(schema), "--chat",
                                    "A number as JSON"))
    assert record["finish_reason"] == "stop" and set(json.loads(record["text"])) == {"n"}


def compile_report(stderr: str, *, store: bool = False) -> tuple[int, ...]:
    """(executables, loaded from the compilation cache) from the start-up line on stderr;
    with ``store``, (executables, from the executable store, from the compilation cache)."""
    match = re.search(r"(\d+) executables ready in [\d.]+ s: (\d+) loaded from the executable store, "
                      r"(\d+) from the compilation cache", stderr)
    assert match, stderr[-3000:]
    return (int(match[1]), int(match[2]), int(match[3])) if store else (int(match[1]), int(match[3]))


def test_a_second_start_loads_every_executable_from_the_compilation_cache(tmp_path):
    args = [*SMALL, *PROMPTS, "--cpu-devices", "1", "--compilation-cache", str(tmp_path / "xla"),
            "--num-pages", "12"]
    first = shiftjax("generate", *args)
    assert compile_report(first.stderr) == (2, 0)  # two token buckets, one mode, cold cache
    assert "2 of 2 executables ready" in first.stderr
    assert "KV cache: 12 pages (--num-pages)" in first.stderr
    texts = [c["text"] for c in completions(first)]
    stop = texts[0][3:6]
    second = shiftjax("generate", *args, "--stop", stop)
    assert compile_report(second.stderr) == (2, 2)  # every one from the cache
    for before, after in zip(completions(first), completions(second)):
        cut = before["text"].find(stop)
        assert after["text"] == (before["text"] if cut < 0 else before["text"][:cut])
        assert after["output_ids"] == before["output_ids"][:len(after["output_ids"])]
    assert completions(second)[0]["finish_reason"] == "stop"
    assert completions(second)[0]["stop_reason"] == stop


def test_a_second_start_with_the_executable_store_lowers_nothing(tmp_path):
    args = [*SMALL, *PROMPTS[:2], "--cpu-devices", "1", "--compilation-cache", str(tmp_path / "xla"),
            "--num-pages", "12", "--executable-store"]
    first = shiftjax("generate", *args)
    assert compile_report(first.stderr, store=True) == (2, 0, 0)
    stored = [p.name for p in (tmp_path / "xla" / "executables").glob("*.executable")]
    # 2 steps, 2 samplers (sample_rows, greedy_rows) of the one sequence bucket
    assert len(stored) == 4 and sum(name.startswith("sampler-") for name in stored) == 2
    second = shiftjax("generate", *args)
    assert compile_report(second.stderr, store=True) == (2, 2, 0)  # neither lowered nor compiled
    assert [c["output_ids"] for c in completions(second)] == [c["output_ids"] for c in completions(first)]


def test_dummy_weights_without_the_compilation_cache():
    from shiftjax.checkpoints.default_model import default_model_path

    config = default_model_path() / "config.json"  # the default model's shape, random weights
    result = shiftjax("generate", *SMALL, *PROMPTS[:2], "--cpu-devices", "1", "--no-compilation-cache",
                      "--load-format", "dummy", "--model", str(config))
    assert compile_report(result.stderr) == (2, 0)
    assert "report no memory statistics" in result.stderr  # the CPU's page-pool fallback, said so
    [completion] = completions(result)
    assert len(completion["output_ids"]) == 12


def test_prefix_caching_is_on_unless_turned_off_on_generate_and_serve():
    from shiftjax.serving.cli import _parse_generate
    from shiftjax.serving.engine.config import EngineConfig
    from shiftjax.serving.engine.engine_args import engine_options
    from shiftjax.serving.server.cli import _parser as serve_parser

    for parse in (lambda argv: _parse_generate(["hi", *argv]), serve_parser().parse_args):
        assert EngineConfig(**engine_options(parse([]))).enable_prefix_caching is True
        assert EngineConfig(**engine_options(parse(["--no-enable-prefix-caching"]))).enable_prefix_caching is False
        assert engine_options(parse(["--no-enable-prefix-caching", "--enable-prefix-caching"]))[
            "enable_prefix_caching"] is True
