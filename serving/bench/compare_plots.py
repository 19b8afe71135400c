"""The plots of ``bench compare`` (matplotlib, Agg: no display needed).

- ``<workload>_latency_vs_throughput.png``: TTFT and TPOT, p50 and p99, against output
  throughput, one line per deployment through the request rates of a sweep.
- ``<workload>_timeline.png``: per deployment, the mode of every step and the queue over
  the run, from the best source there is: the server's step trace when ServerInfo carries
  one (``info_json`` ``step_trace``: ``time`` in Unix seconds, ``mode``, ``waiting``,
  ``running``); else ServerInfo polled during the run (``running``, ``waiting``, and the
  share of the steps between two polls that ran in SP); else reconstructed on the client
  from each request's ``usage.modes`` (one point per request-step, prefill steps spread
  before the first token). The client's own view of the queue (awaiting a first token,
  in flight) is drawn dotted in every case.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from shiftjax.serving.bench.compare import rate_label

MODE_ROWS = {"tp": 0, "sp": 1}


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for workload in report["workloads"]:
        if workload["request_rates"] and len(workload["request_rates"]) > 1:
            written.append(plot_latency_vs_throughput(report, workload["name"], out_dir))
        if workload["timeline"]:
            written.append(plot_timeline(report, workload["name"], out_dir))
    return [p for p in written if p is not None]


def _file_name(workload: str, kind: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", workload) + f"_{kind}.png"


def _runs_of(report: dict, workload: str):
    for deployment in report["deployments"]:
        runs = [run for run in deployment["runs"] if run["workload"] == workload and "result" in run]
        if runs:
            yield deployment["name"], runs


def plot_latency_vs_throughput(report: dict, workload: str, out_dir: Path) -> Path | None:
    import matplotlib.pyplot as plt

    figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    plotted = False
    for color, (name, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, _runs_of(report, workload)):
        summaries = [run["result"]["summary"] for run in runs]
        throughput = [s["output_throughput"] for s in summaries]
        for axis, metric in ((ttft_axis, "ttft"), (tpot_axis, "tpot")):
            axis.plot(throughput, [s[metric]["median_ms"] for s in summaries], "o-", color=color, label=f"{name} p50")
            axis.plot(throughput, [s[metric]["p99_ms"] for s in summaries], "s--", color=color, label=f"{name} p99")
        for run, x, s in zip(runs, throughput, summaries):
            ttft_axis.annotate(rate_label(run["request_rate"]), (x, s["ttft"]["median_ms"]), fontsize=7,
                               textcoords="offset points", xytext=(3, 3))
        plotted = True
    if not plotted:
        plt.close(figure)
        return None
    for axis, title in ((ttft_axis, "TTFT"), (tpot_axis, "TPOT")):
        axis.set_xlabel("output throughput (tokens/s)")
        axis.set_ylabel(f"{title} (ms)")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.set_title(f"{title} against throughput ({workload}; labels: request rate)")
    ttft_axis.legend(fontsize=8)
    figure.suptitle(f"device: {report.get('device') or 'unknown'}")
    figure.tight_layout()
    path = out_dir / _file_name(workload, "latency_vs_throughput")
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def client_mode_events(requests: list[dict]) -> tuple[np.ndarray, list[str]]:
    """(time from the run's start, mode) of every request-step that the requests' usage
    reports: decode steps at the request's output chunks, earlier (prefill) steps spread
    evenly between its send and its first token."""
    times, modes = [], []
    for request in requests:
        if not request["success"] or not request["modes"]:
            continue
        first = request["sent_at"] + request["ttft"]
        chunk_times = first + np.concatenate([[0.0], np.cumsum(request["itl"])])
        decode = min(len(chunk_times) - 1, len(request["modes"]) - 1)
        prefill = len(request["modes"]) - decode
        times += list(np.linspace(request["sent_at"], first, prefill + 1)[1:]) + list(chunk_times[1:decode + 1])
        modes += list(request["modes"])
    return np.asarray(times), modes


def client_queue(requests: list[dict], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Requests waiting for their first token, and requests in flight, at each grid time."""
    sent = np.array([r["sent_at"] for r in requests if r["success"]])
    first = sent + np.array([r["ttft"] for r in requests if r["success"]])
    done = sent + np.array([r["e2el"] for r in requests if r["success"]])
    at = grid[:, None]
    return ((sent <= at) & (at < first)).sum(axis=1), ((sent <= at) & (at < done)).sum(axis=1)


def sampled_mode_share(samples: list[dict], started_unix: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From consecutive ServerInfo samples: each interval's midpoint (seconds from the
    run's start), the share of its steps that ran in SP mode, and its step count
    (intervals without steps are left out)."""
    times, shares, counts = [], [], []
    for before, after in zip(samples, samples[1:]):
        steps = {mode: after["steps_by_mode"].get(mode, 0) - before["steps_by_mode"].get(mode, 0)
                 for mode in after["steps_by_mode"]}
        total = sum(steps.values())
        if total > 0:
            times.append((before["time"] + after["time"]) / 2 - started_unix)
            shares.append(steps.get("sp", 0) / total)
            counts.append(total)
    return np.asarray(times), np.asarray(shares), np.asarray(counts)


def _draw_modes(axis, result: dict) -> str:
    """Mode per step on ``axis`` (tp at 0, sp at 1) from the best source; returns its name."""
    trace, samples = result.get("step_trace"), result.get("server_samples")
    if trace:
        times = np.array([s["time"] - result["started_unix"] for s in trace])
        modes = [s["mode"] for s in trace]
        source = "server step trace"
    elif samples and len(samples) > 1:
        times, shares, counts = sampled_mode_share(samples, result["started_unix"])
        axis.plot(times, shares, "-", lw=0.8, color="0.5")
        axis.scatter(times, shares, s=np.clip(counts, 4, 40), c=shares, cmap="coolwarm", vmin=0, vmax=1)
        return "share of steps in SP per ServerInfo sample"
    else:
        times, modes = client_mode_events(result["requests"])
        source = "per-request usage.modes"
    rows = np.array([MODE_ROWS.get(m, 2) for m in modes])
    for mode, row in MODE_ROWS.items():
        chosen = rows == row
        axis.scatter(times[chosen], rows[chosen], s=4, alpha=0.5, label=mode)
    return source


def _draw_queue(axis, result: dict) -> None:
    """Waiting and running requests on ``axis``: the server's own numbers when it gave
    them, else what the client saw (awaiting a first token, in flight)."""
    trace, samples = result.get("step_trace"), result.get("server_samples")
    if trace and any("replica" in s for s in trace):
        trace = None  # a data-parallel step counts one replica's queue; the samples sum them
    if trace:  # the queue at each step: points, since nothing is known between steps
        times = np.array([s["time"] - result["started_unix"] for s in trace])
        axis.plot(times, [s.get("waiting", 0) for s in trace], ".", ms=3, label="waiting (server, per step)")
        axis.plot(times, [s.get("running", 0) for s in trace], ".", ms=3, label="running (server, per step)")
    elif samples:
        times = np.array([s["time"] - result["started_unix"] for s in samples])
        axis.step(times, [s["waiting"] for s in samples], where="post", label="waiting (server, polled)")
        axis.step(times, [s["running"] for s in samples], where="post", label="running (server, polled)")
    grid = np.linspace(0.0, result["summary"]["duration_s"], 600)
    waiting, in_flight = client_queue(result["requests"], grid)
    axis.step(grid, waiting, where="post", ls=":", label="awaiting first token (client)")
    axis.step(grid, in_flight, where="post", ls=":", label="in flight (client)")


def plot_timeline(report: dict, workload: str, out_dir: Path) -> Path | None:
    import matplotlib.pyplot as plt

    deployments = list(_runs_of(report, workload))
    if not deployments:
        return None
    figure, axes = plt.subplots(2 * len(deployments), 1, figsize=(12, 3.2 * len(deployments)), sharex=True,
                                squeeze=False, gridspec_kw={"height_ratios": [1, 2] * len(deployments)})
    for index, (name, runs) in enumerate(deployments):
        result = runs[-1]["result"]  # a trace is replayed once; of a sweep, the highest rate
        mode_axis, queue_axis = axes[2 * index, 0], axes[2 * index + 1, 0]
        source = _draw_modes(mode_axis, result)
        _draw_queue(queue_axis, result)
        mode_axis.set_yticks([0, 1], ["tp", "sp"])
        mode_axis.set_ylim(-0.25, 1.25)
        mode_axis.set_title(f"{name}: mode per step ({source})", fontsize=9)
        queue_axis.set_ylabel("requests")
        queue_axis.legend(fontsize=7, loc="upper right")
        queue_axis.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds from the start of the run")
    figure.suptitle(f"{workload} (device: {report.get('device') or 'unknown'})")
    figure.tight_layout()
    path = out_dir / _file_name(workload, "timeline")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_main(argv: list[str]) -> int:
    """``shiftjax bench plot compare.json --out-dir DIR``: the plots again, from a saved report."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="shiftjax bench plot", description=plot_main.__doc__)
    parser.add_argument("report", type=Path, help="a compare.json written by bench compare")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the report's directory")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.report.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in write_plots(json.loads(args.report.read_text()), out_dir):
        print(path)
    return 0
