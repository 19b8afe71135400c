"""Where one TP decode step's device time goes, kernel by kernel (one GPU).

Two sections, one process:

1. ``anatomy``: the engine's own decode loop (``engine_loop``'s, async, 1k-token prompts) on
   one GPU, at each ``--seqs``, for each bucket ladder of ``--ladders``. Every kernel of the profiled steady-state steps, per step:
   its time, how many times it runs and the HLO instruction behind it (name, op, source
   line, from the compiled step's HLO, which is saved beside), then the same summed by
   source line; the step's wall and its floor: the bytes it must read (weights but the
   embedding table, plus the K/V of every sequence's context) over the best read-only
   stream of the same run.
2. ``gemms``: each projection GEMM of the shape alone, at each row count, through ``jnp.dot``
   as the model calls it (cuBLAS on the H200): 16 distinct weight copies one after another
   (more than the L2 holds), device time per GEMM and its bytes over the read-only stream.
3. ``attention``: the Pallas decode attention at the shape's heads, 1k context, each
   sequence count, for the shipped configuration and variants of it.

``--shape``: ``llama8b`` (Llama-3.1-8B, all 32 layers) or ``tp2_shard`` (one GPU's share of
the same model in TP mode over two: half the heads, half the MLP, the whole vocabulary; no
collectives). ``--tp``: GPUs the anatomy's TP mesh spans (default 1; ``--shape llama8b --tp
2`` is the two-GPU step, collectives included; the table is the first GPU's).

    bash benchmarks/run_gpu.sh anatomy                                          # on one GPU
    python3 benchmarks/decode_anatomy.py --smoke --out /tmp/anatomy                 # any machine
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from engine_loop import _decode_phase, _HostClock, loop_engine_config, loop_lengths  # noqa: E402
from model_gpu import device_random_params  # noqa: E402
from roofline import device_idle, device_time, kernel_kind, read_ceiling  # noqa: E402
from shift_x2 import big_config, kv_bytes_per_token, log, weight_bytes_per_device, write_results  # noqa: E402

from shiftjax.layouts.mesh import make_mesh  # noqa: E402
from shiftjax.serving.engine.core import Engine  # noqa: E402
from shiftjax.weights import shard_params  # noqa: E402

SHAPES = ("llama8b", "tp2_shard")
GEMM_COPIES = 16


def shape_config(shape: str, smoke: bool):
    config = big_config(smoke)
    if shape == "tp2_shard":
        config = dataclasses.replace(config, num_heads=config.num_heads // 2, num_kv_heads=config.num_kv_heads // 2,
                                     intermediate_size=config.intermediate_size // 2)
    return config


# -- the compiled step's HLO ----------------------------------------------------------------

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)")
_OP = re.compile(r"(?:^|[\s)}])([a-z][a-z0-9\-]*)\(")


def kernel_key(name: str) -> str:
    """An HLO instruction's name as a kernel name: XLA names a fusion's kernel after it with
    '.' and '-' made '_'."""
    return re.sub(r"[.\-]", "_", name)


def _stack_frames(text: str) -> dict[str, str]:
    """``stack_frame_id`` -> ``file:line function`` from the tables XLA prints before the
    computations (FileNames, FunctionNames, FileLocations, StackFrames)."""
    tables, current = collections.defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
        elif current and (m := re.match(r"(\d+) (.*)", line)):
            tables[current][m.group(1)] = m.group(2)
        elif line.strip():
            current = None
    frames = {}
    for frame_id, frame in tables["StackFrames"].items():
        location = tables["FileLocations"].get(re.search(r"file_location_id=(\d+)", frame).group(1), "")
        fields = dict(re.findall(r"(\w+)=(\d+)", location))
        file = tables["FileNames"].get(fields.get("file_name_id"), '"?"').strip('"')
        function = tables["FunctionNames"].get(fields.get("function_name_id"), '"?"').strip('"')
        frames[frame_id] = f"{os.path.basename(file)}:{fields.get('line', '?')} {function}"
    return frames


def hlo_instructions(text: str) -> dict[str, dict]:
    """Every instruction of an HLO module's text, by ``kernel_key`` of its name: its op, its
    custom-call target, and from its metadata its op name and source (``file:line``, by
    ``source_file``/``source_line`` or by ``stack_frame_id``, as XLA versions print it)."""
    frames = _stack_frames(text)
    out, roots, calls, computation = {}, {}, {}, None
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{$", line)
        if header:
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OP.search(rest)
        source = re.search(r'source_file="([^"]*)" source_line=(\d+)', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        info = {"op": op.group(1) if op else "?",
                "target": target.group(1) if target else None,
                "source": (f"{os.path.basename(source.group(1))}:{source.group(2)}" if source
                           else frames.get(frame.group(1)) if frame else None),
                "op_name": op_name.group(1).split("/")[-1] if op_name else None}
        out[kernel_key(name)] = info
        if line.lstrip().startswith("ROOT ") and computation:
            roots[computation] = info
        if called:
            calls[kernel_key(name)] = called.group(1)
    # a fusion without metadata of its own: its fused computation's root's
    for key, computation in calls.items():
        root = roots.get(computation, {})
        for field in ("source", "op_name"):
            if out[key][field] is None:
                out[key][field] = root.get(field)
    return out


def kernel_table(events, steps: int, hlo: dict[str, dict]) -> list[dict]:
    """Per kernel name, per step: time, calls, kind, and the HLO instruction it runs (by its
    name, else by XLA's ``hlo_op`` annotation of the event)."""
    rows: dict[str, dict] = {}
    for _, _, duration, name, stats in events:
        row = rows.get(name)
        if row is None:
            op = stats.get("hlo_op")
            instruction = hlo.get(kernel_key(name)) or (hlo.get(kernel_key(str(op))) if op else None) or {}
            row = rows[name] = {"kernel": name[:90], "kind": kernel_kind(name), "us": 0.0, "calls": 0,
                                "hlo_op": op, **instruction}
        row["us"] += duration * 1e-3
        row["calls"] += 1
    for row in rows.values():
        row["us"] /= steps
        row["calls"] /= steps
    return sorted(rows.values(), key=lambda r: -r["us"])


def by_source(table: list[dict]) -> list[dict]:
    """The kernel table summed by the source line that made each kernel."""
    sums = collections.defaultdict(lambda: {"us": 0.0, "calls": 0.0, "kernels": set()})
    for row in table:
        key = row.get("source") or f"({row['kind']})"
        sums[key]["us"] += row["us"]
        sums[key]["calls"] += row["calls"]
        sums[key]["kernels"].add(row.get("op_name") or row["kernel"][:40])
    return sorted(({"source": k, "us": v["us"], "calls": v["calls"], "what": sorted(v["kernels"])[:6]}
                   for k, v in sums.items()), key=lambda r: -r["us"])


# -- section 1: the engine's decode step ----------------------------------------------------

def anatomy(weights, config, seq_counts, read_bps: float, out_dir: str, smoke: bool, token_buckets, seq_buckets,
            label: str = "") -> dict:
    engine_config, max_tokens = loop_engine_config(seq_counts, smoke, "auto", seq_buckets, token_buckets)
    engine = Engine(weights, engine_config)
    prompt_len, decode_steps, profiled = loop_lengths(smoke)
    weight_bytes = weight_bytes_per_device(weights, weights.mesh)[0]
    used = collections.Counter()  # runs of each executable, to tell which one decodes
    originals = dict(engine.executables.compiled)
    for key, fn in originals.items():
        def counted(*args, _key=key, _fn=fn, **kwargs):
            used[_key] += 1
            return _fn(*args, **kwargs)
        engine.executables.compiled[key] = counted
    out = {"weight_bytes": weight_bytes, "token_buckets": list(engine.executables.ladder.token_buckets),
           "seq_buckets": list(engine.executables.ladder.seq_buckets)}
    for seqs in seq_counts:
        captured = {}

        def profiler(step, iters):
            before = collections.Counter(used)
            idle = device_idle(step, iters, events=True)
            captured["keys"] = used - before
            return idle

        row = _decode_phase(engine, engine.step, _HostClock(), seqs, prompt_len, max_tokens, decode_steps,
                            profiled, profiler=profiler)
        key = captured["keys"].most_common(1)[0][0]
        text = originals[key].as_text() if hasattr(originals[key], "as_text") else ""
        with open(os.path.join(out_dir, f"hlo{label}_decode{seqs}.txt"), "w") as f:
            f.write(text)
        planes = row["idle"] or {}  # the first GPU's (a TP mesh's GPUs run the same kernels)
        plane = planes[min(planes)] if planes else {"events": [], "idle_fraction": None}
        events = plane["events"]
        hlo = hlo_instructions(text)
        table = kernel_table(events, profiled, hlo)
        # the context of the profiled steps is at least the prompt and the tokens decoded before them
        context = prompt_len + decode_steps - profiled
        kv_bytes = seqs * context * kv_bytes_per_token(weights, config)
        floor_ms = (weight_bytes + kv_bytes) / read_bps * 1e3
        result = {"executable": list(key), "wall_ms": row["wall_ms_median"], "idle_fraction": plane["idle_fraction"],
                  "output_ids": row["output_ids"],
                  "kernel_ms": sum(r["us"] for r in table) / 1e3,
                  "kernels": sum(r["calls"] for r in table), "floor_ms": floor_ms, "weight_bytes": weight_bytes,
                  "kv_bytes": kv_bytes, "context_at_least": context,
                  "hlo_instructions_from_model": sum((i["source"] or "").startswith("model.py") for i in hlo.values()),
                  "floor_over_wall": floor_ms / row["wall_ms_median"],
                  "by_kind": plane.get("by_kind", {}),  # ms and count per step (roofline.kernel_breakdown)
                  "kernels_table": table, "by_source": by_source(table)}
        # a sequence count listed again is another phase of the same engine (host time varies by phase)
        repeat = sum(k == f"decode{seqs}" or k.startswith(f"decode{seqs}_") for k in out)
        out[f"decode{seqs}" + (f"_{repeat}" if repeat else "")] = result
        log(f"[anatomy{label}] {seqs} seqs, executable {key}: {row['wall_ms_median']:.2f} ms a step, kernels "
            f"{result['kernel_ms']:.2f} ms x{result['kernels']:.0f}; floor {floor_ms:.2f} ms "
            f"({weight_bytes / 1e9:.2f} GB weights + {kv_bytes / 1e9:.2f} GB K/V) = {result['floor_over_wall']:.0%} of the wall")
        log("  by kind: " + ", ".join(f"{k} {v['ms']:.3f} ms x{v['count']:.0f}" for k, v in result["by_kind"].items()))
        for r in table[:25]:
            log(f"  {r['us']:8.1f} us x{r['calls']:5.1f}  {r['kind'][:10]:10s} {r['kernel'][:60]:60s} "
                f"{r.get('op') or ''} {r.get('op_name') or ''} {r.get('source') or ''}")
        log("  by source line:")
        for r in result["by_source"][:15]:
            log(f"  {r['us']:8.1f} us x{r['calls']:5.1f}  {r['source']:28s} {', '.join(r['what'])[:90]}")
    return out


# -- section 2: the projection GEMMs alone ---------------------------------------------------

def gemm_rates(config, rows_list, read_bps: float) -> dict:
    d, hd = config.hidden_size, config.head_dim
    shapes = {"qkv": (d, (config.num_heads + 2 * config.num_kv_heads) * hd), "o": (config.num_heads * hd, d),
              "gate_up": (d, 2 * config.intermediate_size), "down": (config.intermediate_size, d),
              "lm_head": (d, config.vocab_size)}
    out = {}
    for name, (k, n) in shapes.items():
        weights = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(GEMM_COPIES)]
        chain = jax.jit(lambda x, *ws: [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws])
        for rows in rows_list:
            x = jax.random.normal(jax.random.key(99), (rows, k), jnp.bfloat16)
            timing = device_time(chain, (x, *weights), iters=5, quiet=True)
            if timing is None:  # no device trace (CPU): nothing to report
                continue
            per_gemm = timing["ksum"] / GEMM_COPIES
            bytes_read = k * n * 2 + rows * k * 2
            out[f"{name}:{rows}"] = {"k": k, "n": n, "rows": rows, "us": per_gemm * 1e6,
                                     "span_us_per_gemm": timing["span"] / GEMM_COPIES * 1e6,
                                     "TBps": bytes_read / per_gemm / 1e12, "of_read_stream": bytes_read / per_gemm / read_bps}
            log(f"[gemms] {name:8s} [{rows:3d} x {k}] @ [{k} x {n}]: {per_gemm * 1e6:7.1f} us, "
                f"{bytes_read / per_gemm / 1e12:.2f} TB/s = {bytes_read / per_gemm / read_bps:.0%} of the read stream")
        del weights
    return out


# -- section 3: the decode attention kernel's tuning at the shape's heads ----------------------

def attention_configs(smoke: bool):
    """The shipped decode configuration, then variants of key block, stages, warps and splits."""
    from shiftjax.kernels.pallas_gpu import PallasAttentionConfig
    if smoke:
        return {"shipped": PallasAttentionConfig(interpret=True)}
    return {"shipped": PallasAttentionConfig(),
            "bk64_s3": PallasAttentionConfig(decode_block_k=64, decode_num_stages=3),
            "bk64_s4": PallasAttentionConfig(decode_block_k=64, decode_num_stages=4),
            "bk32_s4": PallasAttentionConfig(decode_block_k=32, decode_num_stages=4),
            "bk128_s3": PallasAttentionConfig(decode_num_stages=3),
            "bk128_w8": PallasAttentionConfig(decode_num_warps=8),
            "bk64_s3_w2": PallasAttentionConfig(decode_block_k=64, decode_num_stages=3, decode_num_warps=2),
            "splits1": PallasAttentionConfig(decode_splits=1),
            "splits2": PallasAttentionConfig(decode_splits=2),
            "splits4": PallasAttentionConfig(decode_splits=4),
            "splits8": PallasAttentionConfig(decode_splits=8)}


def baseline_kernels(path: str):
    """The Pallas attention module at ``path`` (an earlier ``kernels/pallas_gpu.py``), loaded
    inside the package so that its relative imports resolve."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("shiftjax.kernels.pallas_gpu_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def attention_from(module):
    """``ragged_paged_attention``'s Pallas path taken from ``module`` (None: as it is)."""
    from shiftjax.kernels import pallas_gpu
    with contextlib.ExitStack() as stack:
        if module is not None:
            stack.enter_context(mock.patch.object(pallas_gpu, "ragged_paged_attention_pallas",
                                                  module.ragged_paged_attention_pallas))
        yield


def attention_sweep(config, seq_counts, read_bps: float, smoke: bool, baseline=None) -> dict:
    """One decode attention call (the whole Pallas path: q re-layout, both kernels, the
    combine, the scatter back) per configuration, at the shape's heads and each sequence
    count, 1k context (each on shuffled pages), timed as attention_bench times it."""
    import numpy as np
    from attention_bench import make_batch, per_layer_time
    context, layers = (40, 2) if smoke else (1024, 8)
    out = {}
    for seqs in seq_counts:
        q, kc, vc, md = make_batch(np.random.default_rng(seqs), [1] * seqs, [context] * seqs,
                                   q_heads=config.num_heads, kv_slots=config.num_kv_heads, head_dim=config.head_dim,
                                   page_size=16, layers=layers, dtype=jnp.bfloat16)
        kv_bytes = 2 * seqs * context * config.num_kv_heads * config.head_dim * 2
        configs = [(name, cfg, None) for name, cfg in attention_configs(smoke).items()]
        if baseline is not None:  # its own defaults (its config class is its own)
            configs.insert(1, ("baseline", attention_configs(smoke)["shipped"] if smoke else None, baseline))
        for name, cfg, module in configs:
            try:
                with attention_from(module):
                    seconds = per_layer_time(q, kc, vc, md, implementation="pallas", config=cfg,
                                             iters=3 if smoke else 20)
            except Exception as error:  # noqa: BLE001 - a variant Triton refuses is reported
                out[f"{name}:{seqs}"] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                continue
            out[f"{name}:{seqs}"] = {"us": seconds * 1e6, "TBps": kv_bytes / seconds / 1e12,
                                     "of_read_stream": kv_bytes / seconds / read_bps}
            log(f"[attention] {seqs:3d} seqs x {context}, {config.num_heads} q / {config.num_kv_heads} kv, {name:10s}: "
                f"{seconds * 1e6:7.1f} us a layer, {kv_bytes / seconds / 1e12:.2f} TB/s of K/V "
                f"= {kv_bytes / seconds / read_bps:.0%} of the read stream")
        del q, kc, vc
    return out


def _buckets(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    tokens, seqs = spec.split(":")
    return tuple(int(t) for t in tokens.split(",") if t), tuple(int(s) for s in seqs.split(",") if s)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine: the code path only")
    parser.add_argument("--shape", choices=SHAPES, default="tp2_shard")
    parser.add_argument("--tp", type=int, default=1, help="GPUs of the anatomy's TP mesh")
    parser.add_argument("--seqs", default="8,64", help="sequence counts of the decode steps")
    parser.add_argument("--sections", default="anatomy,gemms,attention")
    parser.add_argument("--ladders", default=":",
                        help="the engines' buckets, ';'-separated 'TOKENS:SEQS' (e.g. ':;64:8,64'): token buckets "
                             "below the prefill budget, sequence buckets (both empty: the engine's default ladder; "
                             "see engine_loop.loop_engine_config)")
    parser.add_argument("--gemm-rows", default="1,8,16,32,64,128,256")
    parser.add_argument("--attention-baseline", default="",
                        help="an earlier kernels/pallas_gpu.py: the anatomy and the attention section run it too")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seq_counts = tuple(int(s) for s in args.seqs.split(","))
    config = shape_config(args.shape, args.smoke)
    read = read_ceiling(8 << 20, 1) if args.smoke else read_ceiling()
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": args.shape, "tp": args.tp,
               "read_ceiling": read}
    log(f"device {results['device']}, read-only stream {read['best'] / 1e12:.2f} TB/s (best of {read['tries']})")
    baseline = baseline_kernels(args.attention_baseline) if args.attention_baseline else None
    path = os.path.join(args.out, "decode_anatomy.json")
    started = time.perf_counter()
    if "anatomy" in args.sections:
        mesh = make_mesh(1, args.tp, jax.devices()[:args.tp])
        weights = shard_params(device_random_params(config, jnp.bfloat16), config, mesh)
        runs = [(f"anatomy:{spec}", spec, f"_ladder{i}", None) for i, spec in enumerate(args.ladders.split(";"))]
        if baseline is not None:  # the first ladder again, with the baseline's kernels
            runs.append((f"anatomy_baseline:{runs[0][1]}", runs[0][1], "_baseline", baseline))
        for key, spec, label, module in runs:
            token_buckets, seq_buckets = _buckets(spec)
            with attention_from(module):
                results[key] = anatomy(weights, config, seq_counts, read["best"], args.out, args.smoke,
                                       token_buckets, seq_buckets, label=label)
            write_results(results, path)
        if baseline is not None:  # greedy tokens: the kernels' arithmetic should not change them
            first = results[runs[0][0]]
            results["same_tokens_as_baseline"] = all(
                first[f"decode{n}"]["output_ids"] == results[runs[-1][0]][f"decode{n}"]["output_ids"] for n in set(seq_counts))
            log(f"[anatomy] the same greedy tokens with the baseline's kernels: {results['same_tokens_as_baseline']}")
        del weights
    if "gemms" in args.sections:
        results["gemms"] = gemm_rates(config, [int(r) for r in args.gemm_rows.split(",")], read["best"])
        write_results(results, path)
    if "attention" in args.sections:
        results["attention"] = attention_sweep(config, seq_counts, read["best"], args.smoke, baseline)
    results["seconds"] = time.perf_counter() - started
    write_results(results, path)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
