"""Writes a synthetic trace in the hash-id JSONL format of the Mooncake traces (one request a
line: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``, one id per
``--block-size`` tokens), with a known prefix reuse: ``--system-prompts`` shared prefixes of
``--system-blocks`` blocks, each request one of them (chosen by a Zipf-like weight) plus
1 to ``--max-own-blocks`` blocks of its own, arriving as a Poisson process.

    python benchmarks/traces/make_hash_trace.py --out benchmarks/traces/synthetic_reuse.jsonl

The best hit rate a cache of any size can reach on it is ``shiftjax.serving.bench.
prefix_cache_bound.trace_best_hit_rate``; the bench report prints it beside the measured one.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

BLOCK = 512  # tokens per hash id, as in the Mooncake traces


def make_trace(requests: int, system_prompts: int, system_blocks: int, max_own_blocks: int, output_len: int,
               rate: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, system_prompts + 1)
    weights /= weights.sum()
    next_id = system_prompts * system_blocks  # ids below are the system prompts' blocks
    rows, now = [], 0.0
    for _ in range(requests):
        now += rng.exponential(1.0 / rate)
        system = int(rng.choice(system_prompts, p=weights))
        own = int(rng.integers(1, max_own_blocks + 1))
        hash_ids = list(range(system * system_blocks, (system + 1) * system_blocks))
        hash_ids += list(range(next_id, next_id + own))
        next_id += own
        rows.append({"timestamp": round(now * 1000), "input_length": len(hash_ids) * BLOCK,
                     "output_length": output_len, "hash_ids": hash_ids})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-blocks", type=int, default=4)
    parser.add_argument("--max-own-blocks", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = make_trace(args.requests, args.system_prompts, args.system_blocks, args.max_own_blocks,
                      args.output_len, args.rate, args.seed)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    shared = sum(min(len(r["hash_ids"]), args.system_blocks) for r in rows)
    print(f"{len(rows)} requests, {sum(len(r['hash_ids']) for r in rows)} blocks, {shared} of them system-prompt blocks")


if __name__ == "__main__":
    main()
