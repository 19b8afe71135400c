"""Peak device memory while loading weights, on the GPUs of one host.

Phases, each in a fresh process so that ``peak_bytes_in_use`` counts that phase alone:

1. ``write``: an 8B-shape checkpoint (bf16) of the canonical dummy model, generated sharded
   over all GPUs and written by Orbax to ``--workdir`` (deleted at the end unless ``--keep``);
2. ``restore``: ``restore_weights`` (the sharded restore) onto each mesh of ``--meshes``;
   per device: peak bytes, final weight bytes, one layer's canonical bytes, and the target
   ``peak <= final + one layer``; the restored weights are compared, bit for bit, with
   ``dummy_weights`` on the same mesh (after the peak is read);
3. ``old``: what LLM did before (the canonical model replicated on every device, then
   ``shard_params``) on the first mesh, as the "before" figure;
4. ``dummy70b``: ``--load-format dummy`` of the 70B shape at tp = 2 (bf16, 70.6 GB per
   device), its peak, and one TP-mode step's logits finite.

Run on two GPUs: ``bash benchmarks/run_gpu.sh restore``
(writes ``$OUT/restore_gpu.json``; about 16 GB of disk under ``--workdir``, default /tmp).
``--smoke`` runs every phase on 8 virtual CPU devices with tiny configs (no memory stats
there: those fields are null).
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG_8B = ROOT / "benchmarks/configs/Llama-3.1-8B/config.json"
CONFIG_70B = ROOT / "benchmarks/configs/Llama-3.1-70B/config.json"
# Tiny stand-ins for --smoke: 9 heads over 3 KV heads (padded heads, GQA), odd vocabulary.
SMOKE_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=99, hidden_size=32, intermediate_size=44,
                num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                tie_word_embeddings=False)
SMOKE_70B = dict(SMOKE_8B, num_hidden_layers=5, hidden_size=48, intermediate_size=96)


def log(*args):
    print(*args, flush=True)


def hf_config(path_or_dict) -> dict:
    return dict(path_or_dict) if isinstance(path_or_dict, dict) else json.loads(Path(path_or_dict).read_text())


# --- one phase, in its own process -----------------------------------------------------


def device_memory(devices) -> list[dict | None]:
    out = []
    for device in devices:
        stats = device.memory_stats()
        out.append(None if stats is None else {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use",
                                                                         "bytes_limit")})
    return out


def weight_bytes_per_device(weights) -> dict:
    """Distinct device buffers of both views, per device (the TP view aliases the SP one)."""
    import jax

    held, seen = {}, set()
    for leaf in jax.tree.leaves((weights.tp, weights.sp)):
        for shard in leaf.addressable_shards:
            buffer = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if buffer not in seen:
                seen.add(buffer)
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def one_layer_canonical_bytes(config, itemsize: int) -> int:
    import numpy as np

    from shiftjax.params import param_shapes

    return sum(int(np.prod(s[1:])) * itemsize for name, s in param_shapes(config).items() if name.startswith("layers."))


def memory_report(weights, config, devices, seconds: float) -> dict:
    memory = device_memory(devices)
    held = weight_bytes_per_device(weights)
    layer = one_layer_canonical_bytes(config, 2)
    report = {"seconds": round(seconds, 2), "one_layer_canonical_bytes": layer, "devices": []}
    for device, stats in zip(devices, memory):
        row = {"device": device.id, "final_weight_bytes": held.get(device.id, 0)}
        if stats is not None:
            row.update(stats)
            row["peak_minus_final_bytes"] = stats["peak_bytes_in_use"] - row["final_weight_bytes"]
            row["meets_target"] = stats["peak_bytes_in_use"] <= row["final_weight_bytes"] + layer
        report["devices"].append(row)
    return report


def weights_equal(a, b) -> bool:
    import jax
    import jax.numpy as jnp

    same = jax.jit(lambda x, y: jnp.all(x == y))  # on the devices: no 16 GB host copy
    return all(bool(same(x, y)) for x, y in zip(jax.tree.leaves((a.tp, a.sp)), jax.tree.leaves((b.tp, b.sp))))


def phase(args) -> dict:
    import jax

    from shiftjax.checkpoints import dummy
    from shiftjax.checkpoints.load import load_checkpoint, restore_weights
    from shiftjax.config import ModelConfig
    from shiftjax.layouts.mesh import make_mesh
    from shiftjax.weights import shard_params

    config_8b = hf_config(SMOKE_8B if args.smoke else args.config_8b)
    config_70b = hf_config(SMOKE_70B if args.smoke else args.config_70b)
    sp, tp = args.mesh
    mesh = make_mesh(sp, tp)
    devices = list(mesh.devices.flat)
    start = time.perf_counter()
    if args.phase == "write":
        config = ModelConfig.from_hf_dict(config_8b)
        all_devices = make_mesh(1, len(jax.devices()))
        params = dummy.dummy_params(config, mesh=all_devices, dtype="bfloat16")
        jax.block_until_ready(params)
        made = time.perf_counter()
        dummy.write_checkpoint(params, config_8b, args.checkpoint, overwrite=True)
        size = sum(p.stat().st_size for p in Path(args.checkpoint).rglob("*") if p.is_file())
        return {"generate_seconds": round(made - start, 2), "write_seconds": round(time.perf_counter() - made, 2),
                "checkpoint_bytes": size}
    if args.phase == "restore":
        config, weights = restore_weights(args.checkpoint, mesh=mesh, dtype="bfloat16")
        jax.block_until_ready(weights.tp)
        report = memory_report(weights, config, devices, time.perf_counter() - start)
        report["equal_to_dummy_weights"] = weights_equal(weights, dummy.dummy_weights(config, mesh=mesh))
        return report
    if args.phase == "old":
        from jax.sharding import NamedSharding, PartitionSpec

        config, params = load_checkpoint(args.checkpoint, dtype="bfloat16",
                                         shardings=NamedSharding(mesh, PartitionSpec()))
        weights = shard_params(params, config, mesh)
        del params
        jax.block_until_ready(weights.tp)
        return memory_report(weights, config, devices, time.perf_counter() - start)
    if args.phase == "dummy70b":
        config = ModelConfig.from_hf_dict(config_70b)
        weights = dummy.dummy_weights(config, mesh=mesh, dtype="bfloat16")
        jax.block_until_ready(weights.tp)
        report = memory_report(weights, config, devices, time.perf_counter() - start)
        try:  # the memory figures stand even if the step cannot run
            report["step_logits_finite"] = step_logits_finite(weights, config)
        except Exception as error:  # noqa: BLE001 - reported in the JSON, not hidden
            report["step_error"] = f"{type(error).__name__}: {error}"[:2000]
        return report
    raise ValueError(f"unknown phase {args.phase!r}")


def step_logits_finite(weights, config) -> bool:
    """One TP-mode prefill step of 16 tokens over a small cache: are the logits finite?"""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shiftjax.batch import empty_batch
    from shiftjax.cache import CacheConfig, allocate_cache
    from shiftjax.step_options import StepOptions
    from shiftjax.steps import make_step, params_for

    batch = empty_batch(16, 1, 4)
    batch.token_ids[:] = np.arange(16) % config.vocab_size
    batch.positions[:] = np.arange(16)
    batch.slot_mapping[:] = 16 + np.arange(16)  # page 1 (page 0 is scratch), page size 16
    batch.query_start[1:] = 16
    batch.seq_lens[0] = 16
    batch.page_table[0, 0] = 1
    batch.sample_index[0] = 15
    caches = allocate_cache(weights.mesh, config.num_layers, weights.layout.kv_slots, config.head_dim,
                            CacheConfig(num_pages=4, page_size=16, dtype="bfloat16"))
    attention = "reference" if jax.default_backend() == "cpu" else "auto"
    step = make_step(weights, "tp", StepOptions(attention=attention), return_logits=True)
    out, _ = step(params_for(weights, "tp"), caches, jax.tree.map(jnp.asarray, batch))
    logits = np.asarray(out.logits, np.float32)[0]
    return bool(np.all(np.isfinite(logits)) and np.std(logits) > 0)


# --- the driver ------------------------------------------------------------------------


def run_phase(args, name: str, mesh: tuple[int, int]) -> dict:
    cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), __file__, "--phase", name,
           "--mesh", f"{mesh[0]}x{mesh[1]}", "--checkpoint", str(args.checkpoint),
           "--config-8b", str(args.config_8b), "--config-70b", str(args.config_70b)]
    if args.smoke:
        cmd.append("--smoke")
    log(f"== {name} {mesh[0]}x{mesh[1]}")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.phase_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.phase_timeout} s"}
    result_lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not result_lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        log(tail)
        return {"error": f"exit {proc.returncode}", "output_tail": tail}
    result = json.loads(result_lines[-1][len("RESULT "):])
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    log(json.dumps(result, indent=1))
    return result


def parse_mesh(text: str) -> tuple[int, int]:
    sp, tp = text.lower().split("x")
    return int(sp), int(tp)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny configs on 8 virtual CPU devices")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    parser.add_argument("--phases", default="write,restore,old,dummy70b")
    parser.add_argument("--meshes", default="1x2,2x1", help="sp x tp meshes to restore onto")
    parser.add_argument("--config-8b", default=str(CONFIG_8B))
    parser.add_argument("--config-70b", default=str(CONFIG_70B))
    parser.add_argument("--phase-timeout", type=int, default=280)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--mesh", type=parse_mesh, default=(1, 1), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.smoke:  # before JAX is imported, in this process and the phases it starts
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    # Room for the 70B shape at tp = 2 (70.6 GB of weights per H200) beside the step.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    if args.phase:
        print("RESULT " + json.dumps(phase(args)), flush=True)
        return

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="restore_gpu_"))
    args.checkpoint = workdir / "llama8b_dummy_ckpt"
    meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    phases = args.phases.split(",")
    results = {"device": None, "smoke": args.smoke, "config_8b": str(args.config_8b),
               "config_70b": str(args.config_70b), "phases": {}}
    try:
        if "write" in phases:
            results["phases"]["write"] = run_phase(args, "write", (1, 1))
        for mesh in meshes:
            if "restore" in phases:
                results["phases"][f"restore_{mesh[0]}x{mesh[1]}"] = run_phase(args, "restore", mesh)
        if "old" in phases:
            results["phases"][f"old_{meshes[0][0]}x{meshes[0][1]}"] = run_phase(args, "old", meshes[0])
        if "dummy70b" in phases:
            results["phases"]["dummy70b_1x2"] = run_phase(args, "dummy70b", (1, 2))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    import jax

    results["device"] = f"{len(jax.devices())}x {jax.devices()[0].device_kind}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "restore_gpu.json").write_text(json.dumps(results, indent=1))
    errors = [name for name, r in results["phases"].items() if "error" in r]
    log(f"wrote {Path(args.out) / 'restore_gpu.json'}; phases with errors: {errors or 'none'}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
