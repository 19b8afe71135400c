"""Does the GIL serialise P data-parallel engines in one process? (shiftjax serve --dp P)

Runs P engines of the default model, each on its own device, each driven by its own
thread (as DataParallelService's replicas are), and splits every step's wall time into
device time (the executable call plus the wait for its packed result: XLA runs with the
GIL released) and host time (the rest: schedule, pad, place the batch, unpack, commit,
all Python under the GIL). The same P engines are also run as P processes of one engine
each (no shared GIL) for comparison, so that CPU contention alone (P engines on this
machine's cores) is told apart from GIL contention.

    .venv/bin/python benchmarks/dp_host_time.py --replicas 1 4 --processes [--tiny] --out DIR
    .venv/bin/python benchmarks/dp_host_time.py --smoke --out DIR   # tiny model, P = 1 and 2

Prints, per configuration: mean host ms per step, mean device ms per step, steps, tokens
per second over all replicas, and steps in flight (the steps' summed wall time over the
elapsed time: P when the replicas' steps fully overlap, 1 when they take turns). Same workload per replica: 8 requests, 24-token prompts,
48 output tokens (decode-dominated, as serving is).

Results (2026-11-29, the 2-core CPU shared with other sessions, load average ~15; JSON in
benchmarks/results/dp_host_time/, summarised in serving/server/data_parallel.py's docstring; the
script then lived outside the repository and wrote one file per run):
default model, host ms/step 1.16 (P=1), 1.33 (P=4 threads), 1.05 (P=4 processes), XLA
0.36 to 2.7 s/step, 3.97 steps in flight: device-bound, no GIL effect. --tiny --repeats
20: host 0.51-0.53 (P=1), 0.80-1.08 (P=4 threads), 0.68-0.80 (P=4 processes); tokens/s
at P=4 2.5k-8.2k in threads (six runs) against 6.5k-9.1k in processes (five runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ENGINE = dict(max_model_len=128, page_size=16, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
              token_buckets=(16, 64), seq_buckets=(8,))
REQUESTS, PROMPT, OUTPUT = 8, 24, 48


_step = threading.local()  # the device seconds of the step running on this thread


def instrument(engine, timings: list) -> None:
    """Wraps the engine's two device-touching calls (the executable, the fetch of its
    packed result); appends (wall, device) seconds per step to ``timings``."""
    from shiftjax.serving.engine import transfers

    original_get, original_run = engine.executables.get, engine.run_step

    def get(*key):
        return _timed(original_get(*key))

    def run_step():
        _step.device = 0.0
        start = time.perf_counter()
        report = original_run()
        if report is not None:
            timings.append((time.perf_counter() - start, _step.device))
        return report

    engine.executables.get = get
    engine.run_step = run_step
    if not getattr(transfers.packed_to_host, "probe_timed", False):
        transfers.packed_to_host = _timed(transfers.packed_to_host)
        transfers.packed_to_host.probe_timed = True


def _timed(function):
    def timed(*args):
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            _step.device = getattr(_step, "device", 0.0) + time.perf_counter() - start
    return timed


def drive(engine, seed: int) -> int:
    """Adds the workload and steps the engine to the end on this thread; returns tokens."""
    from shiftjax.serving.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    tokens = 0
    for _ in range(int(os.environ.get("PROBE_REPEATS", "1"))):
        requests = [engine.add_request([(seed * 97 + i * 13 + j) % 4000 + 10 for j in range(PROMPT)], params)
                    for i in range(REQUESTS)]
        engine.run_until_done(requests)
        tokens += sum(len(r.output_ids) for r in requests)
    return tokens


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "vocab_size": 4096, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def build(devices):
    """One engine per device: the default model, or with PROBE_TINY=1 a 2-layer random
    Llama whose steps are mostly host time (the GIL's worst case)."""
    from shiftjax.serving.engine.llm import LLM

    if os.environ.get("PROBE_TINY") == "1":
        config = "/tmp/dp_host_time_tiny/config.json"
        os.makedirs(os.path.dirname(config), exist_ok=True)
        with open(config, "w") as f:
            json.dump(TINY, f)
        return [LLM(config, load_format="dummy", devices=[d], **ENGINE).engine for d in devices]
    return [LLM("default", devices=[d], **ENGINE).engine for d in devices]


def run_threads(replicas: int) -> dict:
    import jax

    engines = build(jax.devices()[:replicas])
    timings = [[] for _ in engines]
    for engine, t in zip(engines, timings):
        instrument(engine, t)
        drive(engine, 99)  # warm-up: first-call costs out of the figures
    for t in timings:
        t.clear()
    tokens = [0] * replicas
    threads = [threading.Thread(target=lambda i=i: tokens.__setitem__(i, drive(engines[i], i)))
               for i in range(replicas)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarise(timings, sum(tokens), time.perf_counter() - start)


def summarise(timings, tokens, seconds) -> dict:
    steps = [s for t in timings for s in t]
    wall = sum(w for w, _ in steps) / len(steps)
    device = sum(d for _, d in steps) / len(steps)
    return {"steps": len(steps), "wall_ms": 1e3 * wall, "device_ms": 1e3 * device, "host_ms": 1e3 * (wall - device),
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            # steps running at once, on average: P when the replicas' steps fully overlap
            "steps_in_flight": wall * len(steps) / seconds}


def one_process_worker(barrier_file: str) -> None:
    """A child of run_processes: one engine on device 0; waits for the barrier file, runs,
    prints its timings as JSON."""
    import jax

    [engine] = build(jax.devices()[:1])
    timings = []
    instrument(engine, timings)
    drive(engine, 99)
    timings.clear()
    print("READY", flush=True)
    while not os.path.exists(barrier_file):
        time.sleep(0.001)
    start = time.perf_counter()
    tokens = drive(engine, int(os.environ.get("PROBE_SEED", "0")))
    print(json.dumps({"timings": timings, "tokens": tokens, "start": time.time() - (time.perf_counter() - start),
                      "end": time.time()}), flush=True)


def run_processes(replicas: int, platform: str) -> dict:
    barrier = f"/tmp/dp_host_time_barrier_{os.getpid()}"
    if os.path.exists(barrier):
        os.remove(barrier)
    env = dict(os.environ, JAX_PLATFORMS=platform)
    children = [subprocess.Popen([sys.executable, __file__, "--worker", barrier], stdout=subprocess.PIPE, text=True,
                                 env=dict(env, PROBE_SEED=str(i), CUDA_VISIBLE_DEVICES=str(i))
                                 if platform != "cpu" else dict(env, PROBE_SEED=str(i)))
                for i in range(replicas)]
    for child in children:
        while child.stdout.readline().strip() != "READY":
            pass
    open(barrier, "w").close()
    results = [json.loads(child.stdout.readline()) for child in children]
    for child in children:
        child.wait()
    os.remove(barrier)
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    return summarise([r["timings"] for r in results], sum(r["tokens"] for r in results), seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--processes", action="store_true", help="also run P processes of one engine each")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random Llama: host-bound steps")
    parser.add_argument("--repeats", type=int, default=1, help="run the workload this many times per replica")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the threads (Python's default: 0.005 s)")
    parser.add_argument("--smoke", action="store_true", help="the tiny model at P = 1 and 2 (a CPU check)")
    parser.add_argument("--out", default=None, help="a directory: dp_host_time.json goes there")
    args = parser.parse_args()
    if args.smoke:
        args.tiny, args.replicas = True, [1, 2]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.worker:  # PROBE_TINY and PROBE_REPEATS come from the parent's environment
        one_process_worker(args.worker)
        return
    os.environ["PROBE_REPEATS"] = str(args.repeats)  # the warm-up runs it as often; so do the workers
    if args.tiny:
        os.environ["PROBE_TINY"] = "1"
    if args.platform == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(args.replicas)}"
    os.environ["JAX_PLATFORMS"] = args.platform
    rows = []
    for replicas in args.replicas:
        rows.append({"replicas": replicas, "how": "threads", **run_threads(replicas)})
        print(json.dumps(rows[-1]), flush=True)
    if args.processes:
        for replicas in args.replicas:
            if replicas > 1:
                rows.append({"replicas": replicas, "how": "processes", **run_processes(replicas, args.platform)})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dp_host_time.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
