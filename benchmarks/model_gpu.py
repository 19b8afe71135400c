"""The model end to end on one GPU: the step functions with the Pallas attention kernels.

1. correctness: per-step logits of the step with ``attention="pallas"`` against the same step
   with the pure-JAX reference, for SmolLM2-135M shapes (random weights, float32 and bf16),
   on batches the real scheduler builds (chunked prefill of several prompts, then decodes);
2. the optimised GPU HLO of a step: no copy or dynamic-slice of a cache-sized buffer, and
   whether weights are copied out of the layer stack;
3. TP-mode decode step time for a Llama-3-8B-shaped model (bf16 random weights) at 1, 8 and
   64 sequences, against the weight-bytes / copy-bandwidth floor measured in the same run;
4. compile time of one step at 2 and at 80 layers (the layer scan keeps it flat).

Run on the H200 with ``bash benchmarks/run_gpu_model.sh``; results go to $OUT.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from roofline import copy_bandwidth, time_fn  # noqa: E402

from shiftjax.batch import empty_batch  # noqa: E402
from shiftjax.cache import CacheConfig, allocate_cache  # noqa: E402
from shiftjax.config import ModelConfig  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.params import param_shapes, params_from_flat, random_params  # noqa: E402
from shiftjax.serving.executables import BucketLadder, pad_batch, to_device  # noqa: E402
from shiftjax.serving.sampling_params import SamplingParams  # noqa: E402
from shiftjax.serving.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402

OUT = os.environ.get("OUT", "bench_out")
RESULTS: dict = {}

SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      max_position_embeddings=2048, tie_word_embeddings=True)
LLAMA8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192)


def log(*args):
    print(*args, flush=True)


def device_random_params(config: ModelConfig, dtype, seed=0):
    """Random weights made on the device (a host copy of 16 GB would dominate the run)."""
    shapes = param_shapes(config)

    def make(key):
        keys = jax.random.split(key, len(shapes))
        flat = {}
        for k, (name, shape) in zip(keys, shapes.items()):
            if name.endswith("norm"):
                flat[name] = jnp.ones(shape, dtype)
            else:
                flat[name] = (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return params_from_flat(flat)

    return jax.jit(make)(jax.random.key(seed))


def check_pallas_against_reference(dtype: str):
    params = random_params(SMOLLM2, seed=0, scale=0.05)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    mesh = make_mesh(1, 1)
    weights = shard_params(params, SMOLLM2, mesh)
    page_size, max_len = 16, 512
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=max_len,
                                      page_size=page_size, num_pages=8 * 32 + 1))
    ladder = BucketLadder((16, 64, 256), (8,))
    rng = np.random.default_rng(0)
    for length in (200, 37, 129, 5, 300, 64):
        sched.add(rng.integers(0, SMOLLM2.vocab_size, length).tolist(), SamplingParams(max_tokens=6, ignore_eos=True))
    cache = CacheConfig(num_pages=8 * 32 + 1, page_size=page_size, dtype=dtype)
    caches = {impl: allocate_cache(mesh, SMOLLM2.num_layers, weights.layout.kv_slots, SMOLLM2.head_dim, cache)
              for impl in ("reference", "pallas")}
    steps = {impl: make_step(weights, "tp", attention=impl if jax.default_backend() == "gpu" else "reference",
                             return_logits=True) for impl in caches}
    worst, n_steps = 0.0, 0
    while sched.has_work:
        scheduled = sched.schedule()
        t, b = ladder.pick(scheduled.num_tokens, len(scheduled.requests))
        batch = to_device(pad_batch(scheduled.batch, t, b), weights)
        outs = {}
        for impl in caches:
            outs[impl], caches[impl] = steps[impl](params_for(weights, "tp"), caches[impl], batch)
        ref = np.asarray(outs["reference"].logits, np.float32)
        pal = np.asarray(outs["pallas"].logits, np.float32)
        rows = [i for i, s in enumerate(scheduled.samples) if s]
        if rows:
            err = float(np.abs(pal[rows] - ref[rows]).max() / np.abs(ref[rows]).max())
            worst = max(worst, err)
        packed = np.asarray(outs["reference"].packed)
        sched.commit(scheduled, packed[:, 0], packed[:, 1].copy().view(np.float32), "tp")
        n_steps += 1
    k_ref = np.asarray(caches["reference"].k, np.float32)
    k_pal = np.asarray(caches["pallas"].k, np.float32)
    RESULTS[f"pallas_vs_reference_{dtype}"] = {
        "steps": n_steps, "max_relative_logit_error": worst,
        "caches_equal": bool(np.array_equal(k_ref, k_pal))}
    log(f"[1] {dtype}: {n_steps} steps, max relative logit error pallas vs reference {worst:.2e}, "
        f"K caches equal: {np.array_equal(k_ref, k_pal)}")


def llama8b_weights_and_caches():
    config = LLAMA8B
    params = device_random_params(config, jnp.bfloat16)
    mesh = make_mesh(1, 1)
    weights = shard_params(params, config, mesh)
    del params
    caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(num_pages=64 * 8 + 1, page_size=16, dtype="bfloat16"))
    return weights, caches


def hlo_report(compiled, caches, weights):
    hlo = compiled.as_text()
    cache_shape = caches.k.shape
    layer_shapes = {cache_shape, cache_shape[1:], (1, *cache_shape[1:])}
    weight_shapes = set()
    for leaf in jax.tree.leaves(weights.tp.layers):
        weight_shapes |= {leaf.shape[1:], leaf.shape[2:]}
    cache_copies, weight_copies = [], []
    for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} (copy|dynamic-slice|slice)\(", hlo):
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        if shape in layer_shapes:
            cache_copies.append(m.group(0))
        elif shape in weight_shapes:
            weight_copies.append(m.group(0))
    return {"cache_sized_copies": cache_copies, "weight_sized_copies_or_slices": weight_copies,
            "input_output_alias": re.search(r"input_output_alias=\{(.*?)\}, entry", hlo).group(1)}


def decode_timing(weights, caches):
    config = LLAMA8B
    bandwidth = copy_bandwidth(2 << 30)
    # Every weight is read once per step except the embedding table (a gather of rows).
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights.tp)) - weights.tp.embed.nbytes
    RESULTS["copy_bandwidth_TBps"] = bandwidth / 1e12
    results = {}
    context = 512
    for num_seqs in (1, 8, 64):
        batch = empty_batch(num_seqs, num_seqs, 64)
        pages_per_seq = context // 16 + 1
        for b in range(num_seqs):
            pages = 1 + b * pages_per_seq + np.arange(pages_per_seq)
            batch.page_table[b, :pages_per_seq] = pages
            batch.seq_lens[b] = context + 1
            batch.positions[b] = context
            batch.slot_mapping[b] = pages[context // 16] * 16 + context % 16
            batch.query_start[b + 1] = b + 1
            batch.sample_index[b] = b
            batch.token_ids[b] = b + 7
        dev_batch = to_device(batch, weights)
        step = make_step(weights, "tp", attention="pallas")
        start = time.perf_counter()
        compiled = step.lower(params_for(weights, "tp"), caches, dev_batch).compile()
        compile_s = time.perf_counter() - start
        if num_seqs == 8:
            RESULTS["hlo_llama8b_decode8"] = hlo_report(compiled, caches, weights)
        state = {"caches": caches}

        def run(batch):
            out, state["caches"] = compiled(params_for(weights, "tp"), state["caches"], batch)
            return out.packed

        seconds = time_fn(run, dev_batch, warmup=3, iters=20)
        caches = state["caches"]
        kv_bytes = 2 * config.num_layers * num_seqs * (context + 1) * config.num_kv_heads * config.head_dim * 2
        floor = (weight_bytes + kv_bytes) / bandwidth  # bytes read against the copy rate (read + written)
        results[num_seqs] = {"step_ms": seconds * 1e3, "floor_ms": floor * 1e3, "floor_over_step": floor / seconds,
                             "tokens_per_s": num_seqs / seconds, "compile_s": compile_s}
        log(f"[3] llama-8B shape, decode {num_seqs:3d} seqs x {context} ctx: {seconds * 1e3:.2f} ms/step, "
            f"floor {floor * 1e3:.2f} ms ({floor / seconds:.0%}), {num_seqs / seconds:.0f} tok/s, compile {compile_s:.1f} s")
    RESULTS["decode_llama8b_tp_p1"] = results
    RESULTS["weight_bytes"] = weight_bytes
    return caches


def compile_time_vs_depth():
    out = {}
    for layers in (2, 80):
        config = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=512, intermediate_size=1024,
                             num_layers=layers, num_heads=8, num_kv_heads=2, head_dim=64)
        params = device_random_params(config, jnp.bfloat16)
        mesh = make_mesh(1, 1)
        weights = shard_params(params, config, mesh)
        caches = allocate_cache(mesh, layers, weights.layout.kv_slots, 64, CacheConfig(65, 16, "bfloat16"))
        batch = to_device(empty_batch(64, 8, 8), weights)
        start = time.perf_counter()
        make_step(weights, "tp", attention="pallas").lower(params_for(weights, "tp"), caches, batch).compile()
        out[layers] = time.perf_counter() - start
        log(f"[4] compile time, {layers} layers: {out[layers]:.2f} s")
    RESULTS["compile_seconds_by_layers"] = out


def main():
    log(jax.__version__, jax.devices())
    for section, fn in (("pallas_f32", lambda: check_pallas_against_reference("float32")),
                        ("pallas_bf16", lambda: check_pallas_against_reference("bfloat16")),
                        ("depth", compile_time_vs_depth)):
        try:
            fn()
        except Exception as error:  # record and go on: one call must bring back every section
            RESULTS[f"{section}_error"] = repr(error)[:2000]
            log(f"{section} failed: {error!r}"[:3000])
    try:
        weights, caches = llama8b_weights_and_caches()
        decode_timing(weights, caches)
    except Exception as error:
        RESULTS["decode_error"] = repr(error)[:2000]
        log(f"decode failed: {error!r}"[:3000])
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "model_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)
    log(json.dumps(RESULTS, indent=2, default=str)[:6000])


if __name__ == "__main__":
    main()
