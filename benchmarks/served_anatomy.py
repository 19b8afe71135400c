"""Where the served engine's time goes with bf16 or FP8 weights, kernel by kernel, for the
two loads of ``served.py`` that matter most: the TTFT of a 4,096-token prompt (prefill) and
decode at one sequence.

The engine is built in this process exactly as ``shiftjax serve`` builds it, from the same
arguments (``served.SERVE_8B``, dummy weights of the Llama-3.1-8B shape), and driven
through :class:`~shiftjax.serving.engine.llm.LLM` (no gRPC: its cost is the same for both
weights). Per deployment:

- ``ttft``: wall time of ``generate`` of a 4,096-token prompt with ``max_tokens=1``
  (``--prompts`` distinct prompts, no prefix hits) with the host's time before, in and after
  the step's launch, and under the profiler one more: the
  executables it ran (``(mode, tokens, seqs)`` and how often), its kernels' device time by
  kind and the top kernels, the device's window and the fraction of it left idle;
- ``decode``: one sequence of a 1,024-token prompt decoding; ``--decode-steps`` engine steps
  timed by wall clock, the last ``--profiled`` of them profiled the same way.

    bash benchmarks/run_gpu.sh anatomy                                        # one GPU, bf16 and fp8
    python benchmarks/served_anatomy.py --smoke --quantization fp8 --out DIR  # the CPU
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from served import CONFIGS, SERVE_8B, prompts_of  # noqa: E402
from roofline import device_idle  # noqa: E402


def engine_arguments(quantization: str, smoke: bool, extra: list[str]) -> list[str]:
    """``shiftjax serve``'s engine arguments for this deployment, ``extra`` last (they win)."""
    if smoke:
        deployment = ["--model", "default", "--cpu-devices", "1", "--max-model-len", "256", "--max-num-seqs", "2",
                      "--max-num-batched-tokens", "64", "--token-buckets", "16,64", "--seq-buckets", "1,2",
                      "--num-pages", "40", "--no-compilation-cache"]
    else:
        deployment = ["--model", str(CONFIGS / "Llama-3.1-8B" / "config.json"), "--load-format", "dummy",
                      "--dtype", "bfloat16", "--tokenizer", str(CONFIGS / "smollm2-tokenizer"), *SERVE_8B]
    return [*deployment, "--quantization", quantization, *extra]


def counting(executables, calls: list) -> collections.Counter:
    """Counts each compiled step's runs from now on (by its ``(mode, tokens, seqs)`` key) and
    appends each call's host span, ``(key, begin, end)`` in ``perf_counter`` seconds, to
    ``calls``: the call returns once the step is enqueued, so its span is the host's launch
    cost (command buffers re-recorded included), not the device's time."""
    runs = collections.Counter()
    for key, fn in dict(executables.compiled).items():
        def counted(*args, _key=key, _fn=fn, **kwargs):
            runs[_key] += 1
            begin = time.perf_counter()
            out = _fn(*args, **kwargs)
            calls.append((_key, begin, time.perf_counter()))
            return out
        executables.compiled[key] = counted
    return runs


def host_spans(calls: list, begin: float, end: float) -> dict:
    """One timed call's host time around its steps, in ms: before the first step's launch
    (scheduling, the batch's arrays), in the launches, and after the last launch (the device's
    time, the result's copy back and the output's assembly)."""
    inside = [c for c in calls if begin <= c[1] <= end]
    if not inside:
        return {}
    return {"before_launch_ms": round(1e3 * (inside[0][1] - begin), 3),
            "launch_ms": round(1e3 * sum(c[2] - c[1] for c in inside), 3),
            "after_launch_ms": round(1e3 * (end - inside[-1][2]), 3)}


def device_summary(fn, calls: int, runs: collections.Counter, top: int = 40) -> dict:
    """``calls`` calls of ``fn()`` under the profiler: the executables they ran, and per
    device ``roofline.device_idle``'s window, idle fraction and kernel time by kind and by
    kernel (per call)."""
    before = collections.Counter(runs)
    devices = device_idle(fn, calls, top=top)
    return {"executables": {"/".join(map(str, key)): count for key, count in (runs - before).items()},
            "devices": devices}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=("none", "fp8"), required=True)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=40)
    parser.add_argument("--profiled", type=int, default=8)
    parser.add_argument("--engine-args", default="", help="more serve arguments, space-separated (e.g. --num-pages 4000)")
    parser.add_argument("--top", type=int, default=40, help="how many kernels, the longest first, to list")
    parser.add_argument("--label", default="", help="added to the result file's name")
    parser.add_argument("--smoke", action="store_true", help="the CPU: the default model, tiny prompts")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from shiftjax.serving.engine.engine_args import add_engine_arguments, build_llm, configure_jax
    from shiftjax.serving.engine.sampling_params import SamplingParams

    engine_parser = argparse.ArgumentParser()
    add_engine_arguments(engine_parser)
    arguments = engine_arguments(args.quantization, args.smoke, args.engine_args.split())
    engine_args = engine_parser.parse_args(arguments)
    configure_jax(engine_args)
    started = time.perf_counter()
    llm = build_llm(engine_args)
    result = {"quantization": args.quantization, "arguments": arguments,
              "startup_s": round(time.perf_counter() - started, 1)}
    calls = []
    runs = counting(llm.engine.executables, calls)
    prompt_len, decode_prompt = (60, 20) if args.smoke else (4096, 1024)
    prompts = prompts_of(args.prompts + 2, prompt_len, 4096, 49152)

    # TTFT: a prompt alone, one token out (the first prompt warms the host path)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    print("ttft begin", flush=True)  # marks where the TTFT part's lines of XLA's log begin
    llm.generate([prompts[0]], one_token)
    seconds, spans = [], []
    for prompt in prompts[1:1 + args.prompts]:
        begin = time.perf_counter()
        llm.generate([prompt], one_token)
        end = time.perf_counter()
        seconds.append(end - begin)
        spans.append(host_spans(calls, begin, end))
    result["ttft"] = {"prompt_tokens": prompt_len, "wall_ms": [round(1e3 * s, 3) for s in seconds],
                      "wall_ms_median": round(1e3 * statistics.median(seconds), 3), "host_spans": spans,
                      **device_summary(lambda: llm.generate([prompts[-1]], one_token), 1, runs, args.top)}
    print("ttft", json.dumps({k: v for k, v in result["ttft"].items() if k != "devices"}), flush=True)

    # decode: one sequence, engine steps one at a time
    engine = llm.engine
    request = engine.add_request(prompts_of(1, decode_prompt, 1024, 49152)[0],
                                 SamplingParams(max_tokens=args.decode_steps + 16, ignore_eos=True))

    def step():  # one turn of the engine's pipeline; a failed step fails the benchmark
        engine.step().result()

    while not request.output_ids:
        step()
    steps, spans = [], []
    for _ in range(args.decode_steps - args.profiled):
        begin = time.perf_counter()
        step()
        end = time.perf_counter()
        steps.append(end - begin)
        spans.append(host_spans(calls, begin, end))
    steady = steps[2:]
    decode = device_summary(step, args.profiled, runs, args.top)
    result["decode"] = {"prompt_tokens": decode_prompt, "step_wall_ms_median": round(1e3 * statistics.median(steady), 3),
                        "host_spans_median": {k: round(statistics.median(s[k] for s in spans[2:] if s), 3)
                                              for k in spans[-1]},
                        "profiled_steps": args.profiled, **decode}
    engine.abort(request)
    while (turn := engine.step()) is not None:
        turn.result()
    print("decode", json.dumps({k: v for k, v in result["decode"].items() if k != "devices"}), flush=True)
    (args.out / f"anatomy_{args.quantization}{args.label}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
