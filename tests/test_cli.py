"""The `shiftjax generate` command, run as a user runs it (a subprocess), on the default model."""

import json
import re
import subprocess
import sys

import pytest
from subprocess_env import environ_without_device_count

SMALL = ["--max-model-len", "64", "--max-num-batched-tokens", "32", "--token-buckets", "8,32",
         "--seq-buckets", "2", "--max-tokens", "12", "--json"]
PROMPTS = ["--prompt-ids", "1,504,3575,282,4649,314", "--prompt-ids", "1,378,1345,6477"]


def shiftjax(*args, timeout=900):
    env = {k: v for k, v in environ_without_device_count().items() if k != "JAX_PLATFORMS"}
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
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0", "hi"],
     "--num-speculative-tokens must be in [1, 16], got 0"),
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


def _serve_and_generate_parsers():
    """Each command's parse of engine options: (name, parse) with parse(argv) -> args."""
    from shiftjax.serving.cli import _parse_generate
    from shiftjax.serving.server.cli import _parser as serve_parser

    return [("generate", lambda argv: _parse_generate(["hi", *argv])), ("serve", serve_parser().parse_args)]


def test_speculative_flags_give_the_speculative_config_on_generate_and_serve():
    from shiftjax.serving.engine.config import EngineConfig
    from shiftjax.serving.engine.engine_args import engine_options
    from shiftjax.serving.engine.speculative import SpeculativeConfig

    for name, parse in _serve_and_generate_parsers():
        assert engine_options(parse([]))["speculative"] is None, name
        assert engine_options(parse(["--speculative-method", "ngram"]))["speculative"] == SpeculativeConfig("ngram")
        options = engine_options(parse(["--speculative-method", "suffix", "--num-speculative-tokens", "5",
                                        "--speculative-disable-by-batch-size", "none", "--suffix-max-depth", "32",
                                        "--suffix-max-cached-requests", "10", "--suffix-min-token-prob", "0.25",
                                        "--suffix-max-spec-factor", "2.5"]))
        assert options["speculative"] == SpeculativeConfig(
            "suffix", num_speculative_tokens=5, disable_by_batch_size=None, suffix_max_depth=32,
            suffix_max_cached_requests=10, suffix_min_token_prob=0.25, suffix_max_spec_factor=2.5), name
        assert EngineConfig(**options).speculative == options["speculative"]
        ngram = engine_options(parse(["--speculative-method", "ngram", "--prompt-lookup-min", "1",
                                      "--prompt-lookup-max", "3", "--speculative-disable-by-batch-size", "32"]))
        assert ngram["speculative"] == SpeculativeConfig("ngram", prompt_lookup_min=1, prompt_lookup_max=3,
                                                         disable_by_batch_size=32), name


def test_speculative_help_shows_the_configs_defaults():
    import dataclasses

    from shiftjax.serving.engine.speculative import SpeculativeConfig
    from shiftjax.serving.server.cli import _parser as serve_parser

    text = " ".join(serve_parser().format_help().split())
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    assert "--num-speculative-tokens K the most tokens a draft may have" in text
    assert f"(default: {defaults['num_speculative_tokens']})" in text
    assert f"('none': at any batch size) (default: {defaults['disable_by_batch_size']})" in text
    assert f"the longest n-gram looked up (default: {defaults['prompt_lookup_max']})" in text


SPECULATIVE_REFUSALS = [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be in [1, 16], got 0"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "x"],
     "argument --num-speculative-tokens: invalid int value: 'x'"),
    (["--speculative-method", "medusa"], "argument --speculative-method: invalid choice: 'medusa'"),
    (["--num-speculative-tokens", "4"],
     "--num-speculative-tokens: speculative decoding is off; give --speculative-method (ngram or suffix)"),
    (["--suffix-max-depth", "8", "--speculative-disable-by-batch-size", "4"],
     "--speculative-disable-by-batch-size, --suffix-max-depth: speculative decoding is off"),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "6"],
     "need 1 <= --prompt-lookup-min <= --prompt-lookup-max, got 6 and 5"),
    (["--speculative-method", "ngram", "--suffix-max-depth", "8"],
     "--suffix-max-depth is an option of --speculative-method suffix, not ngram"),
    (["--speculative-method", "suffix", "--prompt-lookup-max", "8"],
     "--prompt-lookup-max is an option of --speculative-method ngram, not suffix"),
    (["--speculative-method", "suffix", "--suffix-min-token-prob", "1.5"],
     "--suffix-min-token-prob must be in [0, 1], got 1.5"),
    (["--speculative-method", "ngram", "--speculative-disable-by-batch-size", "0"],
     "--speculative-disable-by-batch-size must be positive"),
    (["--speculative-method", "ngram", "--speculative-disable-by-batch-size", "many"],
     "expected a number of requests or 'none', got 'many'"),
]


@pytest.mark.parametrize("argv,message", SPECULATIVE_REFUSALS, ids=[m[:40] for _, m in SPECULATIVE_REFUSALS])
def test_a_bad_speculative_option_is_a_usage_error_naming_the_flag(argv, message, capsys):
    from shiftjax.serving.cli import _parse_generate
    from shiftjax.serving.server.cli import serve_main

    for command in (lambda: _parse_generate(["hi", *argv]), lambda: serve_main(argv)):
        with pytest.raises(SystemExit) as exited:
            command()
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "error: " in error and message in error, error


def test_quantization_and_kv_cache_dtype_flags_on_generate_and_serve():
    from shiftjax.serving.engine.config import EngineConfig
    from shiftjax.serving.engine.engine_args import engine_options

    for name, parse in _serve_and_generate_parsers():
        default = parse([])
        assert default.quantization is None and EngineConfig(**engine_options(default)).cache_dtype is None, name
        fp8 = parse(["--quantization", "fp8", "--kv-cache-dtype", "fp8"])
        assert fp8.quantization == "fp8", name
        assert EngineConfig(**engine_options(fp8)).cache_dtype == "float8_e4m3fn", name
        assert engine_options(parse(["--kv-cache-dtype", "bfloat16"]))["cache_dtype"] == "bfloat16", name
