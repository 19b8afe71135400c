"""Seconds to trace and lower the engine's unrolled step for CUDA, on any machine (issue 8,
target 5: lowering was ~7 s of every executable's cold start on the H200 host).

JAX lowers for a platform it does not run on, so this needs no GPU. The time depends on
the program's structure (layers, kernels, ops), not on its sizes, so the model is
Llama-3.1-8B's depth and head counts at a small width. Per mode, the best of ``--repeats``
fresh traces (a new step function each time, so nothing is cached between them), and how
many Pallas kernels the lowered module holds.

    .venv/bin/python benchmarks/lowering_time.py --out benchmarks/results/lowering_time/HEAD
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_gpu import LLAMA8B, device_random_params  # noqa: E402

from shiftjax.cache import CacheConfig, allocate_cache  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.engine.batch_upload import abstract_upload  # noqa: E402
from shiftjax.serving.engine.executables import engine_step  # noqa: E402
from shiftjax.serving.engine.transfers import batch_sharding, result_columns  # noqa: E402
from shiftjax.step_options import StepOptions  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402


def lowering_seconds(layers: int, repeats: int) -> dict:
    config = dataclasses.replace(LLAMA8B, num_layers=layers, hidden_size=256, intermediate_size=512,
                                 num_heads=8, num_kv_heads=4, head_dim=32, vocab_size=1024)
    mesh = make_mesh(2, 1)
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh)
    caches = allocate_cache(mesh, layers, weights.layout.kv_slots, config.head_dim, CacheConfig(64, 16, "bfloat16"))
    sharding = batch_sharding(weights)
    previous = jax.ShapeDtypeStruct((8, result_columns(0)), np.int32, sharding=sharding)
    out = {"layers": layers, "repeats": repeats}
    for mode in ("tp", "sp"):
        best = None
        for _ in range(repeats):
            options = StepOptions(attention="pallas", layer_loop="unrolled", sample_in_step=False)
            step = engine_step(make_step(weights, mode, options), 8)
            began = time.perf_counter()
            traced = step.trace(params_for(weights, mode), caches, abstract_upload(64, 8, 16, sharding), previous)
            traced_at = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            lowered_at = time.perf_counter()
            run = {"trace_s": traced_at - began, "lower_s": lowered_at - traced_at,
                   "pallas_kernels_in_module": text.count("custom_call @__gpu$xla.gpu.triton")}
            if best is None or run["trace_s"] + run["lower_s"] < best["trace_s"] + best["lower_s"]:
                best = run
        out[mode] = best
        print(f"{mode}: trace {best['trace_s']:.2f} s, lower {best['lower_s']:.2f} s, "
              f"Pallas kernels in the module {best['pallas_kernels_in_module']}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="4 layers, one repeat")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    result = lowering_seconds(4 if args.smoke else args.layers, 1 if args.smoke else args.repeats)
    result.update(jax=jax.__version__, machine=f"{os.cpu_count()} CPUs")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lowering_time.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
