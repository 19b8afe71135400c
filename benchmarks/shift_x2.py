"""Shift Parallelism on two GPUs, in one run: ceilings, correctness, and every row of the
"before" table (TP decode vs the weight floor, SP vs DP, SP vs TP, host gaps).

    bash benchmarks/run_gpu.sh x2            # on two GPUs; JSON + log under $OUT
    python benchmarks/shift_x2.py --smoke    # the same code paths, tiny, on 4 CPU devices

Parts (``--parts``, comma separated): ``ceilings`` (per GPU: read-only stream = a large
reduction, device copy, bf16 matmul; best of several), ``correct`` (SmolLM2-shaped float32
random model: greedy tokens of one GPU vs the 2-GPU mesh in TP, SP and alternate;
Llama-3.1-8B shape in bf16: TP vs SP logits), ``steps`` (the compiled steps alone: wall
and device span per step), ``sp_a2a`` (SP's all-to-alls against DP: NCCL kernels or copy
engines), ``engine`` (the engine's steady-state decode loop, where host time shows;
engine_loop.py, with ``xla_options``). Ratios are against ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_gpu  # noqa: E402
import roofline  # noqa: E402
from model_gpu import LLAMA8B, SMOLLM2, device_random_params  # noqa: E402
from roofline import device_time, time_fn  # noqa: E402

from shiftjax.batch import empty_batch  # noqa: E402
from shiftjax.cache import CacheConfig, allocate_cache  # noqa: E402
from shiftjax.kernels import collectives as collective_kernels  # noqa: E402
from shiftjax.kernels.collectives import setup_one_shot  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.engine import compile as compiling  # noqa: E402
from shiftjax.serving.engine.core import Engine, EngineConfig  # noqa: E402
from shiftjax.serving.engine.sampling_params import SamplingParams  # noqa: E402
from shiftjax.serving.engine.transfers import to_device  # noqa: E402
from shiftjax.step_options import GEMM_BACKENDS, StepOptions  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402

PAGE = 16
PARTS = "ceilings,correct,steps_mesh,steps_1gpu,engine"  # the default run; the others on request
RESULTS: dict = {}
RECORDED_ENVIRONMENT = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_CPP_VMODULE", "NCCL_NVLS_ENABLE")
# (warm-up calls, timed calls) of each step in ``time_steps``; on the CPU (--smoke) timings mean
# nothing, and every step still runs warmed up and timed with fewer
TIMED_CALLS = {"gpu": (3, 15), "cpu": (1, 3)}


def log(*args):
    print(*args, flush=True)


def write_results(results: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


def run_parts(results: dict, runners: dict, parts: list[str], path: str) -> None:
    """Runs each named part into ``results[part]``; one that raises is recorded as an error
    (with its traceback) and the rest still run; ``results`` is rewritten to ``path`` after
    every part, so a run cut short keeps what finished."""
    for part in parts:
        start = time.perf_counter()
        log(f"== {part}")
        try:
            results[part] = runners[part]()
        except Exception as error:  # one failing part must not lose the others' numbers
            results[part] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            log(f"  {part} FAILED: {results[part]['error']}")
        results.setdefault("part_seconds", {})[part] = round(time.perf_counter() - start, 2)
        write_results(results, path)


def ceilings(smoke: bool) -> dict:
    """``roofline.ceilings`` (copy, read-only stream, matmul: best of several, device-timed)
    on every local device."""
    out = {}
    for d in jax.local_devices():
        with jax.default_device(d):
            # --smoke: roofline.py --smoke's sizes (the code path on every device, not the numbers)
            c = roofline.ceilings((8 << 20) if smoke else (4 << 30), 1 if smoke else 3, 128 if smoke else 8192)
        out[str(d)] = {"read_Bps": c["read"]["best"], "copy_Bps_best": c["copy"]["best"],
                       "matmul_flops": c["matmul"]["best"], "detail": c}
        log(f"ceilings {d}:\n{roofline.describe(c)}")
    return out


def decode_batch(n: int, ctx: int, max_pages: int):
    """One greedy decode token for each of ``n`` sequences of ``ctx`` cached tokens."""
    return model_gpu.decode_batch(n, ctx, PAGE, max_pages)


def prefill_batch(n: int, t: int, max_pages: int):
    b = empty_batch(n * t, n, max_pages)
    per = -(-t // PAGE)
    for i in range(n):
        pages = 1 + i * per + np.arange(per)
        pos = np.arange(t)
        rows = slice(i * t, (i + 1) * t)
        b.page_table[i, :per] = pages
        b.seq_lens[i] = t
        b.positions[rows] = pos
        b.slot_mapping[rows] = pages[pos // PAGE] * PAGE + pos % PAGE
        b.query_start[i + 1] = (i + 1) * t
        b.sample_index[i] = (i + 1) * t - 1
        b.token_ids[rows] = (pos * 7919 + i) % 1000
    return b


def weight_bytes_per_device(weights, mesh) -> list[int]:
    """Bytes a TP-mode decode step must read on each device: every weight shard but the
    embedding table, of which a decode gathers a few rows (unless it is also the LM head)."""
    tp = weights.tp
    read = tp if tp.lm_head is None else dataclasses.replace(tp, embed=None)
    return [sum(s.data.nbytes for leaf in jax.tree.leaves(read) for s in leaf.addressable_shards
                if s.device == d) for d in mesh.devices.flat]


def kv_bytes_per_token(weights, config) -> int:
    """K and V bytes a decode step reads per token of context on each device: every layer's
    K and V rows of the KV slots a device holds (TP mode spreads the slots over every device)."""
    return 2 * config.num_layers * weights.dims.kv_slots * config.head_dim * jnp.dtype(jnp.bfloat16).itemsize


def time_steps(weights, mesh, shapes: dict, *, attention: str, profile: bool, num_pages: int,
               compiler_options: dict | None = None, sample_in_step: bool = True, all_to_all: str = "xla") -> dict:
    """Wall (median, synchronised) and device span of each (mode, shape) step, compiled
    with XLA ``compiler_options`` (debug options by name) when given. ``sample_in_step``:
    see ``make_step`` (False: the engine's step, whose greedy packing holds no conditional;
    the in-step sampler's conditionals block the host until the device reaches them);
    ``all_to_all``: ``make_step``'s (SP's exchanges)."""
    config = weights.config
    caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(num_pages, PAGE, str(weights.tp.embed.dtype)))
    state = {"caches": caches}
    lowered = {}
    for mode, name in shapes:
        step = make_step(weights, mode, StepOptions(attention=attention, layer_loop="unrolled", sample_in_step=sample_in_step, all_to_all=all_to_all))
        batch = to_device(shapes[(mode, name)], weights)
        lowered[(mode, name)] = (step.lower(params_for(weights, mode), caches, batch), batch)
    start = time.perf_counter()
    # Concurrently, as the engine compiles (on one GPU they overlap; on a mesh the autotuner
    # serialised them in the before-run).
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        compiled = dict(zip(lowered, pool.map(lambda key: lowered[key][0].compile(compiler_options), lowered)))
    compile_s = time.perf_counter() - start
    log(f"  {dict(mesh.shape)}: {len(compiled)} executables compiled concurrently in {compile_s:.1f} s")
    out = {"compile_s_all": compile_s}
    for (mode, name), executable in compiled.items():
        batch = lowered[(mode, name)][1]
        params = params_for(weights, mode)

        def run(b, field="packed"):
            result, state["caches"] = executable(params, state["caches"], b)
            return getattr(result, field)

        warmup, iters = TIMED_CALLS[jax.default_backend()]
        row = {"wall_ms": time_fn(run, batch, warmup=warmup, iters=iters) * 1e3, "call_ms": _call_ms(run, batch, iters),
               # the greedy tokens of the step (the same batch each call): variants must agree
               "tokens": np.asarray(run(batch))[:, 0].tolist(),
               # the logits' bytes, where the step returns them: SP's against TP's, and a
               # variant that must not change the numbers shows it here
               "logits_sha1": None if sample_in_step else hashlib.sha1(
                   np.asarray(run(batch, "logits").addressable_shards[0].data).tobytes()).hexdigest(),
               # XLA's command buffers as HLO calls; 0 on 2x H200 with JAX 0.11.2 even where they
               # were on (XLA forms them from the thunk sequence): compare the launch time instead
               "command_buffer_calls": executable.as_text().count("to_apply=%command_buffer")}
        span = device_time(run, (batch,), iters=8, top=5) if profile else None
        if span:
            row.update(span_ms=span["span"] * 1e3, kernels_per_step=span["kernels"], by_kind=span["by_kind"],
                       top=[(round(a * 1e3, 3), c, k) for a, c, k in span["top"]])
        else:
            row["span_ms"] = None  # no device trace here (CPU): wall time only
        out[f"{mode}:{name}"] = row
        span_text = "n/a" if row["span_ms"] is None else f"{row['span_ms']:.2f} ms"
        log(f"  {dict(mesh.shape)} {mode:2s} {name:10s} wall {row['wall_ms']:8.2f} ms  device span {span_text}  "
            f"launch {row['call_ms']:.2f} ms  command buffers {row['command_buffer_calls']}  "
            f"kernels {row.get('kernels_per_step', 'n/a')}")
        if row.get("by_kind"):
            log("      per device: " + ", ".join(f"{kind} {v['ms']:.2f} ms x{v['count']:.0f}"
                                              for kind, v in sorted(row["by_kind"].items())))
    return out


def _call_ms(run, batch, iters: int = 15) -> float:
    """Median host time for the executable call to return (the launch, not the step)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = run(batch)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return float(np.median(times)) * 1e3


def correctness(smoke: bool, attention: str, gemms: tuple[str, ...]) -> dict:
    """Greedy tokens of one device vs the 2-device mesh in every mode (float32, random
    SmolLM2-shaped weights: the real model may be missing on a GPU machine without network), and TP vs
    SP logits of the 8B shape in bf16, with XLA's collectives and (two GPUs) with the one-shot
    kernels, whose logits must equal XLA's TP mode's bit for bit; once per GEMM backend of ``gemms`` (``EngineConfig.gemm``;
    on the CPU only Triton, the other's options being GPU-only)."""
    config = dataclasses.replace(SMOLLM2, num_layers=2) if smoke else SMOLLM2
    params = device_random_params(config, jnp.float32, seed=1)
    prompts = [[(i * 37 + j * 11) % 1000 + 5 for j in range(n)] for i, n in enumerate((5, 17, 40, 3))]
    greedy = SamplingParams(max_tokens=8 if smoke else 16, ignore_eos=True)
    big = dataclasses.replace(LLAMA8B, num_layers=2) if smoke else LLAMA8B
    if smoke:
        big = dataclasses.replace(big, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                                  head_dim=32, vocab_size=1024)
    big_weights = shard_params(device_random_params(big, jnp.bfloat16), big, make_mesh(2, 1, jax.devices()[:2]))
    out = {"bf16_tolerance": 1e-2}
    for gemm in ("triton",) if smoke else gemms:
        tokens = {}
        for label, (sp, tp, devices, mode) in {
            "1gpu": (1, 1, jax.devices()[:1], "tp"), "tp2": (1, 2, jax.devices()[:2], "tp"),
            "sp2": (2, 1, jax.devices()[:2], "sp"), "alternate": (2, 1, jax.devices()[:2], "alternate"),
        }.items():
            weights = shard_params(params, config, make_mesh(sp, tp, devices))
            # num_pages given: sized from memory, each engine would take what the one before still holds
            engine = Engine(weights, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                                  num_pages=64, token_buckets=(64,) if smoke else (8, 64), seq_buckets=(4,), mode=mode,
                                                  attention=attention, layer_loop="scan", gemm=gemm))
            requests = [engine.add_request(p, greedy) for p in prompts]
            engine.run_until_done(requests)
            tokens[label] = [r.output_ids for r in requests]
            del engine, weights
        same = {k: v == tokens["1gpu"] for k, v in tokens.items()}
        log(f"{gemm}: greedy tokens equal to one device: {same}")

        caches = allocate_cache(big_weights.mesh, big.num_layers, big_weights.layout.kv_slots, big.head_dim,
                                CacheConfig(2 * 64 + 2, PAGE, "bfloat16"))
        batch = to_device(prefill_batch(2, 64 if smoke else 1000, 64), big_weights)
        options = compiling.xla_compiler_options(StepOptions(gemm=gemm), jax.devices()[0].platform)
        logits = {}
        # XLA's collectives, then (two GPUs) the one-shot kernels for TP's sums and SP's exchanges
        collectives = ("xla",) if smoke else ("xla", "one_shot")
        if "one_shot" in collectives:
            setup_one_shot(big_weights.mesh.devices.flat, require_nvlink=True)
        for collective in collectives:
            for mode in ("tp", "sp"):
                step = make_step(big_weights, mode, StepOptions(attention=attention, layer_loop="unrolled", all_reduce=collective, all_to_all=collective), return_logits=True)
                compiled = step.lower(params_for(big_weights, mode), caches, batch).compile(options)
                result, caches = compiled(params_for(big_weights, mode), caches, batch)
                logits[(collective, mode)] = np.asarray(result.logits.addressable_shards[0].data, np.float32)
        tp, sp = logits[("xla", "tp")], logits[("xla", "sp")]
        rel = float(np.linalg.norm(tp - sp) / np.linalg.norm(tp))
        argmax_equal = bool((tp.argmax(-1) == sp.argmax(-1)).all())
        # the bytes of every (collectives, mode) pair's logits against XLA's TP mode's
        same_bytes = {f"{c}_{m}": bool((logits[(c, m)].view(np.uint32) == tp.view(np.uint32)).all())
                      for c, m in logits}
        log(f"{gemm}: 8B shape TP vs SP logits: relative error {rel:.2e}, argmax equal {argmax_equal}; "
            f"bytes equal to XLA's TP mode: {same_bytes}")
        out[gemm] = {"greedy_tokens": tokens, "greedy_equal": same, "llama8b_tp_vs_sp_rel": rel,
                     "llama8b_argmax_equal": argmax_equal, "llama8b_logits_bytes_equal_xla_tp": same_bytes,
                     "pass": all(same.values()) and rel < out["bf16_tolerance"]
                     and (smoke or all(same_bytes.values()))}
        del caches
    out["pass"] = all(out[g]["pass"] for g in gemms if g in out)
    return out


def big_config(smoke: bool):
    """Llama-3.1-8B's shape at ``LAYERS`` layers (default all 32), or a tiny stand-in."""
    config = dataclasses.replace(LLAMA8B, num_layers=int(os.environ.get("LAYERS", "32")))
    if smoke:
        config = dataclasses.replace(config, num_layers=2, hidden_size=256, intermediate_size=512,
                                     num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=1024)
    return config


def step_table(smoke: bool, attention: str, profile: bool, where: str) -> dict:
    """``where == "mesh"``: TP and SP steps on both GPUs; ``"1gpu"``: one GPU with the DP
    share of the same work (half the sequences, one of the two prompts). Compiled with the
    engine's default GEMM backend (``EngineConfig.gemm``; Triton before ``199e917``)."""
    config = big_config(smoke)
    ctx, prompt, max_pages = (64, 64, 8) if smoke else (1024, 2048, 260)
    params = device_random_params(config, jnp.bfloat16)
    num_pages = 64 * (ctx // PAGE + 1) + 2
    if where == "mesh":
        mesh = make_mesh(2, 1, jax.devices()[:2])
        shapes = {("tp", "dec8"): decode_batch(8, ctx, max_pages), ("tp", "dec64"): decode_batch(64, ctx, max_pages),
                  ("tp", "pre2x2048"): prefill_batch(2, prompt, max_pages),
                  ("sp", "pre2x2048"): prefill_batch(2, prompt, max_pages),
                  ("tp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages),
                  ("sp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages)}
    else:
        mesh = make_mesh(1, 1, jax.devices()[:1])
        shapes = {("tp", f"dec{n}"): decode_batch(n, ctx, max_pages) for n in (4, 8, 32, 64)}
        shapes[("tp", "pre1x2048")] = prefill_batch(1, prompt, max_pages)
    if smoke:  # the code path, not the table: one decode and one prefill step per mesh
        shapes = dict(list(shapes.items())[:1] + list(shapes.items())[-1:])
    weights = shard_params(params, config, mesh)
    del params
    gemm = EngineConfig.gemm
    out = {"layers": config.num_layers, "weight_bytes_per_device": weight_bytes_per_device(weights, mesh),
           "kv_bytes_per_token_per_device": kv_bytes_per_token(weights, config), "decode_context": ctx + 1, "gemm": gemm}
    out.update(time_steps(weights, mesh, shapes, attention=attention, profile=profile, num_pages=num_pages,
                          compiler_options=compiling.xla_compiler_options(StepOptions(gemm=gemm), jax.devices()[0].platform)))
    return out


def levers(smoke: bool, attention: str, profile: bool) -> dict:
    """Where a TP decode step's launch and GEMM time go, and what SP costs against DP, in one
    part (mesh (2, 1): both modes, as ``serve --sp 2``; steps without the in-step sampler, as
    the engine's):

    - ``default`` (XLA's defaults: Triton GEMMs, the engine's default before ``199e917``) /
      ``cublas`` (every GEMM by cuBLAS instead of autotuned Triton: small-M
      GEMMs, and compile time) / ``one_shot`` (XLA's one-shot all-reduce kernel) on decode
      steps at the engine's buckets, and on the SP, TP and DP prefill of equal work;
    - ``dec1`` against ``dec1_in_8``: one decoding sequence in a 1- and an 8-sequence bucket
      (what a sequence bucket saves);
    - one GPU running half the heads and half the MLP (a TP shard's work, with the whole
      vocabulary) with no collectives: how much of the launch the all-reduces cost;
    - one GPU with the whole model prefilling one prompt: DP's share of the equal work.
    """
    from shiftjax.serving.engine.buckets import pad_batch

    config = big_config(smoke)
    ctx, prompt, max_pages = (64, 64, 8) if smoke else (1024, 2048, 260)
    decode = {("tp", "dec1"): pad_batch(decode_batch(1, ctx, max_pages), 16, 1),
              ("tp", "dec1_in_8"): pad_batch(decode_batch(1, ctx, max_pages), 16, 8),
              ("tp", "dec8"): pad_batch(decode_batch(8, ctx, max_pages), 16, 8),
              ("tp", "dec64"): decode_batch(64, ctx, max_pages)}
    prefill = {("sp", "pre2x2048"): prefill_batch(2, prompt, max_pages),
               ("tp", "pre2x2048"): prefill_batch(2, prompt, max_pages),
               ("sp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages),
               ("tp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages)}
    if smoke:
        decode, prefill = dict(list(decode.items())[:1]), dict(list(prefill.items())[:1])
    # (cuBLAS with XLA's default command buffers, as measured; EngineConfig.gemm="cublas" adds small graphs)
    cublas = {"xla_gpu_enable_triton_gemm": False}
    one_shot = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
    variants = functools.partial(_option_variants, smoke, attention, profile, sample_in_step=False)
    mesh = make_mesh(2, 1, jax.devices()[:2])
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh)
    out = {"weight_bytes_per_device": weight_bytes_per_device(weights, mesh)}
    out.update(variants(mesh, weights, {**decode, **prefill}, {"default": None, "cublas": cublas}))
    del weights
    one = make_mesh(1, 1, jax.devices()[:1])
    half = dataclasses.replace(config, num_heads=config.num_heads // 2, num_kv_heads=config.num_kv_heads // 2,
                               intermediate_size=config.intermediate_size // 2)
    weights = shard_params(device_random_params(half, jnp.bfloat16), half, one)
    # a TP shard's work, no collectives
    out.update(variants(one, weights, {k: v for k, v in decode.items() if k[1] != "dec1_in_8"},
                        {"one_gpu_half_model": None}))
    out["one_gpu_half_model"]["weight_bytes_per_device"] = weight_bytes_per_device(weights, one)
    del weights
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, one)  # one GPU, whole model
    out.update(variants(one, weights, {("tp", "pre1x2048"): prefill_batch(1, prompt, max_pages)},
                        {"dp_default": None, "dp_cublas": cublas}))
    del weights
    if not smoke:  # last: the least likely to matter
        weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh)
        out.update(variants(mesh, weights, decode, {"one_shot": one_shot}))
    return out


def sp_all_to_all(smoke: bool, attention: str, profile: bool) -> dict:
    """What SP's all-to-alls cost against DP (target 3): SP prefill of 2 x 2048 and 4096
    tokens and TP of 4096 on the mesh (2, 1), DP's share (one prompt of 2048 on one GPU, the
    whole model), and decode of 64 sequences of 1k (SP and TP on the mesh; DP's share, 32 on
    one GPU), all with ``--gemm cublas``'s options, SP's exchanges by NCCL (``cublas``),
    by the one-shot kernel (``one_shot``: ``make_step(all_to_all="one_shot")``), and by the
    kernel over ``--weight-storage two_copies`` (``one_shot_two_copies``). Greedy tokens and
    the logits' bytes must agree between the aliased variants (``cublas``, ``one_shot``), and SP's logits' bytes with
    TP's at 4096 tokens in each.

    (Earlier trees measured XLA's copy-engine all-to-alls, ``memcpy_p2p``, and token chunks
    here, both slower; README.md, "Tried and not kept".)"""
    config = big_config(smoke)
    prompt, max_pages = (64, 8) if smoke else (2048, 260)
    context = 64 if smoke else 1024
    decode_pages = context // PAGE + 1
    shapes = {("sp", "pre2x2048"): prefill_batch(2, prompt, max_pages),
              ("sp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages),
              ("tp", "pre4096"): prefill_batch(1, 2 * prompt, 2 * max_pages),
              ("sp", "dec64"): decode_batch(64, context, decode_pages),
              ("tp", "dec64"): decode_batch(64, context, decode_pages)}
    cublas = None if smoke else compiling.xla_compiler_options(StepOptions(gemm="cublas"), "gpu")  # GPU-only options
    kernel = "xla" if smoke else "one_shot"  # the kernel needs two GPUs
    run = functools.partial(time_steps, attention=attention, profile=profile, num_pages=64 * (context // PAGE + 1) + 2,
                            compiler_options=cublas, sample_in_step=False)
    mesh = make_mesh(2, 1, jax.devices()[:2])
    if kernel == "one_shot":
        setup_one_shot(mesh.devices.flat, require_nvlink=True)
    out = {}
    for storage in ("aliased", "two_copies"):
        weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh, storage)
        for name, exchange in ((("cublas", "xla"), ("one_shot", kernel)) if storage == "aliased"
                               else (("one_shot_two_copies", kernel),)):
            log(f"  variant {name}")
            out[name] = run(weights, mesh, shapes, all_to_all=exchange)
        del weights
    one = make_mesh(1, 1, jax.devices()[:1])
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, one)
    out["dp_cublas"] = run(weights, one, {("tp", "pre1x2048"): prefill_batch(1, prompt, max_pages),
                                          ("tp", "dec32"): decode_batch(32, context, decode_pages)})
    del weights
    variants = ("cublas", "one_shot", "one_shot_two_copies")
    dp = out["dp_cublas"]["tp:pre1x2048"]["wall_ms"]
    for name in variants:
        sp, tp = out[name]["sp:pre2x2048"]["wall_ms"], out[name]["tp:pre4096"]["wall_ms"]
        out[name]["sp_vs_dp"] = dp / sp
        out[name]["sp_vs_tp_4096"] = tp / out[name]["sp:pre4096"]["wall_ms"]
        # decode: 64 sequences over the mesh against DP's 32 a GPU, and against TP mode's 64
        out[name]["sp_vs_dp_decode64"] = out["dp_cublas"]["tp:dec32"]["wall_ms"] / out[name]["sp:dec64"]["wall_ms"]
        out[name]["sp_vs_tp_decode64"] = out[name]["tp:dec64"]["wall_ms"] / out[name]["sp:dec64"]["wall_ms"]
        log(f"  {name}: SP vs DP {dp / sp:.3f}x, SP vs TP at 4096 {out[name]['sp_vs_tp_4096']:.3f}x; decode of 64: "
            f"SP vs DP {out[name]['sp_vs_dp_decode64']:.3f}x, SP vs TP {out[name]['sp_vs_tp_decode64']:.3f}x")

    def agree(field, names):  # the steps of ``names`` against the first one's
        first = out[names[0]]
        return all(out[name][k][field] == first[k][field] for name in names for k in first if ":" in k)

    # two_copies sums in another order: its greedy tokens differ at near-ties of the random
    # weights (12 of the 64 decode rows in x2_exchange/call5), so only the aliased must agree
    out["same_tokens"] = agree("tokens", variants[:2])
    out["same_logits"] = agree("logits_sha1", variants[:2])
    out["sp_logits_equal_tp_4096"] = {name: out[name]["sp:pre4096"]["logits_sha1"] == out[name]["tp:pre4096"][
        "logits_sha1"] for name in variants}
    log(f"  the same greedy tokens (aliased): {out['same_tokens']}; the same logits' bytes (aliased): "
        f"{out['same_logits']}; SP's logits bytes equal to TP's at 4096: {out['sp_logits_equal_tp_4096']}")
    # SP's logits equal TP's on the GPUs (every run since x2_run1); not on the CPU in bf16, whose
    # all-reduce rounds otherwise (the CPU mesh's equality is tested in float32, test_invariance)
    out["pass"] = out["same_tokens"] and out["same_logits"] and (
        smoke or all(out["sp_logits_equal_tp_4096"][name] for name in variants[:2]))
    return out


def dummy_load(smoke: bool) -> dict:
    """Seconds ``--load-format dummy`` takes for the 8B shape at ``--sp 2``, twice in one
    process (``dummy_start.timed_dummy_loads``)."""
    from dummy_start import timed_dummy_loads

    return timed_dummy_loads(big_config(smoke), make_mesh(2, 1, jax.devices()[:2]), log=log)


def _option_variants(smoke, attention, profile, mesh, weights, shapes, variants, **step_options) -> dict:
    """``time_steps`` of ``shapes`` once per set of XLA compile options (GPU-only sets skipped
    in --smoke), with ``step_options`` (``time_steps``'s keywords)."""
    ctx = 64 if smoke else 1024
    out = {}
    for name, options in variants.items():
        if smoke and options:
            continue  # a GPU-only option
        log(f"  variant {name}")
        out[name] = time_steps(weights, mesh, shapes, attention=attention, profile=profile,
                               num_pages=64 * (ctx // PAGE + 1) + 2, compiler_options=options, **step_options)
    return out


def collectives(smoke: bool) -> dict:
    """Seconds of one all-reduce (``psum``) and one all-to-all over both devices against
    message size (bytes per device), the inputs of the 8-GPU projection (projection.py): each
    collective chained ``repeats`` times inside one jit so launch cost is amortised as in a step."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    sizes = [1 << 12, 1 << 14, 1 << 16, 1 << 18] if smoke else [1 << k for k in range(12, 28, 2)]
    repeats = 4 if smoke else 20
    out = {"bytes_per_device": sizes, "all_reduce_s": [], "all_to_all_s": []}
    kernels = not smoke  # the one-shot kernels run on two GPUs (on the CPU they are lowered only)
    if kernels:
        setup_one_shot(mesh.devices.flat, require_nvlink=True)
        out.update(one_shot_all_reduce_s=[], one_shot_all_to_all_s=[])

    def chained(collective):
        def body(x):
            for _ in range(repeats):
                x = collective(x) * 0.5  # the scale keeps bf16 values bounded and the chain serial
            return x
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    reduce = chained(lambda x: jax.lax.psum(x, "x"))
    exchange = chained(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True))
    measured = {"all_reduce_s": reduce, "all_to_all_s": exchange}
    one_shot = {"one_shot_all_reduce_s": chained(lambda x: collective_kernels.all_reduce(x, ("x",), "one_shot")),
                "one_shot_all_to_all_s": chained(lambda x: collective_kernels.all_to_all(
                    x, "x", 0, "one_shot", collective_kernels.first_ordinal_of(mesh)))}
    if kernels:
        measured.update(one_shot)
    else:  # the CPU cannot run them: lower them, so that a broken wrapper fails here too
        x = jax.device_put(jnp.ones((sizes[0],), jnp.bfloat16), NamedSharding(mesh, P("x")))
        texts = [fn.lower(x).as_text() for fn in one_shot.values()]
        out["one_shot_lowered"] = all(collective_kernels.TARGET in text or collective_kernels.EXCHANGE_TARGET in text
                                      for text in texts)
    for size in sizes:
        x = jax.device_put(jnp.ones((2 * size // 2,), jnp.bfloat16), NamedSharding(mesh, P("x")))
        for name, fn in measured.items():
            if name.startswith("one_shot") and size > collective_kernels.DEFAULT_CAPACITY_BYTES:
                out[name].append(None)  # the kernel would take psum / NCCL: not measured
                continue
            out[name].append(min(time_fn(fn, x, warmup=1 if smoke else 2, iters=3 if smoke else 10)
                                 for _ in range(1 if smoke else 3)) / repeats)
        log(f"  {size:>10d} B/device: " + ", ".join(
            f"{name[:-2]} {'n/a' if out[name][-1] is None else f'{out[name][-1] * 1e6:8.1f} us'}" for name in measured))
    return out


# XLA command buffers (CUDA graphs) for every kind of command: fewer launches per step.
COMMAND_BUFFER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES,CUDNN",
                          "xla_gpu_graph_min_graph_size": "1"}


def summarise(results: dict) -> dict:
    """The issue's ratios from this run's own ceilings ({} when a part or one of the step
    rows they need is missing, as in --smoke, which runs one step of each kind)."""
    if not all(isinstance(results.get(p), dict) and "error" not in results[p]
               for p in ("ceilings", "steps_mesh", "steps_1gpu")):
        return {}
    mesh_rows = ("tp:dec8", "tp:dec64", "tp:pre2x2048", "sp:pre2x2048", "tp:pre4096", "sp:pre4096")
    one_rows = ("tp:dec4", "tp:dec8", "tp:dec64", "tp:pre1x2048")
    if not (all(r in results["steps_mesh"] for r in mesh_rows) and all(r in results["steps_1gpu"] for r in one_rows)):
        return {}
    read = min(c["read_Bps"] for c in results["ceilings"].values())  # the slower GPU bounds a mesh
    mesh, one = results["steps_mesh"], results["steps_1gpu"]
    floor_mesh = max(mesh["weight_bytes_per_device"]) / read
    floor_one = max(one["weight_bytes_per_device"]) / read
    s = {"read_TBps": read / 1e12, "tp_weight_floor_ms_2gpu": floor_mesh * 1e3, "weight_floor_ms_1gpu": floor_one * 1e3}

    def kv_floor(table, seqs, context):  # the K/V a decode step reads, over the same stream
        return seqs * context * table.get("kv_bytes_per_token_per_device", 0) / read

    engine = results.get("engine", {})
    for n in (8, 64):
        # weight floor: the issue's; floor: weights and the K/V of every context (bytes read)
        for name, table, floor in (("tp", mesh, floor_mesh), ("1gpu", one, floor_one)):
            wall = table[f"tp:dec{n}"]["wall_ms"]
            s[f"{name}_dec{n}_weight_floor_ratio"] = floor * 1e3 / wall
            s[f"{name}_dec{n}_floor_ratio"] = (floor + kv_floor(table, n, table.get("decode_context", 0))) * 1e3 / wall
        # the engine's own weights (its mesh may be one GPU: --engine-tp 1)
        floor_engine = max(engine.get("weight_bytes_per_device", mesh["weight_bytes_per_device"])) / read
        for loop in ("sync", "async"):
            for key, row in engine.items():
                if key.endswith(f"{loop}:dec{n}"):
                    s[f"engine_{key}_weight_floor_ratio"] = floor_engine * 1e3 / row["wall_ms_median"]
                    s[f"engine_{key}_floor_ratio"] = (floor_engine + kv_floor(engine, n, engine.get("context_at_least", 0))
                                                      ) * 1e3 / row["wall_ms_median"]
    s["tp_dec8_vs_1gpu_dec4_speedup"] = one["tp:dec4"]["wall_ms"] / mesh["tp:dec8"]["wall_ms"]
    # Equal work: the mesh prefills two prompts in one step; DP gives each GPU one.
    s["sp_vs_dp_throughput"] = one["tp:pre1x2048"]["wall_ms"] / mesh["sp:pre2x2048"]["wall_ms"]
    s["tp_vs_dp_throughput"] = one["tp:pre1x2048"]["wall_ms"] / mesh["tp:pre2x2048"]["wall_ms"]
    s["sp_vs_tp_4096"] = mesh["tp:pre4096"]["wall_ms"] / mesh["sp:pre4096"]["wall_ms"]
    for key, row in mesh.items():
        if isinstance(row, dict) and row.get("span_ms"):
            s[f"host_gap_fraction {key}"] = 1 - row["span_ms"] / row["wall_ms"]
    return s


def _engine_loop_module():
    import engine_loop  # imported on use: it imports this module's helpers
    return engine_loop


def _engine_part(args, attention: str) -> dict:
    return _engine_loop_module().engine_loop(
        args.smoke, attention, args.engine_variants.split(","), args.engine_rounds,
        tuple(int(b) for b in args.engine_seq_buckets.split(",") if b), args.engine_tp, args.engine_model,
        tuple(int(n) for n in args.engine_seq_counts.split(",") if n),
        tuple(int(t) for t in args.engine_token_buckets.split(",") if t))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 4 virtual CPU devices")
    parser.add_argument("--parts", default=PARTS)
    parser.add_argument("--engine-variants", default="shipped,in_step_sampler",
                        help="engines the engine part measures: shipped, cublas, triton (EngineConfig.gemm), "
                             "triton_small_graphs (Triton GEMMs, command buffers down to one command), "
                             "command_buffers (compiled with COMMAND_BUFFER_OPTIONS), no_command_buffers, "
                             "never_update, capture_never_update, skip_temp and skip_profiled (XLA's command "
                             "buffer update modes), cublaslt, one_shot_all_reduce and xla_all_reduce "
                             "(EngineConfig.all_reduce), in_step_sampler (the steps sample in the step, with "
                             "the conditionals that blocked the host)")
    parser.add_argument("--engine-rounds", type=int, default=2,
                        help="times the engine part measures every (variant, loop), in alternating order")
    parser.add_argument("--engine-seq-buckets", default="",
                        help="the engine part's sequence buckets, comma separated (default: the engine's ladder; "
                             "given alone, its token buckets are these)")
    parser.add_argument("--engine-token-buckets", default="",
                        help="the engine part's token buckets below its prefill budget (default: the engine's "
                             "ladder; '64' with --engine-seq-buckets 1,8,64 is the default before 2026-12-01)")
    parser.add_argument("--engine-tp", type=int, default=2,
                        help="GPUs the engine part's TP mesh spans (1: one GPU, the whole model)")
    parser.add_argument("--engine-model", default="llama8b", choices=("llama8b", "smollm2"),
                        help="the engine part's model shape (random bf16 weights)")
    parser.add_argument("--engine-seq-counts", default="",
                        help="sequences decoding in the engine part's steps, comma separated (default 1,8,64)")
    parser.add_argument("--correct-gemms", default=",".join(GEMM_BACKENDS),
                        help="the GEMM backends the correct part checks, in order")
    parser.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                        help="earlier parts' JSON files to summarise together with this run")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 4)
    attention = "reference" if args.smoke else "pallas"
    profile = not args.smoke
    RESULTS.update(device=f"{jax.device_count()}x {jax.devices()[0].device_kind}", jax=jax.__version__,
                   commit=os.environ.get("COMMIT", "unknown"),
                   # what changes XLA's behaviour from outside the script: kept with the numbers
                   environment={name: os.environ.get(name) for name in RECORDED_ENVIRONMENT})
    os.makedirs(args.out, exist_ok=True)
    for path in args.merge:
        with open(path) as f:
            RESULTS.update({k: v for k, v in json.load(f).items() if k not in RESULTS})
    runners = {"ceilings": lambda: ceilings(args.smoke),
               "correct": lambda: correctness(args.smoke, attention, tuple(args.correct_gemms.split(","))),
               "steps_mesh": lambda: step_table(args.smoke, attention, profile, "mesh"),
               "steps_1gpu": lambda: step_table(args.smoke, attention, profile, "1gpu"),
               "collectives": lambda: collectives(args.smoke),
               "levers": lambda: levers(args.smoke, attention, profile),
               "dummy": lambda: dummy_load(args.smoke),
               "sp_a2a": lambda: sp_all_to_all(args.smoke, attention, profile),
               "engine": lambda: _engine_part(args, attention),
               "xla_options": lambda: _engine_loop_module().xla_options()}
    parts = [p for p in args.parts.split(",") if p]
    if args.smoke and args.parts == PARTS:
        parts = list(runners)  # every code path, the GPU-only variants included
    path = os.path.join(args.out, "shift_x2.json")
    run_parts(RESULTS, runners, parts, path)
    RESULTS["summary"] = summarise(RESULTS)
    write_results(RESULTS, path)
    log(json.dumps(RESULTS["summary"], indent=1))
    # a part fails by raising, or by a check it records as "pass" (correct, sp_a2a)
    return 0 if all("error" not in RESULTS[p] and RESULTS[p].get("pass", True) for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
