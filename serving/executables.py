"""Ahead-of-time compiled steps, one per (mode, token bucket, sequence bucket).

Everything is compiled at start and timed; the serving path only looks executables up,
so a batch that fits no bucket is an error, never a recompile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

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
    for name in ("seq_lens", "sample_index", "temperature", "top_p", "top_k", "seed"):
        getattr(padded, name)[:b] = getattr(batch, name)
    padded.page_table[:b] = batch.page_table
    padded.query_start[:b + 1] = batch.query_start
    padded.query_start[b + 1:] = batch.query_start[b]
    return padded


@dataclasses.dataclass
class Executables:
    """Compiled steps keyed by ``(mode, tokens, seqs)``, with compile and run times."""

    ladder: BucketLadder
    compiled: dict
    compile_seconds: dict
    run_seconds: dict = dataclasses.field(default_factory=dict)

    def get(self, mode: str, num_tokens: int, num_seqs: int):
        return self.compiled[(mode, num_tokens, num_seqs)]


def batch_sharding(weights: ModelWeights) -> NamedSharding:
    return NamedSharding(weights.mesh, REPLICATED)


def compile_all(weights: ModelWeights, caches: KVCache, ladder: BucketLadder, modes, *,
                max_pages: int, attention: str = "auto", layer_loop: str = "scan") -> Executables:
    """Lowers every (mode, bucket) step against the real params and caches, then compiles
    them concurrently (XLA compiles outside the GIL; an unrolled 32-layer step takes ~40 s
    on the H200 host, so a ladder compiled one by one would take minutes)."""
    sharding = batch_sharding(weights)
    lowered = {}
    for mode in modes:
        step = make_step(weights, mode, attention=attention, layer_loop=layer_loop)
        for t, b in ladder.pairs():
            if mode == "sp" and t % weights.dims.sp:
                raise ValueError(f"token bucket {t} is not a multiple of sp={weights.dims.sp}")
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                    empty_batch(t, b, max_pages))
            lowered[(mode, t, b)] = step.lower(params_for(weights, mode), caches, abstract)

    def compile_one(key):
        start = time.perf_counter()
        compiled = lowered[key].compile()
        return key, compiled, time.perf_counter() - start

    compiled, seconds = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
        for key, executable, elapsed in pool.map(compile_one, lowered):
            compiled[key], seconds[key] = executable, elapsed
    return Executables(ladder, compiled, seconds)


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
    """The step's ``[seqs, 2]`` int32 result on the host (replicated: any local shard)."""
    return np.asarray(packed.addressable_shards[0].data)


def unpack_host(packed: np.ndarray):
    return packed[:, 0], packed[:, 1].copy().view(np.float32)

