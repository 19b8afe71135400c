"""The bench's outputs: the table printed at the end of a run, and the JSON result file."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from shiftjax.serving.bench.metrics import LATENCY_METRICS

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
WIDTH = 50


def summary_lines(result: dict) -> list[str]:
    """The summary as ``vllm bench serve`` lays it out, so the two read side by side."""
    summary, config = result["summary"], result["config"]

    def row(name, value, digits=2):
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{text:>10}"

    title = f" Serving Benchmark Result{' (' + result['label'] + ')' if result.get('label') else ''} "
    lines = [title.center(WIDTH, "="),
             row("Backend:", config["backend"]),
             row("Traffic request rate:", _rate_text(config)),
             row("Burstiness factor:", float(config["burstiness"])),
             row("Maximum request concurrency:", str(config["max_concurrency"])),
             row("Successful requests:", summary["completed"]),
             row("Failed requests:", summary["failed"]),
             row("Benchmark duration (s):", summary["duration_s"]),
             row("Total input tokens:", summary["total_input_tokens"]),
             row("Total generated tokens:", summary["total_output_tokens"]),
             row("Request throughput (req/s):", summary["request_throughput"]),
             ]
    if summary["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", summary["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", summary["output_throughput"]),
              row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for name in LATENCY_METRICS:
        stats = summary[name]
        lines.append(METRIC_TITLES[name].center(WIDTH, "-"))
        label = name.upper()
        lines.append(row(f"Mean {label} (ms):", stats["mean_ms"]))
        lines.append(row(f"Median {label} (ms):", stats["median_ms"]))
        lines.append(row(f"Std {label} (ms):", stats["std_ms"]))
        for key, value in stats.items():
            if key.startswith("p") and key.endswith("_ms"):
                lines.append(row(f"P{key[1:-3]} {label} (ms):", value))
    if summary.get("client_cpu_fraction", 0.0) > 0.8:
        lines.append(f"note: the client used {summary['client_cpu_fraction']:.0%} of a CPU: it may limit this run")
    lines += prefix_cache_lines(summary, row)
    lines += speculative_lines(summary, row)
    if summary.get("mode_steps"):
        lines.append(" Steps per mode (request-steps) ".center(WIDTH, "-"))
        lines += [row(f"{mode}:", count) for mode, count in sorted(summary["mode_steps"].items())]
    lines.append("=" * WIDTH)
    return lines


def prefix_cache_lines(summary: dict, row) -> list[str]:
    """The measured prefix-cache hit rate beside the best an LRU cache of the bound's size
    could reach on the same requests, and the TTFT of each turn of a multi-turn chat.
    Shown when the server reported cached tokens or the workload can share prefixes."""
    lines = []
    cache = summary.get("prefix_cache") or {}
    if cache.get("cached_prompt_tokens") or cache.get("best_hit_rate"):
        capacity = cache.get("capacity_blocks", math.inf)
        size = "inf" if math.isinf(float(capacity)) else f"{int(capacity)}"
        lines += [" Prefix Cache ".center(WIDTH, "-"),
                  row("Cached prompt tokens:", cache["cached_prompt_tokens"]),
                  row("Measured hit rate (%):", 100.0 * cache["hit_rate"])]
        if "best_hit_rate" in cache:
            lines += [row(f"Best LRU hit rate (%), {size} x {cache['block_size']}-tok:", 100.0 * cache["best_hit_rate"]),
                      row("Measured - best (points):", 100.0 * (cache["hit_rate"] - cache["best_hit_rate"]))]
    if summary.get("ttft_by_turn"):
        lines.append(" TTFT per Turn ".center(WIDTH, "-"))
        lines += [row(f"Turn {turn} median TTFT (ms):", stats["median_ms"])
                  for turn, stats in enumerate(summary["ttft_by_turn"])]
    return lines


def speculative_lines(summary: dict, row) -> list[str]:
    """The run's speculative decoding as the server counted it (vLLM's acceptance rate and
    mean acceptance length), when the server speculates."""
    speculative = summary.get("speculative")
    if not speculative:
        return []
    return [" Speculative Decoding ".center(WIDTH, "-"),
            row("Acceptance rate (%):", 100.0 * speculative["acceptance_rate"]),
            row("Mean accepted length:", speculative["mean_accepted_length"]),
            row("Drafts:", speculative["num_drafts"]),
            row("Draft tokens:", speculative["num_draft_tokens"]),
            row("Accepted tokens:", speculative["num_accepted_tokens"])] + [
            row(f"Accepted at position {i} (% of drafts):", 100.0 * accepted / speculative["num_drafts"])
            for i, accepted in enumerate(speculative["accepted_per_position"]) if speculative["num_drafts"]]


def _rate_text(config: dict) -> str:
    if config["dataset"] in ("trace", "hash-trace"):
        return f"trace x{config['time_scale']:g}"
    rate = "inf" if math.isinf(float(config["request_rate"])) else f"{float(config['request_rate']):g}"
    return f"{rate} chats/s" if config["dataset"] == "multi-turn" else rate


def print_summary_table(result: dict, file=None) -> None:
    print("\n".join(summary_lines(result)), file=file or sys.stdout)


def json_safe(value):
    """``value`` with infinities and NaN as strings (``"inf"``), since JSON has no spelling
    for them and other tools choke on Python's ``Infinity``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a process killed mid-write leaves the old file whole
    partial.write_text(json.dumps(json_safe(result), indent=1, allow_nan=False) + "\n")
    partial.replace(path)
    print(f"result written to {path}", file=sys.stderr)
