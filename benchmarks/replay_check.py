"""Does the simulated replay reproduce what the servers measured?

The projection (``projection.py``) has two halves: a step-time model, checked step by step
against the 2-GPU measurements (README.md, "The 8-GPU projection"), and a replay of workloads through the
real scheduler and shift policy in simulated time (``serving/bench/simulate.py``). This
checks the second half against ``bench compare``'s runs on 2x H200 (README.md, "Two GPUs: TP, SP, DP and Shift served"): it
takes the step times the servers themselves recorded and replays the same workloads with
them, then compares TTFT, TPOT and throughput with what the bench client measured.

Step times: the median wall time per (mode, token bucket, sequence bucket) of the ``tp``
and ``sp`` deployments' step traces on the Azure trace (``step_trace``, host work
included), one table per mode, shared by every deployment that runs that mode; the host
time between consecutive steps (the service loop's, outside a step's own seconds) is the
median gap in the same traces. The shift policy gets the timings the real server measured
at start (``info_json.policy.timing``). DP is left out: at 3ec5d66, when these runs were
made, its server reported no step trace.

    .venv/bin/python benchmarks/replay_check.py --out benchmarks/results/replay_check
    .venv/bin/python benchmarks/replay_check.py --smoke --out /tmp/replay   # short workloads
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT = HERE / "results/compare_x2/merged/compare.json.gz"
TRACE = HERE / "traces/azure2023_code.csv"
DEPLOYMENTS = ("tp", "sp", "shift", "shift-threshold")
MIN_STEPS = 5
METRICS = (("req/s", lambda s: s["request_throughput"]), ("TTFT p50 ms", lambda s: s["ttft"]["p50_ms"]),
           ("TTFT p99 ms", lambda s: s["ttft"]["p99_ms"]), ("TPOT p50 ms", lambda s: s["tpot"]["p50_ms"]))


def load_report(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def runs_by_deployment(report: dict) -> dict[str, dict[str, dict]]:
    """``{deployment: {workload: result}}`` for the runs that completed."""
    return {d["name"]: {run["workload"]: run["result"] for run in d["runs"] if run.get("result")}
            for d in report["deployments"]}


def step_table(trace: list[dict], token_buckets, seq_buckets) -> dict[tuple[int, int], float]:
    """Median step seconds per (token bucket, sequence bucket) of one deployment's trace, for
    the pairs it ran at least ``MIN_STEPS`` times (the run's first step took 566 ms)."""
    from shiftjax.serving.engine.buckets import BucketLadder

    ladder = BucketLadder(tuple(token_buckets), tuple(seq_buckets))  # the bucket the engine ran
    groups: dict[tuple[int, int], list[float]] = {}
    for step in trace:
        groups.setdefault(ladder.pick(step["num_tokens"], step["num_seqs"]), []).append(step["seconds"])
    return {key: statistics.median(seconds) for key, seconds in groups.items() if len(seconds) >= MIN_STEPS}


def host_gap_seconds(trace: list[dict]) -> float:
    """Median time between one step's end and the next one's start, over back-to-back steps
    (a gap longer than 50 ms is the server idling, not host work)."""
    gaps = [b["time"] - a["time"] - b["seconds"] for a, b in zip(trace, trace[1:])]
    back_to_back = [g for g in gaps if -0.001 < g < 0.05]
    if not back_to_back:
        raise SystemExit(f"the step trace has no back-to-back steps ({len(trace)} steps) to measure host time from")
    return statistics.median(back_to_back)


def make_step_seconds(tables: dict[str, dict], token_buckets):
    """A ``StepSeconds`` from the per-mode tables; a (tokens, seqs) pair the trace never ran
    takes the median of its token bucket's other sequence buckets."""
    by_tokens = {mode: {t: statistics.median(v for (tt, _), v in table.items() if tt == t)
                        for t in token_buckets if any(tt == t for tt, _ in table)}
                 for mode, table in tables.items()}

    def step_seconds(mode: str, tokens: int, seqs: int, _contexts) -> float:
        if (tokens, seqs) in tables[mode]:
            return tables[mode][(tokens, seqs)]
        if tokens not in by_tokens[mode]:
            raise SystemExit(f"the {mode} step trace ran no {tokens}-token step {MIN_STEPS} times: "
                             f"no step time to replay it with")
        return by_tokens[mode][tokens]

    return step_seconds


def workload_requests(spec: dict, smoke: bool):
    from shiftjax.serving.bench import simulate as sim

    if spec.get("dataset") == "trace":
        requests = sim.trace_requests(HERE.parent / spec["trace"], start_s=spec["start"],
                                      duration_s=spec["duration"], time_scale=spec["time_scale"])
        requests = [sim.SimRequest(r.arrival_s, min(r.prompt_len, spec["max_input_len"]),
                                   min(r.output_len, spec["max_output_len"])) for r in requests]
        return (requests[:40] if smoke else requests), None
    count = min(spec["num_prompts"], 8) if smoke else spec["num_prompts"]
    return sim.fixed_requests(count, spec["input_len"], spec["output_len"]), spec.get("max_concurrency")


def replay(result: dict, spec: dict, name: str, step_seconds, host_gap: float, timing: dict, smoke: bool) -> dict:
    from shiftjax.serving.bench import simulate as sim
    from shiftjax.serving.engine.buckets import BucketLadder
    from shiftjax.serving.engine.policy import ShiftPolicy
    from shiftjax.serving.engine.scheduler import SchedulerConfig

    info = result["server_info"]
    limits = json.loads(info["info_json"])["limits"]
    ladder = BucketLadder(tuple(info["token_buckets"]), tuple(info["seq_buckets"]))
    modes = tuple(info["modes"])
    policy, threshold = {"tp": ("tp", None), "sp": ("sp", None), "shift": ("auto", None),
                         "shift-threshold": ("auto", 512)}[name]
    config = SchedulerConfig(max_num_batched_tokens=limits["max_num_batched_tokens"],
                             max_num_seqs=limits["max_num_seqs"], max_model_len=limits["max_model_len"],
                             page_size=info["page_size"], num_pages=info["num_pages"] + 1)
    requests, concurrency = workload_requests(spec, smoke)
    simulated = sim.simulate(requests, scheduler_config=config, ladder=ladder, step_seconds=step_seconds,
                             make_policy=lambda: ShiftPolicy(policy, modes, timing, threshold=threshold),
                             max_concurrency=concurrency, host_seconds_per_step=host_gap).summary()
    row = {"steps_by_mode": simulated["steps_by_mode"]}
    for metric, read in METRICS:
        measured, predicted = read(result["summary"]), read(simulated)
        row[metric] = {"measured": measured, "replayed": predicted,
                       "error": None if not measured else round(predicted / measured - 1.0, 4)}
    return row


def markdown(rows: dict) -> str:
    lines = ["| deployment | workload | " + " | ".join(f"{m}: measured / replayed (error)" for m, _ in METRICS) + " |",
             "|" + " --- |" * (2 + len(METRICS))]
    for (name, workload), row in rows.items():
        cells = []
        for metric, _ in METRICS:
            m = row[metric]
            fmt = "{:.2f}" if metric == "req/s" else "{:.0f}" if "TTFT" in metric else "{:.1f}"
            error = "" if m["error"] is None else f" ({m['error'] * 100:+.0f}%)"
            cells.append(f"{fmt.format(m['measured'])} / {fmt.format(m['replayed'])}{error}")
        lines.append(f"| {name} | {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=REPORT, help="a bench compare report (.json or .json.gz)")
    parser.add_argument("--smoke", action="store_true", help="at most 8 fixed and 40 trace requests per workload")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    report = load_report(args.report)
    runs = runs_by_deployment(report)
    specs = {spec["name"]: spec["options"] for spec in report["workloads"]}
    trace_name = next(name for name, spec in specs.items() if spec.get("dataset") == "trace")
    traces = {mode: runs[mode][trace_name]["step_trace"] for mode in ("tp", "sp")}
    info = runs["tp"][trace_name]["server_info"]
    tables = {mode: step_table(trace, info["token_buckets"], info["seq_buckets"]) for mode, trace in traces.items()}
    host_gap = statistics.median(host_gap_seconds(trace) for trace in traces.values())
    step_seconds = make_step_seconds(tables, info["token_buckets"])
    shift_info = json.loads(next(iter(runs["shift"].values()))["server_info"]["info_json"])
    timing = {(t["mode"], t["tokens"], t["seqs"]): t["seconds"] for t in shift_info["policy"]["timing"]}

    rows = {}
    for name in DEPLOYMENTS:
        for workload, result in runs.get(name, {}).items():
            rows[(name, workload)] = replay(result, specs[workload], name, step_seconds, host_gap, timing, args.smoke)
            print(f"{name} / {workload}: " + ", ".join(f"{m} {rows[(name, workload)][m]['error']}" for m, _ in METRICS),
                  flush=True)
    errors = [abs(row[m]["error"]) for row in rows.values() for m, _ in METRICS if row[m]["error"] is not None]
    out = {"report": str(args.report), "smoke": args.smoke, "host_gap_seconds": host_gap,
           "step_tables_ms": {mode: {f"{t}x{s}": round(v * 1e3, 3) for (t, s), v in sorted(table.items())}
                              for mode, table in tables.items()},
           "mean_abs_error": statistics.mean(errors) if errors else None,
           "rows": [{"deployment": n, "workload": w, **row} for (n, w), row in rows.items()]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_check.json").write_text(json.dumps(out, indent=1))
    table = markdown(rows)
    (args.out / "replay_check.md").write_text(table)
    print(table + f"host gap per step {host_gap * 1e3:.2f} ms; mean |error| {out['mean_abs_error']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
