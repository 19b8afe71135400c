"""Seconds ``--load-format dummy`` takes in this process, with JAX's trace, lowering,
compile and cache events (the warm-start question of README.md, "Two GPUs": most of a warm
dummy load is neither compiling nor generating). Run it twice against one
persistent cache directory, the second run warm; ``XLA_FLAGS`` sets the variant.

    JAX_COMPILATION_CACHE_DIR=/tmp/c python3 -P benchmarks/dummy_start.py --model benchmarks/configs/Llama-3.1-8B --out DIR
    python benchmarks/dummy_start.py --smoke
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

import jax


def timed_dummy_loads(config, mesh, log=print) -> dict:
    """``dummy_weights`` made twice in this process ("first", "again": the second reuses the
    first's programs, so what is left is generating): seconds, and the seconds and count of
    each JAX duration event (tracing, lowering, compiling, cache reads) of each."""
    from shiftjax.checkpoints.dummy import dummy_weights

    seconds, counts = collections.defaultdict(float), collections.Counter()

    def listen(name, secs, **_):
        seconds[name.rsplit("/", 1)[-1]] += secs
        counts[name.rsplit("/", 1)[-1]] += 1

    out = {}
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for attempt in ("first", "again"):
            seconds.clear()
            counts.clear()
            start = time.perf_counter()
            weights = dummy_weights(config, mesh=mesh, dtype="bfloat16")
            jax.block_until_ready(jax.tree.leaves(weights))
            out[attempt] = {"seconds": time.perf_counter() - start, "jax_events_s": dict(seconds),
                            "jax_event_counts": dict(counts)}
            log(f"  dummy weights, {attempt}: {out[attempt]['seconds']:.2f} s; " + ", ".join(
                f"{k} {v:.2f} s x{counts[k]}" for k, v in seconds.items()))
            del weights
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Hugging Face config.json or its directory")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama shape on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="a directory for dummy_start.json")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from shiftjax.checkpoints.dummy import read_model_config
    from shiftjax.config import ModelConfig
    from shiftjax.layouts.mesh import make_mesh

    if args.smoke:
        config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    else:
        config = read_model_config(args.model)
    mesh = make_mesh(args.sp, args.tp, jax.devices()[:args.sp * args.tp])
    out = {"config": dataclasses.asdict(config) if args.smoke else str(args.model),
           "backend_ready_s": time.perf_counter() - began, **timed_dummy_loads(config, mesh)}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dummy_start.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
