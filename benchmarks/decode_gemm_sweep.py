"""Does a Pallas (Triton) GEMM beat cuBLAS at the decode projections of a Llama-3.1-8B TP-2 shard?

One GPU's share of the model in TP mode over two (bf16, weights [K, N] row-major, x [M, K]):
qkv [4096, 3072], o [2048, 4096], gate_up [4096, 14336], down [7168, 4096], and gate_up with
SwiGLU fused into the kernel (``gate_up_swiglu``: [M, 7168] out, against XLA's GEMM plus its
SwiGLU fusion). cuBLAS ran these at 42-79% of the read-only stream (decode_anatomy.py,
README.md, "One GPU"); three Pallas configs per shape lost at 64 rows and tied at 16. This is
the wide sweep: per (projection, rows), a screening pass over block_n x block_k x split_k
(4 warps, 4 stages or fewer where shared memory needs), then the best 5 over warps x
stages, until the shape's share of ``--budget-s`` is spent.

Timing: the sum of the kernels' device times per call from a profiler trace (roofline's
kernel records), so the split-K sum is counted; each call runs 8 GEMMs on 8 distinct weight
copies (more bytes than the 50 MB L2 between two uses of a copy) and 8 distinct x (one
shared x lets XLA's DotMerger concatenate the weights each call, weight_layout_bench run 1),
for the candidate and for cuBLAS alike, divided by 8. The screening times many configs in
one trace (each kernel found by its name); the best 3 and cuBLAS are then re-timed alone
(``roofline.device_time``, median of 10 calls). The read-only stream
(``roofline.read_ceiling``) is measured in the same run.

Every config's first output is checked against ``pallas_matmul_reference`` (f32 dot,
rounded to bf16): a difference above two bf16 steps of the largest output is a wrong
result, recorded, left out of the ranking, and makes the script exit 1 at the end. A
config that fails to lower or compile is recorded with the error's first line.

    source benchmarks/gpu_env.sh && python3 -P benchmarks/decode_gemm_sweep.py --out $OUT/gemm   # H200
    python benchmarks/decode_gemm_sweep.py --smoke --out /tmp/gs    # CPU: interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import device_idle, device_time, read_ceiling, time_fn  # noqa: E402

COPIES = 8
# name -> (K, N of the weight); gate_up_swiglu's weight is [K, 2 * ffn], gate columns first
PROJECTIONS = {"qkv": (4096, 3072), "o": (2048, 4096), "gate_up": (4096, 14336),
               "gate_up_swiglu": (4096, 14336), "down": (7168, 4096)}
SMOKE_PROJECTIONS = {"proj": (256, 256), "gate_up_swiglu": (256, 256)}
BLOCK_N, BLOCK_K, SPLIT_K = (16, 32, 64, 128), (64, 128, 256, 512), (1, 2, 4, 8)
NUM_WARPS, NUM_STAGES = (2, 4, 8), (2, 3, 4, 5)
# the pipelined x and weight blocks; the H200 has 227 KiB per block, Triton takes some more
SHARED_MEMORY_BUDGET = 200 * 1024
GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}  # XLA's GEMMs by cuBLAS, as `serve --gemm cublas`


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One candidate's tiling: ``block_n`` output columns per program, ``block_k`` rows of
    the weight per loop step, ``split_k`` programs sharing one column block's K range."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            if not _is_power_of_two(getattr(self, name)) or getattr(self, name) < 16:
                raise ValueError(f"GemmConfig.{name}={getattr(self, name)}: Triton dots need a power of two >= 16.")
        if not _is_power_of_two(self.split_k):
            raise ValueError(f"GemmConfig.split_k={self.split_k}: use 1, 2, 4 or 8.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps={self.num_warps}: use 1, 2, 4, 8 or 16.")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"GemmConfig.num_stages={self.num_stages}: use 1 to 6.")

    @property
    def name(self) -> str:
        return f"bn{self.block_n}_bk{self.block_k}_sk{self.split_k}_w{self.num_warps}_s{self.num_stages}"

    def unfit(self, rows: int, k: int, n: int, swiglu: bool) -> str | None:
        """Why this config cannot run [rows, k] @ [k, n] (None where it can)."""
        out_cols = n // 2 if swiglu else n
        if swiglu and self.split_k != 1:
            return "the SwiGLU kernel needs split_k 1"
        if out_cols % self.block_n or k % self.split_k or (k // self.split_k) % self.block_k:
            return f"block_n must divide {out_cols} and block_k must divide K / split_k = {k / self.split_k:g}"
        weight_blocks = 2 if swiglu else 1
        shared = self.num_stages * (rows * self.block_k + weight_blocks * self.block_k * self.block_n) * 2
        if shared > SHARED_MEMORY_BUDGET:
            return f"{shared // 1024} KiB of pipelined blocks > {SHARED_MEMORY_BUDGET // 1024} KiB"
        return None

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _check_rows(rows: int):
    if rows % 16 or not _is_power_of_two(rows):
        raise ValueError(f"x has {rows} rows: the Triton dot needs a power of two of at least 16 rows "
                         "(a multiple of 16 that is not a power of two does not lower); pad x to 16, 32, 64, ...")


def _gemm_kernel(x_ref, w_ref, o_ref, *, block_n, block_k, k_per_split):
    col_block, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(col_block * block_n, block_n), block_n)

    def step(i, acc):
        k0 = pl.multiple_of(split * k_per_split + i * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        return acc + jnp.dot(x, w_ref[pl.ds(k0, block_k), cols], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_per_split // block_k, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def pallas_matmul(x, w, *, block_n, block_k, split_k, num_warps, num_stages, interpret=False, name="decode_gemm"):
    """x [M, K] @ w [K, N] in bf16 with f32 accumulation; grid (N / block_n, split_k).

    split_k 1 writes bf16 directly; split_k > 1 writes f32 partials [split_k, M, N] that XLA
    sums (that sum is one more kernel, and part of the timed call)."""
    (rows, k), n = x.shape, w.shape[1]
    _check_rows(rows)
    reason = GemmConfig(block_n, block_k, split_k, num_warps, num_stages).unfit(rows, k, n, swiglu=False)
    if reason and "KiB" not in reason:  # shared memory is Triton's to refuse
        raise ValueError(f"pallas_matmul of [{rows}, {k}] @ [{k}, {n}]: {reason}.")
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
        out_spec = pl.BlockSpec((rows, block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, rows, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows, block_n), lambda j, s: (s, 0, j))
    out = pl.pallas_call(
        functools.partial(_gemm_kernel, block_n=block_n, block_k=block_k, k_per_split=k // split_k),
        grid=(n // block_n, split_k),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(x, w)
    return out if split_k == 1 else out.sum(0).astype(x.dtype)


def pallas_matmul_reference(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _swiglu_kernel(x_ref, w_ref, o_ref, *, block_n, block_k, ffn):
    col_block = pl.program_id(0)
    gate_cols = pl.ds(pl.multiple_of(col_block * block_n, block_n), block_n)
    up_cols = pl.ds(pl.multiple_of(ffn + col_block * block_n, block_n), block_n)

    def step(i, carry):
        gate, up = carry
        rows = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, rows]
        return (gate + jnp.dot(x, w_ref[rows, gate_cols], preferred_element_type=jnp.float32),
                up + jnp.dot(x, w_ref[rows, up_cols], preferred_element_type=jnp.float32))

    zeros = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    gate, up = lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
    o_ref[...] = (jax.nn.silu(gate) * up).astype(o_ref.dtype)


def pallas_gate_up_swiglu(x, w_gate_up, ffn, *, block_n, block_k, split_k=1, num_warps, num_stages,
                          interpret=False, name="decode_gate_up_swiglu"):
    """silu(x @ gate) * (x @ up) as bf16 [M, ffn], where w_gate_up is [K, 2 * ffn] with the
    gate in columns [0, ffn) and up in [ffn, 2 ffn): each program accumulates one gate and
    the matching up column block (f32) and writes their SwiGLU, so no [M, 2 ffn] round trip."""
    (rows, k), n = x.shape, w_gate_up.shape[1]
    _check_rows(rows)
    if n != 2 * ffn:
        raise ValueError(f"w_gate_up has {n} columns; gate and up of ffn={ffn} need {2 * ffn}.")
    reason = GemmConfig(block_n, block_k, split_k, num_warps, num_stages).unfit(rows, k, n, swiglu=True)
    if reason and "KiB" not in reason:
        raise ValueError(f"pallas_gate_up_swiglu of [{rows}, {k}] @ [{k}, {n}]: {reason}.")
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, block_n=block_n, block_k=block_k, ffn=ffn),
        grid=(ffn // block_n,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((rows, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, ffn), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(x, w_gate_up)


def pallas_gate_up_swiglu_reference(x, w_gate_up, ffn):
    h = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(h[:, :ffn]) * h[:, ffn:]).astype(x.dtype)


# -- the sweep -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    proj: str
    rows: int
    k: int
    n: int  # the weight's columns

    @property
    def swiglu(self) -> bool:
        return self.proj.endswith("swiglu")

    @property
    def key(self) -> str:
        return f"{self.proj}:{self.rows}"

    def unfit(self, config: GemmConfig) -> str | None:
        return config.unfit(self.rows, self.k, self.n, self.swiglu)


def candidate(shape: Shape, config: GemmConfig, interpret: bool, name: str):
    """(xs, ws) -> the COPIES outputs of the Pallas kernel."""
    if shape.swiglu:
        one = functools.partial(pallas_gate_up_swiglu, ffn=shape.n // 2, interpret=interpret, name=name)
    else:
        one = functools.partial(pallas_matmul, interpret=interpret, name=name)
    one = functools.partial(one, **config.kwargs())
    one = jax.jit(one)  # traced and lowered once, called COPIES times
    return lambda xs, ws: [one(x, w) for x, w in zip(xs, ws)]


def xla_peer(shape: Shape):
    """(xs, ws) -> the COPIES outputs of XLA's `x @ w` (and its SwiGLU fusion)."""
    def one(x, w):
        h = x @ w
        return jax.nn.silu(h[:, :shape.n // 2]) * h[:, shape.n // 2:] if shape.swiglu else h
    return lambda xs, ws: [one(x, w) for x, w in zip(xs, ws)]


@dataclasses.dataclass
class Run:
    smoke: bool
    options: dict | None
    pool: concurrent.futures.ThreadPoolExecutor
    started: float
    iters: int = 5

    def log(self, message: str):
        print(f"[{time.perf_counter() - self.started:6.1f}s] {message}", flush=True)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def kernel_seconds(entries, xs, ws, iters: int) -> dict:
    """Per entry (tag, compiled fn): device seconds per GEMM, the sum of every kernel a call
    launches, from one trace of all entries called ``iters`` times each in turn. A kernel
    whose name has no tag (the split-K sum) belongs to the entry of the last tagged one."""
    def run_all():
        for _, fn in entries:
            for _ in range(iters):
                jax.block_until_ready(fn(xs, ws))
    planes = device_idle(run_all, 1, events=True)
    if planes is None:
        return {}
    events = sorted((e for plane in planes.values() for e in plane["events"]), key=lambda e: e[:2])
    tags, sums, current = [tag for tag, _ in entries], {}, None
    for _, _, duration, name, *_ in events:
        current = max((t for t in tags if t in name), key=len, default=current)
        if current is not None:
            sums[current] = sums.get(current, 0) + duration
    return {tag: total * 1e-9 / iters / COPIES for tag, total in sums.items()}


def time_alone(fn, xs, ws, smoke: bool, iters: int = 10) -> tuple[float, str]:
    """(seconds per GEMM, timer) of one compiled fn: kernel sum where a trace has device events."""
    if not smoke:
        timing = device_time(fn, (xs, ws), iters, quiet=True)
        if timing is not None:
            return timing["ksum"] / COPIES, "device kernel sum"
    return time_fn(fn, xs, ws, warmup=1, iters=3 if smoke else iters) / COPIES, "host wall clock"


def _build(fn, xs, ws, options):
    """Lowered and compiled, in a worker thread: where the Triton kernel is compiled (XLA's
    compile, or the lowering in jaxlib versions that compile it there) the GIL is released."""
    started = time.perf_counter()
    try:
        lowered = jax.jit(fn).lower(xs, ws)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError("lowering: " + _first_line(e)) from e
    return lowered.compile(options), time.perf_counter() - started


def measure(run: Run, shape: Shape, configs, xs, ws, want, tolerance) -> list[dict]:
    """Build the configs in parallel, check each one's first output against ``want``, then
    time the correct ones together; one record per config."""
    records, pending = [], []
    for config in configs:
        tag = f"dgs_{shape.proj}_{shape.rows}_{config.name}"
        fn = candidate(shape, config, run.smoke, tag)
        pending.append((config, tag, run.pool.submit(_build, fn, xs, ws, run.options)))
    timed = []
    for config, tag, future in pending:
        record = {"config": config.name}
        records.append(record)
        try:
            fn, record["build_s"] = future.result()
            record["max_abs_diff"] = _max_abs_diff(fn(xs, ws)[0], want)
        except Exception as e:  # noqa: BLE001
            record["error"] = _first_line(e)
            continue
        if not record["max_abs_diff"] <= tolerance:
            record["wrong"] = True
            run.log(f"  WRONG {shape.key} {config.name}: max abs diff {record['max_abs_diff']:.4g} > {tolerance:.4g}")
            continue
        timed.append((config, tag, fn, record))
    seconds = {} if run.smoke else kernel_seconds([(tag, fn) for _, tag, fn, _ in timed], xs, ws, run.iters)
    for config, tag, fn, record in timed:
        if tag in seconds:
            record["us"], record["timer"] = seconds[tag] * 1e6, "device kernel sum (batch trace)"
        else:  # no trace, or no kernel of this name in it: alone
            s, record["timer"] = time_alone(fn, xs, ws, run.smoke, run.iters)
            record["us"] = s * 1e6
        record["fn"] = fn  # dropped before the JSON
    return records


def screening_configs(shape: Shape) -> list[GemmConfig]:
    """block_n x block_k x split_k at 4 warps and 4 stages (3 or 2 where 4 do not fit),
    the programs nearest two per multiprocessor (264) first, in case the budget cuts."""
    out = []
    for block_n, block_k, split_k in itertools.product(BLOCK_N, BLOCK_K, (1,) if shape.swiglu else SPLIT_K):
        fitting = (GemmConfig(block_n, block_k, split_k, 4, s) for s in (4, 3, 2))
        config = next((c for c in fitting if shape.unfit(c) is None), None)
        if config is not None:
            out.append(config)
    programs = lambda c: (shape.n // (2 if shape.swiglu else 1)) // c.block_n * c.split_k  # noqa: E731
    return sorted(out, key=lambda c: (abs(math.log2(programs(c) / 264)), -c.block_k))


def refinements(shape: Shape, config: GemmConfig, warps=NUM_WARPS, stages=NUM_STAGES) -> list[GemmConfig]:
    variants = (dataclasses.replace(config, num_warps=w, num_stages=s) for w in warps for s in stages)
    return [c for c in variants if c != config and shape.unfit(c) is None]


SMOKE_REFINE = ((2,), (3,))  # warps, stages
SMOKE_CONFIGS = {False: [GemmConfig(32, 64, 1, 4, 2), GemmConfig(64, 64, 2, 4, 2), GemmConfig(16, 64, 4, 4, 2)],
                 True: [GemmConfig(32, 64, 1, 4, 2), GemmConfig(64, 128, 1, 4, 2)]}


def sweep_shape(run: Run, shape: Shape, ws, deadline: float, max_configs: int | None, read_bps: float) -> dict:
    """cuBLAS, then the screening and the refinement of the Pallas configs on the weight
    copies ``ws``, until ``deadline``; the best 3 and cuBLAS re-timed alone at the end."""
    keys = jax.random.split(jax.random.key(1000 + shape.rows), COPIES)
    xs = [jax.random.normal(key, (shape.rows, shape.k), jnp.bfloat16) for key in keys]
    if shape.swiglu:
        want = jax.jit(pallas_gate_up_swiglu_reference, static_argnums=2)(xs[0], ws[0], shape.n // 2)
    else:
        want = jax.jit(pallas_matmul_reference)(xs[0], ws[0])
    # two bf16 steps of the largest output: an f32 sum in another order may round either way
    tolerance = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) * 2.0 ** -6
    weight_bytes = shape.k * shape.n * 2

    peer = jax.jit(xla_peer(shape)).lower(xs, ws).compile(run.options)
    peer_diff = _max_abs_diff(peer(xs, ws)[0], want)
    peer_s, peer_timer = time_alone(peer, xs, ws, run.smoke)

    screening = SMOKE_CONFIGS[shape.swiglu] if run.smoke else screening_configs(shape)
    cap = max_configs or 1 << 30
    records, stopped = [], None
    ok = lambda: sorted((r for r in records if "us" in r), key=lambda r: r["us"])  # noqa: E731

    def stop_reason():
        return "budget" if time.perf_counter() > deadline else "max_configs" if len(records) >= cap else None

    for start in range(0, len(screening), 16):  # screening, in batches of 16 compiled together; one at least
        if start and (stopped := stop_reason()):
            break
        records += measure(run, shape, screening[start:start + 16][:cap - len(records)], xs, ws, want, tolerance)
    screened = ok()
    run.log(f"{shape.key}: screened {len(records)}, best {[(r['config'], round(r['us'], 1)) for r in screened[:5]]}")
    for best in screened[:1 if run.smoke else 5]:  # the best 5 over warps x stages
        if stopped or (stopped := stop_reason()):
            break
        config = next(c for c in screening if c.name == best["config"])
        seen = {r["config"] for r in records}
        variants = [c for c in refinements(shape, config, *(SMOKE_REFINE if run.smoke else ())) if c.name not in seen]
        records += measure(run, shape, variants[:cap - len(records)], xs, ws, want, tolerance)

    ranked = ok()
    for r in ranked[:3]:  # the best re-timed alone, as cuBLAS was
        s, r["timer_alone"] = time_alone(r["fn"], xs, ws, run.smoke)
        r["us_alone"] = s * 1e6
    peer_again, _ = time_alone(peer, xs, ws, run.smoke)
    peer_us = min(peer_s, peer_again) * 1e6
    alone = sorted(ranked[:3], key=lambda r: r["us_alone"])

    def summary(r):
        us = r.get("us_alone", r["us"])
        return {"config": r["config"], "us": us, "us_batch": r["us"], "timer": r.get("timer_alone", r["timer"]),
                "of_read": weight_bytes / (us * 1e-6) / read_bps, "over_cublas": us / peer_us,
                "max_abs_diff": r["max_abs_diff"]}
    for r in records:
        r.pop("fn", None)
    result = {"proj": shape.proj, "rows": shape.rows, "k": shape.k, "n": shape.n, "weight_bytes": weight_bytes,
              "cublas_us": peer_us, "cublas_us_tries": [peer_s * 1e6, peer_again * 1e6], "cublas_timer": peer_timer,
              "cublas_of_read": weight_bytes / (peer_us * 1e-6) / read_bps, "cublas_max_abs_diff": peer_diff,
              "tolerance": tolerance, "best": summary(alone[0]) if alone else None,
              "top5": [summary(r) for r in alone + ranked[3:5]], "configs_tried": len(records),
              "configs_failed": [r for r in records if "error" in r],
              "configs_wrong": [r for r in records if r.get("wrong")],
              "stopped_by": stopped, "all_us": {r["config"]: round(r["us"], 2) for r in ranked}}
    return result


def cuda_lowering() -> dict:
    """Lower a few configs at the real shapes for CUDA (Pallas to Triton IR; no GPU needed,
    nothing compiled), so the smoke run sees the Triton lowering accept them."""
    cases = [(Shape("qkv", 16, 4096, 3072), GemmConfig(32, 256, 2)),
             (Shape("down", 64, 7168, 4096), GemmConfig(64, 128, 1, 4, 3)),
             (Shape("gate_up_swiglu", 64, 4096, 14336), GemmConfig(32, 128, 1, 4, 3))]
    out = {}
    for shape, config in cases:
        xs = [jax.ShapeDtypeStruct((shape.rows, shape.k), jnp.bfloat16)] * COPIES
        ws = [jax.ShapeDtypeStruct((shape.k, shape.n), jnp.bfloat16)] * COPIES
        try:
            traced = jax.jit(candidate(shape, config, False, "dgs")).trace(xs, ws)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            found = any(target in text for target in ("__gpu$xla.gpu.triton", "triton_kernel_call"))
            out[f"{shape.key}:{config.name}"] = "ok" if found else "no Triton call in the HLO"
        except Exception as e:  # noqa: BLE001
            out[f"{shape.key}:{config.name}"] = _first_line(e)
    return out


def table(results: dict) -> str:
    lines = [f"{'proj':15s} {'M':>3s} {'cuBLAS us':>9s} {'%read':>6s} {'Pallas us':>9s} {'%read':>6s} {'ratio':>6s}  "
             f"{'best config':26s} {'tried':>5s} {'failed':>6s} {'max diff':>8s}"]
    for r in results.values():
        best = r["best"] or {"us": float("nan"), "of_read": float("nan"), "over_cublas": float("nan"),
                             "config": "(none ran)", "max_abs_diff": float("nan")}
        lines.append(f"{r['proj']:15s} {r['rows']:3d} {r['cublas_us']:9.1f} {r['cublas_of_read']:6.0%} "
                     f"{best['us']:9.1f} {best['of_read']:6.0%} {best['over_cublas']:6.2f}  {best['config']:26s} "
                     f"{r['configs_tried']:5d} "
                     f"{len(r['configs_failed']):6d} {best['max_abs_diff']:8.4f}"
                     + (f"  (stopped: {r['stopped_by']})" if r["stopped_by"] else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes: checks and code path")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--rows", default=None, help="x rows (tokens), comma-separated (default 16,64; smoke 16)")
    parser.add_argument("--proj", default=None, help="projections, comma-separated (default all)")
    parser.add_argument("--max-configs", type=int, default=None, help="cap on configs per (projection, rows)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall seconds of the sweep (ceiling excluded)")
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    elif jax.devices()[0].platform != "gpu":
        parser.error(f"without --smoke this needs a GPU (JAX sees {jax.devices()[0].platform}); use --smoke on the CPU")
    started = time.perf_counter()
    run = Run(smoke=args.smoke, options=None if args.smoke else GPU_OPTIONS, started=started,
              pool=concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)))
    run.log(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC jax {jax.__version__} "
            f"on {jax.devices()[0].device_kind}")
    projections = SMOKE_PROJECTIONS if args.smoke else PROJECTIONS
    if args.proj:
        projections = {p: projections[p] for p in args.proj.split(",")}
    rows_list = [int(r) for r in (args.rows or ("16" if args.smoke else "16,64")).split(",")]
    for rows in rows_list:
        try:
            _check_rows(rows)
        except ValueError as e:
            parser.error(f"--rows: {e}")
    read = read_ceiling(8 << 20, 1) if args.smoke else read_ceiling()
    run.log(f"read-only stream {read['best'] / 1e12:.2f} TB/s [{read['timer']}], best of {read['tries']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_gemm_sweep.json")
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "smoke": args.smoke, "copies": COPIES,
           "budget_s": args.budget_s, "read_ceiling": read, "results": {}}
    shapes_left = len(projections) * len(rows_list)
    budget_end = time.perf_counter() + args.budget_s
    weights, weights_shape = None, None
    for proj, (k, n) in projections.items():
        if weights_shape != (k, n):  # gate_up_swiglu reuses gate_up's copies
            weights = None
            keys = jax.random.split(jax.random.key(k * n), COPIES)
            weights = [jax.random.normal(key, (k, n), jnp.bfloat16) * jnp.bfloat16(k ** -0.5) for key in keys]
            weights_shape = (k, n)
        for rows in rows_list:
            shape = Shape(proj, rows, k, n)
            now = time.perf_counter()
            deadline = now + max(0.0, budget_end - now) / shapes_left
            shapes_left -= 1
            run.log(f"{shape.key}: [{rows}, {k}] @ [{k}, {n}], {deadline - now:.0f} s of budget")
            out["results"][shape.key] = sweep_shape(run, shape, weights, deadline, args.max_configs, read["best"])
            out["seconds"] = time.perf_counter() - started
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
            run.log(table({shape.key: out["results"][shape.key]}))
    wrong = [(key, r["config"]) for key, result in out["results"].items() for r in result["configs_wrong"]]
    out["wrong"] = wrong
    failed = [(key, r["config"], r["error"]) for key, result in out["results"].items()
              for r in result["configs_failed"]]
    if args.smoke:  # interpret mode runs every config it is given, and the real shapes must lower
        out["cuda_lowering"] = cuda_lowering()
        run.log(f"lowered for CUDA at the real shapes: {out['cuda_lowering']}")
        failed += [(key, "", e) for key, e in out["cuda_lowering"].items() if e != "ok"]
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    timers = sorted({r["cublas_timer"] for r in out["results"].values()} | {
        r["best"]["timer"] for r in out["results"].values() if r["best"]})
    print(f"\nread-only stream {read['best'] / 1e12:.2f} TB/s; us per GEMM ({', '.join(timers)}), "
          "ratio = Pallas / cuBLAS\n"
          + table(out["results"]))
    run.log(f"wrote {path}")
    if wrong:
        print(f"WRONG results (above tolerance): {wrong}", flush=True)
    if args.smoke and failed:
        print(f"failed in the smoke run: {failed}", flush=True)
    return 1 if wrong or (args.smoke and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
