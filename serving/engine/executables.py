"""The compiled steps of an engine, keyed by ``(mode, tokens, seqs)``, and the step as the
engine runs it: its batch taken from two uploaded arrays (``batch_upload.py``) and the
tokens the previous step sampled taken from that step's result on the devices (async
scheduling, ``token_fills.py``), so that placing a step is two transfers and one launch."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection

import jax
from jaxtyping import Array, Int

from shiftjax.batch import empty_batch
from shiftjax.cache import KVCache
from shiftjax.serving.engine.batch_upload import BatchUpload, unpack_batch
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.token_fills import take_sampled_tokens
from shiftjax.serving.engine.transfers import empty_result, pad_result, place_upload
from shiftjax.step_options import StepOptions
from shiftjax.steps import StepOutput, params_for
from shiftjax.weights import ModelWeights


@dataclasses.dataclass
class Executables:
    """Compiled steps keyed by ``(mode, tokens, seqs)``, with compile and run times.

    ``compile_seconds`` holds each executable's own compile (or load) time;
    ``wall_seconds`` the whole start-up compile, ``cache_hits`` how many came from JAX's
    persistent compilation cache, ``loaded_from_store`` how many from the executable store."""

    ladder: BucketLadder
    options: StepOptions
    compiled: dict
    compile_seconds: dict
    run_seconds: dict = dataclasses.field(default_factory=dict)
    wall_seconds: float = 0.0
    cache_hits: int = 0
    stored_keys: frozenset = frozenset()  # from the ExecutableStore: neither lowered nor compiled

    @property
    def loaded_from_store(self) -> int:
        return len(self.stored_keys)

    def get(self, mode: str, num_tokens: int, num_seqs: int):
        return self.compiled[(mode, num_tokens, num_seqs)]

    def merge(self, again: Executables) -> None:
        """Takes ``again``'s executables (compiled anew) in place of the stored ones they replace."""
        self.compiled.update(again.compiled)
        self.compile_seconds.update(again.compile_seconds)
        self.stored_keys = self.stored_keys - set(again.compiled)
        self.cache_hits += again.cache_hits


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


def time_executables(executables: Executables, weights: ModelWeights, caches: KVCache, repeats: int = 3,
                     warm: Collection[tuple] = ()) -> KVCache:
    """Times every executable on an all-padding batch (it writes only the scratch page);
    returns the caches, rebound after each donated call. ``warm``: keys already run once
    (the engine's check of stored steps), which need no warm-up run."""
    for key in executables.compiled:
        if key not in warm:
            caches, _ = run_on_padding(executables, key, weights, caches)  # warm-up
        caches, executables.run_seconds[key] = run_on_padding(executables, key, weights, caches, repeats)
    return caches


def run_on_padding(executables: Executables, key: tuple[str, int, int], weights: ModelWeights, caches: KVCache,
                   repeats: int = 1) -> tuple[KVCache, float]:
    """Runs one executable ``repeats`` times on an all-padding batch (it writes only the
    scratch page); the caches, rebound after each donated call, and the seconds per run
    (the batch's transfer not counted)."""
    mode, t, b = key
    upload = place_upload(empty_batch(t, b, executables.options.max_pages), weights)
    previous = empty_result(weights, executables.ladder.result_rows, executables.options.max_top_logprobs)
    params = params_for(weights, mode)
    start = time.perf_counter()
    for _ in range(repeats):
        out, caches = executables.compiled[key](params, caches, upload, previous)
    jax.block_until_ready(out.packed)
    return caches, (time.perf_counter() - start) / repeats
