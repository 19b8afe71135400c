"""Issue 30's projection for the Llama-3.1-8B shape: the decode speedup that the acceptance
measured on the default model (``speculative_acceptance.py``, the CPU) and the 8B step times
measured on the H200 (``speculative_step.py``) give together. PROJECTED, not measured: it
assumes the 8B model accepts drafts as the 135M default model does, and it counts the
devices' time alone (a turn that drafts schedules after the commit, which puts the host's
share of a step on the critical path; the served default model shows what that costs).

    python benchmarks/speculative_projection.py --acceptance A.json --steps S.json --out DIR
    python benchmarks/speculative_projection.py --smoke --out DIR

Per method, draft length, workload and batch size n: a decode step of the request gives
``tokens_per_decode_step`` tokens; a fraction ``f = drafts / decode_steps`` of its steps
verify a draft of ``L`` tokens on average, costing ``t(n, 1 + L) / t(n, 1)`` (interpolated
in the measured rows layout) and the others cost one. Speedup = tokens per step / mean cost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SMOKE_ACCEPTANCE = {"runs": {"ngram_k3": {"code_edit": {"tokens_per_decode_step": 2.0, "decode_steps": 10,
                                                        "drafts": 5, "draft_tokens": 15}}}}
SMOKE_STEPS = {"steps": [{"seqs": n, "tokens_per_seq": q, "layout": "rows", "ms": 5.0 + n * q / 64}
                         for n in (1, 64) for q in range(1, 5)]}


def step_cost(steps: list[dict], seqs: int, tokens_per_seq: float) -> float:
    """``t(seqs, tokens_per_seq) / t(seqs, 1)``, interpolated between the measured rows."""
    rows = sorted((r["tokens_per_seq"], r["ms"]) for r in steps if r["seqs"] == seqs and r["layout"] == "rows")
    q, ms = zip(*rows)
    return float(np.interp(tokens_per_seq, q, ms) / ms[0])


def project(acceptance: dict, steps: dict) -> dict:
    batch_sizes = sorted({r["seqs"] for r in steps["steps"]})
    result = {}
    for config, workloads in acceptance["runs"].items():
        if config == "none":
            continue
        for workload, run in workloads.items():
            drafted = run["drafts"] / max(run["decode_steps"], 1)
            mean_draft = run["draft_tokens"] / run["drafts"] if run["drafts"] else 0.0
            per_batch = {}
            for n in batch_sizes:
                cost = drafted * step_cost(steps["steps"], n, 1 + mean_draft) + (1 - drafted)
                per_batch[str(n)] = round(run["tokens_per_decode_step"] / cost, 3)
            result[f"{config}/{workload}"] = {"tokens_per_decode_step": run["tokens_per_decode_step"],
                                              "drafted_fraction": round(drafted, 3),
                                              "mean_draft_tokens": round(mean_draft, 2),
                                              "projected_speedup_by_seqs": per_batch}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acceptance", type=Path)
    parser.add_argument("--steps", type=Path)
    parser.add_argument("--smoke", action="store_true", help="embedded inputs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.smoke:
        acceptance, steps = SMOKE_ACCEPTANCE, SMOKE_STEPS
    else:
        acceptance, steps = json.loads(args.acceptance.read_text()), json.loads(args.steps.read_text())
    result = {"projected": True, "note": __doc__.split("\n\n")[0], "rows": project(acceptance, steps)}
    print(json.dumps(result["rows"], indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative_projection.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
