"""Issue 30 served: ``shiftjax serve`` on the default model with and without speculative
decoding, the chat workloads of ``speculative_workloads.py`` sent over gRPC at each
concurrency (greedy, so every deployment must give the same tokens), TTFT and TPOT per
request from the stream's arrival times, and the server's acceptance counters over the run.

    python3 -P benchmarks/speculative_served.py --model DIR --dtype bfloat16 --out DIR   # the H200
    python benchmarks/speculative_served.py --smoke --out DIR                            # the CPU

A deployment speculates with ``--speculative-method`` and its limit (``disable_by_batch_size``:
the default, or none: ``always`` deployments). Writes ``speculative_served.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from speculative_workloads import workloads  # noqa: E402

DEPLOYMENTS = {  # name -> extra serve arguments
    "none": [],
    "ngram": ["--speculative-method", "ngram"],
    "suffix": ["--speculative-method", "suffix"],
    "ngram_always": ["--speculative-method", "ngram", "--speculative-disable-by-batch-size", "none"],
    "suffix_always": ["--speculative-method", "suffix", "--speculative-disable-by-batch-size", "none"],
}


def one_request(address: str, messages: list[dict], max_tokens: int) -> dict:
    from shiftjax.serving.client.grpc_client import Client

    with Client(address, timeout=600) as client:
        started, arrivals, tokens = time.perf_counter(), [], []
        for response in client.generate(messages=messages, max_tokens=max_tokens):
            if response.token_ids:
                arrivals.append(time.perf_counter())
                tokens += list(response.token_ids)
    ttft = arrivals[0] - started if arrivals else None
    tpot = (arrivals[-1] - arrivals[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"tokens": len(tokens), "ttft_s": ttft, "tpot_s": tpot,
            "digest": hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]}


def speculative_counts(server) -> dict:
    info = server.server_info().get("speculative", {})
    return {k: info.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def run_load(server, conversations, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    chosen = [conversations[i % len(conversations)] for i in range(num_requests)]
    before = speculative_counts(server)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: one_request(server.grpc_address, m, max_tokens), chosen))
    seconds = time.perf_counter() - started
    after = speculative_counts(server)
    drafts = int(after["num_drafts"]) - int(before["num_drafts"])
    drafted = int(after["num_draft_tokens"]) - int(before["num_draft_tokens"])
    accepted = int(after["num_accepted_tokens"]) - int(before["num_accepted_tokens"])
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    return {"concurrency": concurrency, "requests": num_requests, "seconds": round(seconds, 3),
            "output_tokens": sum(r["tokens"] for r in results),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / seconds, 2),
            "tpot_ms_p50": round(1e3 * statistics.median(tpots), 3) if tpots else None,
            "tpot_ms_mean": round(1e3 * statistics.fmean(tpots), 3) if tpots else None,
            "ttft_ms_p50": round(1e3 * statistics.median(r["ttft_s"] for r in results), 3),
            "drafts": drafts, "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "digests": [r["digest"] for r in results]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--deployments", default="none,ngram,suffix,ngram_always")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--requests-per-load", default="7,128", help="requests at each concurrency")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--serve-args", default="--max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 1024")
    parser.add_argument("--smoke", action="store_true", help="the CPU: 2 deployments, 2 loads of 2 requests, 6 tokens")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from shiftjax.serving.bench.server_process import Deployment, ServerProcess

    chosen = workloads()
    sets = {"repeating": [c for name, convs in chosen.items() if name != "open_ended" for c in convs],
            "open_ended": chosen["open_ended"], "all": [c for convs in chosen.values() for c in convs]}
    names, loads = args.deployments.split(","), [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.requests_per_load.split(",")]
    serve_args = args.serve_args.split()
    if args.smoke:
        names, loads, counts, args.max_tokens = ["none", "ngram"], [1, 2], [2, 2], 6
        sets = {name: convs[:2] for name, convs in sets.items()}
        # 256 tokens a sequence hold the smoke's prompts (at most 215 tokens) and their 6 tokens; the
        # KV cache is sized by it (65 pages, not 257), and the CPU's scan over the layers carries the
        # whole cache: each decode step took ~1 s at 1024, ~0.3 s at 256
        serve_args = ["--cpu-devices", "1", "--max-model-len", "256", "--max-num-seqs", "4",
                      "--max-num-batched-tokens", "512", "--token-buckets", "16,512", "--seq-buckets", "4"]
    result = {"model": args.model, "max_tokens": args.max_tokens, "serve_args": serve_args, "deployments": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        command = ["{python}", "-P", "-m", "shiftjax.serving.cli", "serve", "--model", args.model, "--dtype", args.dtype,
                   "--port", "{port}", *serve_args, *DEPLOYMENTS[name]]
        if name != "none":
            command += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
        server = ServerProcess(Deployment(name, command, startup_timeout_s=900), args.out / f"{name}.log")
        server.start()
        try:
            runs = {}
            for concurrency, count in zip(loads, counts):
                # one request at a time: each kind of workload; many: all of them mixed
                for workload in ("repeating", "open_ended") if concurrency == 1 else ("all",):
                    run = run_load(server, sets[workload], concurrency, count, args.max_tokens)
                    runs[f"{workload}_c{concurrency}"] = run
                    print(name, workload, concurrency, json.dumps({k: v for k, v in run.items() if k != "digests"}),
                          file=sys.stderr, flush=True)
            result["deployments"][name] = {"startup_s": round(server.startup_seconds, 1), "runs": runs}
        finally:
            server.stop()
    plain = result["deployments"].get("none", {}).get("runs", {})
    for name, deployment in result["deployments"].items():
        for key, run in deployment["runs"].items():
            # greedy: the same tokens, except where batching put a step in another bucket and bf16
            # rounding went another way (as without speculation: README, "Generate offline")
            run["tokens_equal_none"] = key in plain and run["digests"] == plain[key]["digests"]
            if key in plain:
                run["requests_equal_none"] = sum(a == b for a, b in zip(run["digests"], plain[key]["digests"]))
            if key in plain and plain[key]["tpot_ms_p50"] and run["tpot_ms_p50"]:
                run["tpot_p50_over_none"] = round(run["tpot_ms_p50"] / plain[key]["tpot_ms_p50"], 3)
    (args.out / "speculative_served.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
