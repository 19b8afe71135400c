"""How fast can SP mode's exchanges go between two GPUs? (issue 8, target 3)

SP mode exchanges, per layer and device, half of its q|k|v block (2048 tokens x 3072 bf16
for Llama-3.1-8B at 2 x 2048 tokens, 12.6 MB) and half of its attention output (2048 x
2048, 8.4 MB); fewer tokens, less. Measured here, per exchange, in chains of ``CHAIN``
inside one jit, at those sizes and smaller ones:

- ``nccl``: ``lax.all_to_all`` (what XLA ships);
- ``kernel``: shiftjax's one-shot all-to-all (``kernels/one_shot_collectives.cu``: the SMs
  store into the peer), and builds of it (``VARIANTS``) with other block sizes, grid caps and
  loads in flight per thread, each registered under its own target;

and, in a separate process (``--ceiling``, PyTorch), the copy engines' peer copy of 256 MiB,
one direction and both at once: the link's ceiling to hold the rates against. Every
kernel variant's output must equal NCCL's bit for bit.

    python3 -P benchmarks/exchange_bandwidth.py --ceiling --out DIR   # nvidia-h200-x2
    python3 -P benchmarks/exchange_bandwidth.py --out DIR
    python benchmarks/exchange_bandwidth.py --smoke      # two CPU devices, NCCL's path (XLA's) only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CHAIN = 16
SHAPES = {"qkv_32": ((32, 2, 3072), 1), "qkv_128": ((128, 2, 3072), 1), "qkv_512": ((512, 2, 3072), 1),
          "attention_out_512": ((2, 512, 2048), 0), "qkv_1024": ((1024, 2, 3072), 1),
          "attention_out": ((2, 2048, 2048), 0), "qkv": ((2048, 2, 3072), 1)}  # per device; split axis
# builds: (threads, most blocks, words a thread loads before it stores); (512, 132, 1) ships.
# (A first call, when the kernel also copied its own half in the sending loop, measured
# 512/264, 512/528, 1024/132, 1024/264 and 256/528: none clearly faster.)
VARIANTS = {"t256_b528": (256, 528, 1), "batch4": (512, 132, 4), "batch8": (512, 132, 8),
            "t256_b528_batch4": (256, 528, 4)}


def ceiling(repeats: int = 5, mib: int = 256) -> dict:
    """Best GB/s of a peer copy by the copy engines: GPU 0 to 1, and both ways at once."""
    import torch

    n = mib << 20
    a = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    b = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]

    def timed(directions):
        best = 0.0
        for _ in range(repeats):
            for d in (0, 1):
                torch.cuda.synchronize(d)
            start = time.perf_counter()
            for d in directions:  # d's buffer into the other GPU's, on d's stream
                with torch.cuda.stream(streams[d]):
                    b[1 - d].copy_(a[d], non_blocking=True)
            for d in (0, 1):
                torch.cuda.synchronize(d)
            best = max(best, n / (time.perf_counter() - start) / 1e9)
        return best
    timed((0,))  # warm-up: peer mappings
    return {"bytes": n, "one_direction_GBps": timed((0,)), "both_directions_GBps_each": timed((0, 1))}


def exchanges(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    if smoke:  # two CPU devices: XLA's all-to-all alone
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import time_fn
    from shiftjax.kernels import collectives as kernels

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    first = kernels.first_ordinal_of(mesh)
    targets = {"nccl": None}
    if not smoke:
        kernels.setup_one_shot(mesh.devices.flat, require_nvlink=True)
        targets.update(kernel=kernels.EXCHANGE_TARGET)
        ordinals = sorted(int(d.local_hardware_id) for d in mesh.devices.flat)
        for name, (threads, blocks, batch) in VARIANTS.items():
            defines = (f"SHIFTJAX_THREADS={threads}", f"SHIFTJAX_MAX_BLOCKS={blocks}", f"SHIFTJAX_EXCHANGE_BATCH={batch}")
            library = kernels._load(mesh.devices.flat[0], None, defines, suffix=f"_{name}")
            if not library.shiftjax_all_reduce_setup(*ordinals, kernels.DEFAULT_CAPACITY_BYTES, 1):
                raise RuntimeError(library.shiftjax_all_reduce_error().decode())
            targets[name] = kernels.EXCHANGE_TARGET + f"_{name}"
    out = {}
    for shape_name, (shape, split_axis) in SHAPES.items():
        if smoke:
            shape = (max(shape[0] // 64, 1), shape[1], shape[2] // 64) if split_axis == 1 else (2, 32, 64)
        half_bytes = int(jnp.zeros(shape, jnp.bfloat16).nbytes) // 2
        x = jax.device_put(jax.random.normal(jax.random.key(0), (2 * shape[0], *shape[1:]), jnp.bfloat16),
                           NamedSharding(mesh, P("x")))
        rows, want = {}, None
        for name, target in targets.items():
            def body(block, target=target):
                for _ in range(CHAIN):  # a permutation each: the values stay bounded, no extra kernels
                    moved = (jax.lax.all_to_all(block, "x", split_axis, 0, tiled=True) if target is None
                             else kernels.exchange_call(block, split_axis, target, first))
                    block = moved.reshape(shape)
                return block
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            got = np.asarray(fn(x)).view(np.uint16)
            want = got if want is None else want
            seconds = min(time_fn(fn, x, warmup=2, iters=10) for _ in range(3)) / CHAIN
            rows[name] = {"us": seconds * 1e6, "GBps_each_way": half_bytes / seconds / 1e9,
                          "equals_nccl": bool((got == want).all())}
            print(f"  {shape_name:17s} {half_bytes:>9d} B {name:16s} {seconds * 1e6:8.1f} us  {half_bytes / seconds / 1e9:6.1f} GB/s "
                  f"each way  equals NCCL {rows[name]['equals_nccl']}", flush=True)
        out[shape_name] = {"half_bytes": half_bytes, **rows}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/exchange")
    parser.add_argument("--ceiling", action="store_true", help="the copy engines' peer copy (PyTorch), alone")
    parser.add_argument("--smoke", action="store_true", help="tiny, NCCL's path only (CPU devices)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = ceiling() if args.ceiling else exchanges(args.smoke)
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "ceiling.json" if args.ceiling else "exchange.json"), "w") as f:
        json.dump(result, f, indent=1)
