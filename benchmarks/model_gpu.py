"""The model end to end on one GPU: the step functions with the Pallas attention kernels.

1. correctness: per-step logits of the step with ``attention="pallas"`` against the same step
   with the pure-JAX reference, for SmolLM2-135M shapes (random weights, float32 and bf16),
   on batches the real scheduler builds (chunked prefill of several prompts, then decodes);
2. the optimised GPU HLO of a step: no copy or dynamic-slice of a cache-sized buffer, and
   whether weights are copied out of the layer stack;
3. TP-mode decode step time for a Llama-3-8B-shaped model (bf16 random weights) at 1, 8 and
   64 sequences, against the weight-bytes / copy-bandwidth floor measured in the same run;
4. compile time of one step at 2 and at 80 layers (the layer scan keeps it flat).

Run on the H200 with ``bash benchmarks/run_gpu_model.sh``; results go to $OUT. ``--sections``
picks some of ``pallas,depth,hlo,decode`` (``hlo``: section 2 alone, compile only);
``--smoke`` runs every section on tiny shapes on any machine (the CPU test does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from hlo_moves import hlo_report  # noqa: E402
from roofline import ceilings, describe, time_fn  # noqa: E402

from shiftjax.batch import empty_batch  # noqa: E402
from shiftjax.cache import CacheConfig, KVCache, allocate_cache  # noqa: E402
from shiftjax.config import ModelConfig  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.params import param_shapes, params_from_flat, random_params  # noqa: E402
from shiftjax.serving.engine.buckets import BucketLadder, pad_batch  # noqa: E402
from shiftjax.serving.engine.sampling_params import SamplingParams  # noqa: E402
from shiftjax.serving.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from shiftjax.serving.engine.transfers import to_device  # noqa: E402
from shiftjax.step_options import StepOptions  # noqa: E402
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
# --smoke: the same code paths on shapes a CPU runs in seconds (distinct dims, so that the
# HLO report cannot mistake an activation for a weight)
TINY = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=3,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def attention_impl() -> str:
    """Pallas on a GPU, the reference elsewhere (a function: importing this module must not
    start a JAX backend, shift_x2.py configures CPU devices after importing it)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def decode_shapes(smoke: bool) -> dict:
    """Decode sizes of the timing sections: sequences tried, context, page size."""
    if smoke:
        return {"config": TINY, "num_seqs": (4,), "context": 40, "page_size": 16}
    return {"config": LLAMA8B, "num_seqs": (1, 8, 64), "context": 512, "page_size": 16}


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


def check_pallas_against_reference(dtype: str, config: ModelConfig = SMOLLM2,
                                   prompt_lengths=(200, 37, 129, 5, 300, 64), token_buckets=(16, 64, 256)):
    params = random_params(config, seed=0, scale=0.05)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    mesh = make_mesh(1, 1)
    weights = shard_params(params, config, mesh)
    page_size, max_len = 16, 512
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=max_len,
                                      page_size=page_size, num_pages=8 * 32 + 1))
    ladder = BucketLadder(token_buckets, (8,))
    rng = np.random.default_rng(0)
    for length in prompt_lengths:
        sched.add(rng.integers(0, config.vocab_size, length).tolist(), SamplingParams(max_tokens=6, ignore_eos=True))
    cache = CacheConfig(num_pages=8 * 32 + 1, page_size=page_size, dtype=dtype)
    caches = {impl: allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim, cache)
              for impl in ("reference", "pallas")}
    steps = {impl: make_step(weights, "tp", StepOptions(attention=impl if jax.default_backend() == "gpu" else "reference"), return_logits=True) for impl in caches}
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


def weights_and_caches(config: ModelConfig = LLAMA8B, *, context: int = 512, max_seqs: int = 64,
                       page_size: int = 16):
    """bf16 random weights on one device and a random-filled cache with room for ``max_seqs``
    sequences of ``context + 1`` tokens (random, not zeros: zeros can read faster)."""
    params = device_random_params(config, jnp.bfloat16)
    mesh = make_mesh(1, 1)
    weights = shard_params(params, config, mesh)
    del params
    pages_per_seq = context // page_size + 1
    caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(num_pages=max_seqs * pages_per_seq + 1, page_size=page_size,
                                        dtype="bfloat16"))
    fill = jax.jit(lambda c: KVCache(k=jax.random.normal(jax.random.key(1), c.k.shape, c.k.dtype),
                                     v=jax.random.normal(jax.random.key(2), c.v.shape, c.v.dtype)),
                   donate_argnums=0, out_shardings=caches.k.sharding)
    return weights, fill(caches)


def decode_batch(num_seqs: int, context: int, page_size: int, max_pages: int, *, sampled: bool = False):
    """One decode token for each of ``num_seqs`` sequences of ``context`` cached tokens, each
    on its own pages (page 0 is scratch). ``sampled``: temperature 1, top-k 50, top-p 0.9
    (the sampler's sort path); else greedy, which the sampler serves without the sort."""
    batch = empty_batch(num_seqs, num_seqs, max_pages)
    pages_per_seq = context // page_size + 1
    for b in range(num_seqs):
        pages = 1 + b * pages_per_seq + np.arange(pages_per_seq)
        batch.page_table[b, :pages_per_seq] = pages
        batch.seq_lens[b] = context + 1
        batch.positions[b] = context
        batch.slot_mapping[b] = pages[context // page_size] * page_size + context % page_size
        batch.query_start[b + 1] = b + 1
        batch.sample_index[b] = b
        batch.token_ids[b] = b + 7
        if sampled:
            batch.temperature[b], batch.top_k[b], batch.top_p[b], batch.seed[b] = 1.0, 50, 0.9, b
    return batch


def hlo_section(weights, caches, shapes: dict, layer_loops=("scan",)):
    """Section 2 alone: compile the 8-sequence decode step (or the smoke size) and report."""
    num_seqs = shapes["num_seqs"][min(1, len(shapes["num_seqs"]) - 1)]
    batch = to_device(decode_batch(num_seqs, shapes["context"], shapes["page_size"], 64), weights)
    for loop in layer_loops:
        step = make_step(weights, "tp", StepOptions(attention=attention_impl(), layer_loop=loop))
        compiled = step.lower(params_for(weights, "tp"), caches, batch).compile()
        report = hlo_report(compiled, caches, weights)
        RESULTS[f"hlo_decode{num_seqs}_{loop}"] = report
        log(f"[2] {loop}: weight dynamic-slices {report['weight_dynamic_slices']}, copies {report['weight_copies']}, "
            f"static slices {report['weight_static_slices']}; cache moves {report['cache_moves'] or 'none'}")
        log(f"    {report['weight_moves']}")


def decode_timing(weights, caches, shapes: dict, ceiling: dict):
    config = shapes["config"]
    # Every weight is read once per step except the embedding table (a gather of rows).
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights.tp)) - weights.tp.embed.nbytes
    read_bw, copy_bw = ceiling["read"]["best"], ceiling["copy"]["best"]
    results = {}
    context, page_size = shapes["context"], shapes["page_size"]
    for num_seqs in shapes["num_seqs"]:
        dev_batch = to_device(decode_batch(num_seqs, context, page_size, 64), weights)
        step = make_step(weights, "tp", StepOptions(attention=attention_impl()))
        start = time.perf_counter()
        compiled = step.lower(params_for(weights, "tp"), caches, dev_batch).compile()
        compile_s = time.perf_counter() - start
        state = {"caches": caches}

        def run(batch):
            out, state["caches"] = compiled(params_for(weights, "tp"), state["caches"], batch)
            return out.packed

        seconds = time_fn(run, dev_batch, warmup=3, iters=20)
        caches = state["caches"]
        kv_bytes = 2 * config.num_layers * num_seqs * (context + 1) * config.num_kv_heads * config.head_dim * 2
        floor = (weight_bytes + kv_bytes) / read_bw  # bytes read over the read-only stream rate
        results[num_seqs] = {"step_ms": seconds * 1e3, "timer": "host wall clock", "floor_ms": floor * 1e3,
                             "floor_over_step": floor / seconds,
                             "copy_floor_over_step": (weight_bytes + kv_bytes) / copy_bw / seconds,
                             "tokens_per_s": num_seqs / seconds, "compile_s": compile_s}
        log(f"[3] {config.num_layers}-layer d{config.hidden_size} decode {num_seqs:3d} seqs x {context} ctx: "
            f"{seconds * 1e3:.2f} ms/step [host wall clock], read floor {floor * 1e3:.2f} ms ({floor / seconds:.0%}; "
            f"{results[num_seqs]['copy_floor_over_step']:.0%} against the copy rate), {num_seqs / seconds:.0f} tok/s, "
            f"compile {compile_s:.1f} s")
    RESULTS["decode_tp_p1"] = results
    RESULTS["weight_bytes"] = weight_bytes
    return caches


def compile_time_vs_depth(depths=(2, 80), smoke=False):
    out = {}
    for layers in depths:
        config = ModelConfig(architecture="llama", vocab_size=320 if smoke else 32000, hidden_size=64 if smoke else 512,
                             intermediate_size=96 if smoke else 1024, num_layers=layers, num_heads=8, num_kv_heads=2,
                             head_dim=8 if smoke else 64)
        params = device_random_params(config, jnp.bfloat16)
        mesh = make_mesh(1, 1)
        weights = shard_params(params, config, mesh)
        caches = allocate_cache(mesh, layers, weights.layout.kv_slots, config.head_dim, CacheConfig(65, 16, "bfloat16"))
        batch = to_device(empty_batch(64, 8, 8), weights)
        start = time.perf_counter()
        make_step(weights, "tp", StepOptions(attention=attention_impl())).lower(params_for(weights, "tp"), caches, batch).compile()
        out[layers] = time.perf_counter() - start
        log(f"[4] compile time, {layers} layers: {out[layers]:.2f} s")
    RESULTS["compile_seconds_by_layers"] = out


SECTIONS = ("pallas", "depth", "hlo", "decode")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine: runs the code paths only")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for model_gpu.json")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    shapes = decode_shapes(args.smoke)
    log(jax.__version__, jax.devices(), f"sections {sections}", "smoke" if args.smoke else "")
    small = TINY if args.smoke else SMOLLM2
    runs = []
    if "pallas" in sections:
        if args.smoke:  # one dtype, one bucket: the code path, in few compiles
            runs.append(("pallas_f32", lambda: check_pallas_against_reference("float32", small, (37, 5), (64,))))
        else:
            runs += [("pallas_f32", lambda: check_pallas_against_reference("float32")),
                     ("pallas_bf16", lambda: check_pallas_against_reference("bfloat16"))]
    if "depth" in sections:
        runs.append(("depth", lambda: compile_time_vs_depth((2, 6) if args.smoke else (2, 80), args.smoke)))
    for section, fn in runs:
        try:
            fn()
        except Exception as error:  # record and go on: one call must bring back every section
            RESULTS[f"{section}_error"] = repr(error)[:2000]
            log(f"{section} failed: {error!r}"[:3000])
    if "hlo" in sections or "decode" in sections:
        try:
            weights, caches = weights_and_caches(shapes["config"], context=shapes["context"],
                                                 max_seqs=max(shapes["num_seqs"]), page_size=shapes["page_size"])
            if "hlo" in sections:
                hlo_section(weights, caches, shapes)
            if "decode" in sections:
                ceiling = ceilings(8 << 20, 1, 128) if args.smoke else ceilings()
                RESULTS["ceilings"] = ceiling
                log(describe(ceiling))
                decode_timing(weights, caches, shapes, ceiling)
        except Exception as error:
            RESULTS["decode_error"] = repr(error)[:2000]
            log(f"decode failed: {error!r}"[:3000])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)
    log(json.dumps(RESULTS, indent=2, default=str)[:6000])
    return 1 if any(k.endswith("_error") for k in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
