"""Per-device shard computation of one Llama-3-70B-shaped layer in each mode, one GPU.

d 8192, 64 query heads, 8 KV heads, head_dim 128, FFN 28672, random bf16 weights, RMSNorm,
RoPE, SiLU MLP.  T is the GLOBAL number of tokens in the step (the same step processed
both ways), treated as a prefill of T new tokens, causal over themselves (no KV cache read
or write).  Collectives are omitted (one GPU): the Ulysses all_to_all and its inverse are
stood in for by a free reshape of the same bytes, and the TP psums are left out.

  SP mode, sp = 8, tp = 1: T/8 local tokens through ALL weights (QKV for all 64 heads,
     o, gate|up, down); attention for one head block (8 q heads, 1 KV head) over all T.
       "SP-one":   weights contiguous, one GEMM per projection
       "SP-split": weights as 8 aliased blocks per projection (the default storage): 8 GEMMs,
                   QKV outputs concatenated, o summed, MLP per block (gate|up_j -> down_j) summed
  TP mode, tp = 8: T tokens through 1/8 of the weights (block j of every projection, the
     zero-copy view of the aliased blocks); attention for 8 q heads, 1 KV head over T.

Attention: jax.nn.dot_product_attention(implementation="cudnn") where it compiles at that
T, else implementation="xla"; the script prints which was used.

       "SP-split-b": SP-split with the activation passed through lax.optimization_barrier once
                   per block, so XLA's DotMerger cannot merge the 8 qkv dots (21 MB blocks, under
                   its 32 MB threshold) by concatenating their weights at run time.

Timing: L distinct layers unrolled in one jit, hidden state chained (no L2 reuse of weights).
Reported time = device span of one call (first kernel start to last kernel end, profiler
trace of CUPTI kernel records, median of several calls) / L: host dispatch excluded,
launch gaps between kernels included; host wall clock / L printed beside it. Where the
trace holds no device events (the profiler failed, or a CPU) the reported time IS the host
wall clock: every line and the summary's "timer" column say which timer produced the number.  TP layers are the 8 blocks of the SP
layers' aliased storage (same buffers).  Roofline per layer = max(bytes / copy bandwidth,
FLOPs / matmul rate); bytes = weights + GEMM and attention inputs and outputs; copy
bandwidth counts bytes read + written (roofline.copy_bandwidth).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEVICE_SPAN, HOST_WALL, ceilings, describe, device_time, time_fn  # noqa: E402

BF16 = jnp.bfloat16
F32 = jnp.float32


def rmsnorm(x, g, eps=1e-5):
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * g).astype(x.dtype)


def rope(x, pos, theta=500000.0):
    """x [T, H, D], pos [T] (half-split rotary, as in HF Llama)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, D, 2, dtype=F32) / D)
    ang = pos.astype(F32)[:, None] * inv[None, :]
    cos = jnp.cos(ang)[:, None, :]
    sin = jnp.sin(ang)[:, None, :]
    xf = x.astype(F32)
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention(q, k, v, impl):
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], causal."""
    o = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation=impl)
    return o[0]


class Cfg:
    def __init__(self, tiny):
        if tiny:
            self.d, self.H, self.KV, self.hd, self.F, self.P = 256, 16, 8, 16, 512, 8
        else:
            self.d, self.H, self.KV, self.hd, self.F, self.P = 8192, 64, 8, 128, 28672, 8
        self.hq = self.H // self.P           # q heads per block (8)
        self.hk = self.KV // self.P          # kv heads per block (1)
        self.qkv_b = (self.hq + 2 * self.hk) * self.hd   # 1280
        self.o_b = self.hq * self.hd                      # 1024
        self.f_b = self.F // self.P                       # 3584


def make_layers(cfg, n_layers, key):
    """Aliased-block storage (lists of P separate buffers per projection), in-major [K, N]."""
    layers = []
    P, d = cfg.P, cfg.d
    for l in range(n_layers):
        ks = jax.random.split(jax.random.fold_in(key, l), 6)
        s = 1.0 / np.sqrt(d)
        layer = dict(
            g1=(1 + 0.1 * jax.random.normal(ks[0], (d,), F32)),
            g2=(1 + 0.1 * jax.random.normal(ks[1], (d,), F32)),
            qkv=[(jax.random.normal(jax.random.fold_in(ks[2], j), (d, cfg.qkv_b), F32) * s).astype(BF16) for j in range(P)],
            o=[(jax.random.normal(jax.random.fold_in(ks[3], j), (cfg.o_b, d), F32) * s).astype(BF16) for j in range(P)],
            gu=[(jax.random.normal(jax.random.fold_in(ks[4], j), (d, 2 * cfg.f_b), F32) * s).astype(BF16) for j in range(P)],
            down=[(jax.random.normal(jax.random.fold_in(ks[5], j), (cfg.f_b, d), F32) / np.sqrt(cfg.F)).astype(BF16) for j in range(P)],
        )
        layers.append(layer)
    return layers


def contiguous(layer):
    """One buffer per projection, same values as the blocks (block-major column order)."""
    cat = jax.jit(lambda ws, axis: jnp.concatenate(ws, axis=axis), static_argnums=1)
    return dict(g1=layer["g1"], g2=layer["g2"], qkv=cat(layer["qkv"], 1), o=cat(layer["o"], 0),
                gu=cat(layer["gu"], 1), down=cat(layer["down"], 0))


def _copies(x, n, barrier):
    """n uses of x; through an optimization barrier so XLA's DotMerger cannot merge the dots."""
    return jax.lax.optimization_barrier([x] * n) if barrier else [x] * n


def sp_layer(cfg, h, pos_all, W, split, impl, barrier=False):
    """SP mode on one device: h [T/8, d] local tokens; returns [T/8, d]."""
    P = cfg.P
    Tl = h.shape[0]
    T = Tl * P
    x = rmsnorm(h, W["g1"])
    if split:
        qkv = jnp.concatenate([xb @ w for xb, w in zip(_copies(x, P, barrier), W["qkv"])], axis=1)
    else:
        qkv = x @ W["qkv"]
    qkv = qkv.reshape(Tl, P, cfg.hq + 2 * cfg.hk, cfg.hd)
    q = qkv[:, :, : cfg.hq]
    k = qkv[:, :, cfg.hq: cfg.hq + cfg.hk]
    v = qkv[:, :, cfg.hq + cfg.hk:]
    pos_loc = pos_all[:Tl]
    q = rope(q.reshape(Tl, P * cfg.hq, cfg.hd), pos_loc).reshape(Tl, P, cfg.hq, cfg.hd)
    k = rope(k.reshape(Tl, P * cfg.hk, cfg.hd), pos_loc).reshape(Tl, P, cfg.hk, cfg.hd)
    # all_to_all stand-in (omitted collective): [Tl, P blocks, ...] -> [T, 1 block, ...], same bytes
    q = q.reshape(T, cfg.hq, cfg.hd)
    k = k.reshape(T, cfg.hk, cfg.hd)
    v = v.reshape(T, cfg.hk, cfg.hd)
    o = attention(q, k, v, impl)
    o = o.reshape(Tl, P * cfg.o_b)  # inverse all_to_all stand-in
    if split:
        acc = None
        for j, w in enumerate(W["o"]):
            p = jnp.dot(o[:, j * cfg.o_b:(j + 1) * cfg.o_b], w, preferred_element_type=F32)
            acc = p if acc is None else acc + p
        h = h + acc.astype(BF16)
    else:
        h = h + o @ W["o"]
    x = rmsnorm(h, W["g2"])
    if split:
        acc = None
        for xb, wgu, wd in zip(_copies(x, P, barrier), W["gu"], W["down"]):
            gu = xb @ wgu
            a = jax.nn.silu(gu[:, : cfg.f_b]) * gu[:, cfg.f_b:]
            p = jnp.dot(a, wd, preferred_element_type=F32)
            acc = p if acc is None else acc + p
        h = h + acc.astype(BF16)
    else:
        gu = (x @ W["gu"]).reshape(Tl, P, 2, cfg.f_b)
        a = (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(Tl, cfg.F)
        h = h + a @ W["down"]
    return h


def tp_layer(cfg, h, pos, W, impl):
    """TP mode on one device: h [T, d]; W holds one block of each projection; psums omitted."""
    T = h.shape[0]
    x = rmsnorm(h, W["g1"])
    qkv = (x @ W["qkv"]).reshape(T, cfg.hq + 2 * cfg.hk, cfg.hd)
    q = rope(qkv[:, : cfg.hq], pos)
    k = rope(qkv[:, cfg.hq: cfg.hq + cfg.hk], pos)
    v = qkv[:, cfg.hq + cfg.hk:]
    o = attention(q, k, v, impl).reshape(T, cfg.o_b)
    h = h + o @ W["o"]          # + psum (omitted)
    x = rmsnorm(h, W["g2"])
    gu = x @ W["gu"]
    a = jax.nn.silu(gu[:, : cfg.f_b]) * gu[:, cfg.f_b:]
    return h + a @ W["down"]    # + psum (omitted)


def counts(cfg, T, mode):
    """(weight bytes, activation bytes, FLOPs) per layer per device."""
    d, P = cfg.d, cfg.P
    n_tok = T // P if mode == "SP" else T
    share = P if mode == "SP" else 1  # how many blocks of each projection the device reads
    shapes = [(d, cfg.qkv_b * share), (cfg.o_b * share, d), (d, 2 * cfg.f_b * share), (cfg.f_b * share, d)]
    wbytes = sum(k * n for k, n in shapes) * 2
    act = sum(n_tok * (k + n) for k, n in shapes) * 2
    flops = sum(2 * n_tok * k * n for k, n in shapes)
    # attention: 8 q heads, 1 kv head over all T tokens, causal (T(T+1)/2 pairs), QK^T and PV
    flops += 2 * 2 * cfg.hq * cfg.hd * T * (T + 1) // 2
    act += (T * cfg.hq * cfg.hd * 2 + 2 * T * cfg.hk * cfg.hd) * 2
    return wbytes, act, flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, one token count, two layers, small ceilings: runs the code path on any machine")
    ap.add_argument("--tokens", default="8,64,512,4096")
    ap.add_argument("--sp-layers", type=int, default=4)
    ap.add_argument("--tp-layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1e9)
    args = ap.parse_args()
    if args.smoke:
        args.tiny, args.tokens, args.sp_layers, args.tp_layers, args.reps = True, "16", 1, 2, 2
    deadline = time.monotonic() + args.budget_s
    cfg = Cfg(args.tiny)
    on_gpu = jax.devices()[0].platform == "gpu"
    print(f"jax {jax.__version__} device {jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
          flush=True)
    if os.environ.get("COPY_BW") and os.environ.get("MATMUL_RATE"):
        bw, rate = float(os.environ["COPY_BW"]), float(os.environ["MATMUL_RATE"])
    else:
        measured = ceilings(8 << 20, 1, 128) if args.smoke else ceilings()
        print(describe(measured), flush=True)
        bw, rate = measured["copy"]["best"], measured["matmul"]["best"]
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read+write bytes / s); bf16 matmul {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    key = jax.random.key(1)
    L = args.sp_layers
    blocks = make_layers(cfg, L, key)
    contig = [contiguous(b) for b in blocks]
    # TP layers: block j of SP layer l (zero-copy: the very same buffers); L * P distinct layers
    tp_layers = [dict(g1=b["g1"], g2=b["g2"], qkv=b["qkv"][j], o=b["o"][j], gu=b["gu"][j], down=b["down"][j])
                 for b in blocks for j in range(cfg.P)][: args.tp_layers]
    jax.block_until_ready((blocks, contig))
    wl = counts(cfg, 8, "SP")[0]
    print(f"SP layers {L} (x2 storages, {2 * L * wl / 1e9:.1f} GB), TP layers {len(tp_layers)} "
          f"(the aliased blocks of the SP layers)", flush=True)

    trivial = jax.jit(lambda x: x + 1)
    xx = jnp.ones((8,), F32)
    print(f"dispatch+sync of a trivial jit: {time_fn(trivial, xx, iters=20) * 1e6:.1f} us per call", flush=True)

    results = []
    for T in [int(t) for t in args.tokens.split(",")]:
        if time.monotonic() > deadline:
            print(f"time budget spent: skipping T={T} and beyond", flush=True)
            break
        Tl = T // cfg.P
        # attention implementation: cudnn where it compiles at this T
        impl = "xla"
        if on_gpu:
            try:
                qa = jnp.ones((T, cfg.hq, cfg.hd), BF16)
                ka = jnp.ones((T, cfg.hk, cfg.hd), BF16)
                jax.jit(lambda q, k: attention(q, k, k, "cudnn")).lower(qa, ka).compile()
                impl = "cudnn"
            except Exception as e:
                print(f"  cudnn attention failed at T={T}: {type(e).__name__}: {str(e).splitlines()[0][:150]}",
                      flush=True)
        kx = jax.random.fold_in(key, 10_000 + T)
        h_sp = jax.random.normal(kx, (Tl, cfg.d), BF16)
        h_tp = jax.random.normal(kx, (T, cfg.d), BF16)
        pos = jnp.arange(T, dtype=jnp.int32) + 17

        def run_sp(h, pos, Ws, split, barrier=False):
            for W in Ws:
                h = sp_layer(cfg, h, pos, W, split, impl, barrier)
            return h

        def run_tp(h, pos, Ws):
            for W in Ws:
                h = tp_layer(cfg, h, pos, W, impl)
            return h

        row = dict(T=T, impl=impl)
        outs = {}
        for name, fn, args_ in (
            ("SP-one", lambda h, p, W: run_sp(h, p, W, False), (h_sp, pos, contig)),
            ("SP-split", lambda h, p, W: run_sp(h, p, W, True), (h_sp, pos, blocks)),
            ("SP-split-b", lambda h, p, W: run_sp(h, p, W, True, True), (h_sp, pos, blocks)),
            ("TP", run_tp, (h_tp, pos, tp_layers)),
        ):
            n_layers = len(args_[2])
            t0 = time.monotonic()
            comp = jax.jit(fn).lower(*args_).compile()
            tc = time.monotonic() - t0
            outs[name] = comp(*args_)
            t_wall = time_fn(comp, *args_, warmup=2, iters=args.reps) / n_layers
            dt = device_time(comp, args_, args.reps, top=6)
            t = dt["span"] / n_layers if dt else t_wall
            timer = DEVICE_SPAN if dt else HOST_WALL
            mode = name[:2]
            wb, ab, fl = counts(cfg, T, mode)
            floor_bw, floor_fl = (wb + ab) / bw, fl / rate
            floor = max(floor_bw, floor_fl)
            row[name] = (t, floor, floor_bw, floor_fl)
            row.setdefault("timers", set()).add(timer)
            print(f"T={T:5d} {name:8s} layers {n_layers:3d}  {t * 1e6:9.1f} us/layer  floor {floor * 1e6:8.1f} us "
                  f"(bytes {(wb + ab) / 1e6:.1f} MB -> {floor_bw * 1e6:.1f} us; {fl / 1e9:.1f} GFLOP -> "
                  f"{floor_fl * 1e6:.1f} us)  x{t / floor:.2f}  attn={impl}  compile {tc:.1f}s  "
                  + (f"[{DEVICE_SPAN}; kernel sum {dt['ksum'] / n_layers * 1e6:.1f} us, {dt['kernels'] / n_layers:.1f} "
                     f"kernels/layer; host wall {t_wall * 1e6:.1f} us/layer]" if dt
                     else f"[{HOST_WALL}: the profiler trace had no device events]"),
                  flush=True)
            if dt:
                for ts, cnt, kname in dt["top"]:
                    print(f"      {ts / n_layers * 1e6:8.1f} us/layer  {cnt / n_layers:5.1f}x  {kname}", flush=True)
        a = np.asarray(outs["SP-one"], np.float32)
        b = np.asarray(outs["SP-split"], np.float32)
        c = np.asarray(outs["SP-split-b"], np.float32)
        err = float(np.linalg.norm(a - b) / np.linalg.norm(a))
        err2 = float(np.linalg.norm(a - c) / np.linalg.norm(a))
        print(f"T={T:5d} SP-split / SP-split-b vs SP-one output relerr {err:.1e} / {err2:.1e} (same weights; bf16)",
              flush=True)
        results.append(row)

    print("\nSUMMARY (per layer, per device; collectives omitted)")
    print("| T (global) | timer | tokens/device SP / TP | attention | SP-one us (x floor) | SP-split us (x floor) | "
          "split/one | SP-split-b us (x floor) | split-b/one | TP us (x floor) | SP floor us | TP floor us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        T = r["T"]
        one, spl, spb, tp = r["SP-one"], r["SP-split"], r["SP-split-b"], r["TP"]
        print(f"| {T} | {' + '.join(sorted(r['timers']))} | {T // cfg.P} / {T} | {r['impl']} | {one[0] * 1e6:.1f} (x{one[0] / one[1]:.2f}) | "
              f"{spl[0] * 1e6:.1f} (x{spl[0] / spl[1]:.2f}) | {spl[0] / one[0]:.3f} | "
              f"{spb[0] * 1e6:.1f} (x{spb[0] / spb[1]:.2f}) | {spb[0] / one[0]:.3f} | "
              f"{tp[0] * 1e6:.1f} (x{tp[0] / tp[1]:.2f}) | {one[1] * 1e6:.1f} | {tp[1] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
