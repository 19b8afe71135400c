"""FP8 GEMMs on the H200: the Mosaic GPU kernels of kernels/fp8_gemm_mosaic.py against XLA.

For each projection of Llama-3.1-8B and -70B on one GPU and each token count in ``--ms``:
the bf16 XLA GEMM (bf16 weights), the w8a16 kernel (m <= 256: the decode path; wgmma's N
is at most 256), the w8a8 kernel, XLA's w8a16 (convert the e4m3 weights, then a bf16 dot:
``w8a16_matmul_reference``) and XLA's w8a8 (``quantize_rows`` then an e4m3 x e4m3 dot with
float32 output, then the scales), each checked against the reference and timed. In the
same run: the read-only stream rate (roofline.read_ceiling: the best reduction of a
multi-GiB bf16 array) and the FP8 matmul rate (an 8192^3 e4m3 dot through XLA, whose
compiled HLO is checked for a cuBLASLt FP8 custom call). Decode-side figures are weight
bytes / time / stream rate; prefill-side, FLOPs / time / FP8 rate.

Timing: the sum of the kernels' device times per call from a profiler trace
(roofline.device_time's ``ksum``), so the XLA fusions around a kernel (x's quantization,
split-K's sum, the scales) count; each call runs the GEMM on ``copies`` distinct weight
copies (at least 2 and 192 MB of e4m3 weights: more than the 60 MB L2 between two uses)
with distinct x, and the time is divided by ``copies``. Median of 5 calls.

Correctness: each output is compared with its reference (``w8a16_matmul_reference`` /
``w8a8_matmul_reference``) by ||out - ref|| / ||ref||; above 1e-2 (bf16 rounding of both
is about 3e-3) is wrong, and the script exits 1 at the end.

    bash benchmarks/run_gpu.sh kernels                                   # on one GPU
    python3 benchmarks/fp8_gemm_bench.py --probe --out $OUT       # API and variant probe
    python benchmarks/fp8_gemm_bench.py --smoke --out DIR          # the CPU: the XLA rows on a tiny shape
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import device_time, read_ceiling, time_fn  # noqa: E402

from shiftjax.kernels import fp8_gemm  # noqa: E402
from shiftjax.kernels import fp8_gemm_mosaic as mosaic  # noqa: E402
from shiftjax.kernels import fp8_gemm_triton as triton  # noqa: E402

SHAPES = {  # name -> (n, k) of the weight [n, k]
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "70b.qkv": (10240, 8192), "70b.o": (8192, 8192), "70b.gate_up": (57344, 8192), "70b.down": (8192, 28672),
    "smoke": (256, 256),  # --smoke only
}
MS = (1, 16, 64, 256, 1024, 4096)
W8A16_MAX_M = 256
TOLERANCE = 1e-2


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_weights(n: int, k: int, copies: int, seed: int):
    """``copies`` quantized weights (e4m3 values, float32 scales) and their bf16 versions."""
    key = jax.random.key(seed)

    @jax.jit
    def one(key):
        w = jax.random.normal(key, (n, k), jnp.float32) * 0.02
        scale = jnp.max(jnp.abs(w), axis=1) / fp8_gemm.FP8_MAX
        values = (w / scale[:, None]).astype(fp8_gemm.FP8)
        return values, scale, (values.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)

    return [one(k_) for k_ in jax.random.split(key, copies)]


xla_w8a8 = fp8_gemm.w8a8_matmul_cublas  # quantize_rows, an e4m3 x e4m3 dot with float32 output, the scales


def bf16_dot(x, w, scale):
    del scale
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def copies_for(n: int, k: int) -> int:
    return int(min(8, max(2, -(-192e6 // (n * k)))))


def implementations(m: int, kernel_configs: dict) -> dict:
    """name -> (fn(x, values_or_bf16, scale), uses bf16 weights, reference name)."""
    impls = {"xla_bf16": (bf16_dot, True, None),
             "xla_w8a16": (fp8_gemm.w8a16_matmul_reference, False, "w8a16"),
             "xla_w8a8": (xla_w8a8, False, "w8a8")}
    if jax.default_backend() != "gpu":  # --smoke on the CPU: the Mosaic kernels need a Hopper GPU
        return impls
    if m <= W8A16_MAX_M:
        cfg = kernel_configs.get("w8a16")
        impls["mosaic_w8a16"] = (lambda x, v, s, c=cfg: mosaic.w8a16_matmul(x, v, s, c), False, "w8a16")
    cfg = kernel_configs.get("w8a8")
    impls["mosaic_w8a8"] = (lambda x, v, s, c=cfg: mosaic.w8a8_matmul(x, v, s, c), False, "w8a8")
    return impls


def _split_for(n: int, k: int, rows: int, block_k: int, programs: int = 264) -> int:
    """Split-K until ``programs`` programs (or pieces shorter than 4 steps)."""
    split = 1
    while (n // rows) * split < programs and k % (block_k * split * 2) == 0 and k // (block_k * split * 2) >= 4:
        split *= 2
    return split


def triton_variants(n: int, k: int) -> list:
    """The Triton w8a16 tiles the sweep tries: the earlier default's (64 rows, split-K to 2
    programs per SM), tiles with no split-K (no float32 partials, no XLA sum after the
    kernel) whose programs are narrower so that there are still one or two per SM, and the
    default (triton_w8a16_config)."""
    t = triton.TritonW8A16Config
    split = lambda rows, block_k: _split_for(n, k, rows, block_k)  # noqa: E731
    return [t(64, 256, split(64, 256), 4, 4), t(128, 128, split(128, 128), 8, 5),
            t(32, 256, split(32, 256), 4, 4), t(32, 256, 2, 4, 4),
            t(16, 256, 1, 4, 4), t(16, 512, 1, 4, 3), t(16, 256, 1, 2, 6), t(16, 128, 1, 4, 8),
            t(32, 256, 1, 4, 4), t(32, 256, 1, 4, 6), t(32, 512, 1, 4, 3), t(32, 128, 1, 4, 8),
            t(64, 256, 1, 4, 4), t(64, 128, 1, 4, 6), triton.triton_w8a16_config(n, k, 16)]


def mosaic_variants(n: int, k: int) -> list:
    """The Mosaic GPU w8a16 tiles the sweep tries beside the default (w8a16_config)."""
    c = mosaic.W8A16Config
    split = lambda rows, tile_k: _split_for(n, k, rows, tile_k)  # noqa: E731
    return [c(64, 256, 6, split(64, 256)), c(64, 512, 4, split(64, 512)), c(64, 128, 8, split(64, 128)),
            c(64, 256, 4, 1), c(64, 512, 3, 1), c(128, 256, 4, split(128, 256)), c(64, 256, 4, 2 * split(64, 256))]


def sweep_implementations(n: int, k: int, m: int) -> dict:
    """--sweep: XLA's bf16 and w8a8 rows, then tile variants of both w8a16 kernels (Mosaic
    GPU and Triton) at decode token counts, or of the w8a8 kernel above 256 tokens."""
    impls = {"xla_bf16": (bf16_dot, True, None), "xla_w8a8": (xla_w8a8, False, "w8a8")}
    if jax.default_backend() != "gpu":  # --smoke: the Triton kernel in Pallas's interpreter
        impls["triton_interpret"] = (lambda x, w, s: triton.w8a16_matmul(x, w, s, interpret=True), False, "w8a16")
        return impls
    if m <= W8A16_MAX_M:
        for c in (c for c in triton_variants(n, k) if c.divides(n, k)):  # no silent fallback to XLA
            name = f"triton_n{c.block_n}_k{c.block_k}_split{c.split_k}_w{c.num_warps}_s{c.num_stages}"
            impls[name] = (lambda x, w, s, c=c: triton.w8a16_matmul(x, w, s, c), False, "w8a16")
        impls["mosaic_default"] = (lambda x, w, s: mosaic.w8a16_matmul(x, w, s), False, "w8a16")
        for c in (c for c in mosaic_variants(n, k) if c.divides(n, k)):
            name = f"mosaic_t{c.tile_n}_k{c.tile_k}_split{c.split_k}_s{c.stages}"
            impls[name] = (lambda x, w, s, c=c: mosaic.w8a16_matmul(x, w, s, c), False, "w8a16")
    else:
        variants = {
            "mosaic_w8a8_default": None,
            "mosaic_w8a8_ws_128x256x128_s3": mosaic.W8A8Config(128, 256, 128, 3, True),
            "mosaic_w8a8_ws_64x256x128_s4": mosaic.W8A8Config(64, 256, 128, 4, True),
            "mosaic_w8a8_ws_128x128x256_s2": mosaic.W8A8Config(128, 128, 256, 2, True),
            "mosaic_w8a8_ws_128x192x128_s3": mosaic.W8A8Config(128, 192, 128, 3, True),
            "mosaic_w8a8_ws_128x128x128_s3": mosaic.W8A8Config(128, 128, 128, 3, True),  # the default before persistent
            "mosaic_w8a8_persistent_64x256x128_s3": mosaic.W8A8Config(64, 256, 128, 3, True, persistent=True),
        }
        for v, c in variants.items():
            impls[v] = (lambda x, w, s, c=c: mosaic.w8a8_matmul(x, w, s, c), False, "w8a8")
    return impls


def many(fn, copies):
    """One jitted call that applies ``fn`` to ``copies`` (x, weight, scale) triples."""
    def run(xs, ws, ss):
        return [fn(x, w, s) for x, w, s in zip(xs, ws, ss)]
    return jax.jit(run)


def dtime(fn, args, calls: int = 5) -> dict:
    """roofline.device_time of ``calls`` calls, or the host wall clock where the trace has
    no device events (then ksum = span = wall, kernels = 0)."""
    t = device_time(fn, args, calls, quiet=True)
    if t is None:
        wall = time_fn(fn, *args, warmup=1, iters=calls)
        t = {"ksum": wall, "span": wall, "kernels": 0, "timer": "host wall clock"}
    return t


def compile_all(jobs: dict) -> dict:
    """name -> compiled executable or the exception; compiled on 8 threads."""
    def build(item):
        name, (fn, args) = item
        try:
            return name, fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            return name, e
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(pool.map(build, jobs.items()))


def bench_shape(name, n, k, ms, kernel_configs_for, log, impls_for=None, only: str = "") -> list[dict]:
    copies = copies_for(n, k)
    weights = make_weights(n, k, copies, seed=hash(name) % 1000)
    rows = []
    for m in ms:
        xs = [jax.random.normal(jax.random.key(1000 + m + i), (m, k), jnp.bfloat16) for i in range(copies)]
        refs = {"w8a16": fp8_gemm.w8a16_matmul_reference(xs[0], weights[0][0], weights[0][1]),
                "w8a8": fp8_gemm.w8a8_matmul_reference(xs[0], weights[0][0], weights[0][1])}
        impls = impls_for(n, k, m) if impls_for else implementations(m, kernel_configs_for(n, k, m))
        if only:
            impls = {name: impl for name, impl in impls.items() if re.search(only, name)}
        jobs = {}
        for impl, (fn, bf16w, _) in impls.items():
            ws = [w[2] if bf16w else w[0] for w in weights]
            jobs[impl] = (many(fn, copies), (xs, ws, [w[1] for w in weights]))
        compiled = compile_all(jobs)
        for impl, (fn, bf16w, ref_name) in impls.items():
            row = {"shape": name, "n": n, "k": k, "m": m, "impl": impl, "copies": copies}
            exe = compiled[impl]
            if isinstance(exe, Exception):
                row["error"] = f"{type(exe).__name__}: {str(exe)[:400]}"
                log(f"{name} m={m} {impl}: COMPILE ERROR {row['error'][:200]}")
                rows.append(row)
                continue
            args = jobs[impl][1]
            try:
                outs = exe(*args)
                if ref_name is not None:
                    row["rel_err"] = rel_err(outs[0], refs[ref_name])
                    row["ok"] = row["rel_err"] <= TOLERANCE
                if bf16w:
                    row["rel_err_vs_w8a16_ref"] = rel_err(outs[0], refs["w8a16"])
                t = dtime(exe, args)
                if t:
                    row["us"] = t["ksum"] / copies * 1e6
                    row["span_us"] = t["span"] / copies * 1e6
                    row["kernels_per_call"] = t["kernels"] / copies
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            weight_bytes = n * k * (2 if bf16w else 1)
            if "us" in row:
                row["weight_bytes"] = weight_bytes
                row["tflops"] = 2 * m * n * k / (row["us"] * 1e-6) / 1e12
            log(f"{name:12s} m={m:5d} {impl:13s} " + (
                f"{row['us']:9.1f} us  {row.get('rel_err', float('nan')):.1e}" if "us" in row
                else row.get("error", "?")[:200]))
            rows.append(row)
    del weights
    return rows


def fp8_rate(n: int = 8192, repeats: int = 3) -> dict:
    """The 8192^3 e4m3 x e4m3 dot (float32 out) through XLA: rate and whether it is cuBLASLt."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(fp8_gemm.FP8)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(fp8_gemm.FP8)
    fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
    hlo = fn.lower(a, b).compile().as_text()
    calls = sorted({line.split('custom_call_target="')[1].split('"')[0]
                    for line in hlo.splitlines() if 'custom_call_target="' in line})
    tries = []
    for _ in range(repeats):
        tries.append(dtime(fn, (a, b))["ksum"])
    seconds = min(tries)
    out = {"what": f"{n}^3 e4m3 x e4m3 -> f32 XLA dot (FLOP/s)", "best": 2 * n**3 / seconds,
           "tries_tflops": [round(2 * n**3 / s / 1e12, 1) for s in tries], "custom_calls": calls,
           "cublaslt_fp8": any("cublas$lt" in c for c in calls) and "f8e4m3fn" in hlo}
    bf = jax.jit(jnp.matmul)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    t16 = min(dtime(bf, (a16, b16))["ksum"] for _ in range(2))
    out["bf16_matmul_flops"] = 2 * n**3 / t16
    return out


def probe(out_dir: str, log) -> dict:
    """The device's API, the FP8 dot, and each kernel variant on two shapes."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    info = {"jax": jax.__version__, "plgpu": [x for x in dir(plgpu) if not x.startswith("_")]}
    try:
        from jax._src.lib import mosaic_gpu as mgpu_lib
        info["ptxas_isa"] = mgpu_lib._mosaic_gpu_ext._get_ptxas_isa_version()
    except Exception as e:  # noqa: BLE001
        info["ptxas_isa"] = repr(e)
    log(json.dumps({k: v for k, v in info.items() if k != "plgpu"}))
    log("plgpu: " + " ".join(info["plgpu"]))
    variants16 = {
        "f16_t64_k256_s4": mosaic.W8A16Config(64, 256, 4, 1),
        "f16_t64_k256_s4_split4": mosaic.W8A16Config(64, 256, 4, 4),
        "f16_t128_k256_s4_split2": mosaic.W8A16Config(128, 256, 4, 2),
        "f16_t64_k512_s3_split2": mosaic.W8A16Config(64, 512, 3, 2),
        "f16_t64_k128_s6_split4": mosaic.W8A16Config(64, 128, 6, 4),
        "f16_t128_k256_s4_split4": mosaic.W8A16Config(128, 256, 4, 4),
        "f16_t64_k256_s6_split2": mosaic.W8A16Config(64, 256, 6, 2),
        "f16_t64_k512_s4_split4": mosaic.W8A16Config(64, 512, 4, 4),
    }
    variants8 = {
        "ws_128x128x128_s3": mosaic.W8A8Config(128, 128, 128, 3, True),
        "ws_64x256x128_s3": mosaic.W8A8Config(64, 256, 128, 3, True),
        "ws_64x128x128_s5": mosaic.W8A8Config(64, 128, 128, 5, True),
        "ws_64x128x256_s3": mosaic.W8A8Config(64, 128, 256, 3, True),
        "one_128x128x128_s4": mosaic.W8A8Config(128, 128, 128, 4, False),
        "one_64x256x128_s4": mosaic.W8A8Config(64, 256, 128, 4, False),
        "one_128x256x128_s3": mosaic.W8A8Config(128, 256, 128, 3, False),
    }
    results = []
    for shape, (n, k) in (("8b.o", SHAPES["8b.o"]), ("8b.gate_up", SHAPES["8b.gate_up"])):
        copies = copies_for(n, k)
        weights = make_weights(n, k, copies, seed=7)
        for alg, variants, ms in (("w8a16", variants16, (1, 64)), ("w8a8", variants8, (256, 4096))):
            for m in ms:
                xs = [jax.random.normal(jax.random.key(m + i), (m, k), jnp.bfloat16) for i in range(copies)]
                ref_fn = fp8_gemm.w8a16_matmul_reference if alg == "w8a16" else fp8_gemm.w8a8_matmul_reference
                ref = ref_fn(xs[0], weights[0][0], weights[0][1])
                fns = {v: (lambda x, w, s, c=c: (mosaic.w8a16_matmul if alg == "w8a16" else mosaic.w8a8_matmul)(x, w, s, c))
                       for v, c in variants.items()}
                jobs = {v: (many(f, copies), (xs, [w[2] if v == "xla_bf16" else w[0] for w in weights],
                                              [w[1] for w in weights])) for v, f in fns.items()}
                t0 = time.perf_counter()
                compiled = compile_all(jobs)
                log(f"-- {shape} {alg} m={m}: compiled {len(jobs)} in {time.perf_counter() - t0:.1f}s")
                for v, exe in compiled.items():
                    row = {"shape": shape, "alg": alg, "m": m, "variant": v}
                    if isinstance(exe, Exception):
                        row["error"] = "".join(traceback.format_exception_only(type(exe), exe))[-1500:]
                        log(f"   {v}: ERROR {row['error'][-700:]}")
                        results.append(row)
                        continue
                    try:
                        outs = exe(*jobs[v][1])
                        row["rel_err"] = rel_err(outs[0], ref)
                        t = dtime(exe, jobs[v][1])
                        row["us"] = t["ksum"] / copies * 1e6
                        row["kernels"] = t["kernels"] / copies
                        log(f"   {v:28s} {row['us']:9.1f} us  err {row['rel_err']:.1e}  "
                            f"{n * k / row['us'] / 1e6:.2f} TB/s(fp8 w)  {2 * m * n * k / row['us'] / 1e6:.0f} TFLOP/s")
                    except Exception as e:  # noqa: BLE001
                        row["error"] = "".join(traceback.format_exception_only(type(e), e))[-1500:]
                        log(f"   {v}: RUN ERROR {row['error'][-700:]}")
                    results.append(row)
        del weights
    info["variants"] = results
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the FP8 rate and the stream (a probe)")
    parser.add_argument("--shapes", default=",".join(name for name in SHAPES if name != "smoke"))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--stream-gib", type=float, default=2.0)
    parser.add_argument("--fp8-n", type=int, default=8192, help="size of the FP8 rate's square dot")
    parser.add_argument("--smoke", action="store_true", help="the CPU: the smoke shape, m = 16, small ceilings")
    parser.add_argument("--sweep", action="store_true",
                        help="tile variants of the kernels (sweep_implementations) instead of the defaults")
    parser.add_argument("--only", default="", help="a regular expression: run only the implementations it finds")
    parser.add_argument("--deadline-s", type=float, default=0, help="stop before a shape once this many seconds have passed")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.ms, args.stream_gib, args.fp8_n = "smoke", "16", 1 / 64, 256
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "probe.log" if args.probe else "fp8_gemm.log"), "w")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    started = time.time()
    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    if args.no_ceilings:
        rate, stream = {"best": float("nan")}, {"best": float("nan")}
    else:
        rate, stream = measure_ceilings(args, log)
    result.update(fp8_rate=rate, stream=stream)
    failed = False
    json_path = os.path.join(args.out, "probe.json" if args.probe else "fp8_gemm.json")
    if args.probe:
        result["probe"] = probe(args.out, log)
    else:
        rows = []
        for name in args.shapes.split(","):
            if args.deadline_s and time.time() - started > args.deadline_s:
                log(f"deadline: {name} and later shapes not run")
                break
            n, k = SHAPES[name]
            rows += bench_shape(name, n, k, [int(m) for m in args.ms.split(",")],
                                lambda n, k, m: {"w8a16": None, "w8a8": None}, log,
                                impls_for=sweep_implementations if args.sweep else None, only=args.only)
            finish_rows(rows, rate, stream)
            result["rows"] = rows
            with open(json_path, "w") as f:  # after each shape: a call cut short keeps its rows
                json.dump(result, f, indent=1, default=str)
        failed = any(row.get("ok") is False or ("error" in row and row["impl"].startswith(("mosaic", "triton")))
                     for row in rows)
        result["configs"] = {f"{r['shape']}.m{r['m']}": {
            "w8a16": dataclasses.asdict(mosaic.w8a16_config(r["n"], r["k"], r["m"])),
            "w8a8": dataclasses.asdict(mosaic.w8a8_config(r["n"], r["k"], r["m"]))} for r in rows}
        log(sweep_summary(rows) if args.sweep else summary(rows))
    result["seconds"] = time.time() - started
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    log(f"done in {result['seconds']:.0f}s")
    sys.exit(1 if failed else 0)


def measure_ceilings(args, log):
    rate = fp8_rate(args.fp8_n)
    log(f"fp8 rate: {rate['best'] / 1e12:.0f} TFLOP/s {rate['tries_tflops']} cublaslt_fp8={rate['cublaslt_fp8']} "
        f"calls={rate['custom_calls']}; bf16 8192^3: {rate['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    stream = read_ceiling(int(args.stream_gib * (1 << 30)), repeats=2)
    log(f"read-only stream: {stream['best'] / 1e12:.3f} TB/s {stream['tries']}")
    return rate, stream


def finish_rows(rows, rate, stream):
    for row in rows:
        if "us" in row:
            row["stream_fraction"] = row["weight_bytes"] / (row["us"] * 1e-6) / stream["best"]
            row["fp8_fraction"] = 2 * row["m"] * row["n"] * row["k"] / (row["us"] * 1e-6) / rate["best"]


def summary(rows) -> str:
    """Per shape and m: us of each implementation, the kernels' fractions, vs bf16."""
    table = {}
    for r in rows:
        table.setdefault((r["shape"], r["m"]), {})[r["impl"]] = r
    lines = [f"{'shape':12s} {'m':>5s} {'bf16':>8s} {'xw8a16':>8s} {'xw8a8':>8s} {'mw8a16':>8s} {'mw8a8':>8s}"
             f" {'w16/strm':>8s} {'w8/fp8':>7s} {'w16 vs bf16':>11s} {'w8 vs bf16':>10s}"]
    for (shape, m), impls in table.items():
        us = {i: impls[i].get("us") for i in impls}
        fmt = lambda v: f"{v:8.1f}" if v else f"{'-':>8s}"  # noqa: E731
        w16, w8, bf = us.get("mosaic_w8a16"), us.get("mosaic_w8a8"), us.get("xla_bf16")
        lines.append(
            f"{shape:12s} {m:5d} {fmt(bf)} {fmt(us.get('xla_w8a16'))} {fmt(us.get('xla_w8a8'))} {fmt(w16)} {fmt(w8)}"
            f" {impls.get('mosaic_w8a16', {}).get('stream_fraction', 0):8.2f}"
            f" {impls.get('mosaic_w8a8', {}).get('fp8_fraction', 0):7.2f}"
            f" {(bf / w16 if w16 and bf else 0):11.2f} {(bf / w8 if w8 and bf else 0):10.2f}")
    return "\n".join(lines)


def sweep_summary(rows) -> str:
    """Per shape and m, fastest first: us, the fraction of the stream (weight bytes) and of
    the FP8 rate, and the time over XLA's bf16 GEMM."""
    table = {}
    for r in rows:
        table.setdefault((r["shape"], r["m"]), []).append(r)
    lines = []
    for (shape, m), impls in table.items():
        bf = next((r.get("us") for r in impls if r["impl"] == "xla_bf16"), None)
        lines.append(f"{shape} m={m}")
        for r in sorted(impls, key=lambda r: r.get("us", float("inf"))):
            if "us" not in r:
                lines.append(f"    {r['impl']:30s} {r.get('error', '?')[:150]}")
                continue
            lines.append(f"    {r['impl']:30s} {r['us']:8.1f} us  stream {r.get('stream_fraction', 0):5.2f}"
                         f"  fp8 rate {r.get('fp8_fraction', 0):5.2f}  over bf16 {r['us'] / bf if bf else 0:5.2f}"
                         f"  err {r.get('rel_err', float('nan')):.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
