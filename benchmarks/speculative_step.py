"""Issue 30 on one GPU: what verifying a draft costs. The engine's compiled step (its bucket
ladder as the served engine would pick it) timed on the devices for ``n`` sequences of a
``--context``-token context carrying ``q = 1 .. 1 + K`` tokens each, as the scheduler lays a
draft out (``rows``: ``q`` rows of one token over the same pages, the decode kernel's path),
and, for comparison, as one row of ``q`` tokens (``chunk``: the prefill kernel's path, a
chunked-prefill row); beside the read-only stream ceiling and the weights' floor measured in
the same run.

    python3 -P benchmarks/speculative_step.py --model benchmarks/configs/Llama-3.1-8B --out DIR  # the H200
    python benchmarks/speculative_step.py --smoke --out DIR                                      # the CPU

Writes ``speculative_step.json``: per ``(n, q, layout)`` the bucket and milliseconds a step,
and the ratio to ``q = 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # roofline.py, run with -P too

TOKEN_LADDER = (16, 32, 64, 128, 256)


def synthetic_batch(n: int, q: int, context: int, page_size: int, max_pages: int, layout: str):
    """``n`` sequences of ``context`` cached tokens plus ``q`` new ones (pages 1.. in order)."""
    from shiftjax.batch import empty_batch

    pages_each = -(-(context + q) // page_size)
    rows_each, per_row = (q, 1) if layout == "rows" else (1, q)
    batch = empty_batch(n * q, n * rows_each, max_pages)
    for s in range(n):
        pages = 1 + s * pages_each + np.arange(pages_each)
        for r in range(rows_each):
            row = s * rows_each + r
            first = context + r * per_row  # the row's first new position
            batch.page_table[row, :pages_each] = pages
            batch.seq_lens[row] = first + per_row
            tokens = slice(row * per_row, (row + 1) * per_row)
            positions = first + np.arange(per_row)
            batch.positions[tokens] = positions
            batch.slot_mapping[tokens] = pages[positions // page_size] * page_size + positions % page_size
            batch.token_ids[tokens] = 1000 + positions % 97
            batch.sample_index[row] = (row + 1) * per_row - 1
    batch.query_start[1:] = np.cumsum([per_row] * (n * rows_each))
    return batch, n * pages_each


def time_step(engine, batch, iters: int, repeats: int) -> tuple[tuple[int, int], float]:
    """The bucket the engine would run ``batch`` in and the best over ``repeats`` of the
    milliseconds per step over ``iters`` back-to-back steps (the devices' time: nothing
    waits for the host between them)."""
    import jax

    from shiftjax.serving.engine import transfers
    from shiftjax.serving.engine.buckets import pad_batch
    from shiftjax.steps import params_for

    runner, ladder = engine.runner, engine.executables.ladder
    bucket = ladder.pick(batch.num_tokens, batch.num_seqs)
    mode = engine.policy.choose(*bucket)
    upload = transfers.place_upload(pad_batch(batch, *bucket), engine.weights, None)
    previous = transfers.empty_result(engine.weights, ladder.result_rows, engine.executables.options.max_top_logprobs)
    executable, params = engine.executables.get(mode, *bucket), params_for(engine.weights, mode)
    for _ in range(2):
        out, runner.caches = executable(params, runner.caches, upload, previous)
    jax.block_until_ready(out.packed)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out, runner.caches = executable(params, runner.caches, upload, previous)
        jax.block_until_ready(out.packed)
        best = min(best, (time.perf_counter() - start) / iters)
    return bucket, 1e3 * best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/Llama-3.1-8B")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seqs", default="1,8,64")
    parser.add_argument("--max-q", type=int, default=4, help="1 + K: tokens per sequence up to this")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the CPU: a tiny model, 1 and 2 sequences")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import jax

    import shiftjax

    seqs = [int(s) for s in args.seqs.split(",")]
    ladder, page_size = TOKEN_LADDER, 16
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        args.context, seqs, args.max_q, args.iters, ladder = 32, [1, 2], 3, 2, (8, 16)
        args.model = str(Path(__file__).parent / "configs" / "Llama-3.1-8B")  # its shape, shrunk below
    max_rows = max(seqs) * args.max_q
    pages = max(seqs) * -(-(args.context + args.max_q) // page_size) + 2
    options = dict(token_buckets=ladder, seq_buckets=ladder, max_num_seqs=min(max_rows, ladder[-1]),
                   max_num_batched_tokens=ladder[-1], max_model_len=args.context + 64, num_pages=pages,
                   mode="tp", enable_prefix_caching=False)
    if args.smoke:
        config = json.loads(Path(args.model, "config.json").read_text()) | dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512)
        model_dir = args.out / "tiny-config"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config))
        args.model = str(model_dir)
    llm = shiftjax.LLM(args.model, load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                       tokenizer=str(Path(__file__).parent / "configs" / "smollm2-tokenizer"),
                       attention="reference" if args.smoke else "auto", **options)
    engine = llm.engine
    result = {"model": args.model, "context": args.context, "platform": jax.devices()[0].platform, "steps": []}
    if not args.smoke:
        import roofline

        ceiling = roofline.read_ceiling()
        weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.weights.tp))
        result["read_ceiling_bytes_per_s"] = ceiling["best"]
        result["weight_floor_ms"] = 1e3 * weight_bytes / ceiling["best"]
    for n in seqs:
        for layout in ("rows", "chunk"):
            for q in range(1, args.max_q + 1):
                if layout == "chunk" and q == 1:
                    continue  # the same batch as rows at q = 1
                if n * q > ladder[-1]:
                    continue
                batch, _ = synthetic_batch(n, q, args.context, page_size, engine.executables.options.max_pages, layout)
                bucket, ms = time_step(engine, batch, args.iters, 3)
                row = {"seqs": n, "tokens_per_seq": q, "layout": layout, "bucket": list(bucket), "ms": round(ms, 4)}
                result["steps"].append(row)
                print(json.dumps(row), flush=True)
    base = {r["seqs"]: r["ms"] for r in result["steps"] if r["tokens_per_seq"] == 1}
    for row in result["steps"]:
        row["ratio_to_one"] = round(row["ms"] / base[row["seqs"]], 4)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
