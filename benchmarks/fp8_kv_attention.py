"""Decode attention over a bf16 KV cache against an FP8 (float8_e4m3fn) one, on one GPU.

    python3 -P benchmarks/fp8_kv_attention.py            # on the H200 (run_fp8_kv.sh)
    python3 -P benchmarks/fp8_kv_attention.py --smoke    # tiny shapes, interpret mode, any machine

Llama-3.1-8B's attention shape on one GPU (32 q heads, 8 KV heads, head_dim 128, page size
16), every sequence decoding one token over ``--context`` (8k) cached tokens on shuffled
pages, for each of ``--seqs`` sequence counts. Each call is timed as attention_bench.py
times it: inside one jitted ``lax.scan`` over the layers of a stacked cache (more bytes
than the L2 holds, so no layer is read from L2), divided by the layers. Two device times
from a profiler trace: the whole ``ragged_paged_attention`` call (q re-layout, the decode
kernel, the prefill kernel's empty launch, the split combine) and the Pallas decode kernel
alone. Bytes read are the K and V bytes the contexts hold (``2 * seqs * context * 8 * 128 *
itemsize``), against the read-only stream rate measured in the same run
(``roofline.read_ceiling``, best of 12 readings). The FP8 cases use scales 0.5 (K) and 2.0
(V), so the folded scale arithmetic is in the timed path. Correctness: the Pallas path
against the reference on layer 0 of every cache, on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import HOST_WALL, device_time, read_ceiling, time_fn  # noqa: E402

from shiftjax.kernels import AttentionMetadata, ragged_paged_attention  # noqa: E402
from shiftjax.kernels import reference as _reference  # noqa: E402
from shiftjax.kernels.pallas_gpu import PallasAttentionConfig  # noqa: E402
from shiftjax.kernels.reference import to_cache_dtype  # noqa: E402
from shiftjax.kernels.testing import deal_pages  # noqa: E402

_reference._CHUNK_BUDGET_BYTES = 4 << 30  # the oracle only; on the GPU it may hold more at once
FP8 = jnp.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0


def log(*parts):
    print(*parts, flush=True)


def make_case(rng, seqs, context, *, q_heads, kv_slots, head_dim, page_size, layers):
    """bf16 q and a stacked bf16 cache of random values whose pages are dealt out shuffled."""
    page_table, num_pages = deal_pages(rng, [context] * seqs, page_size)
    key_q, key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    shape = (layers, kv_slots, num_pages, page_size, head_dim)
    q = jax.random.normal(key_q, (seqs, q_heads, head_dim), jnp.bfloat16)
    k_cache = jax.random.normal(key_k, shape, jnp.bfloat16)
    v_cache = jax.random.normal(key_v, shape, jnp.bfloat16)
    md = AttentionMetadata(jnp.arange(seqs + 1, dtype=jnp.int32), jnp.full((seqs,), context, jnp.int32),
                           jnp.asarray(page_table))
    return q, k_cache, v_cache, md


def scales_of(cache):
    return dict(k_scale=K_SCALE, v_scale=V_SCALE) if cache.dtype == FP8 else {}


def timed_layers(q, k_cache, v_cache, md, config, iters):
    """Per layer: device seconds of the attention call and of the decode kernel alone."""
    layers = k_cache.shape[0]
    kw = dict(sm_scale=q.shape[-1] ** -0.5, implementation="pallas", config=config, **scales_of(k_cache))

    @jax.jit
    def all_layers(q, k_cache, v_cache, md):
        def body(acc, layer):
            out = ragged_paged_attention(q, k_cache, v_cache, md, layer=layer, **kw)
            return acc + out[:1].astype(jnp.float32), None
        acc, _ = jax.lax.scan(body, jnp.zeros((1,) + q.shape[1:], jnp.float32), jnp.arange(layers, dtype=jnp.int32))
        return acc

    wall = time_fn(all_layers, q, k_cache, v_cache, md, warmup=2, iters=iters) / layers
    trace = device_time(all_layers, (q, k_cache, v_cache, md), iters, top=12, quiet=True)
    if trace is None:
        return {"call_s": wall, "decode_kernel_s": None, "timer": HOST_WALL}
    decode = [t for t, _, name in trace["top"] if "decode" in name]
    return {"call_s": trace["span"] / layers, "decode_kernel_s": sum(decode) / layers if decode else None,
            "kernels_per_layer": trace["kernels"] / layers, "timer": "device span (profiler trace)",
            "top": [(round(t / layers * 1e6, 2), round(n / layers, 2), name) for t, n, name in trace["top"][:6]],
            "host_wall_call_s": wall}


def check(q, k_cache, v_cache, md, config):
    """Relative L2 error of the Pallas path against the reference on layer 0 (on the device)."""
    kw = dict(layer=0, sm_scale=q.shape[-1] ** -0.5, **scales_of(k_cache))
    got = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="pallas", config=config))(
        q, k_cache, v_cache, md)
    want = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="reference"))(q, k_cache, v_cache, md)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return {"rel_l2_error": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "finite": bool(np.isfinite(got).all())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode: the code path only")
    parser.add_argument("--seqs", default="1,8,64")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", default="block_k256,stages4,block_k256_warps8",
                        help="decode configs tried beside the default (on the fp8 cache only with --fp8-variants-only)")
    parser.add_argument("--fp8-variants-only", action="store_true", help="the bf16 cache runs the default only")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_kv_attention.json")
    smoke = args.smoke
    q_heads, kv_slots, head_dim, page_size = (8, 2, 32, 16) if smoke else (32, 8, 128, 16)
    context, iters = (64, 2) if smoke else (args.context, args.iters)
    tiny = dict(prefill_rows=16, prefill_block_k=16, decode_block_k=16, interpret=True)
    variants = {"default": PallasAttentionConfig(**tiny) if smoke else PallasAttentionConfig()}
    # Run 1 also tried block_k 64 x 3 stages, run 2 these: none faster than the default
    # over the FP8 cache (benchmarks/results/fp8_h200/kv_cache/README.md).
    if not smoke:
        variants.update({name: PallasAttentionConfig(**kw) for name, kw in {
            "block_k256": dict(decode_block_k=256),
            "stages4": dict(decode_num_stages=4),
            "block_k256_warps8": dict(decode_block_k=256, decode_num_warps=8),
        }.items() if name in args.variants.split(",")})
    started = time.perf_counter()
    read = read_ceiling(8 << 20, 1) if smoke else read_ceiling()
    read_bps = read["best"]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "shape": dict(q_heads=q_heads, kv_heads=kv_slots, head_dim=head_dim, page_size=page_size,
                             context=context), "fp8_scales": dict(k_scale=K_SCALE, v_scale=V_SCALE),
               "read_stream": read, "cases": {}}
    log(f"{results['device']}, JAX {jax.__version__}; read-only stream {read_bps / 1e12:.3f} TB/s "
        f"(best of {read['tries']}, {read['timer']})")

    def save():
        results["seconds"] = round(time.perf_counter() - started, 1)
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    for seqs in (int(s) for s in args.seqs.split(",")):
        # Enough layers that a scan's bytes exceed the L2 (50 MB), under 2**31 elements an array.
        layers = 2 if smoke else (8 if seqs <= 8 else 3)
        q, k_bf16, v_bf16, md = make_case(np.random.default_rng(seqs), seqs, context, q_heads=q_heads,
                                          kv_slots=kv_slots, head_dim=head_dim, page_size=page_size, layers=layers)
        quantise = jax.jit(lambda c, s: to_cache_dtype(c, FP8, s), static_argnums=1)
        caches = {"bfloat16": (k_bf16, v_bf16)}
        caches["float8_e4m3fn"] = (quantise(k_bf16, K_SCALE), quantise(v_bf16, V_SCALE))
        for dtype, (k_cache, v_cache) in caches.items():
            kv_bytes = 2 * seqs * context * kv_slots * head_dim * k_cache.dtype.itemsize
            case = {"seqs": seqs, "dtype": dtype, "layers": layers, "kv_bytes_per_layer": kv_bytes}
            try:
                case["check"] = check(q, k_cache, v_cache, md, variants["default"])
            except Exception as error:  # noqa: BLE001 - reported, the other cases still run
                case["check"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            for name, config in variants.items():
                if args.fp8_variants_only and dtype != "float8_e4m3fn" and name != "default":
                    continue
                try:
                    t = timed_layers(q, k_cache, v_cache, md, config, iters)
                except Exception as error:  # noqa: BLE001 - a variant Triton refuses is reported
                    case[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
                    log(f"{seqs:3d} seqs {dtype:14s} {name}: failed: {case[name]['error']}")
                    continue
                for key in ("call_s", "decode_kernel_s"):
                    if t[key]:
                        t[key.replace("_s", "_TBps")] = kv_bytes / t[key] / 1e12
                        t[key.replace("_s", "_of_read_stream")] = kv_bytes / t[key] / read_bps
                case[name] = t
                if name != "default" and dtype == "float8_e4m3fn":  # a config worth keeping must be right
                    try:
                        t["check"] = check(q, k_cache, v_cache, md, config)
                    except Exception as error:  # noqa: BLE001
                        t["check"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
                kernel = (f"decode kernel {t['decode_kernel_s'] * 1e6:7.1f} us = {t['decode_kernel_of_read_stream']:.0%}"
                          if t["decode_kernel_s"] else "decode kernel: no trace")
                log(f"{seqs:3d} seqs x {context} {dtype:14s} {name:18s}: call {t['call_s'] * 1e6:7.1f} us "
                    f"({kv_bytes / t['call_s'] / 1e12:.2f} TB/s = {kv_bytes / t['call_s'] / read_bps:.0%} of the "
                    f"read stream), {kernel} [{t['timer']}]; vs reference {t.get('check', case['check'])}")
            results["cases"][f"{dtype}:{seqs}"] = case
            save()
        base, fp8 = (results["cases"][f"{d}:{seqs}"].get("default", {}) for d in caches)
        if base.get("call_s") and fp8.get("call_s"):
            results["cases"][f"speedup:{seqs}"] = {
                "call": base["call_s"] / fp8["call_s"],
                "decode_kernel": (base["decode_kernel_s"] / fp8["decode_kernel_s"]
                                  if base.get("decode_kernel_s") and fp8.get("decode_kernel_s") else None)}
            log(f"{seqs:3d} seqs: fp8 cache {results['cases'][f'speedup:{seqs}']} x faster than bf16 (default config)")
        del q, k_bf16, v_bf16, caches
        save()
    log(f"done in {time.perf_counter() - started:.0f} s -> {path}")


if __name__ == "__main__":
    main()
