"""Weight layouts for "weights live once" (docs/architecture.md), measured on one GPU.

One device of a Llama-3-70B deployment at sp = 8, tp = 1.  SP mode reads all of a
layer's weights with T_sp tokens per device; TP mode (the shift config, tp = 8) reads one
of the 8 blocks of every weight with T_tp tokens.  Four projections per layer:

  qkv   column-parallel  [8192, 10240]  8 blocks of 1280 columns (8 q heads | k | v)
  o     row-parallel     [8192,  8192]  8 blocks of 1024 rows
  gu    column-parallel  [8192, 57344]  8 blocks of 7168 columns (gate | up)
  down  row-parallel     [28672, 8192]  8 blocks of 3584 rows

Storages (what each variant implies):
  C  contiguous, in-major [K, N] (the usual `x @ W`); a column-parallel TP block is a
     strided column range of it, a row-parallel block a contiguous row range.
  S  contiguous, block-major: column-parallel [G, Nb, K] (each block out-major),
     row-parallel [G, Kb, N] (byte-identical to C).  Every TP block is one contiguous
     byte range of S, so a kernel can read it by offset.  One buffer, no extra memory.
  A  aliased blocks: G separate buffers (the default storage).  TP mode uses one of them.
  A+S two copies: S for SP mode plus a TP-sharded copy of the blocks (+1/sp memory).

Variants:
  SP  (i)    one GEMM over C
      (ii)   G GEMMs over A (in-major blocks [K, Nb] / [Kb, N]), concat or sum
      (ii-b) (ii) with x passed through lax.optimization_barrier once per block, which keeps
             XLA's DotMerger from merging the G dots by concatenating their weights each call
             (column-parallel only; run 1 showed that merge on the qkv blocks of 21 MB)
      (iii)  one dot_general over S ("grouped"; for row-parallel it is (i) on S's bytes)
  TP  (iv)   GEMM on a presliced block (A, or the TP copy of A+S), in-major [K, Nb]
      (iv-T) same with an out-major column block [Nb, K] (column-parallel only)
      (v)    XLA dynamic-index of the block out of S + GEMM
      (vi)   Pallas (Triton) GEMM reading the block of S by offset (split-K, tuned)

Timing: N calls unrolled in one jit on N distinct activations, rotating over R weight
copies so that the weights streamed between two uses of one copy exceed 150 MB (L2 is
60 MB).  Reported time = device span of one jit call (first kernel start to last kernel
end, from a profiler trace of CUPTI kernel records; median of several calls) / N, so host
dispatch is excluded but launch gaps between kernels are included; the host wall clock
(roofline.time_fn) / N is printed beside it.  Floors: bandwidth floor = bytes moved (weights +
activations read + outputs written) / copy bandwidth, where copy bandwidth counts bytes
read + bytes written of a device-to-device copy (roofline.copy_bandwidth).  FLOP floor =
2 T K N / measured bf16 matmul rate.  Where the profiler trace holds no device events (the
profiler failed, or a CPU) the reported time IS the host wall clock: each line says which
timer produced it, and a summary cell timed by host wall clock is marked "[wall]".
Run with --smoke on the CPU to test the code paths (--tiny: small shapes, every size).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEVICE_SPAN, HOST_WALL, ceilings as measure_ceilings, describe, device_time, time_fn  # noqa: E402

from jax.experimental import pallas as pl  # noqa: E402

try:
    from jax.experimental.pallas import triton as plgpu  # noqa: E402
except Exception:  # pragma: no cover
    plgpu = None

BF16 = jnp.bfloat16
F32 = jnp.float32


def ceilings(smoke: bool = False):
    """(copy bandwidth, matmul rate): from COPY_BW / MATMUL_RATE if both set, else measured."""
    if os.environ.get("COPY_BW") and os.environ.get("MATMUL_RATE"):
        return float(os.environ["COPY_BW"]), float(os.environ["MATMUL_RATE"])
    measured = measure_ceilings(8 << 20, 1, 128) if smoke else measure_ceilings()
    print(describe(measured), flush=True)
    return measured["copy"]["best"], measured["matmul"]["best"]


# ----------------------------------------------------------------------------------------
# Pallas offset GEMM (Triton backend)
# ----------------------------------------------------------------------------------------

def offset_gemm(x, w, blk, *, kind, rows, bn, bk, splitk, num_warps=4, num_stages=3,
                interpret=False):
    """TP-mode GEMM on block `blk` of the block-major storage S, read by offset.

    kind 'col': w is [G*rows, K] (S reshaped, out-major), x [T, K] -> [T, rows]
    kind 'row': w is [G*rows, N] (S reshaped, in-major),  x [T, rows] -> [T, N]
    blk: int32 [1].  Split-K writes float32 partials [splitk, T, N] summed by XLA.
    """
    T = x.shape[0]
    Tp = max(16, -(-T // 16) * 16)  # Triton dots need M >= 16
    if Tp != T:
        x = jnp.pad(x, ((0, Tp - T), (0, 0)))
    if kind == "col":
        K, n_out = w.shape[1], rows
    else:
        K, n_out = rows, w.shape[1]
    assert K % splitk == 0 and (K // splitk) % bk == 0 and n_out % bn == 0, (K, n_out, bn, bk, splitk)
    ks = K // splitk
    nk = ks // bk

    def kernel(blk_ref, x_ref, w_ref, o_ref):
        j = pl.program_id(0)
        s = pl.program_id(1)
        base = blk_ref[0] * rows

        def body(i, acc):
            k0 = s * ks + i * bk
            xk = x_ref[:, pl.ds(k0, bk)]
            if kind == "col":
                wk = w_ref[pl.ds(base + j * bn, bn), pl.ds(k0, bk)]  # [bn, bk]
                return acc + lax.dot_general(xk, wk, (((1,), (1,)), ((), ())),
                                             preferred_element_type=F32)
            wk = w_ref[pl.ds(base + k0, bk), pl.ds(j * bn, bn)]  # [bk, bn]
            return acc + jnp.dot(xk, wk, preferred_element_type=F32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((Tp, bn), F32))
        o_ref[...] = acc.astype(o_ref.dtype)

    if splitk == 1:
        out_shape = jax.ShapeDtypeStruct((Tp, n_out), x.dtype)
        out_spec = pl.BlockSpec((Tp, bn), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splitk, Tp, n_out), F32)
        out_spec = pl.BlockSpec((None, Tp, bn), lambda j, s: (s, 0, j))
    kw = {}
    if not interpret and plgpu is not None:
        kw["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_out // bn, splitk),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
        out_specs=out_spec,
        interpret=interpret,
        **kw,
    )(blk, x, w)
    if splitk > 1:
        out = out.sum(0).astype(x.dtype)
    return out[:T]


# ----------------------------------------------------------------------------------------
# Problem definition
# ----------------------------------------------------------------------------------------

def projections(tiny: bool):
    if tiny:
        d, heads, kv, hd, ffn, g = 256, 16, 8, 16, 512, 8
    else:
        d, heads, kv, hd, ffn, g = 8192, 64, 8, 128, 28672, 8
    qkv_n = (heads + 2 * kv) * hd
    # name, kind, K (full), N (full)
    return g, [
        ("qkv", "col", d, qkv_n),
        ("o", "row", heads * hd, d),
        ("gu", "col", d, 2 * ffn),
        ("down", "row", ffn, d),
    ]


def pallas_configs(kind, K, n_out, tiny):
    """(bn, bk, splitk, num_warps, num_stages) candidates valid for this shape."""
    if tiny:
        cands = [(16, 32, 1, 4, 2), (16, 16, 2, 4, 2), (32, 16, 4, 4, 2)]
    elif kind == "col" and n_out <= 2048:  # qkv block: 1280 output columns, K 8192
        cands = [(32, 256, 8, 4, 3), (64, 256, 8, 4, 3), (16, 256, 4, 4, 3)]
    elif kind == "col":  # gate|up block: 7168 columns
        cands = [(32, 256, 1, 4, 3), (64, 256, 2, 4, 3), (32, 512, 1, 4, 2)]
    else:  # row-parallel: K = block rows (1024 / 3584), N = 8192; split-K partials cost
        # sk*T*N*4 bytes each way, so prefer many N tiles over split-K here
        cands = [(64, 128, 1, 4, 3), (64, 128, 2, 4, 3), (32, 256, 1, 4, 3)]
    ok = []
    for bn, bk, sk, nw, ns in cands:
        if K % sk == 0 and (K // sk) % bk == 0 and n_out % bn == 0:
            ok.append((bn, bk, sk, nw, ns))
    return ok


def kernel_counts(hlo: str, n: int) -> str:
    """Rough count, per call, of GEMM library calls, Pallas calls and other kernels."""
    lines = [l for l in hlo.splitlines() if "=" in l]
    gemm = sum(1 for l in lines if "custom_call_target=\"__cublas" in l)
    xla_triton = sum(1 for l in lines if "__triton_gemm" in l and " fusion(" in l)
    pallas = sum(1 for l in lines if "custom_call_target=\"__gpu$xla.gpu.triton" in l
                 or "triton_kernel_call" in l)
    # fusions in the entry computation only
    entry = hlo[hlo.find("ENTRY"):]
    fus = sum(1 for l in entry.splitlines() if " fusion(" in l)
    flags = []
    for word in ("dynamic-slice", "concatenate", "copy("):
        if word in entry:
            flags.append(word.rstrip("("))
    return f"gemm {gemm / n:.1f} xla-triton-gemm {xla_triton / n:.1f} pallas {pallas / n:.1f} fusion {fus / n:.1f}" + (
        f" [{','.join(flags)}]" if flags else "")


def relerr(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Bench:
    def __init__(self, bw, rate, reps, log, deadline):
        self.bw, self.rate, self.reps, self.log = bw, rate, reps, log
        self.deadline = deadline
        self.rows = []
        self.skipped = 0

    def n_calls(self, floor_s, cap=32):
        return int(min(cap, max(2, math.ceil(2e-3 / max(floor_s, 1e-9)))))

    def run(self, mode, proj, T, name, fn, xs, ws_per_call, ref, wbytes, abytes, flops,
            extra=""):
        """fn(xs_list, *ws) -> list of outputs; ws_per_call: the weight pytree args."""
        n = len(xs)
        if time.monotonic() > self.deadline:
            self.skipped += 1
            if self.skipped == 1:
                self.log("  time budget spent: skipping the remaining measurements")
            return None
        f = jax.jit(fn)
        t0 = time.monotonic()
        try:
            comp = f.lower(xs, *ws_per_call).compile()
            tc = time.monotonic() - t0
            outs = comp(xs, *ws_per_call)
            err = relerr(outs[0], ref)
            del outs
            t_wall = time_fn(comp, xs, *ws_per_call, warmup=1, iters=3) / n
            dt = device_time(comp, (xs, *ws_per_call), self.reps)
        except Exception as e:  # report and go on
            msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            self.log(f"  {mode} {proj:4s} T={T:5d} {name:8s} FAILED {msg} {extra}")
            return None
        t = dt["span"] / n if dt else t_wall
        timer = DEVICE_SPAN if dt else HOST_WALL
        dev = (f"[{timer}] dev-span {dt['span'] / n * 1e6:.1f} kern-sum {dt['ksum'] / n * 1e6:.1f} kernels/call "
               f"{dt['kernels'] / n:.1f} wall {t_wall * 1e6:.1f}") if dt else (
            f"[{timer}: the profiler trace had no device events] wall {t_wall * 1e6:.1f}")
        bfloor = (wbytes + abytes) / self.bw
        ffloor = flops / self.rate
        floor = max(bfloor, ffloor)
        counts = kernel_counts(comp.as_text(), n)
        row = dict(mode=mode, proj=proj, T=T, name=name, us=t * 1e6, bw_us=bfloor * 1e6,
                   fl_us=ffloor * 1e6, floor_us=floor * 1e6, relerr=err, counts=counts, wall_us=t_wall * 1e6,
                   ksum_us=(dt["ksum"] / n * 1e6) if dt else float("nan"),
                   extra=extra, timer=timer)
        self.rows.append(row)
        self.log(f"  {mode} {proj:4s} T={T:5d} {name:8s} {t * 1e6:9.1f} us  floor {floor * 1e6:8.1f} "
                 f"(bw {bfloor * 1e6:.1f} / flop {ffloor * 1e6:.1f})  x{t / floor:5.2f}  "
                 f"relerr {err:.1e}  n={n}  {dev}  {counts} compile {tc:.1f}s {extra}")
        return t


def reference(x, w_blocks_kind, kind):
    """float32 reference: x [T, K] and S [G, rows, cols]."""
    S = w_blocks_kind.astype(F32)
    x = x.astype(F32)
    if kind == "col":
        G, nb, K = S.shape
        return jnp.einsum("tk,gnk->tgn", x, S, precision="highest").reshape(x.shape[0], G * nb)
    G, kb, N = S.shape
    return jnp.einsum("tgk,gkn->tn", x.reshape(x.shape[0], G, kb), S, precision="highest")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes, CPU, Pallas interpret mode")
    ap.add_argument("--smoke", action="store_true",
                    help="--tiny with one token count per mode and two projections: the code paths, quickly")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sp-tokens", default="8,64,512,4096")
    ap.add_argument("--tp-tokens", default="8,16,64")
    ap.add_argument("--proj", default="qkv,o,gu,down")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this many seconds")
    args = ap.parse_args()
    if args.smoke:
        args.tiny, args.reps, args.sp_tokens, args.tp_tokens, args.proj = True, 2, "8", "16", "qkv,o"
    interpret = args.tiny or jax.devices()[0].platform != "gpu"
    print(f"jax {jax.__version__} device {jax.devices()[0].device_kind} interpret={interpret}", flush=True)
    bw, rate = ceilings(args.smoke)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read+write bytes / s); bf16 matmul {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    G, projs = projections(args.tiny)
    bench = Bench(bw, rate, args.reps, lambda s: print(s, flush=True), time.monotonic() + args.budget_s)
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""), flush=True)
    key = jax.random.key(0)
    L2 = 150e6 if not args.tiny else 1e5
    sp_tokens = [int(t) for t in args.sp_tokens.split(",")]
    tp_tokens = [int(t) for t in args.tp_tokens.split(",")]
    pallas_best = {}
    for pi, (pname, kind, K, N) in enumerate(projs):
        if pname not in args.proj.split(","):
            continue
        nb = N // G if kind == "col" else K // G  # block width along the cut dimension
        full_bytes = K * N * 2
        blk_bytes = full_bytes // G
        s_shape = (G, nb, K) if kind == "col" else (G, nb, N)

        def make_S(k):
            return jax.random.normal(k, s_shape, BF16)

        # derived storages, each a separate buffer
        to_C = jax.jit(lambda S: (S.reshape(G * nb, K).T if kind == "col" else S.reshape(G * nb, N)) + 0)
        if kind == "col":
            to_A = jax.jit(lambda S: [S[j].T + 0 for j in range(G)])      # [K, Nb] in-major
            to_AT = jax.jit(lambda S: [S[j] + 0 for j in range(G)])       # [Nb, K] out-major
        else:
            to_A = jax.jit(lambda S: [S[j] + 0 for j in range(G)])        # [Kb, N]
            to_AT = None

        # ------------------------------ SP mode ------------------------------------------
        R = max(1, math.ceil(L2 / full_bytes))
        keys = jax.random.split(jax.random.fold_in(key, pi), R + 1)
        Ss = [make_S(keys[r]) for r in range(R)]
        Cs = [to_C(S) for S in Ss]
        As = [to_A(S) for S in Ss]
        jax.block_until_ready((Ss, Cs, As))
        print(f"[{pname}] {kind}-parallel K={K} N={N} blocks {G}x{nb}; full {full_bytes / 1e6:.1f} MB, "
              f"block {blk_bytes / 1e6:.1f} MB; SP rotation R={R}", flush=True)
        for T in sp_tokens:
            flops = 2 * T * K * N
            abytes = (T * K + T * N) * 2
            floor = max((full_bytes + abytes) / bw, flops / rate)
            n = bench.n_calls(floor)
            kx = jax.random.split(jax.random.fold_in(keys[R], T), n)
            xs = [jax.random.normal(kx[i], (T, K), BF16) for i in range(n)]
            ref = reference(xs[0], Ss[0], kind)

            def rot(lst):
                return [lst[i % R] for i in range(n)]

            # (i) one GEMM over C
            bench.run("SP", pname, T, "i", lambda xs, ws: [x @ w for x, w in zip(xs, ws)],
                      xs, [rot(Cs)], ref, full_bytes, abytes, flops)
            # (ii) G GEMMs over A
            if kind == "col":
                f2 = lambda xs, wss: [jnp.concatenate([x @ w for w in ws], axis=1) for x, ws in zip(xs, wss)]
                # same, with x passed through an optimization barrier once per block so that XLA's
                # DotMerger (blocks < --xla_gpu_dot_merger_threshold_mb, 32 MB) cannot merge the
                # G dots by concatenating their weights at run time
                f2t = lambda xs, wss: [jnp.concatenate([xb @ w for xb, w in zip(lax.optimization_barrier([x] * len(ws)), ws)], axis=1)
                                       for x, ws in zip(xs, wss)]
            else:
                def f2(xs, wss):
                    out = []
                    for x, ws in zip(xs, wss):
                        acc = None
                        for j, w in enumerate(ws):
                            p = jnp.dot(x[:, j * nb:(j + 1) * nb], w, preferred_element_type=F32)
                            acc = p if acc is None else acc + p
                        out.append(acc.astype(BF16))
                    return out
                f2t = None
            bench.run("SP", pname, T, "ii", f2, xs, [rot(As)], ref, full_bytes, abytes, flops)
            if f2t is not None:
                bench.run("SP", pname, T, "ii-b", f2t, xs, [rot(As)], ref, full_bytes, abytes, flops)
            # (iii) one dot_general over S
            if kind == "col":
                f3 = lambda xs, ws: [jnp.einsum("tk,gnk->tgn", x, w).reshape(x.shape[0], -1) for x, w in zip(xs, ws)]
            else:
                f3 = lambda xs, ws: [jnp.einsum("tgk,gkn->tn", x.reshape(x.shape[0], G, nb), w) for x, w in zip(xs, ws)]
            bench.run("SP", pname, T, "iii", f3, xs, [rot(Ss)], ref, full_bytes, abytes, flops)
            del xs
        del Cs, As, Ss

        # ------------------------------ TP mode ------------------------------------------
        R = max(2, math.ceil(L2 / blk_bytes))
        tkeys = jax.random.split(jax.random.fold_in(key, 100 + pi), R + 1)
        Ss = [make_S(tkeys[r]) for r in range(R)]
        blks = [r % G for r in range(R)]
        A_blk = [to_A(S)[b] for S, b in zip(Ss, blks)]
        AT_blk = [to_AT(S)[b] for S, b in zip(Ss, blks)] if to_AT else None
        bidx = [jnp.array([b], jnp.int32) for b in blks]
        w2d = jax.jit(lambda S: S.reshape(G * nb, S.shape[-1]))
        S2 = [w2d(S) for S in Ss]  # same bytes as S, 2-D view for the Pallas kernel (bitcast)
        jax.block_until_ready((Ss, A_blk, AT_blk, S2))
        print(f"[{pname}] TP rotation R={R} ({R * full_bytes / 1e9:.2f} GB of S)", flush=True)
        kin = K if kind == "col" else nb
        nout = nb if kind == "col" else N
        for T in sorted(tp_tokens, key=lambda t: (t < 16, t)):  # 16 first: T=8 reuses its config
            flops = 2 * T * kin * nout
            abytes = (T * kin + T * nout) * 2
            floor = max((blk_bytes + abytes) / bw, flops / rate)
            n = bench.n_calls(floor)
            kx = jax.random.split(jax.random.fold_in(tkeys[R], T), n)
            xs = [jax.random.normal(kx[i], (T, kin), BF16) for i in range(n)]
            Sb = Ss[0][blks[0]][None]
            ref = reference(xs[0], Sb, kind)

            def rot(lst):
                return [lst[i % R] for i in range(n)]

            if kind == "col":
                f4 = lambda xs, ws: [x @ w for x, w in zip(xs, ws)]          # w [K, Nb]
                f4t = lambda xs, ws: [x @ w.T for x, w in zip(xs, ws)]       # w [Nb, K]
                f5 = lambda xs, ws, bs: [x @ lax.dynamic_index_in_dim(w, b[0], 0, keepdims=False).T
                                         for x, w, b in zip(xs, ws, bs)]
            else:
                f4 = lambda xs, ws: [x @ w for x, w in zip(xs, ws)]          # w [Kb, N]
                f4t = None
                f5 = lambda xs, ws, bs: [x @ lax.dynamic_index_in_dim(w, b[0], 0, keepdims=False)
                                         for x, w, b in zip(xs, ws, bs)]
            bench.run("TP", pname, T, "iv", f4, xs, [rot(A_blk)], ref, blk_bytes, abytes, flops)
            if f4t is not None:
                bench.run("TP", pname, T, "iv-T", f4t, xs, [rot(AT_blk)], ref, blk_bytes, abytes, flops)
            bench.run("TP", pname, T, "v", f5, xs, [rot(Ss), rot(bidx)], ref, blk_bytes, abytes, flops)
            # (vi) Pallas offset GEMM; T=8 reuses T=16's best config (both pad to 16 rows)
            cfgs = pallas_configs(kind, kin, nout, args.tiny)
            if T < 16 and (pname, 16) in pallas_best:
                cfgs = [pallas_best[(pname, 16)]]
            best = None
            for cfg in cfgs:
                bn, bk, sk, nw, ns = cfg
                g = functools.partial(offset_gemm, kind=kind, rows=nb, bn=bn, bk=bk, splitk=sk,
                                      num_warps=nw, num_stages=ns, interpret=interpret)
                f6 = lambda xs, ws, bs, g=g: [g(x, w, b) for x, w, b in zip(xs, ws, bs)]
                t = bench.run("TP", pname, T, "vi", f6, xs, [rot(S2), rot(bidx)], ref, blk_bytes, abytes,
                              flops, extra=f"cfg bn{bn} bk{bk} sk{sk} w{nw} s{ns}")
                if t is not None and (best is None or t < best[0]):
                    best = (t, cfg)
            if best:
                pallas_best[(pname, T)] = best[1]
            del xs
        del Ss, A_blk, AT_blk, S2

    # ----------------------------------- summary ----------------------------------------
    timers = sorted({r["timer"] for r in bench.rows})
    print("\nSUMMARY (us per call: device span / kernel sum (span over floor); floor = max(bytes/copy_bw, "
          "flops/matmul_rate); vi = its best config; layer rows add the span of the 4 projections)")
    print(f"timers used: {', '.join(timers) or 'none'}" + ("; cells marked [wall] are host wall clock per call, "
          "dispatch included, with no kernel sum" if HOST_WALL in timers else ""))
    by = {}
    for r in bench.rows:
        k = (r["mode"], r["proj"], r["T"], r["name"])
        if k not in by or r["us"] < by[k]["us"]:
            by[k] = r
    for mode, names, toks in (("SP", ["i", "ii", "ii-b", "iii"], sp_tokens), ("TP", ["iv", "iv-T", "v", "vi"], tp_tokens)):
        print("| mode | proj | T | floor (bw/flop) | " + " | ".join(names) + " |")
        print("|" + "---|" * (4 + len(names)))
        for pname, *_ in projs:
            for T in toks:
                cells = []
                fl = None
                for nme in names:
                    r = by.get((mode, pname, T, nme))
                    if r:
                        fl = r
                        wall = " [wall]" if r["timer"] == HOST_WALL else ""
                        ksum = "-" if wall else f"{r['ksum_us']:.1f}"
                        cells.append(f"{r['us']:.1f} / {ksum} (x{r['us'] / r['floor_us']:.2f}){wall}")
                    else:
                        cells.append("-")
                if fl:
                    print(f"| {mode} | {pname} | {T} | {fl['floor_us']:.1f} ({fl['bw_us']:.1f}/{fl['fl_us']:.1f}) | "
                          + " | ".join(cells) + " |")
        # layer totals
        print(f"| {mode} | layer (4 proj) | T | floor | " + " | ".join(names) + " |")
        for T in toks:
            tot = {}
            for nme in names:
                s = 0.0
                ok = True
                for pname, kind, *_ in projs:
                    r = by.get((mode, pname, T, nme))
                    if r is None and (nme.endswith("-T") or nme.endswith("-b")):
                        r = by.get((mode, pname, T, nme[:-2]))
                    if r is None:
                        ok = False
                        break
                    s += r["us"]
                tot[nme] = s if ok else None
            fl = sum(by[(mode, p, T, names[0])]["floor_us"] for p, *_ in projs if (mode, p, T, names[0]) in by)
            print(f"| {mode} | layer | {T} | {fl:.1f} | " + " | ".join(
                f"{tot[n]:.1f} (x{tot[n] / fl:.2f})" if tot[n] else "-" for n in names) + " |")
    print("best Pallas configs:", {f"{k[0]}@{k[1]}": v for k, v in pallas_best.items()})


if __name__ == "__main__":
    main()
