"""The layer loop of a Llama-3-8B-shaped TP decode step on one GPU, against the read floor.

The shipped step (``make_step``) with each ``layer_loop`` (``scan``: ``lax.scan`` over the
stacked layers, compile time flat in depth; ``unrolled``: a Python loop, static slices),
bf16 random weights and a random-filled cache, 8 and 64 sequences at 512 context. Each
executable is timed on a greedy batch (the sampler skips its vocabulary sort) and on a
sampled one (temperature 1, top-k 50, top-p 0.9), so the difference is the sampler's cost.
No monkeypatching: what runs is what the engine compiles.

Floors: weight bytes (all but the embedding table, which is gathered) over the read-only
stream rate (``roofline.read_ceiling``; decode reads its weights and writes almost
nothing), the same with the K/V the attention reads added, and, for comparison with older
figures, weight bytes over the copy rate (bytes read + written / s). Both ceilings are the best of several tries in the same run (or taken from
``--ceilings FILE``, a ``roofline.py --json`` output of the same call). Times are host
wall clock per step (median of 20, what serving sees); the device span from a profiler
trace is printed beside it where the trace has one. Also reports the weight and cache
moves in the optimised HLO of each executable (``hlo_moves.hlo_report``).

    python3 benchmarks/decode_variants.py [--loops scan,unrolled] [--json FILE]   # GPU
    python3 benchmarks/decode_variants.py --smoke                                 # any machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_gpu  # noqa: E402
from hlo_moves import hlo_report  # noqa: E402
from roofline import ceilings, describe, device_time, time_fn  # noqa: E402

from shiftjax.serving.engine.transfers import to_device  # noqa: E402
from shiftjax.step_options import LAYER_LOOPS, StepOptions  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402

jax.config.update("jax_default_matmul_precision", "default")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine: runs the code path only")
    parser.add_argument("--loops", default=",".join(LAYER_LOOPS), help="comma-separated layer loops to time")
    parser.add_argument("--seqs", default=None, help="comma-separated sequence counts (default 8,64)")
    parser.add_argument("--ceilings", help="JSON from roofline.py --json (else measured here)")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    shapes = model_gpu.decode_shapes(args.smoke)
    config, context, page_size = shapes["config"], shapes["context"], shapes["page_size"]
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else ([4] if args.smoke else [8, 64])
    loops = args.loops.split(",")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} jax {jax.__version__} {jax.devices()} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    if args.ceilings:
        with open(args.ceilings) as f:
            ceiling = json.load(f)
        print(f"ceilings from {args.ceilings}:", flush=True)
    else:
        ceiling = ceilings(8 << 20, 1, 128) if args.smoke else ceilings()
    print(describe(ceiling), flush=True)
    weights, caches = model_gpu.weights_and_caches(config, context=context, max_seqs=max(seqs), page_size=page_size)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights.tp)) - weights.tp.embed.nbytes
    read_floor = weight_bytes / ceiling["read"]["best"]
    copy_floor = weight_bytes / ceiling["copy"]["best"]
    print(f"weight bytes read per step {weight_bytes / 1e9:.2f} GB: read floor {read_floor * 1e3:.2f} ms, "
          f"copy-rate floor {copy_floor * 1e3:.2f} ms", flush=True)
    results = {"ceilings": ceiling, "weight_bytes": weight_bytes, "read_floor_ms": read_floor * 1e3,
               "copy_floor_ms": copy_floor * 1e3, "runs": []}
    for loop in loops:
        for num_seqs in seqs:
            batches = {kind: to_device(model_gpu.decode_batch(num_seqs, context, page_size, 64,
                                                              sampled=kind == "sampled"), weights)
                       for kind in ("greedy", "sampled")}
            start = time.perf_counter()
            exe = make_step(weights, "tp", StepOptions(attention=model_gpu.attention_impl(), layer_loop=loop)).lower(
                params_for(weights, "tp"), caches, batches["greedy"]).compile()
            compile_s = time.perf_counter() - start
            report = hlo_report(exe, caches, weights)
            state = {"caches": caches}

            def run(b):
                out, state["caches"] = exe(params_for(weights, "tp"), state["caches"], b)
                return out.packed

            # K/V the attention reads: every sequence's context + 1 tokens, every layer
            kv_bytes = (2 * config.num_layers * num_seqs * (context + 1) * config.num_kv_heads * config.head_dim
                        * caches.k.dtype.itemsize)
            kv_floor = (weight_bytes + kv_bytes) / ceiling["read"]["best"]
            for kind, batch in batches.items():
                seconds = time_fn(run, batch, warmup=3, iters=3 if args.smoke else 20)
                trace = device_time(run, (batch,), 3 if args.smoke else 10)
                span = trace["span"] if trace else None
                row = {"loop": loop, "seqs": num_seqs, "sampling": kind, "step_ms": seconds * 1e3,
                       "timer": "host wall clock", "device_span_ms": span * 1e3 if span else None,
                       "read_floor_over_step": read_floor / seconds, "copy_floor_over_step": copy_floor / seconds,
                       "kv_bytes": kv_bytes, "read_floor_with_kv_over_step": kv_floor / seconds,
                       "compile_s": compile_s, "hlo": report}
                results["runs"].append(row)
                print(f"{loop:8s} {kind:7s} B={num_seqs:3d}: {seconds * 1e3:7.2f} ms/step [host wall clock]"
                      + (f", device span {span * 1e3:.2f} ms" if span else ", no device trace")
                      + f"; read floor / step {read_floor / seconds:.0%} (with K/V {kv_floor / seconds:.0%}; "
                      f"copy-rate floor / step {copy_floor / seconds:.0%}); compile {compile_s:.1f} s", flush=True)
            caches = state["caches"]
            if args.json:  # after every executable: a timeout keeps what finished
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2, default=str)
            print(f"   HLO: weight dynamic-slices {report['weight_dynamic_slices']}, copies "
                  f"{report['weight_copies']}, static slices {report['weight_static_slices']}; cache moves "
                  f"{report['cache_moves'] or 'none'}; {report['weight_moves']}", flush=True)
    print("\n| layer loop | sampling | seqs | ms/step (host wall) | device span ms | read floor / step | "
          "copy-rate floor / step | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["runs"]:
        span = f"{r['device_span_ms']:.2f}" if r["device_span_ms"] else "-"
        print(f"| {r['loop']} | {r['sampling']} | {r['seqs']} | {r['step_ms']:.2f} | {span} | "
              f"{r['read_floor_over_step']:.0%} | {r['copy_floor_over_step']:.0%} | {r['compile_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
