"""SP mode's head/token exchange, other ways than one all-to-all per direction, against the
shipped layer and DP on equal work (target 3 of issue 8), in one process:

- ``shipped``: ``model.sp_layer`` (one tiled ``all_to_all`` before attention, one after);
- ``permute<c>``: the exchange as ``sp - 1`` ``ppermute``s per direction (device ``s`` keeps
  its own block and sends block ``s + k`` by shift ``k``), the tokens cut into ``c`` chunks so
  that a chunk's transfer may run under the next chunk's GEMMs; ``_lhs``: compiled with
  XLA's latency-hiding scheduler;
- ``two_copies``: the shipped layer over ``--weight-storage two_copies`` (one GEMM per
  weight in SP mode);
- ``dp``: one GPU, the whole model, one prompt (DP's share of the equal work).

Each ``permute`` variant's logits' bytes must equal the shipped step's (the same sums in the
same order); ``two_copies`` sums in another order, and ``dp`` is another program.

    python3 -P benchmarks/sp_exchange.py --out DIR      # nvidia-h200-x2, gpu_env.sh sourced
    python benchmarks/sp_exchange.py --smoke           # 2 CPU devices, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_gpu import device_random_params  # noqa: E402
from shift_x2 import PAGE, big_config, prefill_batch, time_steps  # noqa: E402

import shiftjax.steps as steps_module  # noqa: E402
from shiftjax.layouts.mesh import SP, TP, make_mesh  # noqa: E402
from shiftjax.kernels.fp8_rows import swiglu_reference  # noqa: E402
from shiftjax.model import _column_blocks, _row_blocks, attention_core, rms_norm  # noqa: E402
from shiftjax.serving.engine.compile import xla_compiler_options  # noqa: E402
from shiftjax.step_options import StepOptions  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402

# (xla_gpu_enable_analytical_latency_estimator is not here: with it XLA aborts the process,
# a CHECK in TritonFusion::GetLaunchConfig, JAX 0.11.2 on 2x H200)
SCHEDULER_OPTIONS = {
    "sol": {"xla_gpu_enable_analytical_sol_latency_estimator": True},
    "slop": {"xla_gpu_memory_limit_slop_factor": 400},
    "overlap2": {"xla_gpu_experimental_parallel_collective_overlap_limit": 2},
}


def _exchange(blocks, sp: int):
    """``blocks[:, b]`` (``[n, sp, ...]``, block ``b`` of this device's rows) sent to device
    ``b``: returns ``[sp, n, ...]``, row group ``r`` = device ``r``'s rows of this device's block.
    By shifts: at shift ``k`` device ``s`` sends block ``s + k`` and receives from ``s - k``."""
    s = lax.axis_index(SP)
    by_shift = [lax.dynamic_index_in_dim(blocks, s, axis=1, keepdims=False)]
    for k in range(1, sp):
        outgoing = lax.dynamic_index_in_dim(blocks, (s + k) % sp, axis=1, keepdims=False)
        by_shift.append(lax.ppermute(outgoing, SP, perm=[(r, (r + k) % sp) for r in range(sp)]))
    # the rows that came from device r arrived at shift (s - r) mod sp
    return jnp.take(jnp.stack(by_shift), (s - jnp.arange(sp)) % sp, axis=0)


def permute_layer(chunks: int):
    def layer(x, w, k_cache, v_cache, layer_index, ctx):
        dims = ctx.dims
        sp, local = dims.sp, x.shape[0]
        if local % chunks:
            raise ValueError(f"{local} tokens a device do not cut into {chunks} chunks")
        size = local // chunks
        h = rms_norm(x, w.attn_norm, ctx.eps)
        gathered = [_exchange(_column_blocks(h[c * size:(c + 1) * size], w.wqkv, sp, ctx), sp) for c in range(chunks)]
        qkv = jnp.swapaxes(jnp.stack(gathered), 0, 1).reshape(sp * local, -1)  # [r, c, n] order
        attn, k_cache, v_cache = attention_core(qkv, w.bqkv, k_cache, v_cache, layer_index, ctx)
        by_device = attn.reshape(sp, chunks, size, -1)
        projected = []
        for c in range(chunks):
            # [n, sp, q]: this device's rows of chunk c, head block b from device b
            heads = _exchange(jnp.swapaxes(by_device[:, c], 0, 1), sp)
            projected.append(_row_blocks(jnp.swapaxes(heads, 0, 1), w.wo, ctx))
        x = x + lax.psum(jnp.concatenate(projected), TP)
        h = rms_norm(x, w.mlp_norm, ctx.eps)
        act = swiglu_reference(_column_blocks(h, w.w_gate_up, sp, ctx))
        return x + lax.psum(_row_blocks(act, w.w_down, ctx), TP), k_cache, v_cache

    return layer


@contextlib.contextmanager
def sp_layer_replaced(layer):
    """``make_step`` builds SP steps from ``layer`` (None: the shipped ``model.sp_layer``)."""
    shipped = steps_module.sp_layer
    steps_module.sp_layer = layer or shipped
    try:
        yield
    finally:
        steps_module.sp_layer = shipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-two-copies", dest="two_copies", action="store_false",
                        help="skip the shipped layer over two-copy weight storage")
    parser.add_argument("--variants", default="",
                        help="comma separated (shipped always runs); default: all but the permute2_lhs_<scheduler option> ones")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    config = big_config(args.smoke)
    prompt = 64 if args.smoke else 2048
    attention = "reference" if args.smoke else "pallas"
    profile = not args.smoke
    options = xla_compiler_options(StepOptions(gemm="cublas"), jax.devices()[0].platform)
    lhs = {**(options or {}), "xla_gpu_enable_latency_hiding_scheduler": True}
    max_pages = prompt // PAGE + 1
    # shift_x2.time_steps: compiled, timed, profiled, and the logits' digest of each step
    timed = functools.partial(time_steps, attention=attention, profile=profile, num_pages=2 * max_pages + 2,
                              sample_in_step=False)
    sp_shapes = {("sp", "pre2x2048"): prefill_batch(2, prompt, max_pages)}
    variants = {"shipped": (None, options), "permute1": (permute_layer(1), options),
                "permute2": (permute_layer(2), options), "permute2_lhs": (permute_layer(2), lhs),
                "permute4_lhs": (permute_layer(4), lhs)}
    # the latency-hiding scheduler with other cost models or limits (XLA debug options)
    for name, extra in SCHEDULER_OPTIONS.items():
        variants[f"permute2_lhs_{name}"] = (permute_layer(2), {**lhs, **extra})
    wanted = args.variants.split(",") if args.variants else [n for n in variants if "lhs_" not in n]
    if args.smoke:
        wanted = ["shipped", "permute1", "permute2"]
    unknown = set(wanted) - set(variants)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {', '.join(variants)}")
    variants = {name: variants[name] for name in dict.fromkeys(["shipped", *wanted])}
    out = {"layers": config.num_layers, "prompt": prompt}
    mesh = make_mesh(2, 1, jax.devices()[:2])
    params = device_random_params(config, jnp.bfloat16)
    for storage in ("aliased", "two_copies") if args.two_copies else ("aliased",):
        weights = shard_params(params, config, mesh, storage)
        for name, (layer, compile_options) in (variants.items() if storage == "aliased" else
                                               [("two_copies", (None, options))]):
            print(name, flush=True)
            try:
                with sp_layer_replaced(layer):
                    out[name] = timed(weights, mesh, sp_shapes, compiler_options=compile_options)["sp:pre2x2048"]
            except Exception as error:  # an XLA option this build may not know; the exit status says
                print(name, f"{type(error).__name__}: {error}"[:300], flush=True)
                out[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        del weights
    one = make_mesh(1, 1, jax.devices()[:1])
    weights = shard_params(params, config, one)
    del params
    print("dp", flush=True)
    out["dp"] = timed(weights, one, {("tp", "pre1x2048"): prefill_batch(1, prompt, max_pages)},
                      compiler_options=options)["tp:pre1x2048"]
    dp = out["dp"]["wall_ms"]
    for name in [n for n in out if isinstance(out[n], dict) and n != "dp"]:  # (errors are strings)
        out[name]["sp_vs_dp"] = dp / out[name]["wall_ms"]
        out[name]["logits_equal_shipped"] = out[name]["logits_sha1"] == out["shipped"]["logits_sha1"]
        print(f"{name}: SP vs DP {out[name]['sp_vs_dp']:.3f}x, logits equal to shipped: "
              f"{out[name]['logits_equal_shipped']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sp_exchange.json"), "w") as f:
        json.dump(out, f, indent=1)
    # The exchanges reorder transfers, not sums: other logits are a bug in them. A variant
    # that failed fails the run too, unless it is one of the XLA-option variants (an option
    # that this XLA does not know is a finding, not a bug).
    failed = [name[:-len("_error")] for name in out if name.endswith("_error")]
    unexplained = [name for name in failed if not name.startswith("permute2_lhs_")]
    wrong = [name for name in out if name.startswith("permute") and isinstance(out[name], dict)
             and not out[name]["logits_equal_shipped"]]
    if unexplained or wrong:
        print(f"FAILED: variants that raised {unexplained}, permute logits unlike shipped {wrong}", flush=True)
    return 1 if unexplained or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
