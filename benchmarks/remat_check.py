"""Issue 28: does a full KV cache change how XLA compiles the served prefill step?

Served, the FP8 8B's 4,096-token prefill ran 191 Mosaic GEMM kernels and 73.5 ms of them
where the same step with a 4,000-page pool (and ``fp8_step.py``'s, with a tiny cache) ran
128 and 44 ms (``fp8_served_anatomy.py``, benchmarks/results/fp8_h200/served_anatomy/);
XLA's kernel names carried ``_remat``. XLA's GPU scheduler and rematerialization take their
memory limit as the device memory less the program's inputs and outputs, which a cache
filling the GPU makes small. This script compiles the Llama-3.1-8B FP8 prefill step (one
4,096-token prompt, the served engine's XLA options) with a cache of ``--pages`` (default:
as the engine sizes it, 90% of what the weights leave) in variants, and for each reports
the HLO's ``remat`` instructions, the Mosaic custom calls, XLA's temporary size and the
step's median time:

- ``small_cache``: a 2,000-page cache (the reference point);
- ``full_cache_xla_default``: the cache allocated, then the step compiled against it with
  the served options less ``compile.NO_REMATERIALIZATION`` (the engine before it);
- ``full_cache_compiled_first``: the same, compiled against the cache's abstract shape
  before it is allocated (the limit comes from the shapes, not from what is free);
- ``full_cache``: the served options (XLA's ``rematerialization`` pass disabled).

Found (benchmarks/results/fp8_h200/remat/, before ``NO_REMATERIALIZATION``, whose
``full_cache_no_remat`` is today's ``full_cache``): FP8, 271 rematerialized instructions,
190 Mosaic GEMMs instead of 128, 113.5 ms against 80.8; bf16 240, 107.5 ms against 105.4;
the temporaries 1.34 GiB in every variant.

    python3 -P benchmarks/remat_check.py --out DIR    # the H200 (via benchmarks/gpu_env.sh)
    python benchmarks/remat_check.py --smoke --out DIR  # the CPU: the default model's shape, 2 layers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from fp8_step import CONFIG, PAGE, batch_for, timed_steps  # noqa: E402

from shiftjax.cache import CacheGeometry  # noqa: E402
from shiftjax.checkpoints.dummy import dummy_weights  # noqa: E402
from shiftjax.config import ModelConfig  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.engine.compile import NO_REMATERIALIZATION, xla_compiler_options  # noqa: E402
from shiftjax.step_options import StepOptions  # noqa: E402
from shiftjax.steps import make_step  # noqa: E402

VARIANTS = ("small_cache", "full_cache_xla_default", "full_cache_compiled_first", "full_cache")


def hlo_counts(compiled) -> dict:
    text = compiled.as_text()
    analysis = compiled.memory_analysis()
    return {"remat_instructions": sum(" = " in line and "remat" in line.split(" = ")[0] for line in text.splitlines()),
            "mosaic_calls": text.count('custom_call_target="mosaic_gpu'),
            "temp_gib": None if analysis is None else analysis.temp_size_in_bytes / 2**30}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=None, help="the full cache's pages (default: as the engine)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU: the default model's shape, 2 layers, 64 tokens, the reference attention")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; the variants are {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    config_path, tokens, attention, small_pages = CONFIG, 4096, "pallas", 2000
    if args.smoke:
        from shiftjax.checkpoints.default_model import default_model_path

        config_path, tokens, attention, small_pages = default_model_path() / "config.json", 64, "reference", 8
        args.layers, args.pages, args.iterations = 2, args.pages or 40, 2
    config = dataclasses.replace(ModelConfig.from_json_file(config_path), num_layers=args.layers)
    mesh = make_mesh(1, 1)
    weights = dummy_weights(config, mesh=mesh, dtype="bfloat16", quantization=args.quantization)
    jax.block_until_ready(weights.tp)
    options = StepOptions(attention=attention, layer_loop="unrolled", sample_in_step=False)
    step = make_step(weights, "tp", options)
    geometry = CacheGeometry(config.num_layers, weights.layout.kv_slots, PAGE, config.head_dim, "bfloat16")
    stats = jax.devices()[0].memory_stats() or {}
    limit, in_use = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
    full_pages = args.pages or int(0.9 * (limit - in_use - 2 * 2**30)) // geometry.page_bytes_per_device(1)
    batch, _ = batch_for(tokens, 1, 0, tokens, tokens // PAGE)
    compiler_options = xla_compiler_options(options, jax.devices()[0].platform) or {}
    result = {"device": str(jax.devices()[0]), "bytes_limit_gib": limit / 2**30, "in_use_gib": in_use / 2**30,
              "full_pages": full_pages, "full_cache_gib": full_pages * geometry.page_bytes_per_device(1) / 2**30,
              "variants": {}}
    print(json.dumps(result), flush=True)
    for variant in args.variants.split(","):
        pages = small_pages if variant == "small_cache" else full_pages
        variant_options = dict(compiler_options)
        if variant in ("full_cache_xla_default", "full_cache_compiled_first"):
            for name in NO_REMATERIALIZATION:
                variant_options.pop(name, None)
        try:
            started = time.perf_counter()
            if variant == "full_cache_compiled_first":
                compiled = step.lower(weights.tp, geometry.abstract(mesh, pages), batch).compile(variant_options)
                caches = geometry.allocate(mesh, pages)
            else:
                caches = geometry.allocate(mesh, pages)
                compiled = step.lower(weights.tp, caches, batch).compile(variant_options)
            row = {"pages": pages, "compile_s": round(time.perf_counter() - started, 1), **hlo_counts(compiled)}
            _, _, caches = timed_steps(compiled, weights.tp, caches, batch, 1)  # the first run
            times, _, caches = timed_steps(compiled, weights.tp, caches, batch, args.iterations)
            row["ms_median"] = 1e3 * statistics.median(times)
            del caches, compiled
        except Exception as error:  # noqa: BLE001 - a variant that fails is a finding
            row = {"pages": pages, "error": f"{type(error).__name__}: {str(error)[:600]}"}
        result["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
        (args.out / f"remat_{args.quantization}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
