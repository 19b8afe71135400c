"""Host time of the engine's per-step bookkeeping, without a model: the scheduler's
``schedule`` (building the step's batch), ``pad_batch`` and ``pack_batch`` (the two-array
upload), and ``commit``, for N sequences decoding with long contexts. On 2x H200 the
scheduler took 0.8-1.2 ms of a 6 ms step at 64 sequences (benchmarks/README.md, "Two GPUs"), where
the host and the devices are close; this measures it where it can be changed.

    .venv/bin/python benchmarks/scheduler_host.py --seqs 1 8 64 --context 1000 --baseline REV --out DIR

Writes ``scheduler_host.json``: per sequence count, the median microseconds per call of
each phase over ``--steps`` decode steps (after every prompt is prefilled), steps run one
at a time (schedule, then commit with made-up tokens). ``--baseline REV`` measures that
git revision's ``serving/engine/scheduler.py`` in the same process too, alternating with this
tree's over ``--repeats`` (this machine's timings drift by 2x between runs), and reports
the median over repeats of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

from shiftjax.serving.engine import scheduler as current
from shiftjax.serving.engine.batch_upload import pack_batch
from shiftjax.serving.engine.buckets import pad_batch
from shiftjax.serving.engine.sampling_params import SamplingParams


def scheduler_at(revision: str) -> types.ModuleType:
    """``serving/engine/scheduler.py`` as it was at a git revision, loaded as a module."""
    source = subprocess.run(["git", "show", f"{revision}:serving/engine/scheduler.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parent).stdout
    module = types.ModuleType(f"scheduler_at_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:serving/engine/scheduler.py", "exec"), module.__dict__)
    return module


def measure(module, seqs: int, context: int, steps: int, page_size: int = 16) -> dict[str, float]:
    Scheduler, SchedulerConfig = module.Scheduler, module.SchedulerConfig
    budget = 1024  # prefill in large steps, so that every request decodes before the first ends
    max_tokens = -(-seqs * context // budget) + steps + 8
    max_model_len = context + max_tokens
    pages = seqs * -(-max_model_len // page_size) + 1
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                          max_model_len=max_model_len, page_size=page_size, num_pages=pages))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [scheduler.add([(i * 13 + j) % 1000 + 3 for j in range(context)], params, ()) for i in range(seqs)]
    seconds: dict[str, list[float]] = {"schedule": [], "pad": [], "pack": [], "commit": []}
    token_buckets = (64, budget)

    def step(timed: bool):
        marks = [time.perf_counter()]
        scheduled = scheduler.schedule()
        marks.append(time.perf_counter())
        tokens = next(t for t in token_buckets if t >= scheduled.num_tokens)
        padded = pad_batch(scheduled.batch, tokens, seqs)
        marks.append(time.perf_counter())
        pack_batch(padded, scheduled.token_source)
        marks.append(time.perf_counter())
        n = len(scheduled.requests)
        scheduler.commit(scheduled, np.full(n, 7, np.int32), np.zeros(n, np.float32), "tp")
        marks.append(time.perf_counter())
        if timed:
            for name, begin, end in zip(seconds, marks, marks[1:]):
                seconds[name].append(end - begin)

    while any(not r.output_ids for r in requests):
        step(timed=False)
    for _ in range(steps):
        assert sum(not r.finished for r in requests) == seqs, "every sequence decodes in every timed step"
        step(timed=True)
    return {name: float(np.median(values)) * 1e6 for name, values in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--baseline", default=None, help="a git revision to measure alongside")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny: 1 and 4 sequences, HEAD as the baseline")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.smoke:
        args.seqs, args.context, args.steps, args.repeats, args.baseline = [1, 4], 40, 10, 2, "HEAD"
    modules = {"this tree": current}
    if args.baseline:
        modules[args.baseline] = scheduler_at(args.baseline)
    results = {"context": args.context, "steps": args.steps, "repeats": args.repeats,
               "microseconds_per_call": {name: {} for name in modules}}
    for seqs in args.seqs:
        runs = {name: [] for name in modules}
        for repeat in range(args.repeats):
            for name in list(modules)[::1 if repeat % 2 == 0 else -1]:
                runs[name].append(measure(modules[name], seqs, args.context, args.steps))
        for name, rows in runs.items():
            row = {phase: float(np.median([r[phase] for r in rows])) for phase in rows[0]}
            results["microseconds_per_call"][name][seqs] = row
            print(f"{name:>10} {seqs:3d} sequences: " + ", ".join(f"{k} {v:7.1f} us" for k, v in row.items()),
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scheduler_host.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
