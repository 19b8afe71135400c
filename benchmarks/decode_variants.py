"""Where a Llama-3-8B-shaped TP decode step on one GPU spends its time beyond the floor.

Variants of the same step (bf16 random weights, 8 and 64 sequences at 512 context):
``scan`` (the shipped layer scan), ``unrolled`` (a Python loop over layers, static weight
slices), ``greedy`` (the scan with argmax instead of the full top-k/top-p sampler). Run once
plain and once with ``XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true`` by
``benchmarks/run_gpu_decode_variants.sh``. Also lists the copy / dynamic-slice instructions
of the optimised HLO that move more than 1 MiB.
"""

from __future__ import annotations

import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import model_gpu  # noqa: E402
from roofline import copy_bandwidth, time_fn  # noqa: E402

import shiftjax.model as model  # noqa: E402
import shiftjax.steps as steps  # noqa: E402
from shiftjax.batch import empty_batch  # noqa: E402
from shiftjax.serving.executables import to_device  # noqa: E402

jax.config.update("jax_default_matmul_precision", "default")


def unrolled_layers(layer_fn, x, layers, k_cache, v_cache, ctx):
    for i in range(layers.attn_norm.shape[0]):
        weights = jax.tree.map(lambda w, i=i: w[i], layers)
        x, k_cache, v_cache = layer_fn(x, weights, k_cache, v_cache, jnp.int32(i), ctx)
    return x, k_cache, v_cache


def greedy(logits, *args):
    return jnp.argmax(logits, -1).astype(jnp.int32), jnp.max(logits, -1)


def big_moves(hlo: str) -> dict:
    sizes = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "u16": 2, "pred": 1, "s8": 1, "u8": 1}
    found = {}
    for m in re.finditer(r"= ([a-z0-9]+)\[([0-9,]*)\]\{[^}]*\} (copy|dynamic-slice|slice)\(", hlo):
        dims = [int(d) for d in m.group(2).split(",") if d]
        nbytes = int(np.prod(dims)) * sizes.get(m.group(1), 4)
        if nbytes > (1 << 20):
            key = f"{m.group(3)} {m.group(1)}{dims}"
            found[key] = found.get(key, 0) + 1
    return found


def main():
    flags = os.environ.get("XLA_FLAGS", "")
    print("XLA_FLAGS:", flags, jax.devices(), flush=True)
    weights, caches = model_gpu.llama8b_weights_and_caches()
    bandwidth = copy_bandwidth(2 << 30)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights.tp)) - weights.tp.embed.nbytes
    original_run, original_sample = model.run_layers, steps.sample
    for variant in ("scan", "unrolled", "greedy"):
        steps.run_layers = unrolled_layers if variant == "unrolled" else original_run
        steps.sample = greedy if variant == "greedy" else original_sample
        for num_seqs in (8, 64):
            batch = empty_batch(num_seqs, num_seqs, 64)
            for b in range(num_seqs):
                pages = 1 + b * 33 + np.arange(33)
                batch.page_table[b, :33] = pages
                batch.seq_lens[b], batch.positions[b] = 513, 512
                batch.slot_mapping[b] = pages[32] * 16
                batch.query_start[b + 1], batch.sample_index[b], batch.token_ids[b] = b + 1, b, b + 7
            dev = to_device(batch, weights)
            start = time.perf_counter()
            exe = steps.make_step(weights, "tp", attention="pallas").lower(
                steps.params_for(weights, "tp"), caches, dev).compile()
            compile_s = time.perf_counter() - start
            state = {"caches": caches}

            def run(b):
                out, state["caches"] = exe(steps.params_for(weights, "tp"), state["caches"], b)
                return out.packed

            seconds = time_fn(run, dev, warmup=3, iters=20)
            caches = state["caches"]
            floor = weight_bytes / bandwidth
            print(f"{variant:9s} B={num_seqs:3d}: {seconds * 1e3:7.2f} ms/step, weight floor {floor * 1e3:.2f} ms "
                  f"({floor / seconds:.0%}), compile {compile_s:.1f} s", flush=True)
            if num_seqs == 8:
                print("   big copies/slices:", big_moves(exe.as_text()), flush=True)


if __name__ == "__main__":
    main()
