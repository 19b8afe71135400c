"""Ahead-of-time compiled steps, one per (mode, token bucket, sequence bucket).

Everything is compiled at start and timed; the serving path only looks executables up,
so a batch that fits no bucket is an error, never a recompile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Int

from shiftjax.batch import StepBatch, empty_batch
from shiftjax.cache import KVCache
from shiftjax.layouts.specs import REPLICATED
from shiftjax.steps import make_step, params_for
from shiftjax.weights import ModelWeights


class NoBucket(ValueError):
    """A batch larger than every compiled bucket."""


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
        rounded up to multiples of ``multiple`` (the SP degree), and sequence buckets
        ``factor**i`` up to ``max_seqs``. Each bucket is one executable per mode, compiled at
        start, so the ladder trades padding against start-up time."""
        def ladder(first, last):
            values, v = [], first
            while v < last:
                values.append(v)
                v *= factor
            return values + [last]

        tokens = [-(-t // multiple) * multiple for t in ladder(min(min_tokens, max_tokens), max_tokens)]
        return cls(tuple(sorted(set(tokens))), tuple(ladder(1, max_seqs)))

    def max_seqs(self) -> int:
        """The most sequences a step can hold and still fit a bucket: the largest sequence
        bucket that the largest token bucket is compiled for (a step of n sequences has at
        least n tokens, so any smaller step finds a bucket on the way up)."""
        return max(b for b in self.seq_buckets if b <= self.token_buckets[-1])

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
    for name in ("token_ids", "positions", "slot_mapping"):
        getattr(padded, name)[:n] = getattr(batch, name)
    for name in ("seq_lens", "sample_index", "temperature", "top_p", "top_k", "seed", "min_p", "top_logprobs"):
        getattr(padded, name)[:b] = getattr(batch, name)
    padded.page_table[:b] = batch.page_table
    padded.query_start[:b + 1] = batch.query_start
    padded.query_start[b + 1:] = batch.query_start[b]
    return padded


@dataclasses.dataclass
class Executables:
    """Compiled steps keyed by ``(mode, tokens, seqs)``, with compile and run times.

    ``compile_seconds`` holds each executable's own compile time (they compile
    concurrently); ``wall_seconds`` the whole start-up compile, ``cache_hits`` how many came
    from JAX's persistent compilation cache."""

    ladder: BucketLadder
    compiled: dict
    compile_seconds: dict
    run_seconds: dict = dataclasses.field(default_factory=dict)
    max_top_logprobs: int = 0
    wall_seconds: float = 0.0
    cache_hits: int = 0

    def get(self, mode: str, num_tokens: int, num_seqs: int):
        return self.compiled[(mode, num_tokens, num_seqs)]


def batch_sharding(weights: ModelWeights) -> NamedSharding:
    return NamedSharding(weights.mesh, REPLICATED)


def compile_workers(platform: str) -> int:
    """How many executables compile at once. On the CPU, all of them (XLA compiles outside
    the GIL). On a GPU, one: concurrent compiles there each autotune the same GEMM fusions
    again, one at a time under the autotuner's per-device lock (16 concurrent 32-layer
    compiles on 2x H200 had not finished one in 520 s; benchmarks/results/compare_x2/), while
    a compile after another reuses its autotuning results (3 more mesh executables took
    12.6 s after 6 had taken 108 s; benchmarks/x2_results.md)."""
    return 1 if platform == "gpu" else (os.cpu_count() or 1)


def compile_all(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, *,
                max_pages: int, attention: str = "auto", layer_loop: str = "scan",
                max_top_logprobs: int = 0, progress=None, workers: int | None = None) -> Executables:
    """Lowers every (mode, bucket) step against the real params and caches, then compiles
    them, ``workers`` at a time (default :func:`compile_workers` of the devices' platform).

    ``progress(done, total, elapsed_seconds)``, if given, is called as each one finishes.
    Counts the executables JAX's persistent compilation cache supplied (its
    ``/jax/compilation_cache/cache_hits`` event)."""
    start = time.perf_counter()
    with JaxCompileEvents() as events:
        lowered = _lower_all(weights, caches, ladder, modes, max_pages=max_pages, attention=attention,
                             layer_loop=layer_loop, max_top_logprobs=max_top_logprobs)

        def compile_one(key):
            began = time.perf_counter()
            compiled = lowered[key].compile()
            return key, compiled, time.perf_counter() - began

        compiled, seconds = {}, {}
        workers = min(len(lowered), workers or compile_workers(weights.mesh.devices.flat[0].platform))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for future in concurrent.futures.as_completed([pool.submit(compile_one, k) for k in lowered]):
                key, executable, elapsed = future.result()
                compiled[key], seconds[key] = executable, elapsed
                if progress is not None:
                    progress(len(compiled), len(lowered), time.perf_counter() - start)
    return Executables(ladder, compiled, seconds, max_top_logprobs=max_top_logprobs,
                       wall_seconds=time.perf_counter() - start, cache_hits=events.cache_hits)


def _lower_all(weights, caches, ladder, modes, *, max_pages, attention, layer_loop, max_top_logprobs):
    sharding = batch_sharding(weights)
    lowered = {}
    for mode in modes:
        step = make_step(weights, mode, attention=attention, layer_loop=layer_loop,
                         max_top_logprobs=max_top_logprobs)
        for t, b in ladder.pairs():
            if mode == "sp" and t % weights.dims.sp:
                raise ValueError(f"token bucket {t} is not a multiple of sp={weights.dims.sp}")
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                    empty_batch(t, b, max_pages))
            lowered[(mode, t, b)] = step.lower(params_for(weights, mode), caches, abstract)
    return lowered


def temporary_bytes(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, *,
                    max_pages: int, attention: str, layer_loop: str, max_top_logprobs: int) -> int:
    """The largest per-device temporary buffer size of the largest bucket's step in any mode,
    from XLA's memory analysis: what the page pool must leave free. ``caches`` may be
    abstract (``ShapeDtypeStruct``) and small; the step updates them in place, so their
    size does not change the temporaries."""
    largest = BucketLadder((ladder.token_buckets[-1],), (ladder.seq_buckets[-1],))
    lowered = _lower_all(weights, caches, largest, modes, max_pages=max_pages, attention=attention,
                         layer_loop=layer_loop, max_top_logprobs=max_top_logprobs)
    sizes = []
    for step in lowered.values():
        analysis = step.compile().memory_analysis()
        sizes.append(0 if analysis is None else int(analysis.temp_size_in_bytes))
    return max(sizes)


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

    def _on_event(self, event: str, **_):
        with self._lock:
            if event == self.CACHE_HIT:
                self.cache_hits += 1
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
    """The host batch, replicated on the mesh; every process holds the same host batch
    (the scheduler is deterministic), so each places only its own devices' copies."""
    sharding = batch_sharding(weights)

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, batch)


def time_executables(executables: Executables, weights: ModelWeights, caches: KVCache,
                     max_pages: int, repeats: int = 3) -> KVCache:
    """Times every executable on an all-padding batch (it writes only the scratch page);
    returns the caches, rebound after each donated call."""
    for (mode, t, b), exe in executables.compiled.items():
        batch = to_device(empty_batch(t, b, max_pages), weights)
        params = params_for(weights, mode)
        out, caches = exe(params, caches, batch)  # warm-up
        jax.block_until_ready(out.packed)
        start = time.perf_counter()
        for _ in range(repeats):
            out, caches = exe(params, caches, batch)
        jax.block_until_ready(out.packed)
        executables.run_seconds[(mode, t, b)] = (time.perf_counter() - start) / repeats
    return caches


def packed_to_host(packed) -> np.ndarray:
    """The step's ``[seqs, 2 + 2K]`` int32 result on the host (replicated: any local shard)."""
    return np.asarray(packed.addressable_shards[0].data)


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

