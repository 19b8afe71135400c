"""w8a8's activation quantization: XLA's passes (the references, jitted) against the fused
one-pass kernels of kernels/fp8_rows.py, at a prefill step's rows, with the bytes each must
move (the input read once, e4m3 values and float32 scales written) over the copy bandwidth
measured in the same run.

    python3 benchmarks/fp8_rows_bench.py --out DIR        # on the GPU
    python3 benchmarks/fp8_rows_bench.py --smoke          # tiny shapes, Pallas's interpreter, any machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import roofline  # noqa: E402

from shiftjax.kernels import fp8_gemm, fp8_rows  # noqa: E402

# (label, rows, width): the widths of Llama-3.1-8B (d 4096, ffn 14336) and -70B (8192, 28672)
SHAPES = [("8b", 4096, 4096, 14336), ("8b_1024", 1024, 4096, 14336), ("70b", 4096, 8192, 28672)]
SMOKE_SHAPES = [("smoke", 8, 64, 96)]


CONFIGS = [fp8_rows.RowsConfig(max_chunk, elements_per_thread=per_thread)
           for max_chunk in (1024, 2048, 4096) for per_thread in (16, 32, 64, 128)]


def _ops(d: int, ffn: int, rows: int, interpret: bool):
    """name -> (inputs, reference, kernel of a config, bytes the op must move)."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, d), jnp.bfloat16)
    weight = (1 + 0.1 * jax.random.normal(key, (d,))).astype(jnp.bfloat16)
    gate_up = jax.random.normal(jax.random.key(1), (rows, 2 * ffn), jnp.bfloat16)
    kernel = lambda config: dict(implementation="pallas", interpret=interpret, config=config)
    out_bytes = lambda width: rows * width + 4 * rows  # e4m3 values, float32 scales
    return {
        "quantize (o's input)": (
            (x,), fp8_gemm.quantize_rows,
            lambda config: lambda x: fp8_rows.quantized(x, **kernel(config)), x.nbytes + out_bytes(d)),
        "rms_norm + quantize (qkv's, gate|up's)": (
            (x, weight), lambda x, w: fp8_rows.rms_norm_quantized_reference(x, w, 1e-5),
            lambda config: lambda x, w: fp8_rows.rms_norm_quantized(x, w, 1e-5, **kernel(config)),
            x.nbytes + d * 2 + out_bytes(d)),
        "swiglu + quantize (down's)": (
            (gate_up,), fp8_rows.swiglu_quantized_reference,
            lambda config: lambda g: fp8_rows.swiglu_quantized(g, **kernel(config)), gate_up.nbytes + out_bytes(ffn)),
    }


def _timed(fn, inputs, moved: int, copy_rate: float, iters: int) -> dict:
    seconds, timer = roofline.timed(fn, *inputs, iters=iters)
    return {"us": round(seconds * 1e6, 2), "timer": timer, "of_copy_ceiling": round(moved / seconds / copy_rate, 3)}


def _agreement(got, want) -> dict:
    (v, s), (v_ref, s_ref) = got, want
    back = np.asarray(v.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[:, None]
    back_ref = np.asarray(v_ref.astype(jnp.float32), np.float64) * np.asarray(s_ref, np.float64)[:, None]
    return {"values_differing": float(np.mean(np.asarray(v.astype(jnp.float32)) != np.asarray(v_ref.astype(jnp.float32)))),
            "max_scale_rel": float(np.max(np.abs(np.asarray(s) / np.asarray(s_ref) - 1))),
            "rel_error": float(np.linalg.norm(back - back_ref) / np.linalg.norm(back_ref))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write rows_bench.json here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in Pallas's interpreter (any machine)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    ceiling = roofline.copy_ceiling(64 << 20 if args.smoke else 4 * roofline.GiB, repeats=1 if args.smoke else 3)
    print(f"copy bandwidth (read+written): {ceiling['best'] / 1e12:.3f} TB/s, best of {ceiling['tries']} "
          f"[{ceiling['timer']}]", flush=True)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_ceiling": ceiling, "cases": []}
    for label, rows, d, ffn in shapes:
        # the sweep at the 8B prompt's rows only; the others run the default (first: its agreement is reported)
        configs = list(dict.fromkeys([fp8_rows.DEFAULT_CONFIG, *(CONFIGS if label == "8b" else [])]))
        for name, (inputs, reference, kernel_of, moved) in _ops(d, ffn, rows, args.smoke).items():
            ref_fn = jax.jit(reference)
            fns = {config: jax.jit(kernel_of(config)) for config in configs}
            case = {"shape": label, "rows": rows, "op": name, "bytes": moved,
                    "agreement": _agreement(fns[fp8_rows.DEFAULT_CONFIG](*inputs), ref_fn(*inputs)),
                    "xla": _timed(ref_fn, inputs, moved, ceiling["best"], args.iters),
                    "configs": {f"max_chunk={c.max_chunk},per_thread={c.elements_per_thread}":
                                _timed(fn, inputs, moved, ceiling["best"], args.iters) for c, fn in fns.items()}}
            case["kernel"] = next(iter(case["configs"].values()))  # the default config's
            best = min(case["configs"], key=lambda k: case["configs"][k]["us"])
            case["best_config"] = {"config": best, **case["configs"][best]}
            case["kernel_over_xla"] = round(case["kernel"]["us"] / case["xla"]["us"], 3)
            results["cases"].append(case)
            print(f"{label:8s} {name:40s} xla {case['xla']['us']:8.1f} us ({case['xla']['of_copy_ceiling']:.2f} of copy)  "
                  f"kernel {case['kernel']['us']:8.1f} us ({case['kernel']['of_copy_ceiling']:.2f})  "
                  f"x{case['kernel_over_xla']:.2f}  best {case['best_config']}  agreement {case['agreement']}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rows_bench.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
