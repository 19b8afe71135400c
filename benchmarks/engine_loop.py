"""The engine part (``shift_x2.py --parts engine``): the engine's own decode loop,
where host time shows, with the variants it compares (GEMM backends, XLA's command-buffer
options and update modes, the in-step sampler of before) and
``xla_options``, which says which of those options this XLA accepts. Imported by
shift_x2.py when those parts run."""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import model_gpu
import numpy as np
from model_gpu import device_random_params
from roofline import device_idle
from shift_x2 import COMMAND_BUFFER_OPTIONS, PAGE, big_config, kv_bytes_per_token, log, weight_bytes_per_device

from shiftjax.layouts.mesh import make_mesh
from shiftjax.serving.engine import runner as runner_module
from shiftjax.serving.engine import transfers
from shiftjax.serving.engine.core import Engine, EngineConfig
from shiftjax.serving.engine.sampling_params import SamplingParams
from shiftjax.weights import shard_params

# the engine variants that set EngineConfig fields (engine_loop); the others keep the defaults
_VARIANT_CONFIG = {"cublas": {"gemm": "cublas"}, "triton": {"gemm": "triton"}, "triton_small_graphs": {"gemm": "triton"},
                   "one_shot_all_reduce": {"all_reduce": "one_shot"}, "xla_all_reduce": {"all_reduce": "xla"}}
# XLA's command buffers (CUDA graphs) re-record every command that reads or writes an
# allocation whose address changed since the last run (an argument, an output, the temporary
# buffer); these modes give some of them stable addresses (JAX 0.11.2's XLA: see the
# xla_options part for which it accepts)
UPDATE_MODE = "xla_gpu_command_buffer_update_mode"
# the engine variants whose steps compile with more XLA options (on top of the backend's)
_VARIANT_OPTIONS = {"command_buffers": COMMAND_BUFFER_OPTIONS,
                    "triton_small_graphs": {"xla_gpu_graph_min_graph_size": 1},
                    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
                    # the mode's names differ between XLA versions: JAX 0.10.2's has NEVER_UPDATE and
                    # CAPTURE_CMD_NEVER_UPDATE, later ones SKIP_TEMP and SKIP_PROFILED
                    "never_update": {UPDATE_MODE: "NEVER_UPDATE"},
                    "capture_never_update": {UPDATE_MODE: "CAPTURE_CMD_NEVER_UPDATE"},
                    "skip_temp": {UPDATE_MODE: "SKIP_TEMP"}, "skip_profiled": {UPDATE_MODE: "SKIP_PROFILED"},
                    # XLA's GEMMs by cuBLASLt (its own heuristics for skinny decode GEMMs) where cuBLAS runs them
                    "cublaslt": {"xla_gpu_enable_cublaslt": True}}
def _adjust_steps(variant: str):
    """What ``variant`` changes in the engine's steps, as ``Engine(adjust_steps=...)`` takes it
    (None: nothing). ``shipped``: the engine as it is (its default GEMM backend and options).
    ``cublas`` / ``triton``: its steps with that ``gemm`` (``_VARIANT_CONFIG``; cuBLAS:
    command buffers down to one command; Triton: XLA's defaults). ``triton_small_graphs``:
    Triton GEMMs, command buffers down to one command (XLA's default: five).
    ``in_step_sampler``: its steps made with the in-step sampler of before (whose
    ``lax.cond`` skips blocked the host on the GPU). ``command_buffers``: its steps compiled
    with ``COMMAND_BUFFER_OPTIONS``; ``no_command_buffers``: with none. ``never_update``,
    ``capture_never_update``, ``skip_temp``, ``skip_profiled``: XLA's command buffer update
    modes of those names (``UPDATE_MODE``). ``cublaslt``: the GEMMs by cuBLASLt
    (``xla_gpu_enable_cublaslt``). ``one_shot_all_reduce`` / ``xla_all_reduce``: TP mode's
    sums by shiftjax's one-shot kernel (two GPUs) / by XLA's psum (``EngineConfig.all_reduce``;
    ``shipped`` takes its default, ``auto``). (The batch copied into the step's own buffers
    and the one-row LM head of before were measured and not kept: benchmarks/README.md,
    "Tried and not kept".)"""
    if variant == "in_step_sampler":
        return lambda options: options.replace(sample_in_step=True)
    if variant in _VARIANT_OPTIONS:
        extra = tuple(_VARIANT_OPTIONS[variant].items())
        return lambda options: options.replace(xla_options=options.xla_options + extra)
    if variant != "shipped" and variant not in _VARIANT_CONFIG:
        raise ValueError(f"unknown engine variant {variant!r}")
    return None


def _variant_engine(variant: str, weights, config: EngineConfig) -> Engine:
    return Engine(weights, config, adjust_steps=_adjust_steps(variant))


class _HostClock:
    """Seconds per call of the engine's host phases, collected by wrapping them."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name].append(time.perf_counter() - began)
        return timed

    def medians_ms(self, since: dict[str, int]) -> dict[str, float]:
        return {name: float(np.median(values[since.get(name, 0):])) * 1e3
                for name, values in self.seconds.items() if len(values) > since.get(name, 0)}


def engine_loop(smoke: bool, attention: str, variants: list[str], rounds: int = 2,
                seq_buckets: tuple[int, ...] = (), tp: int = 2, model: str = "llama8b",
                seq_counts: tuple[int, ...] = (), token_buckets: tuple[int, ...] = ()) -> dict:
    """Wall time per decode step in the engine's own loop (schedule, pad, place, run,
    fetch, commit), pure TP over ``tp`` GPUs (a (1, tp) mesh: one mode, so only TP
    executables; ``tp`` 1: one GPU, the whole model), at 1, 8 and 64 sequences of 1k
    context: one step at a time (the host waits for each step before it schedules the
    next) and with async scheduling (step N+1
    dispatched before N's result is read). Per step, the median host time of each phase
    (``schedule``, ``pad``, ``place`` on the devices, the executable call ``dispatch``,
    ``fetch`` of the result, ``commit``), and from a profile of steady-state steps (first
    round only) the share of the time each GPU sits idle (target 4: < 5%).

    ``variants`` (see ``_adjust_steps``) are all built first, then measured interleaved:
    per sequence count, every (variant, loop) once in order and once in reverse, ``rounds``
    times in all, so that neither drift nor going first favours one (earlier runs, which
    measured one variant after another, saw the first one launch slower).

    ``token_buckets`` and ``seq_buckets``: the engines' buckets (``loop_engine_config``;
    default: the engine's own ladder for 64 sequences and a 1024-token budget, 16 and 64 tokens
    and sequences, where 1 and 8 sequences decode in a (16, 16) step; before 2026-12-01 the
    default was token buckets 64 and 1024, one sequence bucket per count, so every decode step
    ran 64 rows: ``token_buckets=(64,), seq_buckets=(1, 8, 64)`` reproduces it). ``model``:
    ``llama8b`` (Llama-3.1-8B shape) or ``smollm2`` (the default model's shape, where the
    host's share is largest); ``seq_counts``: default 1, 8 and 64."""
    variants = list(variants)  # variants whose options this XLA refuses are dropped below
    config = big_config(smoke) if model == "llama8b" else model_gpu.SMOLLM2
    prompt_len, decode_steps, profiled = loop_lengths(smoke)
    seq_counts = seq_counts or ((1, 8) if smoke else (1, 8, 64))
    if seq_buckets and max(seq_buckets) < max(seq_counts):
        raise ValueError(f"sequence buckets {seq_buckets} cannot hold {max(seq_counts)} sequences")
    weights = shard_params(device_random_params(config, jnp.bfloat16), config, make_mesh(1, tp, jax.devices()[:tp]))
    out = {"weight_bytes_per_device": weight_bytes_per_device(weights, weights.mesh), "rounds": rounds,
           "tp": tp, "model": model, "kv_bytes_per_token_per_device": kv_bytes_per_token(weights, config),
           "context_at_least": prompt_len}  # every timed step reads at least the prompt's K/V
    # one clock for every engine: the phases run one after another, each reading its own entries
    clock = _HostClock()
    engines = {}
    for variant in list(variants):
        started = time.perf_counter()
        engine_config, max_tokens = loop_engine_config(seq_counts, smoke, attention, seq_buckets, token_buckets,
                                                       **_VARIANT_CONFIG.get(variant, {}))
        try:
            engine = _variant_engine(variant, weights, engine_config)
        except Exception as error:  # noqa: BLE001 - an XLA without the variant's option: the others still run
            if "While setting option" not in str(error) or variant == variants[0]:
                raise
            out[f"{variant}:error"] = f"{type(error).__name__}: {str(error)[:300]}"
            log(f"  engine variant {variant} left out: {out[f'{variant}:error']}")
            variants.remove(variant)
            continue
        out[f"{variant}:startup"] = {"seconds": time.perf_counter() - started, "phases": engine.startup_seconds}
        out["ladder"] = dataclasses.asdict(engine.executables.ladder)
        engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
        engine.scheduler.commit = clock.wrap("commit", engine.scheduler.commit)
        engine.executables.compiled = {key: clock.wrap("dispatch", fn) for key, fn in engine.executables.compiled.items()}
        engines[variant] = engine
    # the runner's host phases, timed where the runner calls them (its module's names)
    phases = ((runner_module, "pad_batch", "pad"), (transfers, "place_upload", "place"),
              (transfers, "packed_to_host", "fetch"))
    originals = {(module, name): getattr(module, name) for module, name, _ in phases}
    for module, name, label in phases:
        setattr(module, name, clock.wrap(label, originals[(module, name)]))

    def one_at_a_time(engine):  # a step launched and finished back to back: the loop before async scheduling
        launched = engine._launch()
        if launched is not None:
            engine._finish(launched)

    def pipelined(engine):
        engine.step().result()

    outputs = {}
    try:
        for seqs in seq_counts:
            order = [(v, loop) for v in variants for loop in ("sync", "async")]
            measured = collections.defaultdict(list)
            for r in range(rounds):
                for variant, loop in order if r % 2 == 0 else order[::-1]:
                    engine = engines[variant]
                    step = functools.partial(pipelined if loop == "async" else one_at_a_time, engine)
                    row = _decode_phase(engine, step, clock, seqs, prompt_len, max_tokens, decode_steps,
                                        profiled if r == 0 else 0)
                    outputs[f"{variant}:{loop}:dec{seqs}:r{r}"] = row.pop("output_ids")
                    measured[(variant, loop)].append(row)
                    idle = "" if "idle_fraction_max" not in row else \
                        f", GPUs idle {100 * row['idle_fraction_max']:.1f}% of the profiled steps"
                    phases = " ".join(f"{k} {v:.2f}" for k, v in row["host_ms"].items())
                    log(f"  engine loop, round {r}, {variant:6s} {loop:5s} {seqs:2d} seqs: "
                        f"{row['wall_ms_median']:.2f} ms per decode step{idle}; host ms per call: {phases}")
                    for plane, profile in sorted((row["idle"] or {}).items())[:1]:
                        log(f"    {plane}, kernels per step: " + ", ".join(
                            f"{kind} {v['ms']:.2f} ms x{v['count']:.0f}" for kind, v in profile["by_kind"].items()))
            for (variant, loop), rows in measured.items():
                first = rows[0]
                first["rounds_ms"] = [row["wall_ms_median"] for row in rows]
                first["wall_ms_median"] = float(np.mean(first["rounds_ms"]))  # the mean of the rounds' medians
                out[f"{variant}:{loop}:dec{seqs}"] = first
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    # Greedy decoding: every loop and round of a variant must generate the same tokens. Across
    # variants only where their arithmetic is the same (cuBLAS and Triton GEMMs round bf16
    # differently, and random weights leave near-ties), so that is reported, not required.
    def reference(key, variant):
        return outputs[f"{variant}:sync:dec{key.split(':dec')[1].split(':')[0]}:r0"]

    out["same_tokens_within_variants"] = all(ids == reference(key, key.split(":")[0]) for key, ids in outputs.items())
    out["same_tokens_everywhere"] = all(ids == reference(key, variants[0]) for key, ids in outputs.items())
    log(f"  the same greedy tokens in every loop and round of each variant: {out['same_tokens_within_variants']}; "
        f"in every variant: {out['same_tokens_everywhere']}")
    return out


def loop_lengths(smoke: bool) -> tuple[int, int, int]:
    """The decode phase's prompt length (the context), decode steps and profiled steps."""
    return (40, 12, 3) if smoke else (1000, 40, 12)


def loop_engine_config(seq_counts, smoke: bool, attention: str, seq_buckets=(), token_buckets=(),
                       **fields) -> tuple[EngineConfig, int]:
    """The TP-mode engine of the decode loop, sized for the most sequences of ``seq_counts``,
    and the ``max_tokens`` each request asks for (enough to decode through every step).
    Its buckets: the engine's default ladder for that size (``BucketLadder.geometric``), or
    where either is given ``seq_buckets`` (default: ``seq_counts``) and ``token_buckets``
    (default: the sequence buckets; the prefill budget is always one)."""
    prompt_len, decode_steps, _ = loop_lengths(smoke)
    most = max(seq_counts)
    # Prefill in large chunks, so that every sequence is decoding before the first one ends:
    # the last prompt's chunks queue behind the others' decode tokens (decode comes first),
    # and with a 64-token budget the first sequences ended before the last one began.
    prefill_budget = 4 * prompt_len if smoke else 1024
    max_tokens = -(-most * prompt_len // prefill_budget) + 2 * decode_steps
    max_model_len = prompt_len + max_tokens + 8
    ladder = {}
    if token_buckets or seq_buckets:
        seq_buckets = tuple(seq_buckets or seq_counts)
        token_buckets = tuple(token_buckets or seq_buckets)
        ladder = {"token_buckets": tuple(sorted({t for t in token_buckets if t < prefill_budget} | {prefill_budget})),
                  "seq_buckets": seq_buckets}
    config = EngineConfig(
        max_model_len=max_model_len, max_num_seqs=most, num_pages=most * -(-max_model_len // PAGE) + 1,
        max_num_batched_tokens=prefill_budget, mode="tp", attention=attention, layer_loop="unrolled",
        **ladder, **fields)
    return config, max_tokens


def _decode_phase(engine, step, clock, seqs, prompt_len, max_tokens, decode_steps, profiled,
                  profiler=device_idle) -> dict:
    """``seqs`` requests prefilled, then ``decode_steps`` steps in which all of them decode
    (checked: ``decoding`` counts the running requests at each timed step), the last
    ``profiled`` of them under ``profiler(step, profiled)`` (``idle`` in the row); then they
    are aborted and the engine drained."""
    requests = [engine.add_request([(i * 13 + j) % 1000 + 3 for j in range(prompt_len)],
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i in range(seqs)]
    while any(not r.output_ids for r in requests):
        step()
    times, decoding = [], []
    since = {name: len(values) for name, values in clock.seconds.items()}
    for _ in range(decode_steps - profiled):
        decoding.append(sum(not r.finished for r in requests))
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    host = clock.medians_ms(since)
    idle = profiler(step, profiled) if profiled else {}
    decoding.append(sum(not r.finished for r in requests))
    if min(decoding) != seqs:
        raise RuntimeError(f"only {min(decoding)} of {seqs} sequences decoded in every timed step")
    first = [r.output_ids[:decode_steps // 2] for r in requests]  # what every loop has generated
    for r in requests:
        engine.abort(r)
    while (turn := engine.step()) is not None:  # the step async scheduling left in flight
        turn.result()
    steady = sorted(times[2:])
    row = {"wall_ms_median": steady[len(steady) // 2] * 1e3, "steps_timed": len(steady), "host_ms": host,
           "idle": idle, "sequences_decoding": seqs, "output_ids": first}
    if idle:
        row["idle_fraction_max"] = max(d["idle_fraction"] for d in idle.values())
    return row


def xla_options() -> dict:
    """Which of the engine variants' XLA options this XLA accepts: each compiles a small
    program with it (an unknown option or value fails to compile; on a CPU the GPU options
    are accepted and ignored)."""
    x = jnp.ones((256, 256), jnp.float32)
    lowered = jax.jit(lambda a: jnp.tanh(a @ a).sum()).lower(x)
    out = {}
    for variant, options in _VARIANT_OPTIONS.items():
        try:
            float(lowered.compile(options)(x))
            out[variant] = "accepted"
        except Exception as error:  # noqa: BLE001 - the answer is the error
            out[variant] = f"{type(error).__name__}: {str(error)[:300]}"
        log(f"  {variant} {options}: {out[variant]}")
    return out
