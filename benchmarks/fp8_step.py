"""Issue 28 on one GPU within a small device budget: the engine's step function with FP8
weights against bf16, on the Llama-3.1-8B shape cut to ``--layers`` layers (a decode step's
time is the layers' plus the LM head's; compile time grows with depth), timed by wall clock
over repeated donated calls after a warm-up:

- decode at 1 sequence (16-token bucket) and 64 sequences (64 tokens), each at a context
  of 1,024 tokens; the 64-sequence step also with an FP8 KV cache;
- prefill of one 4,096-token prompt (TTFT's device part);
- the read-only stream rate measured in the same run, and each decode step's weight floor
  (the weight bytes it reads over that rate);
- ``--w8a16``: the decode steps again with the other decode GEMMs in place of the default
  (w8a16 on the Triton kernel): w8a8 on cuBLASLt's FP8 GEMM, and w8a16 on the Mosaic GPU
  kernel; and prefill's w8a8 on cuBLASLt's FP8 GEMM instead of the Mosaic kernel;
- ``--check-reference``: each FP8 step's logits against the same step with XLA's reference
  GEMMs (``quantized_gemm="reference"``), which read each layer's weights sliced: a kernel
  that read the wrong layer, or the wrong memory, shows as a relative error near 1.

    python3 -P benchmarks/fp8_step.py --out DIR          # the H200 (via benchmarks/gpu_env.sh)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from shiftjax.batch import empty_batch
from shiftjax.cache import CacheConfig, allocate_cache
from shiftjax.checkpoints.dummy import dummy_weights
from shiftjax.config import ModelConfig
from shiftjax.kernels.fp8_gemm import DEFAULT_CHOICE, Fp8GemmChoice
from shiftjax.layouts.mesh import make_mesh
from shiftjax.serving.engine.compile import step_compiler_options
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P too
from fp8_served import weight_bytes  # noqa: E402
from roofline import device_idle, read_ceiling  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "Llama-3.1-8B" / "config.json"
PAGE = 16
CASES = {  # name -> (tokens bucket, sequences, context before the step, new tokens per sequence)
    "decode_1": (16, 1, 1024, 1),
    "decode_64": (64, 64, 1024, 1),
    "prefill_4096": (4096, 1, 0, 4096),
}


def logits_against_reference(logits, reference_step, weights, caches, batch) -> dict:
    """This step's logits against the reference GEMMs' on the same batch (the caches are
    zeroed first: both steps then attend to the K and V they wrote themselves)."""
    caches = jax.tree.map(jnp.zeros_like, caches)
    reference, _ = reference_step(weights.tp, caches, batch)
    got = np.asarray(logits, np.float64)
    want = np.asarray(reference.logits, np.float64)
    return {"reference_rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "reference_argmax_agreement": float(np.mean(got.argmax(-1) == want.argmax(-1)))}


def timed_steps(run_step, params, caches, batch, iterations: int):
    """Seconds of each of ``iterations`` donated calls of ``run_step`` (synchronised on the
    packed result), the last call's output, and the caches it returned."""
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        out, caches = run_step(params, caches, batch)
        jax.block_until_ready(out.packed)
        times.append(time.perf_counter() - started)
    return times, out, caches


def batch_for(tokens: int, seqs: int, context: int, new: int, max_pages: int):
    batch = empty_batch(tokens, seqs, max_pages)
    per_seq = -(-(context + new) // PAGE)
    row = 0
    for s in range(seqs):
        positions = np.arange(context, context + new)
        pages = 1 + s * per_seq + np.arange(per_seq)
        batch.token_ids[row:row + new] = (7 + s + positions) % 30000
        batch.positions[row:row + new] = positions
        batch.slot_mapping[row:row + new] = pages[positions // PAGE] * PAGE + positions % PAGE
        row += new
        batch.query_start[s + 1] = row
        batch.seq_lens[s] = context + new
        batch.page_table[s, :per_seq] = pages
        batch.sample_index[s] = row - 1
    return jax.tree.map(jnp.asarray, batch), 1 + seqs * per_seq


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--attention", default="pallas", help="reference: the CPU check of this script")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--fp8-kv", action="store_true", help="also the 64-sequence decode over an FP8 cache")
    parser.add_argument("--w8a16", action="store_true", help="also the decode steps with the w8a16 kernels")
    parser.add_argument("--served-options", action="store_true",
                        help="compile with the served engine's XLA options (serving/engine/compile.py)")
    parser.add_argument("--check-reference", action="store_true",
                        help="compare each FP8 step's logits with the reference GEMMs' (relative L2, argmax)")
    parser.add_argument("--profile", action="store_true",
                        help="also each step's device kernels under the profiler (by kind and the top ones)")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU: the default model's shape, 2 layers, short contexts, the reference attention")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = dict(CASES)
    if args.smoke:
        from shiftjax.checkpoints.default_model import default_model_path

        config = dataclasses.replace(ModelConfig.from_json_file(default_model_path() / "config.json"), num_layers=2)
        args.attention, args.iterations, args.fp8_kv, args.w8a16, args.check_reference = "reference", 2, True, True, True
        cases = {"decode_1": (16, 1, 64, 1), "decode_64": (16, 4, 64, 1), "prefill_4096": (64, 1, 0, 64)}
    else:
        config = dataclasses.replace(ModelConfig.from_json_file(CONFIG), num_layers=args.layers)
    mesh = make_mesh(1, 1)
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "layers": args.layers,
              "served_options": args.served_options,
              "stream_bytes_per_s": read_ceiling(1 << 24, 1)["best"] if args.smoke else read_ceiling()["best"],
              "runs": {}}
    print("stream", result["stream_bytes_per_s"], flush=True)
    options = StepOptions(attention=args.attention, layer_loop="unrolled", sample_in_step=False)
    chosen = args.cases.split(",")
    decode = ("decode_1", "decode_64")
    variants = [("bf16", "none", "bfloat16", tuple(CASES), DEFAULT_CHOICE),
                ("fp8", "fp8", "bfloat16", tuple(CASES), DEFAULT_CHOICE)]
    if args.fp8_kv:
        variants.append(("fp8_kv", "fp8", "float8_e4m3fn", ("decode_64",), DEFAULT_CHOICE))
    if args.w8a16:
        every_step_on_cublas = Fp8GemmChoice(w8a16_max_tokens=0, cublas_max_rows=1 << 30)
        variants += [("fp8_w8a8_cublas", "fp8", "bfloat16", (*decode, "prefill_4096"), every_step_on_cublas),
                     ("fp8_w8a16_mosaic", "fp8", "bfloat16", decode, Fp8GemmChoice(triton_max_rows=0))]
    weights = None
    for name, quantization, cache_dtype, cases_of, fp8_gemm in variants:
        if weights is None or weights.quantization != quantization:
            weights = None  # the previous variant's weights go before the next are made
            weights = dummy_weights(config, mesh=mesh, dtype="bfloat16", quantization=quantization)
        step = make_step(weights, "tp", dataclasses.replace(options, fp8_gemm=fp8_gemm))
        reference_step = None
        if args.check_reference and quantization == "fp8":
            reference_step = make_step(weights, "tp", dataclasses.replace(
                options, fp8_gemm=fp8_gemm, quantized_gemm="reference"))
        for case in [c for c in cases_of if c in chosen]:
            tokens, seqs, context, new = cases[case]
            max_pages = -(-(context + new) // PAGE)
            batch, pages = batch_for(tokens, seqs, context, new, max_pages)
            key = f"{name}/{case}"
            try:
                caches = allocate_cache(mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                                        CacheConfig(num_pages=pages, page_size=PAGE, dtype=cache_dtype))
                started = time.perf_counter()
                run_step = step
                if args.served_options:
                    run_step = step.lower(weights.tp, caches, batch).compile(
                        step_compiler_options(weights, options, tokens))
                out, caches = run_step(weights.tp, caches, batch)
                jax.block_until_ready(out.packed)
                compile_s = time.perf_counter() - started
                times, out, caches = timed_steps(run_step, weights.tp, caches, batch, args.iterations)
                run = {"ms_median": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
                       "first_call_s": round(compile_s, 1), "finite": bool(np.isfinite(np.asarray(out.logits)).all())}
                if args.profile:  # per step, by device: kernel time by kind, the top kernels, idle time
                    def one_step():
                        nonlocal caches
                        _, _, caches = timed_steps(run_step, weights.tp, caches, batch, 1)
                    run["device"] = device_idle(one_step, 3)
                if reference_step is not None:
                    run.update(logits_against_reference(out.logits, reference_step, weights, caches, batch))
                if case.startswith("decode"):
                    floor = weight_bytes(config, quantization) / result["stream_bytes_per_s"]
                    run["weight_floor_ms"] = 1e3 * floor
                    run["floor_over_median"] = floor * 1e3 / run["ms_median"]
                del caches
            except Exception as error:  # noqa: BLE001 - a variant that fails is a finding
                run = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
            bf16 = result["runs"].get(f"bf16/{case}", {})
            if "ms_median" in run and "ms_median" in bf16:
                run["over_bf16"] = run["ms_median"] / bf16["ms_median"]
            result["runs"][key] = run
            print(key, json.dumps(run), flush=True)
            (args.out / "fp8_step.json").write_text(json.dumps(result, indent=1))
        del step


if __name__ == "__main__":
    sys.exit(main())
