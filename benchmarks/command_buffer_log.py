"""What XLA's command buffers (CUDA graphs) cost the host, per phase of shift_x2.py's
engine part, from its log when run with ``TF_CPP_VMODULE=command_buffer_thunk=3`` (and
``command_executor=1`` for how many commands each re-recording took).

Before each launch XLA re-records the commands of a graph whose buffers moved since the
last launch; the log has one line per launch and one per update, with the update's
duration. The engine part prints a line at the end of each (variant, loop, sequences)
phase, so the XLA lines before it belong to that phase: its prefill steps as well as its
decode steps and the drain (per-launch figures average over all of them). Per phase and
device: graph launches, the share of them that re-recorded the graph first, the update
time in all and per launch, and how many distinct graph sizes were updated; with
``command_executor`` lines, how many commands the re-recordings took ({commands re-recorded:
times}, all devices).

    python3 benchmarks/command_buffer_log.py LOG [LOG...] --out DIR   # DIR/command_buffer_log.json
    python3 benchmarks/command_buffer_log.py --smoke --out DIR         # a made-up log, checked
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

PHASE = re.compile(r"engine loop, round (\d+), (\S+)\s+(sync|async)\s+(\d+) seqs: ([\d.]+) ms per decode step")
UPDATED = re.compile(r"\[(\d+)\] Updated command buffer in (\d+) (?:μs|us); num_commands=(\d+)")
RECORDED = re.compile(r"Updated (\d+) commands in \d+ (?:μs|us) \(skipped (\d+) command updates\)")
EXECUTED = re.compile(r"\[(\d+)\] Execute command buffer")


def phases(lines) -> list[dict]:
    """One row per engine phase, from the XLA lines since the previous phase line."""
    rows = []
    updates = collections.defaultdict(list)  # device -> [(microseconds, commands)]
    launches = collections.Counter()
    recorded = collections.Counter()  # commands re-recorded by one update -> times
    for line in lines:
        if match := RECORDED.search(line):
            commands, skipped = map(int, match.groups())
            if commands > 1:  # nested single-command executors log too
                recorded[commands - skipped] += 1
        elif match := UPDATED.search(line):
            device, micros, commands = map(int, match.groups())
            updates[device].append((micros, commands))
        elif match := EXECUTED.search(line):
            launches[int(match.group(1))] += 1
        elif match := PHASE.search(line):
            round_, variant, loop, seqs, step_ms = match.groups()
            devices = sorted(set(updates) | set(launches))
            rows.append({
                "round": int(round_), "variant": variant, "loop": loop, "seqs": int(seqs),
                "step_ms": float(step_ms),
                "per_device": {str(d): {
                    "launches": launches[d], "updates": len(updates[d]),
                    "updated_share": round(len(updates[d]) / max(launches[d], 1), 3),
                    "update_ms": round(sum(u for u, _ in updates[d]) / 1e3, 2),
                    "update_us_per_launch": round(sum(u for u, _ in updates[d]) / max(launches[d], 1), 1),
                    "graph_sizes_updated": len({c for _, c in updates[d]})} for d in devices},
                **({"commands_rerecorded": dict(sorted(recorded.items()))} if recorded else {})})
            updates, launches, recorded = collections.defaultdict(list), collections.Counter(), collections.Counter()
    return rows


def describe(row: dict) -> str:
    devices = "; ".join(f"GPU {d}: {v['launches']} launches, {100 * v['updated_share']:.0f}% re-recorded, "
                        f"{v['update_us_per_launch']:.0f} us each" for d, v in row["per_device"].items())
    return (f"round {row['round']} {row['variant']:16s} {row['loop']:5s} {row['seqs']:2d} seqs "
            f"{row['step_ms']:6.2f} ms/step | {devices}")


SMOKE_LOG = """I1130 command_buffer_thunk.cc:1] [0] Execute command buffer; num_executions=1
I1130 command_buffer_thunk.cc:2] [0] Updated command buffer in 300 μs; num_commands=465
I1130 command_buffer_thunk.cc:1] [0] Execute command buffer; num_executions=1
I1130 command_executor.cc:3] Updated 12 commands in 90 μs (skipped 9 command updates)
I1130 command_buffer_thunk.cc:2] [0] Updated command buffer in 100 us; num_commands=12
  engine loop, round 0, shipped sync   8 seqs: 5.25 ms per decode step; host ms per call: dispatch 0.70
I1130 command_buffer_thunk.cc:1] [1] Execute command buffer; num_executions=1
  engine loop, round 1, skip_temp async 64 seqs: 7.17 ms per decode step; host ms per call: dispatch 0.72
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*")
    parser.add_argument("--smoke", action="store_true", help="a made-up log of two phases, checked")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    sources = {"smoke": SMOKE_LOG.splitlines()} if args.smoke else {}
    for path in args.logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            sources[path] = f.readlines()
    if not sources:
        parser.error("give engine logs, or --smoke")
    out = {name: phases(lines) for name, lines in sources.items()}
    for name, rows in out.items():
        print(name)
        for row in rows:
            print("  " + describe(row))
    if args.smoke:
        first, second = out["smoke"]
        assert first["per_device"]["0"] == {"launches": 2, "updates": 2, "updated_share": 1.0, "update_ms": 0.4,
                                            "update_us_per_launch": 200.0, "graph_sizes_updated": 2}, first
        assert second["per_device"]["1"]["launches"] == 1 and second["per_device"]["1"]["updates"] == 0, second
        assert second["seqs"] == 64 and second["variant"] == "skip_temp", second
        assert first["commands_rerecorded"] == {3: 1} and "commands_rerecorded" not in second, first
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "command_buffer_log.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
