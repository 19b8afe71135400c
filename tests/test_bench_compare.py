"""bench compare: starts deployments (fake servers as subprocesses), health-checks them,
runs the same workloads against each, stops them with SIGTERM, writes JSON, table, plots."""

import json

import numpy as np
import pytest

from shiftjax.serving.bench.cli import bench_main
from shiftjax.serving.bench.compare import WorkloadSpec, read_workloads
from shiftjax.serving.bench.compare_plots import client_mode_events, client_queue, sampled_mode_share
from shiftjax.serving.bench.server_process import Deployment, read_deployments

FAKE = ["{python}", "-m", "shiftjax.serving.bench.fake_server", "--port", "{port}", "--http-port", "{http_port}",
        "--startup-delay", "0.5", "--prefill-delay", "0.02"]


def test_compare_runs_every_deployment_on_the_same_requests(tmp_path):
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 16, "output_length": 4}) + "\n"
                             for t in [0, 0, 0, 0, 0, 400, 800]))  # a burst of five, then single requests
    deployments = tmp_path / "deployments.json"
    deployments.write_text(json.dumps({"device": "loopback", "deployments": [
        {"name": "fast", "command": FAKE + ["--token-delay", "0.004", "--sp-from", "3"]},
        {"name": "slow", "command": FAKE + ["--token-delay", "0.03", "--sp-from", "3", "--no-step-trace"]},
        {"name": "broken", "command": ["{python}", "-c", "raise SystemExit(3)"]},
    ]}))
    workloads = tmp_path / "workloads.json"
    workloads.write_text(json.dumps([
        # 8 tokens out: 7 gaps, so a first token the loaded client reads a few ms late moves the
        # median TPOT little (with 3 out, 6 ms late took the slow fake's 30 ms gaps to 27.2 ms)
        {"name": "sweep", "input_len": 8, "output_len": 8, "num_prompts": 6, "request_rates": [30, "inf"]},
        {"name": "bursty trace", "dataset": "trace", "trace": str(trace), "time_scale": 0.5},
    ]))
    out = tmp_path / "out"
    code = bench_main(["compare", "--deployments", str(deployments), "--workloads", str(workloads),
                       "--out-dir", str(out), "--vocab-size", "300", "--no-progress", "--goodput", "ttft:5000",
                       "--sample-interval", "0.03"])
    assert code == 1  # the broken deployment fails the invocation, after the others ran

    report = json.loads((out / "compare.json").read_text())
    assert report["device"] == "loopback"
    fast, slow, broken = report["deployments"]
    assert "exited with 3" in broken["error"] and broken["runs"] == []
    for deployment in (fast, slow):
        assert deployment["error"] is None and deployment["exit_code"] == 0  # SIGTERM, clean exit
        assert [(r["workload"], r["request_rate"]) for r in deployment["runs"]] == [
            ("sweep", 30.0), ("sweep", "inf"), ("bursty trace", None)]
        assert all(r["result"]["summary"]["completed"] > 0
                   and r["result"]["summary"]["failed"] == 0 for r in deployment["runs"])
        assert all(r["result"]["device"] == "loopback" for r in deployment["runs"])
        assert all(r["result"]["summary"]["goodput_slos_ms"] == {"ttft": 5000.0} for r in deployment["runs"])
    # the same requests went to both
    for run_fast, run_slow in zip(fast["runs"], slow["runs"]):
        lengths = lambda run: [(q["prompt_len"], q["output_len"], q["scheduled_at"]) for q in run["result"]["requests"]]  # noqa: E731
        assert lengths(run_fast) == lengths(run_slow)
    tpot = lambda d: d["runs"][1]["result"]["summary"]["tpot"]["median_ms"]  # noqa: E731
    assert tpot(slow) >= 30 * 0.95 and tpot(slow) > tpot(fast)  # 30 ms between the slow fake's tokens
    trace_run = fast["runs"][2]["result"]
    assert trace_run["step_trace"] and {s["mode"] for s in trace_run["step_trace"]} == {"tp", "sp"}
    assert len(trace_run["requests"]) == 7
    # without a step trace, the timeline has ServerInfo polled during the run
    slow_trace_run = slow["runs"][2]["result"]
    assert "step_trace" not in slow_trace_run and len(slow_trace_run["server_samples"]) >= 3
    last = slow_trace_run["server_samples"][-1]
    assert last["steps_by_mode"]["tp"] + last["steps_by_mode"]["sp"] == last["steps"] > 0
    assert max(s["running"] for s in slow_trace_run["server_samples"]) >= 3

    table = (out / "compare.md").read_text()
    assert "| fast" in table and "| slow" in table and "TTFT p99" in table
    plots = {p.split("/")[-1] for p in report["plots"]}
    assert plots == {"sweep_latency_vs_throughput.png", "bursty_trace_timeline.png"}
    assert all((out / name).stat().st_size > 10_000 for name in plots)
    assert (out / "logs" / "fast.log").is_file()
    # the plots again from the saved report (infinite rates read back as "inf")
    assert bench_main(["plot", str(out / "compare.json"), "--out-dir", str(tmp_path / "replot")]) == 0
    assert {p.name for p in (tmp_path / "replot").iterdir()} == plots


def test_client_timeline_reconstruction_by_hand():
    request = {"success": True, "sent_at": 1.0, "ttft": 0.5, "itl": [0.1, 0.2], "e2el": 0.8,
               "modes": ["sp", "sp", "tp", "tp"]}
    times, modes = client_mode_events([request])
    # two prefill steps spread up to the first token at 1.5, two decode steps at 1.6 and 1.8
    assert times == pytest.approx([1.25, 1.5, 1.6, 1.8])
    assert modes == ["sp", "sp", "tp", "tp"]
    waiting, in_flight = client_queue([request], np.array([1.2, 1.6, 1.9]))
    assert waiting.tolist() == [1, 0, 0] and in_flight.tolist() == [1, 1, 0]


def test_mode_share_from_server_info_samples_by_hand():
    samples = [{"time": 100.0, "steps_by_mode": {"tp": 0, "sp": 0}},
               {"time": 101.0, "steps_by_mode": {"tp": 3, "sp": 1}},  # 1 of 4 steps in SP
               {"time": 102.0, "steps_by_mode": {"tp": 3, "sp": 1}},  # idle: left out
               {"time": 103.0, "steps_by_mode": {"tp": 3, "sp": 3}}]  # all SP
    times, shares, counts = sampled_mode_share(samples, started_unix=100.0)
    assert times.tolist() == [0.5, 2.5] and shares.tolist() == [0.25, 1.0] and counts.tolist() == [4, 2]


def test_a_data_parallel_queue_is_drawn_from_the_summed_samples_not_one_replicas_steps():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shiftjax.serving.bench.compare_plots import _draw_queue

    samples = [{"time": 100.0, "waiting": 7, "running": 2}, {"time": 101.0, "waiting": 0, "running": 0}]
    result = {"started_unix": 100.0, "summary": {"duration_s": 1.0}, "requests": [], "server_samples": samples}
    labels = {}
    for name, trace in (("one engine", [{"time": 100.5, "waiting": 3, "running": 1}]),
                        ("dp", [{"time": 100.5, "waiting": 3, "running": 1, "replica": 1}])):
        figure, axis = plt.subplots()
        _draw_queue(axis, {**result, "step_trace": trace})
        labels[name] = {line.get_label() for line in axis.get_lines()}
        plt.close(figure)
    assert "waiting (server, per step)" in labels["one engine"]
    assert "waiting (server, polled)" in labels["dp"] and "waiting (server, per step)" not in labels["dp"]


def test_configuration_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        WorkloadSpec.from_dict({"name": "x", "input_length": 5})
    assert read_workloads(['[{"name": "a", "request_rates": [1, "inf"]}]'])[0].request_rates == [1.0, float("inf")]
    with pytest.raises(ValueError, match="unique"):
        read_workloads(['[{"name": "a"}, {"name": "a"}]'])
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"name": "a"}]))
    with pytest.raises(ValueError, match="command"):
        read_deployments(path)
    assert Deployment.from_dict({"name": "a", "command": "shiftjax serve --port {port}"}).command == [
        "shiftjax", "serve", "--port", "{port}"]
    # a misspelt --only would run nothing and exit 0
    path.write_text(json.dumps([{"name": "tp", "command": "x"}]))
    assert bench_main(["compare", "--deployments", str(path), "--workloads", '[{"name": "w"}]',
                       "--out-dir", str(tmp_path / "o"), "--only", "tpp"]) == 2


def test_a_failing_run_is_recorded_and_the_next_one_still_runs(tmp_path):
    deployments = tmp_path / "deployments.json"  # no HTTP port: the openai run cannot connect
    deployments.write_text(json.dumps([{"name": "grpc-only", "command": [
        "{python}", "-m", "shiftjax.serving.bench.fake_server", "--port", "{port}", "--token-delay", "0.002"]}]))
    workloads = json.dumps([{"name": "over http", "backend": "openai", "input_len": 4, "output_len": 2,
                             "num_prompts": 2},
                            {"name": "over grpc", "input_len": 4, "output_len": 2, "num_prompts": 2}])
    out = tmp_path / "out"
    code = bench_main(["compare", "--deployments", str(deployments), "--workloads", workloads, "--out-dir", str(out),
                       "--vocab-size", "50", "--no-progress"])
    assert code == 1
    (deployment,) = json.loads((out / "compare.json").read_text())["deployments"]
    failed, passed = deployment["runs"]
    assert "/v1/models" in failed["error"] and "result" not in failed
    assert passed["result"]["summary"]["completed"] == 2
    assert deployment["exit_code"] == 0
    assert "over grpc" in (out / "compare.md").read_text()


def test_merge_joins_reports_of_separate_invocations(tmp_path):
    """run_compare.sh runs one deployment per ``bench compare`` (each under its own time
    limit); ``bench merge`` makes them one report, table and plots."""
    deployments = tmp_path / "deployments.json"
    deployments.write_text(json.dumps({"device": "loopback", "deployments": [
        {"name": "fast", "command": FAKE + ["--token-delay", "0.004", "--sp-from", "3"]},
        {"name": "slow", "command": FAKE + ["--token-delay", "0.02", "--sp-from", "3"]}]}))
    single = {"name": "single", "input_len": 8, "output_len": 3, "num_prompts": 2, "max_concurrency": 1}
    burst = {"name": "burst", "input_len": 8, "output_len": 3, "num_prompts": 4}
    common = ["--deployments", str(deployments), "--vocab-size", "300", "--no-progress"]
    for name, workloads in [("fast", [single, burst]), ("slow", [single]), ("slow", [burst])]:
        out = tmp_path / f"{name}_{workloads[-1]['name']}"
        assert bench_main(["compare", *common, "--workloads", json.dumps(workloads), "--only", name,
                           "--out-dir", str(out)]) == 0
    reports = sorted(str(p) for p in tmp_path.glob("*_*/compare.json"))
    assert len(reports) == 3
    merged = tmp_path / "merged"
    assert bench_main(["merge", *reports, "--out-dir", str(merged)]) == 0
    report = json.loads((merged / "compare.json").read_text())
    assert report["device"] == "loopback"
    assert sorted(w["name"] for w in report["workloads"]) == ["burst", "single"]
    runs = {d["name"]: sorted(r["workload"] for r in d["runs"]) for d in report["deployments"]}
    assert runs == {"fast": ["burst", "single"], "slow": ["burst", "single"]}
    table = (merged / "compare.md").read_text()
    assert sum(line.startswith("| slow ") for line in table.splitlines()) == 2

    assert [len(d["starts"]) for d in report["deployments"]] == [1, 2]  # slow started twice
    # a run in two reports (a rerun, or all:X beside load:X) would count twice
    assert bench_main(["merge", *reports, str(tmp_path / "slow_single" / "compare.json"),
                       "--out-dir", str(tmp_path / "x")]) == 2
    # a deployment whose invocation was killed mid-way fails the merged report
    killed = json.loads((tmp_path / "fast_burst" / "compare.json").read_text())
    killed["deployments"][0]["error"] = "interrupted: still running when saved"
    (tmp_path / "killed.json").write_text(json.dumps(killed))
    assert bench_main(["merge", str(tmp_path / "killed.json"), "--out-dir", str(tmp_path / "y")]) == 1

    # reports that cannot be one: another device, or one workload name for two workloads
    other = json.loads((tmp_path / "fast_burst" / "compare.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(other | {"device": "elsewhere"}))
    assert bench_main(["merge", reports[0], str(tmp_path / "other.json"), "--out-dir", str(tmp_path / "x")]) == 2
    other["workloads"][0]["options"]["num_prompts"] = 99
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert bench_main(["merge", reports[0], str(tmp_path / "other.json"), "--out-dir", str(tmp_path / "x")]) == 2
