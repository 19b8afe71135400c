"""Can a one-shot all-reduce of our own replace NCCL's in TP mode's steps? (issue 8, targets
2 and 4). A TP decode step on two GPUs makes ~65 all-reduces of 2-512 KiB; NCCL's sit on a
~27 us latency floor (README.md, "Two GPUs") and split XLA's CUDA graph of the step
into ~66 launches per GPU. A Mosaic GPU kernel that writes its partial sums straight into
the peer's buffer over NVLink (``plgpu.remote_ref``), signals, waits for the peer's, and
adds, is one kernel: it may be quicker, and XLA may keep it inside one graph.

Variants, each on mesh (sp, tp) = (1, 2) and (2, 1), summing over both axes as TP mode does:

- ``psum``: ``lax.psum`` over sp then tp (NCCL), what ships;
- ``ffi_one_shot``: shiftjax's one-shot kernel (``kernels/one_shot_collectives.cu``), an XLA
  FFI call with its buffers set up once, which XLA may keep inside its CUDA graphs;
- ``one_shot_blocks``: the kernel, one block per 2048-element chunk, a semaphore pair each;
- ``one_shot_single``: the kernel, one block looping over the chunks, one semaphore pair.

For each: equality with ``psum`` at 1 / 8 / 64 / 512 rows of 4096 (bf16), 50 repeated calls
agreeing; then 64 chained ``x = AR(x @ w)`` in one jit (a decode step's collective count),
host wall and device span per call, against the same chain without the all-reduce.

    python3 -P benchmarks/one_shot_all_reduce.py --out DIR   # nvidia-h200-x2, gpu_env.sh sourced
    python benchmarks/one_shot_all_reduce.py --smoke         # 2 CPU devices: psum only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import device_time, time_fn  # noqa: E402

from shiftjax.kernels.collectives import all_reduce, psum_reference, setup_one_shot  # noqa: E402

CHUNK = 2048  # elements one block moves: 4 KiB of bf16, 16 per thread of a warpgroup


def psum(x):
    return psum_reference(x, ("sp", "tp"))


def _peer(axes=("sp", "tp")):
    """The other device of a two-device group, as mesh coordinates ({axis: index}): the
    one axis of size 2 flips, the others stay the caller's."""
    wide = [a for a in axes if lax.axis_size(a) == 2]
    if len(wide) != 1 or any(lax.axis_size(a) != 1 for a in axes if a not in wide):
        raise NotImplementedError("one-shot all-reduce: exactly two devices")
    return {wide[0]: 1 - lax.axis_index(wide[0])}


def one_shot(x, *, per_block: bool):
    """x summed over the two devices: each writes its x into the peer's ``recv``, then adds
    its own and the received in float32 (a + b == b + a, so both devices get the same)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape, dtype = x.shape, x.dtype
    size = int(np.prod(shape))
    if size % CHUNK:
        raise ValueError(f"{size} elements are not whole chunks of {CHUNK}")
    chunks = size // CHUNK
    blocks = chunks if per_block else 1

    def body(x_ref, out_ref, recv_ref, ready, done):
        peer = _peer()
        x_flat = x_ref.reshape(chunks, CHUNK)
        out_flat = out_ref.reshape(chunks, CHUNK)
        recv_flat = recv_ref.reshape(chunks, CHUNK)
        remote = plgpu.remote_ref(recv_ref, peer).reshape(chunks, CHUNK)
        if per_block:
            b = lax.axis_index("blocks")
            ready_b, done_b = ready.at[b], done.at[b]
            # the peer's kernel has started: its recv buffer is no longer another op's
            pl.semaphore_signal(ready_b, device_id=peer)
            pl.semaphore_wait(ready_b)
            remote[b] = x_flat[b]
            pl.semaphore_signal(done_b, device_id=peer)
            pl.semaphore_wait(done_b)
            out_flat[b] = (x_flat[b].astype(jnp.float32) + recv_flat[b].astype(jnp.float32)).astype(dtype)
        else:
            pl.semaphore_signal(ready, device_id=peer)
            pl.semaphore_wait(ready)

            @pl.loop(0, chunks)
            def _send(c):
                remote[c] = x_flat[c]
            pl.semaphore_signal(done, device_id=peer)
            pl.semaphore_wait(done)

            @pl.loop(0, chunks)
            def _add(c):
                out_flat[c] = (x_flat[c].astype(jnp.float32) + recv_flat[c].astype(jnp.float32)).astype(dtype)

    sem = plgpu.SemaphoreType.REGULAR((blocks,)) if per_block else plgpu.SemaphoreType.REGULAR
    out, _ = plgpu.kernel(
        body, out_type=[jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, dtype)],
        grid=(blocks,), grid_names=("blocks",), scratch_types=[sem, sem])(x)
    return out


def ffi_one_shot(x):
    """shiftjax's own kernel (kernels/one_shot_collectives.cu, an XLA FFI call)."""
    return all_reduce(x, ("sp", "tp"), "one_shot")


VARIANTS = {"psum": psum, "ffi_one_shot": ffi_one_shot,
            "one_shot_blocks": functools.partial(one_shot, per_block=True),
            "one_shot_single": functools.partial(one_shot, per_block=False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--chain", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)} (psum first)")
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    parser_variants = [v for v in args.variants.split(",") if v]
    variants = {"psum": psum} if args.smoke else {name: VARIANTS[name] for name in parser_variants}
    if "ffi_one_shot" in variants:
        setup_one_shot(jax.devices()[:2])
    hidden = 512 if args.smoke else 4096
    options = None if args.smoke else {"xla_gpu_enable_triton_gemm": False}  # --gemm cublas, as serve
    devices = np.asarray(jax.devices()[:2])
    out = {"chunk": CHUNK, "hidden": hidden}
    for mesh_shape in ((1, 2), (2, 1)):
        mesh = jax.sharding.Mesh(devices.reshape(mesh_shape), ("sp", "tp"))
        tag = f"mesh{mesh_shape[0]}x{mesh_shape[1]}"

        def sharded(fn, mesh=mesh):  # every device its own [rows, hidden] partial
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(("sp", "tp")), out_specs=P(("sp", "tp")),
                                         check_vma=False))
        for rows in (1, 8, 64, 512):
            parts = jax.device_put(jax.random.normal(jax.random.key(rows), (2 * rows, hidden), jnp.bfloat16),
                                   NamedSharding(mesh, P(("sp", "tp"))))
            want = None
            for name, fn in variants.items():
                key = f"{tag}:rows{rows}:{name}"
                try:
                    compiled = sharded(fn).lower(parts).compile(options)
                    got = np.asarray(compiled(parts), np.float32)
                    repeats = [np.asarray(compiled(parts), np.float32) for _ in range(50)]
                except Exception as error:  # noqa: BLE001 - the answer is the error
                    out[key] = {"error": f"{type(error).__name__}: {error}"[:1500]}
                    print(key, out[key]["error"][:600], flush=True)
                    traceback.print_exc(limit=3)
                    continue
                want = got if want is None else want
                halves = got.reshape(2, rows, hidden)
                row = {"bitwise_equal_psum": bool((got == want).all()),
                       "max_abs_diff_psum": float(np.abs(got - want).max()),
                       "devices_agree": bool((halves[0] == halves[1]).all()),
                       "repeats_agree": all((r == got).all() for r in repeats)}
                out[key] = row
                print(key, json.dumps(row), flush=True)
        # 64 chained products and all-reduces: a decode step's collectives, nothing else
        for rows in (8, 64):
            x = jax.device_put(jax.random.normal(jax.random.key(0), (2 * rows, hidden), jnp.bfloat16),
                               NamedSharding(mesh, P(("sp", "tp"))))
            w = jax.device_put(jax.random.normal(jax.random.key(1), (hidden, hidden), jnp.bfloat16)
                               * (0.5 / hidden ** 0.5), NamedSharding(mesh, P()))
            for name, reduce in {"no_all_reduce": lambda v: v + v, **variants}.items():
                key = f"{tag}:chain{args.chain}:rows{rows}:{name}"

                def chain(x, w, reduce=reduce):
                    for _ in range(args.chain):
                        x = reduce(x @ w)
                    return x
                fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P(("sp", "tp")), P()),
                                           out_specs=P(("sp", "tp")), check_vma=False))
                try:
                    compiled = fn.lower(x, w).compile(options)
                    wall = time_fn(compiled, x, w, warmup=3, iters=30)
                    span = device_time(compiled, (x, w), iters=10, quiet=True)
                except Exception as error:  # noqa: BLE001
                    out[key] = {"error": f"{type(error).__name__}: {error}"[:1500]}
                    print(key, out[key]["error"][:600], flush=True)
                    continue
                row = {"wall_us": wall * 1e6, "span_us": None if span is None else span["span"] * 1e6,
                       "kernels_per_call": None if span is None else span["kernels"]}
                out[key] = row
                print(key, json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "one_shot_all_reduce.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
