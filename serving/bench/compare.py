"""``shiftjax bench compare``: several deployments, the same workloads, one report.

Every workload (and every request rate of a sweep) is built once from its seed before any
server starts, so each deployment receives the same requests at the same offsets. Each
deployment is started, health-checked, run through every workload and stopped before the
next starts (they share the devices). Out come one JSON file, one table and the plots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path

from shiftjax.serving.bench import serve_bench
from shiftjax.serving.bench.report import json_safe, write_json
from shiftjax.serving.bench.server_process import ServerInfoSampler, ServerProcess, read_deployments

CONFIG_FIELDS = {f.name for f in dataclasses.fields(serve_bench.ServeBenchConfig)} - {"server"}
FLOAT_FIELDS = {f.name for f in dataclasses.fields(serve_bench.ServeBenchConfig) if str(f.type).startswith("float")}


def _as_config_values(options: dict) -> dict:
    """JSON's ``60`` for a float option becomes ``60.0``, and ``"inf"`` becomes infinity."""
    return {k: float(v) if k in FLOAT_FIELDS and isinstance(v, (int, str)) and not isinstance(v, bool) else v
            for k, v in options.items()}


@dataclasses.dataclass
class WorkloadSpec:
    """A named workload: ``bench serve`` options, swept over ``request_rates`` if given.
    ``timeline`` asks for the per-step mode and queue plot of its runs. A sweep sends the
    same prompts at every rate, so with a ``cache_salt`` each rate gets its own
    (``salt@rate``): a point does not find the prompts of the one before in the server's
    prefix cache."""

    name: str
    options: dict
    request_rates: list[float] | None = None
    timeline: bool = False

    @classmethod
    def from_dict(cls, item: dict) -> "WorkloadSpec":
        item = dict(item)
        name = item.pop("name", None)
        rates = item.pop("request_rates", None)
        timeline = bool(item.pop("timeline", item.get("dataset") == "trace"))
        unknown = set(item) - CONFIG_FIELDS
        if not name or unknown:
            raise ValueError(f"a workload needs a name and takes bench serve options {sorted(CONFIG_FIELDS)} "
                             f"plus request_rates and timeline; got unknown keys {sorted(unknown)}"
                             if unknown else "a workload needs a name")
        if rates is not None:
            rates = [float(rate) for rate in rates]  # "inf" reads as infinity
        return cls(name, _as_config_values(item), rates, timeline)

    def points(self) -> list[float | None]:
        return self.request_rates or [None]


def read_workloads(sources: list[str]) -> list[WorkloadSpec]:
    """Workloads from JSON files or inline JSON (``[...]`` or ``{...}``)."""
    specs = []
    for source in sources:
        text = source if source.lstrip().startswith(("[", "{")) else Path(source).read_text()
        data = json.loads(text)
        specs += [WorkloadSpec.from_dict(item) for item in (data if isinstance(data, list) else [data])]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names must be unique, got {names}")
    return specs


def planned_runs(specs: list[WorkloadSpec], common: dict) -> list[tuple[WorkloadSpec, float | None, serve_bench.ServeBenchConfig, serve_bench.Workload]]:
    """Every (workload, rate) with its config (server filled in later) and its requests."""
    runs = []
    for spec in specs:
        for rate in spec.points():
            options = common | spec.options | ({"request_rate": rate} if rate is not None else {})
            if rate is not None and options.get("cache_salt"):
                options["cache_salt"] = f"{options['cache_salt']}@{rate:g}"
            config = serve_bench.ServeBenchConfig(server="", **options)
            runs.append((spec, rate, config, serve_bench.build_workload(config)))
    return runs


def run_deployment(process: ServerProcess, runs, out_dir: Path, sample_interval_s: float = 0.25,
                   on_run=lambda entry: None) -> dict:
    """Starts one deployment, runs every planned run against it, stops it; ``on_run(entry)``
    after each run (the caller saves what ran, so a killed invocation keeps it)."""
    entry = {"name": process.deployment.name, "command": process.command, "runs": [], "error": None}
    try:
        process.start()
        entry["startup_seconds"] = process.startup_seconds
        entry["server_info"] = process.server_info()
        for spec, rate, config, workload in runs:
            address = process.http_address if config.backend == "openai" else process.grpc_address
            config = dataclasses.replace(config, server=address, label=f"{process.deployment.name}/{spec.name}")
            print(f"[{process.deployment.name}] {spec.name}" + (f" at {rate:g} req/s" if rate else ""), file=sys.stderr)
            sampler = ServerInfoSampler(process.grpc_address, sample_interval_s) if spec.timeline else contextlib.nullcontext()
            try:
                with sampler:
                    result = asyncio.run(serve_bench.run_serve_bench(config, workload))
            except (ConnectionError, OSError, ValueError) as error:  # this run only; the next may work
                message = f"[{process.deployment.name}] {spec.name}: {type(error).__name__}: {error}"
                print(message, file=sys.stderr)
                entry["runs"].append({"workload": spec.name, "request_rate": rate, "error": message})
                continue
            if spec.timeline:
                result["server_samples"] = sampler.samples
            step_trace = (process.server_info(include_step_trace=True).get("info_json") or {}).get("step_trace") if spec.timeline else None
            if step_trace:
                end = result["started_unix"] + result["summary"]["duration_s"]
                result["step_trace"] = [s for s in step_trace if result["started_unix"] <= s["time"] <= end + 1.0]
            entry["runs"].append({"workload": spec.name, "request_rate": rate, "result": result})
            on_run(entry)
    except RuntimeError as error:
        entry["error"] = str(error)
        print(str(error), file=sys.stderr)
    finally:
        entry["exit_code"] = process.stop()
        entry["log"] = str(process.log_path)
    return entry


TABLE_NOTE = ("Times in ms. SP req-steps: the share of request-steps (each request's usage.modes) "
              "that ran in SP mode.")


def rate_label(rate) -> str:
    """A run's request rate for a table or plot; a report read back from JSON spells
    infinity ``"inf"``."""
    if rate is None:
        return "-"
    return f"{float(rate):g}"


def table_rows(report: dict) -> list[dict]:
    """One row per (deployment, workload, rate): the numbers the comparison turns on."""
    rows = []
    for deployment in report["deployments"]:
        for run in deployment["runs"]:
            if "result" not in run:
                continue  # a run that failed as a whole: its error is in the report
            s = run["result"]["summary"]
            steps = s.get("mode_steps") or {}
            rows.append({
                "deployment": deployment["name"], "workload": run["workload"],
                "rate": rate_label(run["request_rate"]),
                "ok": f"{s['completed']}/{s['completed'] + s['failed']}",
                "req/s": f"{s['request_throughput']:.2f}", "out tok/s": f"{s['output_throughput']:.0f}",
                "TTFT p50": f"{s['ttft']['median_ms']:.1f}", "TTFT p99": f"{s['ttft'].get('p99_ms', math.nan):.1f}",
                "TPOT p50": f"{s['tpot']['median_ms']:.2f}", "TPOT p99": f"{s['tpot'].get('p99_ms', math.nan):.2f}",
                "ITL p50": f"{s['itl']['median_ms']:.2f}",
                "goodput": "-" if s["request_goodput"] is None else f"{s['request_goodput']:.2f}",
                "SP req-steps": f"{steps.get('sp', 0) / sum(steps.values()):.0%}" if steps else "-",
            })
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table (times in ms), readable in a terminal and pasteable in a README."""
    if not rows:
        return "(no runs)"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    text_columns = ("deployment", "workload")

    def line(cells):
        return "| " + " | ".join(str(cells[c]).ljust(widths[c]) if c in text_columns else str(cells[c]).rjust(widths[c])
                                 for c in columns) + " |"

    return "\n".join([line({c: c for c in columns}), "|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|",
                      *(line(r) for r in rows)])


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shiftjax bench compare",
                                     description="Start each deployment, run the same workloads, compare.")
    parser.add_argument("--deployments", required=True, metavar="FILE.json",
                        help='[{"name", "command" (with {port} {http_port} {python}), "env"}] or {"device", "deployments"}')
    parser.add_argument("--workloads", required=True, nargs="+", metavar="FILE.json|JSON",
                        help='[{"name", bench serve options in snake_case, "request_rates": [...], "timeline"}]')
    parser.add_argument("--out-dir", required=True, help="compare.json, compare.md, plots and server logs go here")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these deployments")
    parser.add_argument("--device", help='what the deployments run on, e.g. "2x H200" (overrides the file)')
    parser.add_argument("--sample-interval", type=float, default=0.25,
                        help="seconds between ServerInfo polls during a timeline workload")
    serve_bench.add_workload_arguments(parser)
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    try:
        deployments, meta = read_deployments(args.deployments)
        if args.only:
            unknown = sorted(set(args.only) - {d.name for d in deployments})
            if unknown:
                raise ValueError(f"--only {unknown}: no such deployment in {args.deployments} "
                                 f"(it has {[d.name for d in deployments]})")
            deployments = [d for d in deployments if d.name in args.only]
        specs = read_workloads(args.workloads)
        base = serve_bench.config_from_args(args, server="")
        # options given on the command line apply to every workload that does not set them
        defaults = dataclasses.asdict(serve_bench.ServeBenchConfig(server=""))
        common = {k: v for k, v in dataclasses.asdict(base).items()
                  if k in CONFIG_FIELDS - {"label", "device"} and v != defaults[k]}
        common["percentiles"] = sorted(set(base.percentiles) | {50.0, 99.0})  # the plots need p50 and p99
        runs = planned_runs(specs, common)
    except (ValueError, OSError) as error:
        print(f"shiftjax bench compare: {error}", file=sys.stderr)
        return 2
    device = args.device or meta.get("device")
    report = {"device": device, "workloads": [dataclasses.asdict(s) for s in specs], "deployments": []}
    def save(entry=None):
        """compare.json with what has run so far: a crash or a time limit keeps it. A
        deployment still running is saved with an error saying so (a report of a killed
        invocation must not read as complete)."""
        for run in (entry or report["deployments"][-1])["runs"]:
            if "result" in run:
                run["result"]["device"] = device
        running = [] if entry is None else [entry | {"error": entry["error"] or "interrupted: still running when saved"}]
        write_json(report | {"deployments": report["deployments"] + running}, out_dir / "compare.json")

    for deployment in deployments:
        process = ServerProcess(deployment, out_dir / "logs" / f"{deployment.name}.log")
        report["deployments"].append(run_deployment(process, runs, out_dir, args.sample_interval, on_run=save))
        save()
    return write_report(report, out_dir)


def write_report(report: dict, out_dir: Path) -> int:
    """compare.json, compare.md (the table, also printed) and the plots of ``report``;
    1 if a deployment or one of its runs failed, else 0."""
    table = format_table(table_rows(report))
    print(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text(f"device: {report['device']}\n\n{TABLE_NOTE}\n\n{table}\n")
    from shiftjax.serving.bench.compare_plots import write_plots

    report["plots"] = [str(p) for p in write_plots(report, out_dir)]
    write_json(json_safe(report), out_dir / "compare.json")
    failed = [d["name"] for d in report["deployments"] if d.get("error") or any("error" in r for r in d["runs"])]
    if failed:
        print(f"shiftjax bench compare: these deployments failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def merge_reports(reports: list[dict]) -> dict:
    """One report from several ``bench compare`` reports of the same device (e.g. one
    deployment per invocation, so that each has its own time limit): the workloads of all
    (a name used twice must describe the same workload), and each deployment's runs
    (a deployment in several reports has its runs appended, in order, and each start kept
    in ``starts``; the same run in two reports is an error)."""
    if not reports:
        raise ValueError("nothing to merge")
    devices = {r.get("device") for r in reports}
    if len(devices) != 1:
        raise ValueError(f"reports of different devices cannot be merged: {sorted(map(str, devices))}")
    workloads, deployments = {}, {}
    for report in reports:
        for spec in report["workloads"]:
            if workloads.setdefault(spec["name"], spec) != spec:
                raise ValueError(f"workload {spec['name']!r} differs between the reports")
        for deployment in report["deployments"]:
            if deployment["name"] in deployments:  # e.g. its load workloads in one step, the trace in another
                merged = deployments[deployment["name"]]
                done = {(r["workload"], str(r["request_rate"])) for r in merged["runs"]}
                again = [r["workload"] for r in deployment["runs"] if (r["workload"], str(r["request_rate"])) in done]
                if again:
                    raise ValueError(f"deployment {deployment['name']!r} ran {again} in two reports")
                merged["runs"] = merged["runs"] + deployment["runs"]
                merged["error"] = merged.get("error") or deployment.get("error")
                merged["starts"] = merged["starts"] + [_start_of(deployment)]
            else:
                deployments[deployment["name"]] = dict(deployment) | {"starts": [_start_of(deployment)]}
    return {"device": devices.pop(), "workloads": list(workloads.values()), "deployments": list(deployments.values())}


def _start_of(deployment: dict) -> dict:
    """One server start of a deployment, as its report recorded it."""
    return {k: deployment.get(k) for k in ("startup_seconds", "exit_code", "log", "error")}


def merge_main(argv: list[str]) -> int:
    """``shiftjax bench merge a/compare.json b/compare.json ... --out-dir DIR``: one
    report, table and plots from several ``bench compare`` runs."""
    parser = argparse.ArgumentParser(prog="shiftjax bench merge", description=merge_main.__doc__)
    parser.add_argument("reports", nargs="+", type=Path, help="compare.json files written by bench compare")
    parser.add_argument("--out-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        report = merge_reports([json.loads(path.read_text()) for path in args.reports])
    except (ValueError, OSError, KeyError) as error:
        print(f"shiftjax bench merge: {error}", file=sys.stderr)
        return 2
    return write_report(report, args.out_dir)
