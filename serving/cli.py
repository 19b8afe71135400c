"""The ``shiftjax`` command: one entry point, one module per subcommand (imported on use, so
``shiftjax client`` never loads JAX)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "generate": generate_main,
        "convert": _checkpoint_command("convert_main"),
        "import-gguf": _checkpoint_command("import_gguf_main"),
        "prepare-default": prepare_default_main,
        "serve": _lazy_command("shiftjax.serving.serve_cli", "serve_main"),
        "client": _lazy_command("shiftjax.serving.client_cli", "client_main"),
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
    parser = argparse.ArgumentParser(prog="shiftjax generate", description="Offline batched generation.")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT")
    parser.add_argument("--model", default="default", help="a shiftjax checkpoint dir, or 'default'")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                        help="a prompt given as token ids (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mode", choices=("tp", "sp", "auto", "alternate"), default="auto")
    parser.add_argument("--shift-threshold", type=int, default=None,
                        help="with --mode auto: SP mode from this many tokens per step up")
    parser.add_argument("--weight-storage", choices=("aliased", "two_copies"), default="aliased")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="run on N virtual CPU devices (try meshes without GPUs)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--token-buckets", default=None, metavar="16,64,128",
                        help="token counts to compile a step for (default: 16 x 4**i up to the max)")
    parser.add_argument("--seq-buckets", default=None, metavar="1,4,8",
                        help="sequence counts to compile a step for (default: 4**i up to the max)")
    parser.add_argument("--attention", choices=("reference", "pallas", "auto"), default="auto")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of process 0, for a mesh over several processes")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.prompts and not args.prompt_ids:
        parser.error("give at least one PROMPT or --prompt-ids")
    return args


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def generate_main(argv: list[str]) -> int:
    args = _parse_generate(argv)
    import jax

    if args.cpu_devices is not None:
        # Must precede the first use of a backend; a config value, not an environment variable.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    from shiftjax.checkpoints.format import CheckpointError
    from shiftjax.config import ConfigError
    from shiftjax.serving.llm import LLM
    from shiftjax.serving.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        prompts = list(args.prompts) + [_parse_ids(t) for t in args.prompt_ids]
        start = time.perf_counter()
        llm = LLM(args.model, sp=args.sp, tp=args.tp, dtype=args.dtype,
                  weight_storage=args.weight_storage, mode=args.mode,
                  shift_threshold=args.shift_threshold, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  page_size=args.page_size, attention=args.attention,
                  token_buckets=args.token_buckets and tuple(_parse_ids(args.token_buckets)),
                  seq_buckets=args.seq_buckets and tuple(_parse_ids(args.seq_buckets)))
        ready = time.perf_counter()
        completions = llm.generate(prompts, params, chat=args.chat)
        done = time.perf_counter()
    except (ValueError, CheckpointError, ConfigError) as error:
        print(f"shiftjax generate: {error}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:
        return 0
    generated = sum(len(c.output_ids) for c in completions)
    summary = (f"mesh sp={args.sp} tp={args.tp} on {jax.devices()[0].platform}; load+compile "
               f"{ready - start:.1f} s ({len(llm.engine.executables.compiled)} executables compiled in "
               f"{llm.compile_seconds:.1f} s summed); generated {generated} "
               f"tokens in {done - ready:.2f} s; steps {llm.engine.stats['steps']}, "
               f"mode switches {llm.engine.stats['switches']}")
    for completion in completions:
        if args.json:
            print(json.dumps(completion.to_json()))
        else:
            print(f"--- {llm.tokenizer.decode(completion.prompt_ids)!r}\n{completion.text}\n")
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
