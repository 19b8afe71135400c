"""The ``shiftjax`` command: one entry point, one module per subcommand (imported on use, so
``shiftjax client`` never loads JAX)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "generate": generate_main,
        "convert": _checkpoint_command("convert_main"),
        "import-gguf": _checkpoint_command("import_gguf_main"),
        "prepare-default": prepare_default_main,
        "serve": _lazy_command("shiftjax.serving.server.cli", "serve_main"),
        "client": _lazy_command("shiftjax.serving.client.cli", "client_main"),
        "bench": _lazy_command("shiftjax.serving.bench.cli", "bench_main"),
    }
    if not argv or argv[0] not in commands:
        print(f"usage: shiftjax {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def _checkpoint_command(name: str):
    return _lazy_command("shiftjax.checkpoints.cli", name)


def _lazy_command(module: str, name: str):
    def run(argv):
        import importlib

        return getattr(importlib.import_module(module), name)(argv)

    return run


def prepare_default_main(argv: list[str]) -> int:
    """Imports and converts the embedded default model once; prints its path."""
    argparse.ArgumentParser(prog="shiftjax prepare-default").parse_args(argv)
    from shiftjax.checkpoints.default_model import default_model_path

    print(default_model_path())
    return 0


def _parse_generate(argv: list[str]) -> argparse.Namespace:
    from shiftjax.serving.engine.engine_args import add_engine_arguments, engine_arguments_error

    parser = argparse.ArgumentParser(prog="shiftjax generate", description="Offline batched generation.")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                        help="a prompt given as token ids (repeatable)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=32)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, default=0)
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="end the output where TEXT first appears, not returned (repeatable)")
    structured = sampling.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="SCHEMA_OR_FILE",
                            help="the output is JSON valid under this schema (inline JSON, or a file)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", help="the output matches this regular expression in full")
    structured.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is one of these strings (repeatable)")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if not args.prompts and not args.prompt_ids:
        parser.error("give at least one PROMPT or --prompt-ids")
    if error := engine_arguments_error(args):
        parser.error(error)
    return args


def _structured_outputs(args: argparse.Namespace):
    """The constraint the flags ask for, or None (ValueError for a schema or grammar file
    that cannot be read)."""
    from shiftjax.serving.engine.structured_outputs import StructuredOutputs

    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "true", "false")):
            text = _read(text, "--json-schema")
        return StructuredOutputs(json=text)
    if args.grammar is not None:
        return StructuredOutputs(grammar=_read(args.grammar, "--grammar"))
    if args.json_object or args.regex is not None or args.choice:
        return StructuredOutputs(json_object=args.json_object, regex=args.regex,
                                 choice=tuple(args.choice) if args.choice else None)
    return None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path!r} ({error.strerror})") from None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def generate_main(argv: list[str]) -> int:
    args = _parse_generate(argv)
    from shiftjax.serving.engine.engine_args import build_llm, configure_jax

    configure_jax(args)  # platform, processes, compilation cache: before any compile
    import jax

    from shiftjax.checkpoints.format import CheckpointError
    from shiftjax.config import ConfigError
    from shiftjax.serving.engine.grammar import check_grammar
    from shiftjax.serving.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                stop=tuple(args.stop), structured_outputs=_structured_outputs(args))
        if params.structured_outputs is not None:  # refused before the model loads and compiles
            check_grammar(params.structured_outputs)
        prompts = list(args.prompts) + [_parse_ids(t) for t in args.prompt_ids]
        start = time.perf_counter()
        llm = build_llm(args)
        ready = time.perf_counter()
        completions = llm.generate(prompts, params, chat=args.chat)
        done = time.perf_counter()
    except (ValueError, CheckpointError, ConfigError) as error:
        print(f"shiftjax generate: {error}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:
        return 0
    generated = sum(len(c.output_ids) for c in completions)
    executables = llm.engine.executables
    snapshot = llm.engine.snapshot()
    summary = (f"mesh sp={args.sp} tp={args.tp} on {jax.devices()[0].platform}; load+compile "
               f"{ready - start:.1f} s ({len(executables.compiled)} executables compiled in "
               f"{llm.compile_seconds:.1f} s summed, {executables.cache_hits} from the compilation cache); "
               f"generated {generated} tokens in {done - ready:.2f} s; steps {snapshot.steps}, "
               f"mode switches {snapshot.switches}")
    if args.speculative_method is not None:
        summary += f"; {speculation_summary(args.speculative_method, snapshot.speculative)}"
    for completion in completions:
        if args.json:
            print(json.dumps(completion.to_json()))
        else:
            print(f"--- {llm.tokenizer.decode(completion.prompt_ids)!r}\n{completion.text}\n")
    print(summary, file=sys.stderr)
    return 0


def speculation_summary(method: str, counters) -> str:
    """What speculative decoding did (``counters``: a ``SpecDecodeCounters``), in one clause."""
    return (f"speculative decoding ({method}): {counters.num_drafts} drafts, {counters.num_accepted_tokens} of "
            f"{counters.num_draft_tokens} draft tokens accepted ({counters.acceptance_rate:.0%}), mean accepted "
            f"length {counters.mean_accepted_length:.2f}")


if __name__ == "__main__":
    sys.exit(main())
