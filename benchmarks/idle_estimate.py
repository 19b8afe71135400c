"""Device idle time of the engine's decode loop without the profiler's slowdown (issue 8,
target 4), from a ``shift_x2.py`` engine part's JSON.

Profiled steps run slower than unprofiled ones (up to 2x in the runs of
``results/x2_levers/``), so the idle fraction inside the profile overstates idle time. A kernel's own duration is device time, which the
profiler does not stretch; so this compares each GPU's kernel time per step (from the
profiled steps) with the unprofiled wall time per step of the same (variant, loop, size):

    idle = 1 - kernel time / unprofiled wall

Two figures, because a collective's duration includes waiting for the other GPU: counting
the collectives as busy, and counting them as idle (an upper bound: the time the GPU runs
no other kernel). The first is no true lower bound: under the profiler the GPUs drift
further apart and the all-reduces wait longer, so it can come out negative.

    python3 benchmarks/idle_estimate.py benchmarks/results/x2_levers/engine_8bba9c6/engine/shift_x2.json
    python3 benchmarks/idle_estimate.py --smoke --out DIR   # that file; writes DIR/idle_estimate.json
"""

from __future__ import annotations

import argparse
import json
import os

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "results", "x2_levers", "engine_8bba9c6", "engine", "shift_x2.json")


def estimates(engine: dict) -> list[dict]:
    """One row per (variant:loop:size, device) that has a profile."""
    rows = []
    for key, row in engine.items():
        if not isinstance(row, dict) or not row.get("idle"):
            continue
        wall = row["wall_ms_median"]
        for device, profile in sorted(row["idle"].items()):
            kernels = sum(kind["ms"] for kind in profile["by_kind"].values())
            collectives = profile["by_kind"].get("collective", {}).get("ms", 0.0)
            rows.append({"step": key, "device": device, "wall_ms": wall, "kernel_ms": kernels,
                         "collective_ms": collectives, "idle_low": 1 - kernels / wall,
                         "idle_high": 1 - (kernels - collectives) / wall,
                         "idle_in_profile": profile["idle_fraction"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", help="shift_x2.json with an engine part")
    parser.add_argument("--smoke", action="store_true", help=f"read {os.path.relpath(MEASURED)}")
    parser.add_argument("--out", help="also write idle_estimate.json here")
    args = parser.parse_args()
    if (args.json is None) == (not args.smoke):
        parser.error("give a JSON file or --smoke")
    with open(args.json or MEASURED) as f:
        engine = json.load(f)["engine"]
    rows = estimates(engine)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "idle_estimate.json"), "w") as f:
            json.dump({"source": args.json or MEASURED, "rows": rows}, f, indent=1)
    print(f"{'step':28s} {'device':16s} {'wall':>6s} {'kernels':>8s} {'coll.':>6s}  idle (collectives busy / idle; in the profile)")
    for r in rows:
        print(f"{r['step']:28s} {r['device']:16s} {r['wall_ms']:6.2f} {r['kernel_ms']:8.2f} {r['collective_ms']:6.2f}  "
              f"{100 * r['idle_low']:5.0f}% / {100 * r['idle_high']:3.0f}%; {100 * r['idle_in_profile']:3.0f}%")


if __name__ == "__main__":
    main()
