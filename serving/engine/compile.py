"""Lowering and compiling the steps ahead of time: every (mode, token bucket, sequence
bucket) of a ladder, against the real params and caches, with the same XLA options for
every step of an engine (so that TP and SP steps do the same arithmetic), loaded from the
executable store where it holds them."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Collection

import jax
import numpy as np

from shiftjax.cache import KVCache
from shiftjax.serving.engine.batch_upload import abstract_upload
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.executable_store import ExecutableStore, step_key, temporaries_key
from shiftjax.serving.engine.executables import Executables, engine_step
from shiftjax.serving.engine.transfers import batch_sharding, result_columns
from shiftjax.step_options import StepOptions
from shiftjax.steps import make_step, params_for, quantized_gemm_for
from shiftjax.weights import ModelWeights


def compile_workers(platform: str, gemm: str = "cublas") -> int:
    """How many executables compile at once: on the CPU all of them (XLA compiles outside
    the GIL); on a GPU with Triton GEMMs one, since concurrent compiles serialise under the
    autotuner's per-device lock and autotune the same fusions again; with cuBLAS GEMMs,
    which leave little to autotune, a quarter of the usable cores, each compile running
    LLVM on threads of its own (benchmarks/README.md, "Two GPUs"). ``--dp`` replicas,
    which compile at the same time, share them (``server/service_args.py``)."""
    cpus = usable_cpus()
    if platform != "gpu":
        return cpus
    return 1 if gemm == "triton" else max(1, cpus // 4)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container's limit sets), not
    the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


# XLA's GPU rematerialization takes as its memory budget 80% of the device (or the
# allocator's limit) less the program's inputs and outputs, which a KV cache filling the GPU
# leaves near zero: it then recomputed 63 of the Llama-3.1-8B FP8 prefill step's 128 GEMMs
# (113.5 ms against 80.8 ms; bf16 107.5 against 105.4) without lowering its temporaries
# (1.34 GiB either way; benchmarks/README.md, "FP8 weights"). The page pool is sized from
# the temporaries the steps measure under these same options, so it leaves them their room.
NO_REMATERIALIZATION = {"xla_disable_hlo_passes": "rematerialization"}


NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}

# XLA puts a custom call (an FFI handler, as Mosaic GPU kernels are) into a command buffer by
# tracing it (stream capture), and keeps the traces of its last 16 sets of buffer addresses.
# Under JAX's default allocator a decode step's temporaries can move from step to step, and
# then an FP8 step's Mosaic GEMMs are traced again at every launch. Served Llama-3.1-8B FP8
# TPOT at one request on an H100 (bf16 6.24 ms), four runs traced: 5.29, 5.71, 4.77, 4.66 ms
# (two paid for new traces, two did not); three runs launched between the graphs' pieces:
# 4.79, 4.91, 4.71 ms (benchmarks/README.md, "FP8 weights"). Untraced costs at most a few
# percent against a lucky traced run and removes the unlucky ones. The Pallas Triton kernels
# are XLA's own kernels, not custom calls, and stay in the graphs.
GRAPHS_WITHOUT_CUSTOM_CALLS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUDNN"}


def xla_compiler_options(options: StepOptions, platform: str, num_tokens: int = 0,
                         mosaic_kernels: bool = False) -> dict | None:
    """XLA's compile options for a step of ``num_tokens`` on ``platform`` (a device's
    ``platform``; 0: a step of unknown size, taken as small); ``mosaic_kernels``: the step
    multiplies FP8 weights with the Mosaic GPU kernels (:func:`runs_mosaic_kernels`).

    On GPUs, no rematerialization (``NO_REMATERIALIZATION``). ``gemm="triton"``: otherwise
    XLA's defaults (GEMMs by Triton fusions it autotunes). ``gemm="cublas"``: every GEMM
    calls cuBLAS, and XLA's command buffers (CUDA graphs) take runs of any length between
    two collectives (by default five commands or more; with cuBLAS, fewer fusions leave
    shorter runs, launched one by one). cuBLAS compiles several times faster and serves
    batches faster; Triton decodes one sequence a little faster (benchmarks/README.md,
    "Two GPUs"). Past ``options.cuda_graph_max_tokens``, no command buffers
    (``NO_COMMAND_BUFFERS``): a 4,096-token prefill of the Llama-3.1-8B shape spent 4-5 ms
    of the host's time launching its graph, re-recorded first, while the device waited
    (benchmarks/README.md, "One GPU: FP8 weights"). Below it, a step with Mosaic GPU kernels
    leaves custom calls out of its graphs (``GRAPHS_WITHOUT_CUSTOM_CALLS``).
    ``options.xla_options`` come on top, on every platform."""
    extra = dict(options.xla_options)
    if platform != "gpu":
        return extra or None
    gemm = {} if options.gemm == "triton" else {"xla_gpu_enable_triton_gemm": False, "xla_gpu_graph_min_graph_size": 1}
    limit = options.cuda_graph_max_tokens
    if limit is not None and num_tokens > limit:
        graphs = NO_COMMAND_BUFFERS
    else:
        graphs = GRAPHS_WITHOUT_CUSTOM_CALLS if mosaic_kernels else {}
    return {**NO_REMATERIALIZATION, **gemm, **graphs, **extra}


def runs_mosaic_kernels(quantization: str, mesh, options: StepOptions) -> bool:
    """Whether the steps of weights quantized by ``quantization`` on ``mesh`` multiply them
    with the Mosaic GPU kernels (custom calls)."""
    return quantization != "none" and quantized_gemm_for(options.quantized_gemm, mesh) == "pallas"


def step_compiler_options(weights: ModelWeights, options: StepOptions, num_tokens: int) -> dict | None:
    """:func:`xla_compiler_options` for a step of ``num_tokens`` over ``weights``: their
    devices' platform, and whether they run the Mosaic GPU kernels."""
    return xla_compiler_options(options, weights.mesh.devices.flat[0].platform, num_tokens,
                                runs_mosaic_kernels(weights.quantization, weights.mesh, options))


def compile_all(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, options: StepOptions, *,
                progress: Callable[[int, int, float], None] | None = None, workers: int | None = None,
                store: ExecutableStore | None = None, report: Callable[[str], None] | None = None,
                only: Collection[tuple] | None = None, load_stored: bool = True) -> Executables:
    """Every (mode, bucket) step, compiled against the real params and caches: loaded from
    ``store`` where it holds the step (no tracing, lowering or compiling), else lowered and
    compiled ``workers`` at a time (default :func:`compile_workers` of the devices'
    platform) and then saved to ``store``.

    ``progress(done, total, elapsed_seconds)``, if given, is called as each one is ready;
    ``report(message)`` hears about stored entries that could not be loaded. ``only``: just
    these ``(mode, tokens, seqs)`` steps of the ladder; ``load_stored=False``: compile them
    even where the store holds them (a stored one failed when run), and store them again.
    Counts the executables JAX's
    persistent compilation cache supplied (its ``/jax/compilation_cache/cache_hits``
    event) and those the store supplied."""
    start = time.perf_counter()
    _require_max_pages(options)
    steps = _steps(weights, ladder, modes)
    if only is not None:
        only = set(only)
        steps = [k for k in steps if k in only]
    compiler_options = {key: step_compiler_options(weights, options, key[1]) for key in steps}
    compiled, seconds, store_keys = {}, {}, {}

    def ready(key, executable, elapsed):
        compiled[key], seconds[key] = executable, elapsed
        if progress is not None:
            progress(len(compiled), len(steps), time.perf_counter() - start)

    if store is not None:
        devices = list(weights.mesh.devices.flat)
        for mode, t, b in steps:
            store_keys[(mode, t, b)] = step_key(weights, caches, options, mode=mode, num_tokens=t, num_seqs=b,
                                                result_rows=ladder.result_rows,
                                                compiler_options=compiler_options[(mode, t, b)])

        def load(key):
            began = time.perf_counter()
            return key, store.load(store_keys[key], devices, report), time.perf_counter() - began

        # Concurrently: a load is file reading and the runtime's module loading, not Python.
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(steps), 8) or 1) as pool:
            for key, executable, elapsed in pool.map(load, steps if load_stored else []):
                if executable is not None:
                    ready(key, executable, elapsed)
    stored = frozenset(compiled)
    with JaxCompileEvents() as events:
        lowered = _lower_steps(weights, caches, [k for k in steps if k not in compiled], options, ladder.result_rows)

        def compile_one(key):
            began = time.perf_counter()
            hits_before = events.hits_by_thread[threading.get_ident()]
            executable = lowered[key].compile(compiler_options[key])
            elapsed = time.perf_counter() - began
            # Only an executable XLA just compiled is stored: one that JAX loaded from its
            # persistent cache, serialized again, loads but fails when run on the CPU
            # ("Function ... not found"; tests/test_executable_store.py).
            if store is not None and events.hits_by_thread[threading.get_ident()] == hits_before:
                store.save_reporting(store_keys[key], executable, report)
            return key, executable, elapsed

        if lowered:
            platform = weights.mesh.devices.flat[0].platform
            workers = min(len(lowered), workers or compile_workers(platform, options.gemm))
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for future in concurrent.futures.as_completed([pool.submit(compile_one, k) for k in lowered]):
                    ready(*future.result())
    # In ladder order, whatever order they became ready in: every process of a multi-process
    # mesh must run them (time_executables) in the same order, collectives and all.
    return Executables(ladder, options, {k: compiled[k] for k in steps}, {k: seconds[k] for k in steps},
                       wall_seconds=time.perf_counter() - start, cache_hits=events.cache_hits, stored_keys=stored)


def _require_max_pages(options: StepOptions) -> None:
    if options.max_pages is None:
        raise ValueError("the engine's steps need StepOptions.max_pages (the page table's width)")


def _steps(weights, ladder, modes) -> list[tuple[str, int, int]]:
    steps = []
    for mode in modes:
        for t, b in ladder.pairs():
            if mode == "sp" and t % weights.dims.sp:
                raise ValueError(f"token bucket {t} is not a multiple of sp={weights.dims.sp}")
            steps.append((mode, t, b))
    return steps


def _lower_steps(weights, caches, steps, options: StepOptions, result_rows: int) -> dict:
    sharding = batch_sharding(weights)
    previous = jax.ShapeDtypeStruct((result_rows, result_columns(options.max_top_logprobs)), np.int32,
                                    sharding=sharding)
    made = {}
    lowered = {}
    for mode, t, b in steps:
        if mode not in made:
            made[mode] = engine_step(make_step(weights, mode, options), result_rows)
        lowered[(mode, t, b)] = made[mode].lower(params_for(weights, mode), caches,
                                                 abstract_upload(t, b, options.max_pages, sharding), previous)
    return lowered


def temporary_bytes(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, options: StepOptions, *,
                    store: ExecutableStore | None = None, workers: int | None = None) -> int:
    """The largest per-device temporary buffer size of the largest bucket's step in any mode,
    from XLA's memory analysis: what the page pool must leave free. ``caches`` may be
    abstract (``ShapeDtypeStruct``) and small; the step updates them in place, so their
    size does not change the temporaries. The steps compile ``workers`` at a time (default
    :func:`compile_workers`); with a ``store`` the size is read from it when it holds one
    for these steps, else measured and saved there (a warm start compiles nothing)."""
    _require_max_pages(options)
    largest = BucketLadder((ladder.token_buckets[-1],), (ladder.seq_buckets[-1],))
    platform = weights.mesh.devices.flat[0].platform
    compiler_options = step_compiler_options(weights, options, largest.token_buckets[0])
    key = None
    if store is not None:
        key = temporaries_key(weights, caches, options, modes=modes, num_tokens=largest.token_buckets[0],
                              num_seqs=largest.seq_buckets[0], result_rows=ladder.result_rows,
                              compiler_options=compiler_options)
        saved = store.load_number(key)
        if saved is not None:
            return saved
    lowered = _lower_steps(weights, caches, _steps(weights, largest, modes), options, ladder.result_rows)

    def size(step) -> int:
        analysis = step.compile(compiler_options).memory_analysis()
        return 0 if analysis is None else int(analysis.temp_size_in_bytes)

    workers = min(len(lowered), workers or compile_workers(platform, options.gemm))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        largest_size = max(pool.map(size, lowered.values()))
    if store is not None:
        store.save_number(key, largest_size)
    return largest_size


class JaxCompileEvents:
    """Counts, while entered, JAX's compile events from every thread: persistent-cache hits
    and misses, and backend compiles (a cache hit is also a backend "compile" event, so
    ``backend_compiles`` counts every executable JAX had to produce)."""

    CACHE_HIT = "/jax/compilation_cache/cache_hits"
    CACHE_MISS = "/jax/compilation_cache/cache_misses"
    BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch, 0.10.2

    def __init__(self):
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0
        self.backend_compiles = 0
        self.hits_by_thread = collections.Counter()  # JAX reports a hit on the compiling thread

    def _on_event(self, event: str, **_):
        with self._lock:
            if event == self.CACHE_HIT:
                self.cache_hits += 1
                self.hits_by_thread[threading.get_ident()] += 1
            elif event == self.CACHE_MISS:
                self.cache_misses += 1

    def _on_duration(self, event: str, _seconds: float, **_):
        if event == self.BACKEND_COMPILE:
            with self._lock:
                self.backend_compiles += 1

    def __enter__(self) -> "JaxCompileEvents":
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
