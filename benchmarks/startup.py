"""Start-up time of an engine: cold, with JAX's compilation cache only, and with the
executable store.

Each start is a fresh process that builds ``shiftjax.LLM`` with the given options against
one cache directory: **cold** (the directory empty), **compilation cache** (the XLA cache
filled, the executable store emptied: every step is traced and lowered, then its binary
comes from the cache) and **executable store** (the entries the cold start stored: nothing
traced, lowered or compiled; the "compilation cache" start stores nothing, since only
fresh compiles are stored). Each start generates 4 tokens and reports its wall time, the part spent making the executables, and
where they came from. Every condition runs ``--repeats`` times (cold ones on a fresh
directory each time). Writes ``startup.json`` into ``--out``.

    .venv/bin/python benchmarks/startup.py --cpu-devices 4 --sp 2 --tp 2 --out DIR
    python3 -P benchmarks/startup.py --model benchmarks/configs/Llama-3.1-8B --load-format dummy \\
        --tokenizer benchmarks/configs/smollm2-tokenizer --dtype bfloat16 --sp 2 --num-pages 4096 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
began = time.perf_counter()
import jax
options = json.loads(sys.argv[1])
if options.pop("cpu_devices"):
    jax.config.update("jax_num_cpu_devices", options["sp"] * options["tp"])
jax.config.update("jax_compilation_cache_dir", options.pop("cache_dir"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
events = {}  # JAX's duration events (tracing, lowering, compiling, cache reads): name -> [count, s]
def listen(name, seconds, **_):
    count_seconds = events.setdefault(name.rsplit("/", 1)[-1], [0, 0.0])
    count_seconds[0] += 1
    count_seconds[1] += seconds
jax.monitoring.register_event_duration_secs_listener(listen)
from shiftjax.serving.engine.llm import LLM
llm = LLM(**options)
ready = time.perf_counter() - began
executables = llm.engine.executables
from shiftjax.serving.engine.sampling_params import SamplingParams
[completion] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))  # they run
print("RESULT " + json.dumps({"start_seconds": ready, "output_ids": completion.output_ids,
                              "executables_seconds": executables.wall_seconds,
                              "weights_seconds": llm.load_seconds, "phases": llm.engine.startup_seconds,
                              "samplers_from_store": llm.engine.samplers.loaded_from_store,
                              "executables": len(executables.compiled),
                              "loaded_from_store": executables.loaded_from_store,
                              "compilation_cache_hits": executables.cache_hits, "jax_events": events}))
"""


def start(options: dict, cache_dir: Path, cpu_devices: bool) -> dict:
    payload = dict(options, cache_dir=str(cache_dir), cpu_devices=cpu_devices,
                   executable_store=str(cache_dir / "executables"))
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if cpu_devices else {}))
    proc = subprocess.run([sys.executable, *(["-P"] if sys.flags.safe_path else []), "-c", CHILD,
                           json.dumps(payload)], capture_output=True, text=True, env=env, timeout=3000)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"start-up failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-format", default="orbax")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--gemm", default="cublas", choices=("triton", "cublas"), help="EngineConfig.gemm")
    parser.add_argument("--compile-workers", type=int, default=None, help="EngineConfig.compile_workers")
    parser.add_argument("--token-buckets", default="16,64")
    parser.add_argument("--seq-buckets", default="1,4")
    parser.add_argument("--num-pages", type=int, default=64,
                        help="KV-cache pages; 0: sized from device memory, as serve does by default")
    parser.add_argument("--cpu-devices", action="store_true", help="run on sp x tp virtual CPU devices")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--conditions", default="cold,compilation cache,executable store",
                        help="the starts of each repeat, in order (cold first; a condition may repeat)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer random model, one repeat (CI)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    model = args.model
    if args.smoke:
        args.cpu_devices, args.repeats, args.sp = True, 1, 2  # two modes: the policy times every step
        # one token and one sequence bucket: an executable a mode, each start's path the same
        args.token_buckets, args.seq_buckets = "64", "4"
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
                  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
                  "eos_token_id": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(config))
        model, args.load_format = str(work / "model"), "dummy"
    options = dict(model=model, load_format=args.load_format, tokenizer=args.tokenizer, dtype=args.dtype,
                   sp=args.sp, tp=args.tp, mode=args.mode, gemm=args.gemm,
                   compile_workers=args.compile_workers, num_pages=args.num_pages or None, max_model_len=128,
                   max_num_seqs=max(int(b) for b in args.seq_buckets.split(",")),
                   max_num_batched_tokens=max(int(t) for t in args.token_buckets.split(",")),
                   token_buckets=[int(t) for t in args.token_buckets.split(",")],
                   seq_buckets=[int(b) for b in args.seq_buckets.split(",")])
    results = {"options": options, "cpu_devices": args.cpu_devices, "runs": []}
    try:
        for repeat in range(args.repeats):
            cache = work / f"cache{repeat}"
            for condition in args.conditions.split(","):
                if condition == "compilation cache":  # set the cold start's entries aside
                    (cache / "executables").rename(cache / "executables.cold")
                if condition == "executable store" and (cache / "executables.cold").exists():
                    shutil.rmtree(cache / "executables", ignore_errors=True)
                    (cache / "executables.cold").rename(cache / "executables")
                began = time.perf_counter()
                run = start(options, cache, args.cpu_devices)
                run.update(condition=condition, repeat=repeat, process_seconds=time.perf_counter() - began)
                results["runs"].append(run)
                expected = {"cold": (0, 0), "compilation cache": (0, run["executables"]),
                            "executable store": (run["executables"], 0)}[condition]
                if (run["loaded_from_store"], run["compilation_cache_hits"]) != expected:
                    raise RuntimeError(f"{condition}: expected (from the store, from the cache) = {expected}: {run}")
                if run["output_ids"] != results["runs"][0]["output_ids"]:
                    raise RuntimeError(f"{condition}: other tokens than the cold start: {run}")
                print(f"{condition:>18}: process {run['process_seconds']:6.1f} s, in-process start "
                      f"{run['start_seconds']:6.1f} s, executables {run['executables_seconds']:6.1f} s "
                      f"({run['loaded_from_store']} from the store, {run['compilation_cache_hits']} from the "
                      f"compilation cache, of {run['executables']}; samplers from the store: "
                      f"{run['samplers_from_store']}); weights {run['weights_seconds']:.1f} s, "
                      + ", ".join(f"{k} {v:.1f} s" for k, v in run["phases"].items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
