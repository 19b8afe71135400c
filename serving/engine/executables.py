"""Ahead-of-time compiled steps, one per (mode, token bucket, sequence bucket).

Everything is compiled at start and timed; the serving path only looks executables up,
so a batch that fits no bucket is an error, never a recompile.

The engine's step (:func:`engine_step`) is the model's step with its batch taken from two
uploaded arrays (``batch_upload.py``) and the tokens that the previous step sampled
taken from that step's result on the devices (async scheduling, ``token_fills.py``):
placing a step is two transfers and one launch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int

from shiftjax.batch import PER_SEQUENCE_FIELDS, PER_TOKEN_FIELDS, StepBatch, empty_batch
from shiftjax.cache import KVCache
from shiftjax.layouts.specs import REPLICATED
from shiftjax.serving.engine.batch_upload import BatchUpload, abstract_upload, pack_batch, unpack_batch
from shiftjax.serving.engine.executable_store import ExecutableStore, step_key, temporaries_key
from shiftjax.serving.engine.token_fills import take_sampled_tokens
from shiftjax.steps import StepOutput, make_step, params_for
from shiftjax.weights import ModelWeights


class NoBucket(ValueError):
    """A batch larger than every compiled bucket."""


def _pads_decode(seqs: int, tokens: int) -> bool:
    """Whether a decode step of ``seqs`` sequences (one token each) in a ``tokens`` bucket
    multiplies padding rows that cost: more than twice its rows and above 16 (16 rows took
    1.03-1.10x the time of 8 for the 8B TP shard's projections, 64 rows 1.23-1.52x:
    ``benchmarks/x2_results.md``, "One GPU")."""
    return tokens > max(2 * seqs, 16)


@dataclasses.dataclass(frozen=True)
class BucketLadder:
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    def __post_init__(self):
        for name in ("token_buckets", "seq_buckets"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] <= 0:
                raise ValueError(f"{name} must be strictly increasing positive integers, got {values}")

    @classmethod
    def geometric(cls, max_tokens: int, max_seqs: int, *, min_tokens: int = 16, factor: int = 4,
                  multiple: int = 1):
        """Token buckets ``min_tokens * factor**i`` up to ``max_tokens`` (which is always one),
        rounded up to multiples of ``multiple`` (the SP degree); sequence buckets: the token
        buckets below ``max_seqs``, then ``max_seqs`` (also a token bucket where none lies
        within twice it). Each bucket pair is one executable per mode, compiled at start, so
        the ladder trades padding against start-up time.

        The sequence buckets are token buckets so that a decode step of a bucket's worth of
        sequences (one token each) runs in a step of as many tokens. Sequence buckets of
        8, 32, 128 beside token buckets 16, 64, 256 (before) ran 64 decoding sequences as a
        step of 256 tokens for 128 sequences: 1.31x the device time of a (64, 64) step
        (Llama-3.1-8B's TP shard on one H200, ``benchmarks/decode_anatomy.py``). Below 16
        rows the GEMMs gain little (16 rows against 8: 3-10% per projection, 2% a step)."""
        def ladder(first, last):
            values, v = [], first
            while v < last:
                values.append(v)
                v *= factor
            return values + [last]

        def rounded(t):
            return -(-t // multiple) * multiple

        tokens = sorted({rounded(t) for t in ladder(min(min_tokens, max_tokens), max_tokens)})
        # (a sequence bucket above the largest token bucket would pair with no token bucket)
        last = min(max_seqs, tokens[-1])
        if _pads_decode(last, min(t for t in tokens if t >= last)):  # a full batch decodes unpadded
            tokens = sorted(set(tokens) | {rounded(last)})
        seqs = {t for t in tokens if t < max_seqs} | {last}
        return cls(tuple(tokens), tuple(sorted(seqs)))

    @property
    def result_rows(self) -> int:
        """Rows of every step's result: the largest sequence bucket, so that a step can
        read the one before it whatever their buckets."""
        return self.seq_buckets[-1]

    def max_seqs(self) -> int:
        """The most sequences a step can hold and still fit a bucket: the largest sequence
        bucket that the largest token bucket is compiled for (a step of n sequences has at
        least n tokens, so any smaller step finds a bucket on the way up)."""
        return max(b for b in self.seq_buckets if b <= self.token_buckets[-1])

    def padded_decode_steps(self) -> list[tuple[int, int]]:
        """``(sequences, tokens)`` for each sequence bucket whose decode step (one token a
        sequence) runs in a token bucket that pads it (``_pads_decode``). A ladder given by
        hand may have them; the geometric one has none."""
        steps = [(seqs, self.pick(seqs, seqs)[0]) for seqs in self.seq_buckets if seqs <= self.token_buckets[-1]]
        return [(seqs, tokens) for seqs, tokens in steps if _pads_decode(seqs, tokens)]

    def pairs(self):
        return [(t, b) for t in self.token_buckets for b in self.seq_buckets if b <= t]

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        for t in self.token_buckets:
            if t >= num_tokens:
                for b in self.seq_buckets:
                    if num_seqs <= b <= t:
                        return t, b
        raise NoBucket(
            f"a step of {num_tokens} tokens and {num_seqs} sequences fits no compiled bucket "
            f"(tokens {self.token_buckets}, sequences {self.seq_buckets})"
        )


def pad_batch(batch: StepBatch, num_tokens: int, num_seqs: int) -> StepBatch:
    """``batch`` padded to a bucket: padding tokens write the scratch page, padding
    sequences are empty and sample nothing."""
    padded = empty_batch(num_tokens, num_seqs, batch.page_table.shape[1])
    n, b = batch.num_tokens, batch.num_seqs
    for name in PER_TOKEN_FIELDS:
        getattr(padded, name)[:n] = getattr(batch, name)
    for name in PER_SEQUENCE_FIELDS:
        getattr(padded, name)[:b] = getattr(batch, name)
    padded.page_table[:b] = batch.page_table
    padded.query_start[:b + 1] = batch.query_start
    padded.query_start[b + 1:] = batch.query_start[b]
    return padded


@dataclasses.dataclass
class Executables:
    """Compiled steps keyed by ``(mode, tokens, seqs)``, with compile and run times.

    ``compile_seconds`` holds each executable's own compile (or load) time;
    ``wall_seconds`` the whole start-up compile, ``cache_hits`` how many came from JAX's
    persistent compilation cache, ``loaded_from_store`` how many from the executable store."""

    ladder: BucketLadder
    compiled: dict
    compile_seconds: dict
    run_seconds: dict = dataclasses.field(default_factory=dict)
    max_top_logprobs: int = 0
    wall_seconds: float = 0.0
    cache_hits: int = 0
    stored_keys: frozenset = frozenset()  # from the ExecutableStore: neither lowered nor compiled

    @property
    def loaded_from_store(self) -> int:
        return len(self.stored_keys)

    def get(self, mode: str, num_tokens: int, num_seqs: int):
        return self.compiled[(mode, num_tokens, num_seqs)]


def engine_step(step, result_rows: int):
    """``step`` (from ``make_step``) as the engine runs it: its batch unpacked from a
    :class:`BatchUpload`, the tokens whose ``token_source`` is set taken from ``previous``
    (the result of the step launched before, not yet on the host), and its result padded
    to ``result_rows``. Caches (argument 1) are donated."""

    def run(params, caches: KVCache, upload: BatchUpload,
            previous: Int[Array, "result_rows columns"]) -> tuple[StepOutput, KVCache]:
        batch, token_source = unpack_batch(upload)
        batch = batch.replace(token_ids=take_sampled_tokens(batch.token_ids, previous, token_source))
        out, caches = step(params, caches, batch)
        return out.replace(packed=pad_result(out.packed, result_rows)), caches

    return jax.jit(run, donate_argnums=(1,))


def pad_result(packed: Int[Array, "seqs columns"], rows: int) -> Int[Array, "rows columns"]:
    return jnp.pad(packed, ((0, rows - packed.shape[0]), (0, 0)))


def result_columns(max_top_logprobs: int) -> int:
    return 2 + 2 * max_top_logprobs  # StepOutput.packed


def empty_result(weights: ModelWeights, ladder: BucketLadder, max_top_logprobs: int) -> jax.Array:
    """The ``previous`` of a step that takes no sampled tokens (placed once, read by many)."""
    return place_replicated(np.zeros((ladder.result_rows, result_columns(max_top_logprobs)), np.int32), weights)


def batch_sharding(weights: ModelWeights) -> NamedSharding:
    return NamedSharding(weights.mesh, REPLICATED)


def compile_workers(platform: str, gemm: str = "cublas") -> int:
    """How many executables compile at once. On the CPU, all of them (XLA compiles outside
    the GIL). On a GPU with Triton GEMMs, one: measured on 2x H200 with the unrolled 32-layer
    8B step, 16 compiles at once had not finished one in 520 s
    (benchmarks/results/compare_x2/run0_concurrent_compile/), while one at a time took
    13.5-17.7 s each (compare_x2.md), and 3 more after 6 took 12.6 s (x2_results.md): the
    concurrent compiles serialise under the autotuner's per-device lock and autotune the
    same fusions again, where a compile after another reuses its results. With cuBLAS GEMMs
    there is little to autotune: 8 mesh steps compiled at once in 11.5 s, and the 18 steps
    of a ladder in 52.2 s against 123.2 s one at a time (x2_results.md, "GEMMs: cuBLAS or
    Triton", "cuBLAS by default"), so a quarter of the usable cores (each compile runs
    LLVM on several threads of its own). ``--dp`` replicas, which compile at the same time,
    share them (server.service_args.build_data_parallel_service)."""
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


GEMM_BACKENDS = ("triton", "cublas")


def xla_compiler_options(gemm: str, platform: str) -> dict | None:
    """XLA's compile options for the steps on ``platform`` (a device's ``platform``); the
    same for every step of an engine, so that TP and SP steps do the same arithmetic.

    ``"triton"``: XLA's defaults (GEMMs by Triton fusions XLA autotunes, by compiling and
    timing candidate kernels). ``"cublas"``: on GPUs every GEMM calls cuBLAS, and XLA's
    command buffers (CUDA graphs) take runs of any length between two collectives (default:
    five commands or more; with cuBLAS, fewer fusions leave shorter runs, launched one by
    one). Measured on 2x H200, Llama-3.1-8B shape (benchmarks/x2_results.md, "GEMMs: cuBLAS
    or Triton"): with cuBLAS, eight steps compiled in 11.5 s instead of 177.6 s and 2048-
    and 4096-token prefill steps ran 4-7% faster in every mode; in the engine's TP decode
    loop it was 1.03x / 1.04x faster at 8 / 64 sequences and 1.07x slower at one, where the
    host's launch bounds the step. Both backends gave one GPU's greedy tokens in TP, SP and
    alternate on the mesh, with bit-identical TP and SP logits (the ``correct`` part).
    cuBLAS is the default (``EngineConfig.gemm``): it starts cold 5x faster (its steps
    also compile at once, :func:`compile_workers`) and serves batches faster;
    ``"triton"`` for the lowest latency of one sequence."""
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm must be one of {GEMM_BACKENDS}, got {gemm!r}")
    if platform != "gpu" or gemm == "triton":
        return None
    return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_graph_min_graph_size": 1}


def compile_all(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, *,
                max_pages: int, attention: str = "auto", layer_loop: str = "scan", gemm: str = "cublas",
                max_top_logprobs: int = 0, sample_in_step: bool = True, all_reduce: str = "xla",
                all_to_all: str = "xla", progress: Callable[[int, int, float], None] | None = None,
                workers: int | None = None, store: ExecutableStore | None = None,
                report: Callable[[str], None] | None = None, only: Collection[tuple] | None = None) -> Executables:
    """Every (mode, bucket) step, compiled against the real params and caches: loaded from
    ``store`` where it holds the step (no tracing, lowering or compiling), else lowered and
    compiled ``workers`` at a time (default :func:`compile_workers` of the devices'
    platform) and then saved to ``store``.

    ``progress(done, total, elapsed_seconds)``, if given, is called as each one is ready;
    ``report(message)`` hears about stored entries that could not be loaded. ``only``: just
    these ``(mode, tokens, seqs)`` steps of the ladder. Counts the
    executables JAX's persistent compilation cache supplied (its
    ``/jax/compilation_cache/cache_hits`` event) and those the store supplied."""
    start = time.perf_counter()
    options = dict(max_pages=max_pages, attention=attention, layer_loop=layer_loop,
                   max_top_logprobs=max_top_logprobs, sample_in_step=sample_in_step, all_reduce=all_reduce,
                   all_to_all=all_to_all)
    compiler_options = xla_compiler_options(gemm, weights.mesh.devices.flat[0].platform)
    steps = _steps(weights, ladder, modes)
    if only is not None:
        only = set(only)
        steps = [k for k in steps if k in only]
    compiled, seconds, store_keys = {}, {}, {}

    def ready(key, executable, elapsed):
        compiled[key], seconds[key] = executable, elapsed
        if progress is not None:
            progress(len(compiled), len(steps), time.perf_counter() - start)

    if store is not None:
        devices = list(weights.mesh.devices.flat)
        for mode, t, b in steps:
            store_keys[(mode, t, b)] = step_key(weights, caches, mode=mode, num_tokens=t, num_seqs=b,
                                                result_rows=ladder.result_rows, compiler_options=compiler_options,
                                                **options)

        def load(key):
            began = time.perf_counter()
            return key, store.load(store_keys[key], devices, report), time.perf_counter() - began

        # Concurrently: a load is file reading and the runtime's module loading, not Python.
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(steps), 8) or 1) as pool:
            for key, executable, elapsed in pool.map(load, steps):
                if executable is not None:
                    ready(key, executable, elapsed)
    stored = frozenset(compiled)
    with JaxCompileEvents() as events:
        lowered = _lower_steps(weights, caches, [k for k in steps if k not in compiled],
                               result_rows=ladder.result_rows, **options)

        def compile_one(key):
            began = time.perf_counter()
            hits_before = events.hits_by_thread[threading.get_ident()]
            executable = lowered[key].compile(compiler_options)
            elapsed = time.perf_counter() - began
            # Only an executable XLA just compiled is stored: one that JAX loaded from its
            # persistent cache, serialized again, loads but fails when run on the CPU
            # ("Function ... not found"; tests/test_executable_store.py).
            if store is not None and events.hits_by_thread[threading.get_ident()] == hits_before:
                store.save_reporting(store_keys[key], executable, report)
            return key, executable, elapsed

        if lowered:
            workers = min(len(lowered), workers or compile_workers(weights.mesh.devices.flat[0].platform, gemm))
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for future in concurrent.futures.as_completed([pool.submit(compile_one, k) for k in lowered]):
                    ready(*future.result())
    # In ladder order, whatever order they became ready in: every process of a multi-process
    # mesh must run them (time_executables) in the same order, collectives and all.
    return Executables(ladder, {k: compiled[k] for k in steps}, {k: seconds[k] for k in steps},
                       max_top_logprobs=max_top_logprobs, wall_seconds=time.perf_counter() - start,
                       cache_hits=events.cache_hits, stored_keys=stored)


def _steps(weights, ladder, modes) -> list[tuple[str, int, int]]:
    steps = []
    for mode in modes:
        for t, b in ladder.pairs():
            if mode == "sp" and t % weights.dims.sp:
                raise ValueError(f"token bucket {t} is not a multiple of sp={weights.dims.sp}")
            steps.append((mode, t, b))
    return steps


def _lower_steps(weights, caches, steps, *, result_rows, max_pages, attention, layer_loop, max_top_logprobs,
                 sample_in_step=True, all_reduce="xla", all_to_all="xla"):
    sharding = batch_sharding(weights)
    previous = jax.ShapeDtypeStruct((result_rows, result_columns(max_top_logprobs)), np.int32, sharding=sharding)
    made = {}
    lowered = {}
    for mode, t, b in steps:
        if mode not in made:
            made[mode] = engine_step(make_step(weights, mode, attention=attention, layer_loop=layer_loop,
                                               max_top_logprobs=max_top_logprobs, sample_in_step=sample_in_step,
                                               all_reduce=all_reduce, all_to_all=all_to_all),
                                     result_rows)
        lowered[(mode, t, b)] = made[mode].lower(params_for(weights, mode), caches,
                                                 abstract_upload(t, b, max_pages, sharding), previous)
    return lowered


def temporary_bytes(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, *,
                    max_pages: int, attention: str, layer_loop: str, max_top_logprobs: int,
                    sample_in_step: bool = True, gemm: str = "cublas", all_reduce: str = "xla", all_to_all: str = "xla",
                    store: ExecutableStore | None = None, workers: int | None = None) -> int:
    """The largest per-device temporary buffer size of the largest bucket's step in any mode,
    from XLA's memory analysis: what the page pool must leave free. ``caches`` may be
    abstract (``ShapeDtypeStruct``) and small; the step updates them in place, so their
    size does not change the temporaries. The steps compile ``workers`` at a time (default
    :func:`compile_workers`); with a ``store`` the size is read from it when it holds one
    for these steps, else measured and saved there (a warm start compiles nothing)."""
    largest = BucketLadder((ladder.token_buckets[-1],), (ladder.seq_buckets[-1],))
    options = dict(max_pages=max_pages, attention=attention, layer_loop=layer_loop,
                   max_top_logprobs=max_top_logprobs, sample_in_step=sample_in_step, all_reduce=all_reduce,
                   all_to_all=all_to_all)
    platform = weights.mesh.devices.flat[0].platform
    compiler_options = xla_compiler_options(gemm, platform)
    key = None
    if store is not None:
        key = temporaries_key(weights, caches, modes=modes, num_tokens=largest.token_buckets[0],
                              num_seqs=largest.seq_buckets[0], result_rows=ladder.result_rows,
                              compiler_options=compiler_options, **options)
        saved = store.load_number(key)
        if saved is not None:
            return saved
    lowered = _lower_steps(weights, caches, _steps(weights, largest, modes), result_rows=ladder.result_rows,
                           **options)

    def size(step) -> int:
        analysis = step.compile(compiler_options).memory_analysis()
        return 0 if analysis is None else int(analysis.temp_size_in_bytes)

    with concurrent.futures.ThreadPoolExecutor(min(len(lowered), workers or compile_workers(platform, gemm))) as pool:
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


def to_device(batch: StepBatch, weights: ModelWeights) -> StepBatch:
    """The host batch, replicated on the mesh, as ``make_step``'s step takes it (tests,
    benchmarks, notebooks; the engine places :func:`place_upload`'s two arrays instead).
    Every process holds the same host batch (the scheduler is deterministic), so each
    places only its own devices' copies."""
    sharding = batch_sharding(weights)
    return jax.tree.map(lambda x: _place(x, sharding), batch)


def place_upload(batch: StepBatch, weights: ModelWeights, token_source: np.ndarray | None = None) -> BatchUpload:
    """A padded host batch packed and placed like :func:`to_device`: two transfers."""
    sharding = batch_sharding(weights)
    return jax.tree.map(lambda x: _place(x, sharding), pack_batch(batch, token_source))


def place_replicated(x: np.ndarray, weights: ModelWeights) -> jax.Array:
    """A host array replicated on the mesh (each process places its own devices' copies)."""
    return _place(x, batch_sharding(weights))


def _place(x, sharding: NamedSharding) -> jax.Array:
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def time_executables(executables: Executables, weights: ModelWeights, caches: KVCache,
                     max_pages: int, repeats: int = 3, warm: Collection[tuple] = ()) -> KVCache:
    """Times every executable on an all-padding batch (it writes only the scratch page);
    returns the caches, rebound after each donated call. ``warm``: keys already run once
    (the engine's check of stored steps), which need no warm-up run."""
    for key in executables.compiled:
        if key not in warm:
            caches, _ = run_on_padding(executables, key, weights, caches, max_pages)  # warm-up
        caches, executables.run_seconds[key] = run_on_padding(executables, key, weights, caches, max_pages, repeats)
    return caches


def run_on_padding(executables: Executables, key: tuple[str, int, int], weights: ModelWeights, caches: KVCache,
                   max_pages: int, repeats: int = 1) -> tuple[KVCache, float]:
    """Runs one executable ``repeats`` times on an all-padding batch (it writes only the
    scratch page); the caches, rebound after each donated call, and the seconds per run
    (the batch's transfer not counted)."""
    mode, t, b = key
    upload = place_upload(empty_batch(t, b, max_pages), weights)
    previous = empty_result(weights, executables.ladder, executables.max_top_logprobs)
    params = params_for(weights, mode)
    start = time.perf_counter()
    for _ in range(repeats):
        out, caches = executables.compiled[key](params, caches, upload, previous)
    jax.block_until_ready(out.packed)
    return caches, (time.perf_counter() - start) / repeats


def start_host_copy(packed: jax.Array) -> jax.Array:
    """The copy of a step's ``[result_rows, 2 + 2K]`` result that the host reads (replicated: any
    local shard), its transfer to the host requested now, so it lands when the step ends
    instead of when the host asks (DESIGN.md's ``copy_to_host_async``)."""
    shard = packed.addressable_shards[0].data
    shard.copy_to_host_async()
    return shard


def packed_to_host(host_copy: jax.Array) -> np.ndarray:
    """The result as a host array (waits for the step): ``host_copy`` from :func:`start_host_copy`."""
    return np.asarray(host_copy)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step's samples on the host, unpacked by static offsets."""

    tokens: np.ndarray  # [seqs] int32
    logprobs: np.ndarray  # [seqs] float32, under the model
    top_ids: np.ndarray  # [seqs, K] int32, most likely first (K = 0 when not compiled in)
    top_logprobs: np.ndarray  # [seqs, K] float32


def unpack_host(packed: Int[np.ndarray, "seqs columns"]) -> StepResult:
    k = (packed.shape[1] - 2) // 2
    return StepResult(tokens=packed[:, 0], logprobs=packed[:, 1].copy().view(np.float32),
                      top_ids=packed[:, 2:2 + k], top_logprobs=packed[:, 2 + k:].copy().view(np.float32))

