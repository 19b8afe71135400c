"""Ragged paged attention on the GPU: decode, prefill and mixed.

    python3 benchmarks/attention_bench.py            # on a GPU (run_gpu.sh kernels)
    python3 benchmarks/attention_bench.py --smoke    # tiny shapes, interpret mode, any machine

Every kernel call is timed inside one jitted ``lax.scan`` over ``--layers`` layers of a
stacked cache (one call per layer, as in the model), so dispatch overhead is amortised and
no layer's K/V is still in L2 from the previous call. Reported time is per call (per layer).

- decode: 64 sequences x 4096 context, D 128, bf16, (8 q heads, 1 KV slot) and (32 q, 8
  KV); achieved bytes/s = K+V bytes the context needs / time, against the measured copy
  bandwidth (read + written bytes/s of a 4 GiB device copy, ``roofline.copy_bandwidth``).
  JAX's own Triton paged decode kernel (``pallas.ops.gpu.paged_attention``) runs beside it
  as a peer where it accepts the shapes.
- prefill: one 2048-token chunk after 2048 cached tokens, 32 q / 8 KV heads, D 128, bf16;
  FLOP/s = 4 * D * (visible query-key pairs) * heads / time, against cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``) on the same shapes laid out
  contiguously, counted with cuDNN's own mask's pairs.
- mixed: one 1024-token chunk (after 1024 cached) plus 63 decode tokens (4096 context)
  in one call, against the prefill-only and decode-only calls on the same cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import copy_bandwidth, time_fn  # noqa: E402

from shiftjax.kernels import AttentionMetadata, ragged_paged_attention  # noqa: E402
from shiftjax.kernels import reference as _reference  # noqa: E402
from shiftjax.kernels.pallas_gpu import PallasAttentionConfig  # noqa: E402
from shiftjax.kernels.testing import deal_pages  # noqa: E402

# The reference is only the correctness check here; on the GPU it may hold more at once
# (fewer unrolled tile groups, faster compile).
_reference._CHUNK_BUDGET_BYTES = 4 << 30


def make_batch(rng, q_lens, seq_lens, *, q_heads, kv_slots, head_dim, page_size, layers, dtype):
    """Random q and a stacked cache whose pages are dealt to the sequences shuffled."""
    page_table, num_pages = deal_pages(rng, seq_lens, page_size)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    shape = (layers, kv_slots, num_pages, page_size, head_dim)
    q = jax.random.normal(kq, (int(query_start[-1]), q_heads, head_dim), dtype)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    md = AttentionMetadata(jnp.asarray(query_start), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(page_table))
    return q, k_cache, v_cache, md


def per_layer_time(q, k_cache, v_cache, md, *, implementation, config, iters):
    """Median seconds of one attention call, from a scan over every layer of the cache."""
    layers = k_cache.shape[0]
    sm_scale = 1.0 / np.sqrt(q.shape[-1])

    @jax.jit
    def all_layers(q, k_cache, v_cache, md):
        def body(acc, layer):
            out = ragged_paged_attention(q, k_cache, v_cache, md, layer=layer, sm_scale=sm_scale,
                                         implementation=implementation, config=config)
            return acc + out[:1].astype(jnp.float32), None
        acc, _ = jax.lax.scan(body, jnp.zeros((1,) + q.shape[1:], jnp.float32), jnp.arange(layers, dtype=jnp.int32))
        return acc

    return time_fn(all_layers, q, k_cache, v_cache, md, warmup=2, iters=iters) / layers


def check(q, k_cache, v_cache, md, config, tol):
    """Relative error of the Pallas path against the reference, on layer 0 (run on the GPU)."""
    kw = dict(layer=0, sm_scale=1.0 / np.sqrt(q.shape[-1]))
    got = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="pallas", config=config))(q, k_cache, v_cache, md)
    ref = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="reference"))(q, k_cache, v_cache, md)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    if not np.isfinite(got).all() or err > tol:
        print(f"  !! WRONG: relative error {err:.2e} (tolerance {tol:.0e}), finite={np.isfinite(got).all()}")
    return err


def best_of(label, variants, run):
    """Run every config variant, print each, return (seconds, config) of the fastest."""
    best = None
    for cfg in variants:
        try:
            seconds = run(cfg)
        except Exception as e:  # a variant Triton rejects (resources) is reported, not fatal
            print(f"  {label} {cfg_str(cfg)}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        print(f"  {label} {cfg_str(cfg)}: {seconds * 1e6:9.1f} us")
        if best is None or seconds < best[0]:
            best = (seconds, cfg)
    return best


def cfg_str(cfg):
    return (f"rows={cfg.prefill_rows} pbk={cfg.prefill_block_k} pw={cfg.prefill_num_warps} ps={cfg.prefill_num_stages} "
            f"dbk={cfg.decode_block_k} splits={cfg.decode_splits} dw={cfg.decode_num_warps} ds={cfg.decode_num_stages}")


def bench_decode(args, bw, rng, q_heads, kv_slots, page_size):
    seqs, context, head_dim, dtype = args.decode_seqs, args.context, 128, jnp.bfloat16
    q, kc, vc, md = make_batch(rng, [1] * seqs, [context] * seqs, q_heads=q_heads, kv_slots=kv_slots,
                               head_dim=head_dim, page_size=page_size, layers=args.layers, dtype=dtype)
    kv_bytes = 2 * seqs * context * kv_slots * head_dim * jnp.dtype(dtype).itemsize
    print(f"decode {seqs} seqs x {context} ctx, {q_heads} q / {kv_slots} kv heads, D {head_dim}, page {page_size}, "
          f"bf16: {kv_bytes / 1e6:.1f} MB of K/V per call")
    base = PallasAttentionConfig(interpret=args.smoke)
    variants = [base] if args.smoke or args.quick else [
        base,  # block_k 128, 4 warps, 2 stages
        PallasAttentionConfig(decode_block_k=64, decode_num_stages=3),
        PallasAttentionConfig(decode_block_k=32, decode_num_stages=4),
        PallasAttentionConfig(decode_block_k=64, decode_num_warps=8, decode_num_stages=3),
        PallasAttentionConfig(decode_block_k=64, decode_num_warps=2, decode_num_stages=3),
        PallasAttentionConfig(decode_splits=1),
        PallasAttentionConfig(decode_splits=32),
    ]
    best = best_of("pallas", variants, lambda cfg: per_layer_time(q, kc, vc, md, implementation="pallas", config=cfg, iters=args.iters))
    err = check(q, kc, vc, md, best[1], 2e-2)
    rate = kv_bytes / best[0]
    print(f"  => best {best[0] * 1e6:.1f} us, {rate / 1e12:.2f} TB/s K/V read = {100 * rate / bw:.0f}% of copy bandwidth "
          f"({bw / 1e12:.2f} TB/s); rel. error vs reference {err:.1e}")
    if not args.smoke and not args.quick:
        peer_jax_paged(q, kc, vc, md, kv_bytes, bw, args)
    return dict(case=f"decode {q_heads}q/{kv_slots}kv page {page_size}", us=best[0] * 1e6, tbs=rate / 1e12, pct=100 * rate / bw,
                cfg=cfg_str(best[1]), config=best[1])


def peer_jax_paged(q, kc, vc, md, kv_bytes, bw, args):
    """JAX's Triton paged decode kernel on the same pages (its layout lacks the layer axis)."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except Exception as e:
        print(f"  peer jax paged_attention: unavailable ({e})")
        return
    layers = kc.shape[0]
    lengths = md.seq_lens
    for k_splits in (8,):
        try:
            @jax.jit
            def all_layers(q, kc, vc, pt, lengths):
                def body(acc, layer):
                    out = paged_attention(q, kc[layer], vc[layer], pt, lengths, k_splits=k_splits, pages_per_compute_block=8)
                    return acc + out[:1].astype(jnp.float32), None
                acc, _ = jax.lax.scan(body, jnp.zeros((1,) + q.shape[1:], jnp.float32), jnp.arange(layers))
                return acc
            pt = md.page_table[:, : md.page_table.shape[1] // k_splits * k_splits]
            t = time_fn(all_layers, q, kc, vc, pt, lengths, warmup=2, iters=args.iters) / layers
            print(f"  peer jax paged_attention k_splits={k_splits}: {t * 1e6:.1f} us ({100 * kv_bytes / t / bw:.0f}% of copy bw; "
                  "includes XLA's per-layer slice copy of the cache, so an upper bound)")
        except Exception as e:
            print(f"  peer jax paged_attention k_splits={k_splits}: failed: {type(e).__name__}: {str(e)[:200]}")


def causal_pairs(q_len, kv_len):
    """Visible (query, key) pairs for a chunk of q_len queries ending at position kv_len - 1."""
    first = kv_len - q_len
    return sum(first + i + 1 for i in range(q_len))


def bench_prefill(args, rng, page_size):
    q_heads, kv_slots, head_dim, dtype = 32, 8, 128, jnp.bfloat16
    chunk, cached = args.chunk, args.cached
    q, kc, vc, md = make_batch(rng, [chunk], [cached + chunk], q_heads=q_heads, kv_slots=kv_slots,
                               head_dim=head_dim, page_size=page_size, layers=args.layers, dtype=dtype)
    flops = 4 * head_dim * q_heads * causal_pairs(chunk, cached + chunk)
    print(f"prefill {chunk} tokens after {cached} cached, {q_heads} q / {kv_slots} kv, D {head_dim}, page {page_size}, bf16: "
          f"{flops / 1e9:.1f} GFLOP (causal pairs only)")
    base = PallasAttentionConfig(interpret=True, prefill_rows=16, prefill_block_k=16) if args.smoke else PallasAttentionConfig()
    variants = [base] if args.smoke or args.quick else [
        base,  # rows 128, block_k 128, 8 warps, 2 stages
        PallasAttentionConfig(prefill_block_k=64, prefill_num_stages=3),
        PallasAttentionConfig(prefill_block_k=64, prefill_num_warps=4, prefill_num_stages=3),
        PallasAttentionConfig(prefill_rows=64, prefill_block_k=64, prefill_num_warps=4, prefill_num_stages=3),
        PallasAttentionConfig(prefill_block_k=32, prefill_num_warps=4, prefill_num_stages=4),
        PallasAttentionConfig(prefill_block_k=64, prefill_num_stages=2),
    ]
    best = best_of("pallas", variants, lambda cfg: per_layer_time(q, kc, vc, md, implementation="pallas", config=cfg, iters=args.iters))
    err = check(q, kc, vc, md, best[1], 2e-2)
    rate = flops / best[0]
    print(f"  => best {best[0] * 1e6:.1f} us, {rate / 1e12:.0f} TFLOP/s; rel. error vs reference {err:.1e}")
    result = dict(case=f"prefill page {page_size}", us=best[0] * 1e6, tflops=rate / 1e12, cfg=cfg_str(best[1]), config=best[1])
    if args.smoke:
        return result
    # cuDNN on contiguous [1, S, H, D]: the keys are the sequence's 4096 positions.
    kv_len = cached + chunk
    key = jax.random.key(7)
    qd = jax.random.normal(key, (args.layers, 1, chunk, q_heads, head_dim), dtype)
    kd = jax.random.normal(key, (args.layers, 1, kv_len, kv_slots, head_dim), dtype)
    vd = jax.random.normal(key, (args.layers, 1, kv_len, kv_slots, head_dim), dtype)
    cudnn_cases = [
        ("non-causal (q 2048 x kv 4096)", dict(is_causal=False), chunk * kv_len),
        ("causal, top-left mask (cuDNN's)", dict(is_causal=True), causal_pairs(chunk, chunk)),
    ]
    for label, kwargs, pairs in cudnn_cases[: 1 if args.quick else 2]:
        try:
            @jax.jit
            def all_layers(qd, kd, vd):
                def body(acc, xs):
                    qq, kk, vv = xs
                    out = jax.nn.dot_product_attention(qq, kk, vv, implementation="cudnn", **kwargs)
                    return acc + out[:, :1].astype(jnp.float32), None
                acc, _ = jax.lax.scan(body, jnp.zeros((1, 1, q_heads, head_dim), jnp.float32), (qd, kd, vd))
                return acc
            t = time_fn(all_layers, qd, kd, vd, warmup=2, iters=args.iters) / args.layers
            cudnn_rate = 4 * head_dim * q_heads * pairs / t
            print(f"  cuDNN {label}: {t * 1e6:.1f} us, {cudnn_rate / 1e12:.0f} TFLOP/s -> ours = {100 * rate / cudnn_rate:.0f}% of it")
            result[f"cudnn {label}"] = cudnn_rate / 1e12
        except Exception as e:
            print(f"  cuDNN {label}: failed: {type(e).__name__}: {str(e)[:300]}")
    return result


def bench_mixed(args, rng, page_size, config):
    q_heads, kv_slots, head_dim, dtype = 32, 8, 128, jnp.bfloat16
    chunk, decodes = args.mixed_chunk, args.decode_seqs - 1
    ctx = args.context
    q_lens = [chunk] + [1] * decodes
    seq_lens = [args.mixed_cached + chunk] + [ctx] * decodes
    q, kc, vc, md = make_batch(rng, q_lens, seq_lens, q_heads=q_heads, kv_slots=kv_slots, head_dim=head_dim,
                               page_size=page_size, layers=args.layers, dtype=dtype)
    print(f"mixed: one {chunk}-token chunk (after {args.mixed_cached} cached) + {decodes} decode tokens at {ctx} ctx, "
          f"{q_heads} q / {kv_slots} kv, D {head_dim}, page {page_size}")
    run = functools.partial(per_layer_time, implementation="pallas", config=config, iters=args.iters)
    both = run(q, kc, vc, md)
    err = check(q, kc, vc, md, config, 2e-2)
    # The same sequences split into two calls: the chunk alone, the decode tokens alone.
    pt = md.page_table
    md_p = AttentionMetadata(md.query_start[:2], md.seq_lens[:1], pt[:1])
    md_d = AttentionMetadata(md.query_start[1:] - chunk, md.seq_lens[1:], pt[1:])
    alone_p = run(q[:chunk], kc, vc, md_p)
    alone_d = run(q[chunk:], kc, vc, md_d)
    print(f"  one call {both * 1e6:.1f} us vs prefill alone {alone_p * 1e6:.1f} + decode alone {alone_d * 1e6:.1f} = "
          f"{(alone_p + alone_d) * 1e6:.1f} us; rel. error vs reference {err:.1e}")
    return dict(case=f"mixed page {page_size}", us=both * 1e6, separate_us=(alone_p + alone_d) * 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (any machine)")
    parser.add_argument("--quick", action="store_true", help="default configs only, no tuning sweep")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--page-sizes", default="16")
    args = parser.parse_args()
    args.decode_seqs, args.context, args.chunk, args.cached = 64, 4096, 2048, 2048
    args.mixed_chunk, args.mixed_cached = 1024, 1024
    if args.smoke:
        args.decode_seqs, args.context, args.chunk, args.cached, args.layers, args.iters = 3, 40, 20, 12, 2, 1
        args.mixed_chunk, args.mixed_cached = 9, 5
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} jax {jax.__version__} on {jax.devices()[0].device_kind}")
    bw = copy_bandwidth(64 << 20 if args.smoke else 4 << 30)
    print(f"copy bandwidth (read + written): {bw / 1e12:.2f} TB/s")
    rng = np.random.default_rng(0)
    results = []
    page_sizes = [16] if args.smoke else [int(p) for p in args.page_sizes.split(",")]
    for page_size in page_sizes:
        results.append(bench_decode(args, bw, rng, 8, 1, page_size))
        results.append(bench_decode(args, bw, rng, 32, 8, page_size))
    prefill = [bench_prefill(args, rng, page_size) for page_size in page_sizes]
    results += prefill
    for page_size in page_sizes:
        # The mixed call gets the best decode (32q/8kv) and prefill settings found above.
        dec = [r for r in results if r["case"] == f"decode 32q/8kv page {page_size}"][0]["config"]
        pre = [r for r in results if r["case"] == f"prefill page {page_size}"][0]["config"]
        cfg = dataclasses.replace(dec, **{f.name: getattr(pre, f.name) for f in dataclasses.fields(pre) if f.name.startswith("prefill")})
        print(f"  mixed config: {cfg_str(cfg)}")
        results.append(bench_mixed(args, rng, page_size, cfg))
    print("\nsummary")
    for r in results:
        print("  " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "config"))


if __name__ == "__main__":
    main()
