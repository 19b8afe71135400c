"""Served TPOT and TTFT, and a tree against an earlier one: ``shiftjax serve`` with bf16 or
FP8 weights on dummy weights of a Llama shape, over gRPC: TPOT at 1 and at 64 concurrent requests (1,024 prompt tokens, 128
out, EOS ignored), the TTFT of a 4,096-token prompt, the KV-cache size the server chose,
and the read-only stream rate measured in the same run (a subprocess, before any server)
for each deployment's weight floor (weight bytes / stream rate).

    bash benchmarks/run_gpu.sh served                       # one GPU: bf16 and fp8
    BEFORE=before_tree bash benchmarks/run_gpu.sh before_after
    python benchmarks/served.py --smoke --out DIR           # the CPU

A deployment ``NAME@before`` is NAME served by an earlier tree: ``--before-path`` (that tree's
root, a tree from 5835ffb on, which imports from its root; benchmarks/run_gpu.sh links it from
``BEFORE``) goes first on the server's PYTHONPATH, so one call compares the trees. The servers
run as ``python -P``: PYTHONPATH alone picks the tree, not the working directory.

Writes ``served.json`` (one entry per deployment, with each ratio to bf16 where the
bf16 deployment ran in the same call).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
SERVE_8B = ["--max-model-len", "5120", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
            "--token-buckets", "16,64,4096", "--seq-buckets", "1,64"]
SERVE_8B_C1 = ["--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
               "--token-buckets", "16,1024", "--seq-buckets", "1", "--no-compilation-cache"]
SERVE_70B = ["--max-model-len", "2048", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
             "--token-buckets", "16,1024", "--seq-buckets", "1"]
# name -> (model config, serve arguments, environment)
DEPLOYMENTS = {
    "bf16": ("Llama-3.1-8B", [*SERVE_8B], {}),
    "fp8": ("Llama-3.1-8B", [*SERVE_8B, "--quantization", "fp8"], {}),
    "fp8_kv": ("Llama-3.1-8B", [*SERVE_8B, "--quantization", "fp8", "--kv-cache-dtype", "fp8"], {}),
    # XLA's VMM allocator: a step's buffers stay where they were, so its CUDA graphs are not re-recorded
    "bf16_vmm": ("Llama-3.1-8B", [*SERVE_8B, "--gpu-allocator", "vmm"], {}),
    "fp8_vmm": ("Llama-3.1-8B", [*SERVE_8B, "--quantization", "fp8", "--gpu-allocator", "vmm"], {}),
    # 70 GB of FP8 weights and a cache of 40+ GiB need more than JAX's default 75% of the GPU
    # (the cache at 80% of what is left, not 90%: headroom for the holes weight loading leaves)
    "fp8_70b": ("Llama-3.1-70B", [*SERVE_70B, "--quantization", "fp8", "--kv-memory-fraction", "0.8"],
                {"XLA_CLIENT_MEM_FRACTION": "0.94"}),
    # decode at one request under XLA's command-buffer (CUDA graph) settings: two executables
    # each, no compilation cache (its key must not mix the variants)
    "bf16_c1": ("Llama-3.1-8B", [*SERVE_8B_C1], {}),
    "fp8_c1": ("Llama-3.1-8B", [*SERVE_8B_C1, "--quantization", "fp8"], {}),
    "fp8_c1_vmm": ("Llama-3.1-8B", [*SERVE_8B_C1, "--quantization", "fp8", "--gpu-allocator", "vmm"], {}),
    **{f"fp8_c1_{name}": ("Llama-3.1-8B", [*SERVE_8B_C1, "--quantization", "fp8"], {"XLA_FLAGS": flags})
       for name, flags in (("no_graphs", "--xla_gpu_enable_command_buffer="),
                           ("untraced_calls", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN"),
                           ("trace_cache_256", "--xla_cmd_buffer_trace_cache_size=256"))},
}
LOADS = {"bf16": ("c1", "c64", "ttft4096"), "fp8": ("c1", "c64", "ttft4096"), "fp8_kv": ("c1", "c64"),
         "bf16_vmm": ("c1", "c64", "ttft4096"), "fp8_vmm": ("c1", "c64", "ttft4096"),
         "fp8_70b": ("c1",), **{name: ("c1",) for name in DEPLOYMENTS if "_c1" in name}}

# roofline.read_ceiling in a process of its own, so that this one never holds GPU memory
STREAM_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # benchmarks/
from roofline import read_ceiling
ceiling = read_ceiling()
print(json.dumps({"stream_bytes_per_s": ceiling["best"], "what": ceiling["what"], "timer": ceiling["timer"]}))
"""


def weight_bytes(config, quantization: str) -> int:
    """Bytes a decode step reads of the weights (``config``: a ``ModelConfig``): the layer
    GEMMs (1 byte a weight in FP8 plus their scales, 2 in bf16) and the LM head (bf16); the
    embedding is gathered."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    gemm = layers * (d * (q + 2 * kv) + q * d + d * 2 * f + f * d)
    channels = layers * ((q + 2 * kv) + d + 2 * f + d)
    per_weight = 1 if quantization == "fp8" else 2
    return gemm * per_weight + (channels * 4 if quantization == "fp8" else 0) + 2 * d * config.vocab_size


def one_request(address: str, prompt_ids: list[int], max_tokens: int) -> dict:
    from shiftjax.serving.client.grpc_client import Client

    with Client(address, timeout=900) as client:
        started, arrivals, count = time.perf_counter(), [], 0
        for response in client.generate(prompt_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True):
            if response.token_ids:
                arrivals.append(time.perf_counter())
                count += len(response.token_ids)
    return {"tokens": count, "ttft_s": arrivals[0] - started if arrivals else None,
            "tpot_s": (arrivals[-1] - arrivals[0]) / (count - 1) if count > 1 else None}


def run_load(address: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(address, p, max_tokens), prompts))
    seconds = time.perf_counter() - started
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {"concurrency": concurrency, "requests": len(prompts), "prompt_tokens": len(prompts[0]),
            "max_tokens": max_tokens, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / seconds, 2),
            "tpot_ms_p50": round(1e3 * statistics.median(tpots), 3) if tpots else None,
            "ttft_ms_p50": round(1e3 * statistics.median(ttfts), 3) if ttfts else None,
            "ttft_ms_min": round(1e3 * min(ttfts), 3) if ttfts else None}


def prompts_of(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", default="bf16,fp8")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="the CPU: the default model's shape, tiny loads")
    parser.add_argument("--before-path", help="PYTHONPATH entry of the earlier tree that NAME@before deployments serve")
    args = parser.parse_args()
    if "@before" in args.deployments and not args.before_path:
        parser.error("a NAME@before deployment needs --before-path")
    from shiftjax.serving.bench.server_process import Deployment, ServerProcess

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"deployments": {}}
    if not args.smoke:
        probe = subprocess.run([sys.executable, "-c", STREAM_PROBE, str(Path(__file__).resolve().parent)],
                               capture_output=True, text=True, timeout=300)
        result["stream"] = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {
            "error": probe.stderr[-2000:]}
        print("stream", json.dumps(result["stream"]), file=sys.stderr, flush=True)
    # prompt ids within the tokenizer's vocabulary (dummy weights serve the default model's tokenizer)
    vocab = 49152
    sizes = {"c1": (4, 1024, 128, 1), "c64": (64, 1024, 128, 64), "ttft4096": (3, 4096, 1, 1)}
    for name in args.deployments.split(","):
        base_name, _, tree = name.partition("@")
        if base_name not in DEPLOYMENTS or tree not in ("", "before"):
            raise SystemExit(f"unknown deployment {name!r}: one of {', '.join(DEPLOYMENTS)}, each optionally @before")
        model, serve_args, env = DEPLOYMENTS[base_name]
        if tree == "before":
            env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [args.before_path, os.environ.get("PYTHONPATH")]))}
        config_path = CONFIGS / model / "config.json"
        command = ["{python}", "-P", "-m", "shiftjax.serving.cli", "serve", "--model", str(config_path),
                   "--load-format", "dummy", "--dtype", "bfloat16", "--port", "{port}",
                   # the default model's tokenizer, shipped in the tree (its GGUF is not on the device)
                   "--tokenizer", str(CONFIGS / "smollm2-tokenizer"), *serve_args]
        if args.smoke:  # the default model on one CPU device, tiny buckets
            from shiftjax.checkpoints.default_model import default_model_path

            config_path = default_model_path() / "config.json"
            quantize = [a for a in serve_args if a in ("--quantization", "--kv-cache-dtype", "fp8")]
            command = ["{python}", "-P", "-m", "shiftjax.serving.cli", "serve", "--model", "default", "--port", "{port}",
                       "--cpu-devices", "1", "--max-model-len", "256", "--max-num-seqs", "2",
                       "--max-num-batched-tokens", "64", "--token-buckets", "64", "--seq-buckets", "2",
                       "--num-pages", "40", *quantize]
            sizes = {"c1": (1, 20, 4, 1), "c64": (2, 20, 4, 2), "ttft4096": (1, 60, 1, 1)}
        log_name = name.replace("@", "_")
        server = ServerProcess(Deployment(name, command, env=env, startup_timeout_s=1200), args.out / f"{log_name}.log")
        server.start()
        try:
            info = server.server_info()
            entry = {"startup_s": round(server.startup_seconds, 1), "serve_args": serve_args,
                     "quantization": info.get("quantization"), "page_pool": info.get("page_pool"), "runs": {}}
            for load in LOADS[base_name]:
                count, length, max_tokens, concurrency = sizes[load]
                run = run_load(server.grpc_address, prompts_of(count, length, zlib.crc32(load.encode()), vocab),
                               concurrency, max_tokens)
                entry["runs"][load] = run
                print(name, load, json.dumps(run), file=sys.stderr, flush=True)
            from shiftjax.config import ModelConfig  # (no JAX in this process)

            entry["weight_bytes_read_per_step"] = weight_bytes(ModelConfig.from_json_file(config_path),
                                                               "fp8" if "--quantization" in serve_args else "none")
            stream = result.get("stream", {}).get("stream_bytes_per_s")
            if stream:
                entry["weight_floor_ms"] = round(1e3 * entry["weight_bytes_read_per_step"] / stream, 3)
            result["deployments"][name] = entry
        finally:
            server.stop()
        (args.out / "served.json").write_text(json.dumps(result, indent=1))
    for name, entry in result["deployments"].items():
        # each against bf16 under the same allocator
        base = result["deployments"].get("bf16_c1" if "_c1" in name else "bf16_vmm" if name.endswith("_vmm") else "bf16")
        if base is None or name.startswith("bf16"):
            continue
        for load, run in entry["runs"].items():
            other = base["runs"].get(load)
            if not other:
                continue
            for key in ("tpot_ms_p50", "ttft_ms_min", "ttft_ms_p50"):
                if run.get(key) and other.get(key):
                    run[f"{key}_over_bf16"] = round(run[key] / other[key], 3)
    (args.out / "served.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
