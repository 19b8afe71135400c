"""Projected step times of TP, SP, Shift and DP on 8x H200 for the Llama-3-70B shape (bf16),
and the paper's workloads replayed through the real scheduler with them.

Every number this prints for 8 GPUs is a **projection**, not a measurement. The model:

    step(mode, T tokens, B seqs, contexts) = layers * (gemm + attention + collectives per layer)
                                           + embedding all-reduce + LM head + logits all-gather

- **gemm** (projections, norms, RoPE, SiLU: everything of a layer but attention): the
  per-device roofline floor of the shard (weight + activation bytes over the copy rate, or
  FLOPs over the matmul rate) times an efficiency ratio measured on one H200 on the 70B
  layer as one device of 8 sees it (README.md, "One GPU: the Llama-3-70B layer and the weight storages", the layer bench's time
  minus its cuDNN attention), interpolated in log(tokens per device). Shards of 1/8 of the
  weights take the TP-layer ratios, larger shards the SP-layer ratios.
- **attention** (this project's Pallas kernels): ``fixed + max(KV bytes / rate, FLOPs /
  rate)``, fitted to the kernels' device time in the one-GPU Llama-3.1-8B steps
  (``results/x2_run2/steps_1gpu.json``): decode 4..64 seqs x 1k, prefill 2048.
- **collectives**: ``latency + bytes * f(n) / busbw``, fitted to all-reduce and all-to-all
  times on 2 H200s (``shift_x2.py --parts collectives``) and carried to n GPUs with NCCL's
  ring model: bus bandwidth is the same at any n (nccl-tests ``doc/PERFORMANCE.md``:
  all-reduce busbw = algbw * 2(n-1)/n, all-gather and all-to-all busbw = algbw * (n-1)/n,
  "the bus bandwidth ... should be independent of the number of ranks"), and the latency
  grows by ``hwLat`` per ring step, 2(n-1) steps for an all-reduce and n-1 for an
  all-gather (NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel``: NVLink ring LL
  ``hwLat`` = 0.47 us). An all-to-all is taken to be n-1 steps too; the logits all-gather
  uses the all-to-all fit (same (n-1)/n traffic).
- Left out: host time between steps (0 here; the engine loop's GPUs idle between steps on 2
  GPUs: README.md, "Two GPUs"), sampling, and compute/communication overlap (none is assumed).

Deployments (70B bf16 = 141 GB of weights; one H200 has 141 GB): SP is sp=4 x tp=2 (each
device holds half the weights, 70.6 GB; sp=8 would need all 141 GB on every device and
does not fit), Shift is that mesh with TP mode over all 8, TP is tp=8, and DP is 4
replicas of TP over 2 GPUs (a one-GPU replica cannot hold the weights).

    .venv/bin/python benchmarks/projection.py --out benchmarks/results/projection
    .venv/bin/python benchmarks/projection.py --smoke --out /tmp/p   # synthetic collectives, tiny workloads
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
NCCL_RING_HOP_S = 0.47e-6  # NVIDIA/nccl src/graph/tuning.cc: hwLat[NVLINK][RING][LL]
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Hardware:
    hbm_bytes: float = 141e9
    copy_Bps: float = 3.666e12  # README.md, "One GPU: the Llama-3-70B layer...": its copy ceiling
    read_Bps: float = 3.73e12  # README.md, "The 8-GPU projection": read-only stream (GPU 0, the slower)
    matmul_flops: float = 655e12  # README.md, "One GPU: the Llama-3-70B layer...": bf16 8192^3


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    d: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def weight_bytes(self) -> float:
        layer = self.d * (self.q_heads + 2 * self.kv_heads) * self.head_dim + self.q_heads * self.head_dim * self.d
        return BF16 * (self.layers * (layer + 3 * self.d * self.ffn) + 2 * self.vocab * self.d)


LLAMA3_70B = Shape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256)
LLAMA31_8B = Shape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256)

# README.md, "One GPU: the Llama-3-70B layer and the weight storages": one 70B layer as one device of 8 sees it (device span, us), by
# global tokens T; TP: T tokens through 1/8 of the weights, SP: T/8 tokens through all of them.
LAYER_BENCH_US = {"tp": {8: 90.3, 64: 89.6, 512: 198.1, 4096: 1410.7},
                  "sp_contiguous": {8: 425.4, 64: 415.9, 512: 445.9, 4096: 1236.2},
                  "sp_split": {8: 1151.1, 64: 579.8, 512: 603.6, 4096: 1551.5}}
BENCH_ATTENTION_FIXED_S = 5.5e-6  # cuDNN attention kernel at T = 8 in that trace
CUDNN_FLOPS = 380e12  # cuDNN causal attention on the H200, B4 S4096 H32 D128 (the design's probe)


def causal_flops(q: int, ctx: int, heads: int, head_dim: int) -> float:
    """QK^T and PV FLOPs of ``q`` new tokens at the end of a ``ctx``-token sequence."""
    keys = q * ctx - q * (q - 1) / 2
    return 4.0 * head_dim * heads * keys


def gemm_floor_s(shape: Shape, tokens: float, fraction: float, hw: Hardware, kv_slots: int | None = None) -> float:
    """Roofline floor of a layer's four projections for ``tokens`` through ``fraction`` of the weights."""
    hd, kv = shape.head_dim, kv_slots or shape.kv_heads
    gemms = [(shape.d, fraction * (shape.q_heads + 2 * kv) * hd), (fraction * shape.q_heads * hd, shape.d),
             (shape.d, fraction * 2 * shape.ffn), (fraction * shape.ffn, shape.d)]
    moved = sum(BF16 * (k * n + tokens * (k + n)) for k, n in gemms)
    flops = sum(2.0 * tokens * k * n for k, n in gemms)
    return max(moved / hw.copy_Bps, flops / hw.matmul_flops)


def layer_ratios(hw: Hardware) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per family: (log tokens per device, measured gemm time / floor) of the 70B layer bench."""
    out = {}
    for family, row in LAYER_BENCH_US.items():
        per_device, fraction = (1, 1 / 8) if family == "tp" else (8, 1.0)
        m = np.array([t / per_device for t in row])
        gemm = np.array([row[t] * 1e-6 - BENCH_ATTENTION_FIXED_S - causal_flops(t, t, 8, 128) / CUDNN_FLOPS
                         for t in row])
        floor = np.array([gemm_floor_s(LLAMA3_70B, x, fraction, hw) for x in m])
        out[family] = (np.log(m), gemm / floor)
    return out


@dataclasses.dataclass(frozen=True)
class AttentionFit:
    """Seconds of one layer's attention on one device: fixed + max(bytes / kv_Bps, flops / flops_per_s)."""

    fixed_s: float
    kv_Bps: float
    flops_per_s: float

    def seconds(self, seqs, heads: int, kv_slots: int, head_dim: int) -> float:
        if not seqs:
            return 0.0
        kv_bytes = sum(ctx for _, ctx in seqs) * kv_slots * head_dim * 2 * BF16
        flops = sum(causal_flops(q, ctx, heads, head_dim) for q, ctx in seqs)
        return float(self.fixed_s + max(kv_bytes / self.kv_Bps, flops / self.flops_per_s))


def _kernel_s(row: dict, name: str) -> tuple[float, int]:
    total, count = next((ms, n) for ms, n, kernel in row["top"] if name in kernel)
    return total * 1e-3, int(count)


def fit_attention(steps_1gpu: dict, shape: Shape = LLAMA31_8B, ctx: int = 1024) -> AttentionFit:
    """The attention kernels' device time in the one-GPU 8B steps (profile ``top`` lists)."""
    slots, points = shape.kv_heads, []
    for key, row in steps_1gpu.items():
        if key.startswith("tp:dec"):
            seconds, calls = _kernel_s(row, "ragged_paged_attention_decode")
            points.append((int(key[6:]) * (ctx + 1) * slots * shape.head_dim * 2 * BF16, seconds / calls))
    x, t = np.array(points).T
    slope, fixed = np.polyfit(x, t, 1)
    seconds, calls = _kernel_s(steps_1gpu["tp:pre1x2048"], "ragged_paged_attention_prefill")
    flops = causal_flops(2048, 2048, shape.q_heads, shape.head_dim)
    return AttentionFit(float(fixed), float(1 / slope), float(flops / (seconds / calls - fixed)))


@dataclasses.dataclass(frozen=True)
class CollectiveFit:
    """One collective's seconds against bytes per device, fitted at 2 GPUs, NCCL's ring model at n."""

    kind: str  # "all_reduce" or "all_to_all" (also used for all-gather)
    latency_s: float  # at n = 2
    bus_Bps: float
    hop_s: float = NCCL_RING_HOP_S

    def ring_steps(self, n: int) -> int:
        return 2 * (n - 1) if self.kind == "all_reduce" else n - 1

    def traffic(self, n: int) -> float:
        """Bytes on the bus per byte per device: 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
        return (2.0 if self.kind == "all_reduce" else 1.0) * (n - 1) / n

    def seconds(self, nbytes: float, n: int) -> float:
        if n == 1 or nbytes <= 0:
            return 0.0
        return self.latency_s + (self.ring_steps(n) - self.ring_steps(2)) * self.hop_s + nbytes * self.traffic(n) / self.bus_Bps


def fit_collective(kind: str, sizes, seconds) -> CollectiveFit:
    """Least squares in relative error of ``t = latency + bytes * traffic(2) / busbw`` at n = 2."""
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    traffic = CollectiveFit(kind, 0.0, 1.0).traffic(2)
    a = np.stack([1 / seconds, sizes * traffic / seconds], axis=1)
    (latency, inverse_bw), *_ = np.linalg.lstsq(a, np.ones_like(seconds), rcond=None)
    if inverse_bw <= 0:
        raise ValueError(f"{kind}: the fit gives no positive bandwidth; check the collectives file")
    return CollectiveFit(kind, max(float(latency), 0.0), float(1 / inverse_bw))


def load_collectives(path: str | Path, hw: Hardware = Hardware()) -> tuple[CollectiveFit, CollectiveFit]:
    """Fits of ``shift_x2.py --parts collectives``. Its chain scales every result by 0.5, one
    elementwise pass over the buffer (read + write at the copy rate), which is taken out: in
    a step the residual add that consumes the result is part of the layer's compute."""
    data = json.loads(Path(path).read_text())
    data = data.get("collectives", data)
    if "error" in data:
        raise ValueError(f"{path}: the collectives part failed on the device: {data['error']}")
    sizes = np.asarray(data["bytes_per_device"], float)
    scale = 2 * sizes / hw.copy_Bps
    return tuple(fit_collective(kind, sizes, np.asarray(data[f"{kind}_s"]) - scale) for kind in ("all_reduce", "all_to_all"))


@dataclasses.dataclass(frozen=True)
class Deployment:
    """``replicas`` engines, each on an (sp, tp) mesh; modes "tp" (over sp * tp) and, when sp > 1, "sp"."""

    name: str
    sp: int
    tp: int
    replicas: int = 1
    sp_weights: str = "contiguous"  # or "split" (aliased blocks, today's default)

    @property
    def group(self) -> int:
        return self.sp * self.tp


@dataclasses.dataclass
class StepModel:
    shape: Shape
    hw: Hardware
    attention: AttentionFit
    all_reduce: CollectiveFit
    all_to_all: CollectiveFit

    def __post_init__(self):
        self._ratios = layer_ratios(self.hw)

    def gemm_s(self, tokens: float, fraction: float, family: str) -> float:
        logs, ratios = self._ratios[family]
        ratio = float(np.interp(math.log(max(tokens, 1.0)), logs, ratios))
        return ratio * gemm_floor_s(self.shape, tokens, fraction, self.hw)

    def kv_slots(self, devices: int) -> int:
        return -(-self.shape.kv_heads // devices)

    def breakdown(self, dep: Deployment, mode: str, num_tokens: int, num_seqs: int, seqs) -> dict[str, float]:
        """Seconds of one step by component; ``num_tokens``/``num_seqs`` are the padded bucket."""
        s, ar, a2a, p = self.shape, self.all_reduce, self.all_to_all, dep.group
        heads, slots = -(-s.q_heads // p), self.kv_slots(p)
        if mode == "tp":
            gemm = self.gemm_s(num_tokens, 1 / p, "tp" if p >= 4 else "sp_contiguous")
            comm = 2 * ar.seconds(num_tokens * s.d * BF16, p)
        elif mode == "sp" and dep.sp > 1:
            local = num_tokens / dep.sp
            gemm = self.gemm_s(local, 1 / dep.tp, f"sp_{dep.sp_weights}")
            qkv = local * (s.q_heads + 2 * slots * p) / dep.tp * s.head_dim * BF16
            comm = (a2a.seconds(qkv, dep.sp) + a2a.seconds(local * s.q_heads / dep.tp * s.head_dim * BF16, dep.sp)
                    + 2 * ar.seconds(local * s.d * BF16, dep.tp))
        else:
            raise ValueError(f"mode {mode!r} does not run on {dep.name} (sp={dep.sp}, tp={dep.tp})")
        attention = self.attention.seconds(seqs, heads, slots, s.head_dim)
        lm_bytes = -(-s.vocab // p) * s.d * BF16
        out = {"gemm": s.layers * gemm, "attention": s.layers * attention, "collectives": s.layers * comm,
               "embed_allreduce": ar.seconds(num_tokens * s.d * BF16, p),
               "lm_head": lm_bytes / self.hw.read_Bps + a2a.seconds(num_seqs * s.vocab * 4, p)
               + (ar.seconds(num_seqs * s.d * BF16, dep.sp) if mode == "sp" else 0.0)}
        out["total"] = sum(out.values())
        return out

    def step_seconds(self, dep: Deployment):
        return lambda mode, t, b, seqs: self.breakdown(dep, mode, t, b, seqs)["total"]

    def kv_capacity_tokens(self, dep: Deployment, utilization: float = 0.9, reserve_bytes: float = 5e9) -> int:
        """Tokens of KV cache one replica holds: (utilization * HBM - weights - reserve) per device
        over the bytes a token's K and V take on one device. Negative: the weights do not fit."""
        free = utilization * self.hw.hbm_bytes - self.shape.weight_bytes / dep.tp - reserve_bytes
        per_token = self.shape.layers * self.kv_slots(dep.group) * self.shape.head_dim * 2 * BF16
        return int(free // per_token)


# Measured 2-GPU steps, Llama-3.1-8B shape, device span in ms: results/x2_run1/steps.log
# (tp dec and prefill, sp prefill) and results/x2_run2/allreduce.json (variant nccl).
MEASURED_X2_MS = {"tp dec8 x 1k": 4.34, "tp dec64 x 1k": 6.22, "tp pre 2x2048": 60.80, "sp pre 2x2048": 60.36,
                  "tp pre 4096": 65.45, "sp pre 4096": 64.45}


def check_two_gpu(steps_1gpu: dict, ar: CollectiveFit, a2a: CollectiveFit, hw: Hardware = Hardware(),
                  weight_bytes: float | None = None) -> list[dict]:
    """Predicts the measured 2-GPU 8B steps from the one-GPU steps plus the collectives fit.

    TP over 2 reads half the weights: the one-GPU step minus its attention, minus half the
    weight bytes at the read rate, plus the one-GPU attention of half the sequences (half
    the KV heads of all of them is the same work). A prefill of 2x2048 on the mesh does the
    GEMM FLOPs of one 2048 prompt per device, and the same attention; 4096 causal tokens
    over half the heads is twice one GPU's 2048-prompt attention."""
    s = LLAMA31_8B
    weight_bytes = weight_bytes or steps_1gpu["weight_bytes_per_device"][0]
    span = {k: v["span_ms"] * 1e-3 for k, v in steps_1gpu.items() if isinstance(v, dict) and "span_ms" in v}
    attn = {k: _kernel_s(steps_1gpu[k], "ragged_paged_attention")[0] for k in span}

    def extras(tokens, seqs, sp):
        return (ar.seconds(tokens * s.d * BF16, 2) + a2a.seconds(seqs * s.vocab * 4, 2)
                + (ar.seconds(seqs * s.d * BF16, 2) if sp else 0.0))

    def tp_layers(tokens):
        return s.layers * 2 * ar.seconds(tokens * s.d * BF16, 2)

    def sp_layers(local):
        slots = 2 * -(-s.kv_heads // 2) * 2  # K and V slots of both devices
        return s.layers * (a2a.seconds(local * (s.q_heads + slots) * s.head_dim * BF16, 2)
                           + a2a.seconds(local * s.q_heads * s.head_dim * BF16, 2))

    pre = span["tp:pre1x2048"]
    predicted = {}
    for seqs, half in ((8, "tp:dec4"), (64, "tp:dec32")):
        own = f"tp:dec{seqs}"
        compute = span[own] - attn[own] - 0.5 * weight_bytes / hw.read_Bps + attn[half]
        predicted[f"tp dec{seqs} x 1k"] = compute + tp_layers(seqs) + extras(seqs, seqs, False)
    predicted["tp pre 2x2048"] = pre + tp_layers(4096) + extras(4096, 2, False)
    predicted["sp pre 2x2048"] = pre + sp_layers(2048) + extras(4096, 2, True)
    predicted["tp pre 4096"] = pre + attn["tp:pre1x2048"] + tp_layers(4096) + extras(4096, 1, False)
    predicted["sp pre 4096"] = pre + attn["tp:pre1x2048"] + sp_layers(2048) + extras(4096, 1, True)
    return [{"step": k, "measured_ms": MEASURED_X2_MS[k], "predicted_ms": v * 1e3,
             "error_pct": 100 * (v * 1e3 / MEASURED_X2_MS[k] - 1)} for k, v in predicted.items()]


def synthetic_collectives() -> dict:
    """A made-up 2-GPU collectives table (20 us + bytes / 300 GB/s) for ``--smoke`` and tests only."""
    sizes = [1 << k for k in range(12, 28, 2)]
    return {"bytes_per_device": sizes, "all_reduce_s": [20e-6 + b / 300e9 for b in sizes],
            "all_to_all_s": [20e-6 + b / 2 / 300e9 for b in sizes], "synthetic": True}


DEPLOYMENTS = {  # name: (deployment, policy, threshold)
    "TP": (Deployment("TP", 1, 8), "tp", None),
    "SP": (Deployment("SP", 4, 2), "sp", None),
    "Shift": (Deployment("Shift", 4, 2), "auto", None),
    "Shift-threshold": (Deployment("Shift-threshold", 4, 2), "auto", 512),
    "DP": (Deployment("DP", 1, 2, replicas=4), "tp", None),
}
PAPER = {"Shift": (102, 10.1, 37.4e3), "TP": (159, 9.34, 24.7e3), "DP": (614, 22.5, 45.9e3)}


def simulate_deployment(model: StepModel, name: str, requests, max_concurrency, sp_weights: str) -> dict:
    from shiftjax.serving.bench import simulate as sim
    from shiftjax.serving.engine.buckets import BucketLadder
    from shiftjax.serving.engine.policy import ShiftPolicy
    from shiftjax.serving.engine.scheduler import SchedulerConfig

    dep, policy, threshold = DEPLOYMENTS[name]
    dep = dataclasses.replace(dep, sp_weights=sp_weights)
    modes = ("tp", "sp") if dep.sp > 1 else ("tp",)
    # the engine's default ladder when the projection was made (8124ef2; README.md, "The 8-GPU projection") (sequence buckets 1, 4, ...; today's
    # are its token buckets): kept, so that the committed projection reproduces
    ladder = BucketLadder(BucketLadder.geometric(8192, 256, multiple=dep.sp).token_buckets, (1, 4, 16, 64, 256))
    step = model.step_seconds(dep)
    run_seconds = sim.measured_run_seconds(ladder, modes, step)
    config = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=16384, page_size=16,
                             num_pages=model.kv_capacity_tokens(dep) // 16 + 1)
    result = sim.simulate(requests, scheduler_config=config, ladder=ladder, replicas=dep.replicas,
                          make_policy=lambda: ShiftPolicy(policy, modes, run_seconds, threshold=threshold),
                          step_seconds=step, max_concurrency=max_concurrency)
    summary = result.summary()
    return {key: summary[key] for key in ("completed", "duration_s", "total_token_throughput", "output_throughput",
                                          "ttft", "tpot", "itl", "steps", "steps_by_mode", "preemptions")}


def workloads(smoke: bool, trace: str, trace_start: float, trace_duration: float, scales) -> dict:
    from shiftjax.serving.bench import simulate as sim

    if smoke:
        return {"single 512/8": (sim.fixed_requests(1, 512, 8), 1),
                "saturation 512/8 x 16": (sim.fixed_requests(16, 512, 8), 8),
                "azure code (20 requests)": (sim.trace_requests(trace, duration_s=10.0)[:20], None)}
    out = {"single 4096/250": (sim.fixed_requests(4, 4096, 250), 1),
           "saturation 4096/250, 256 concurrent": (sim.fixed_requests(1024, 4096, 250), 256)}
    for scale in scales:
        out[f"azure code [{trace_start:g}, +{trace_duration:g}) s x{scale:g}"] = (
            sim.trace_requests(trace, start_s=trace_start, duration_s=trace_duration, time_scale=scale), None)
    return out


def markdown(report: dict) -> str:
    """The check, the step times and the simulations as markdown tables (every 8-GPU figure projected)."""
    lines = ["| step (Llama-3.1-8B, 2x H200) | measured ms | predicted ms | error |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {r['error_pct']:+.1f}% |"
              for r in report["check_2gpu"]]
    shapes = list(next(iter(report["steps"].values())))
    lines += ["", "| projected step ms (gemm / attention / collectives) | " + " | ".join(shapes) + " |",
              "|---" * (len(shapes) + 1) + "|"]
    for name, row in report["steps"].items():
        cells = [f"**{c['total']:.1f}** ({c['gemm']:.1f} / {c['attention']:.1f} / {c['collectives']:.1f})"
                 for c in row.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| workload | deployment | TTFT mean / p99 ms | TPOT mean / p99 ms | total tok/s | steps by mode | paper |",
              "|---|---|---|---|---|---|---|"]
    for workload, rows in report["simulations"].items():
        for name, r in rows.items():
            paper, text = PAPER.get(name), ""
            if paper and workload.startswith("single"):
                text = f"TTFT {paper[0]} / TPOT {paper[1]}"
            elif paper and workload.startswith("saturation"):
                text = f"{paper[2] / 1e3:.1f}k tok/s"
            lines.append(f"| {workload} | {name} | {r['ttft']['mean_ms']:.1f} / {r['ttft']['p99_ms']:.1f} | "
                         f"{r['tpot']['mean_ms']:.2f} / {r['tpot']['p99_ms']:.2f} | "
                         f"{r['total_token_throughput'] / 1e3:.1f}k | {r['steps_by_mode']} | {text} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", default=str(HERE / "results/x2_run3/collectives.json"),
                        help="shift_x2.py --parts collectives output (its JSON, or that part of it)")
    parser.add_argument("--steps-1gpu", default=str(HERE / "results/x2_run2/steps_1gpu.json"))
    parser.add_argument("--trace", default=str(HERE / "traces/azure2023_code.csv"))
    parser.add_argument("--trace-start", type=float, default=600.0)
    parser.add_argument("--trace-duration", type=float, default=600.0)
    parser.add_argument("--time-scales", type=float, nargs="*", default=[1.0, 0.5],
                        help="one Azure replay per scale; none: skip the trace")
    parser.add_argument("--sp-weights", choices=("contiguous", "split"), default="contiguous")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    parser.add_argument("--hop-us", type=float, default=NCCL_RING_HOP_S * 1e6,
                        help="latency per extra ring step; negative: all of the 2-GPU latency grows with the steps")
    parser.add_argument("--smoke", action="store_true", help="synthetic collectives, tiny workloads")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    steps_1gpu = json.loads(Path(args.steps_1gpu).read_text())["steps_1gpu"]
    if args.smoke:
        data = synthetic_collectives()
        ar, a2a = (fit_collective(k, data["bytes_per_device"], data[f"{k}_s"]) for k in ("all_reduce", "all_to_all"))
    else:
        ar, a2a = load_collectives(args.collectives)
    ar, a2a = (dataclasses.replace(f, hop_s=f.latency_s / f.ring_steps(2) if args.hop_us < 0 else args.hop_us * 1e-6)
               for f in (ar, a2a))
    model = StepModel(LLAMA3_70B, Hardware(), fit_attention(steps_1gpu), ar, a2a)
    report = {"projected": True, "synthetic_collectives": args.smoke, "collectives_file": args.collectives,
              "fits": {"all_reduce": dataclasses.asdict(ar), "all_to_all": dataclasses.asdict(a2a),
                       "attention": dataclasses.asdict(model.attention)},
              "check_2gpu": check_two_gpu(steps_1gpu, ar, a2a), "steps": {}, "simulations": {}}
    shapes = {"decode 1 x 4k": (16, 1, [(1, 4097)]), "decode 64 x 4k": (64, 64, [(1, 4200)] * 64),
              "decode 256 x 4k": (256, 256, [(1, 4200)] * 256), "prefill 4096": (4096, 1, [(4096, 4096)]),
              "prefill 2 x 4096": (8192, 2, [(4096, 4096)] * 2)}
    meshes = [(Deployment("TP", 1, 8), "tp"), (Deployment("SP, Shift", 4, 2), "tp"), (Deployment("SP, Shift", 4, 2), "sp"),
              (Deployment("sp=8 (bf16 does not fit)", 8, 1), "sp"), (Deployment("DP replica", 1, 2), "tp")]
    for dep, mode in meshes:
        report["steps"][f"{dep.name}: ({dep.sp}, {dep.tp}) {mode} mode"] = {
            k: {c: v * 1e3 for c, v in model.breakdown(dep, mode, *shape).items()} for k, shape in shapes.items()}
    for workload, (requests, concurrency) in workloads(args.smoke, args.trace, args.trace_start,
                                                        args.trace_duration, args.time_scales).items():
        report["simulations"][workload] = {}
        for name in args.deployments:
            report["simulations"][workload][name] = row = simulate_deployment(
                model, name, requests, concurrency, args.sp_weights)
            print(f"{workload:45s} {name:16s} TTFT {row['ttft']['mean_ms']:8.1f} ms  TPOT {row['tpot']['mean_ms']:6.2f} ms"
                  f"  {row['total_token_throughput'] / 1e3:6.1f}k tok/s  {row['steps_by_mode']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "projection.json").write_text(json.dumps(report, indent=1))
    Path(args.out, "projection_tables.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
