"""Can the transfer of SP's first exchange hide under its GEMM on these GPUs? (issue 8,
target 3: XLA overlaps no collective with a GEMM, README.md, "Two GPUs" and "Tried and not
kept"). SP's q|k|v projection plus all-to-all gives each device every token of its
head block; so does gathering every token's normed hidden state and multiplying by the
device's own head block, which is an all-gather feeding a GEMM: JAX's Mosaic GPU kernel
``all_gather_lhs_matmul`` fuses the two, sending tiles to the peer while it multiplies. Per
device, at the 8B shape with ``--sp 2`` (2 x 2048 tokens, hidden 4096, q|k|v block 3072):

- ``sp_a2a``: what SP mode does (local tokens x both blocks, one all-to-all);
- ``gather_then_matmul``: XLA's all-gather, then cuBLAS;
- ``matmul_only``: the GEMM of all tokens with no transfer (the floor of the fused kernel);
- ``mosaic_<config>``: the fused kernel, a few tile configs (GPU only).

    python3 -P benchmarks/collective_matmul.py --out DIR      # nvidia-h200-x2, gpu_env.sh sourced
    python benchmarks/collective_matmul.py --smoke            # 2 CPU devices, tiny, no Mosaic
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import device_time, time_fn  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    local, hidden, block = (64, 128, 96) if args.smoke else (2048, 4096, 3072)
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    keys = jax.random.split(jax.random.key(0), 2)
    h = jax.device_put(jax.random.normal(keys[0], (2 * local, hidden), jnp.bfloat16), NamedSharding(mesh, P("x")))
    # device d's head block is columns [d * block, (d + 1) * block)
    w = jax.device_put(jax.random.normal(keys[1], (hidden, 2 * block), jnp.bfloat16) * hidden ** -0.5,
                       NamedSharding(mesh, P(None, "x")))
    w_both = jax.device_put(w, NamedSharding(mesh, P()))  # SP mode holds every block of the TP shard
    h_whole = jax.device_put(h, NamedSharding(mesh, P()))
    options = None if args.smoke else {"xla_gpu_enable_triton_gemm": False}  # --gemm cublas

    def sharded(fn, in_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(None, "x"), check_vma=False))

    def sp_a2a(h_local, w_all):  # [local, 2, block] -> all-to-all -> [2 * local, block]
        blocks = (h_local @ w_all).reshape(h_local.shape[0], 2, -1)
        return lax.all_to_all(blocks, "x", split_axis=1, concat_axis=0, tiled=True)[:, 0]

    variants = {
        "sp_a2a": (sharded(sp_a2a, (P("x"), P())), (h, w_both)),
        "gather_then_matmul": (sharded(lambda x, y: lax.all_gather(x, "x", axis=0, tiled=True) @ y,
                                       (P("x"), P(None, "x"))), (h, w)),
        "matmul_only": (sharded(lambda x, y: x @ y, (P(), P(None, "x"))), (h_whole, w)),
    }
    if not args.smoke:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

        for tile_m, tile_n, width, wg in ((128, 128, 4, cm.MatmulDimension.N), (128, 128, 8, cm.MatmulDimension.M),
                                          (256, 128, 4, cm.MatmulDimension.N), (128, 64, 8, cm.MatmulDimension.N)):
            config = cm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                                     grid_minor_dim=cm.MatmulDimension.N, grid_tile_width=width, wg_dimension=wg)
            name = f"mosaic_{tile_m}x{tile_n}_w{width}_{wg}"
            fused = functools.partial(cm.all_gather_lhs_matmul, axis_name="x", config=config, dtype=jnp.bfloat16)
            variants[name] = (sharded(fused, (P("x"), P(None, "x"))), (h, w))
    out = {"local_tokens": local, "hidden": hidden, "block": block}
    want = None
    for name, (fn, fn_args) in variants.items():
        try:
            compiled = fn.lower(*fn_args).compile(options)
            result = np.asarray(compiled(*fn_args), np.float32)
        except Exception as error:
            if not name.startswith("mosaic_"):
                raise  # the XLA variants are the reference: nothing to compare without them
            out[name] = {"error": f"{type(error).__name__}: {error}"[:400]}  # e.g. a tile over shared memory
            print(name, out[name]["error"], flush=True)
            continue
        want = result if want is None else want  # sp_a2a's, the first
        span = device_time(compiled, fn_args, iters=10, quiet=True)
        row = {"wall_us": time_fn(compiled, *fn_args, warmup=3, iters=20) * 1e6,
               "span_us": None if span is None else span["span"] * 1e6,
               "max_abs_diff_vs_sp_a2a": float(np.abs(result - want).max()),
               "bitwise_equal_sp_a2a": bool((result == want).all())}
        out[name] = row
        print(name, json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "collective_matmul.json"), "w") as f:
        json.dump(out, f, indent=1)
    # Every variant that ran computes the same products (bf16 outputs of unit scale): a
    # larger difference is a bug, in this script or in a kernel.
    ran = [name for name in variants if "error" not in out[name]]
    return 0 if all(out[name]["max_abs_diff_vs_sp_a2a"] < 0.05 for name in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
