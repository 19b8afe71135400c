"""Where XLA puts SP mode's all-to-alls in the compiled step: async or not, and what runs
between a start and its done (the overlap that ``make_step(a2a_chunks=n)`` is for).

    python3 -P benchmarks/a2a_schedule.py            # on nvidia-h200-x2 (gpu_env.sh sourced)
    python benchmarks/a2a_schedule.py --smoke        # 2 CPU devices
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_gpu import LLAMA8B, device_random_params  # noqa: E402
from roofline import time_fn  # noqa: E402
from shift_x2 import PAGE, prefill_batch  # noqa: E402

from shiftjax.cache import CacheConfig, allocate_cache  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.executables import to_device, xla_compiler_options  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402


def schedule_summary(hlo: str) -> dict:
    """Counts of all-to-all forms, and the opcodes scheduled between each start and its done."""
    lines = [l.strip() for l in hlo.splitlines()]
    starts = {}
    between = []
    for i, line in enumerate(lines):
        m = re.match(r"(%?[\w.\-]+) = .*? (all-to-all-start|all-to-all-done|async-start|async-done)\((.*?)\)", line)
        if not m:
            continue
        name, op, operands = m.groups()
        if op.endswith("start"):
            starts[name] = i
        elif operands.split(",")[0].strip() in starts:
            first = starts.pop(operands.split(",")[0].strip())
            ops = [re.search(r"= \S+ ([\w\-]+)\(", l) for l in lines[first + 1:i]]
            between.append([o.group(1) for o in ops if o])
    return {"all-to-all": len(re.findall(r" all-to-all\(", hlo)),
            "all-to-all-start": len(re.findall(r" all-to-all-start\(", hlo)),
            "async-start": len(re.findall(r" async-start\(", hlo)),
            "grouped_instructions": hlo.count("_scheduling_group_id"),
            "between_start_and_done": between[:6]}


def _gathered_in_step_order(gathered, sp: int, local: int):
    size = local // len(gathered)
    ordered = jnp.stack(gathered).reshape(len(gathered), sp, size, -1)
    return jnp.swapaxes(ordered, 0, 1).reshape(sp * local, -1)


def to_heads_grouped(h, wqkv, sp: int, chunks: int):
    """``model._project_to_head_block`` with chunk c's all-to-all and chunk c+1's GEMMs in
    one XLA scheduling group (``_scheduling_group_id``): overlap them, if XLA honours it."""
    from jax.experimental.xla_metadata import set_xla_metadata

    from shiftjax.layouts.mesh import SP
    from shiftjax.model import _column_blocks

    size = h.shape[0] // chunks
    gathered = []
    for c in range(chunks):
        with set_xla_metadata(_scheduling_group_id=str(c)):
            qkv = _column_blocks(h[c * size:(c + 1) * size], wqkv, sp)
        with set_xla_metadata(_scheduling_group_id=str(c + 1)):
            gathered.append(lax.all_to_all(qkv, SP, split_axis=1, concat_axis=0, tiled=True))
    return _gathered_in_step_order(gathered, sp, h.shape[0])


def to_heads_explicit(h, wqkv, sp: int, chunks: int):
    """The same with JAX's explicit async all-to-all (``all_to_all_start`` / ``done``, a
    private API): chunk c's done after chunk c+1's start and GEMMs."""
    from jax._src.lax import parallel

    from shiftjax.layouts.mesh import SP
    from shiftjax.model import _column_blocks

    size = h.shape[0] // chunks
    gathered, pending = [], None
    for c in range(chunks):
        qkv = _column_blocks(h[c * size:(c + 1) * size], wqkv, sp)
        future = parallel.all_to_all_start(qkv, SP, split_axis=1, concat_axis=0, tiled=True)
        if pending is not None:
            gathered.append(pending.done())
        pending = future
    gathered.append(pending.done())
    return _gathered_in_step_order(gathered, sp, h.shape[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=4,
                        help="1 for the grouped variant: group ids repeat across the unrolled layers' inlined calls")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 2)
    layers = 2 if args.smoke else args.layers
    config = dataclasses.replace(LLAMA8B, num_layers=layers)
    if args.smoke:
        config = dataclasses.replace(config, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                                     head_dim=32, vocab_size=1024)
    prompt = 512 if args.smoke else 2048
    mesh = make_mesh(2, 1, jax.devices()[:2])
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh)
    max_pages = prompt // PAGE + 1
    caches = allocate_cache(mesh, layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(2 * max_pages + 2, PAGE, "bfloat16"))
    batch = to_device(prefill_batch(2, prompt, max_pages), weights)
    base = xla_compiler_options("cublas", jax.devices()[0].platform) or {}
    lhs = {"xla_gpu_enable_latency_hiding_scheduler": True}
    # name -> (a2a_chunks, XLA options, replacement of model._project_to_head_block or None)
    variants = {"chunks1": (1, {}, None), "chunks2": (2, {}, None), "chunks2_grouped": (2, {}, to_heads_grouped),
                "chunks2_explicit": (2, {}, to_heads_explicit)}
    if not args.smoke:
        variants.update({
            "chunks1_windowed": (1, {**lhs, "xla_gpu_experimental_enable_alltoall_windowed_einsum": True}, None),
            "chunks2_grouped_lhs": (2, lhs, to_heads_grouped), "chunks2_explicit_lhs": (2, lhs, to_heads_explicit)})
    import shiftjax.model as model

    shipped = model._project_to_head_block
    out = {}
    for key, (chunks, extra, replacement) in variants.items():
        model._project_to_head_block = replacement or shipped
        try:
            step = make_step(weights, "sp", attention="reference" if args.smoke else "pallas", layer_loop="unrolled",
                             sample_in_step=False, a2a_chunks=chunks)
            compiled = step.lower(params_for(weights, "sp"), caches, batch).compile({**base, **extra} or None)
        except Exception as error:  # an option or API this JAX does not have
            out[key] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(key, out[key]["error"], flush=True)
            continue
        finally:
            model._project_to_head_block = shipped
        state = {"caches": caches}

        def run(b):
            result, state["caches"] = compiled(params_for(weights, "sp"), state["caches"], b)
            return result

        row = schedule_summary(compiled.as_text())
        row["wall_ms"] = time_fn(lambda b: run(b).packed, batch, warmup=2, iters=10) * 1e3
        row["logits_sha1"] = hashlib.sha1(np.asarray(run(batch).logits.addressable_shards[0].data).tobytes()).hexdigest()
        caches = state["caches"]
        out[key] = row
        print(key, json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "a2a_schedule.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
