"""The engine's sampler: run after a step (made with ``sample_in_step=False``) whose batch
has a row that samples or asks for alternatives, on that step's logits.

The step itself packs the greedy tokens, so an all-greedy step never runs this, and this
never skips anything with a conditional: on a GPU a conditional blocks the host until the
device reaches it (``steps.make_step``). One executable per sequence bucket, compiled at
start like the steps; it reads the per-sequence half of the step's upload
(``batch_upload.py``) and pads its result to the steps' result rows, so that the next
step reads it as it would the step's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from shiftjax.batch import StepBatch
from shiftjax.sampling import pack_samples
from shiftjax.serving.engine.batch_upload import abstract_upload, unpack_sequences
from shiftjax.serving.engine.buckets import BucketLadder
from shiftjax.serving.engine.compile import JaxCompileEvents
from shiftjax.serving.engine.executable_store import ExecutableStore, sampler_key
from shiftjax.serving.engine.transfers import batch_sharding, pad_result, place_replicated
from shiftjax.step_options import StepOptions
from shiftjax.weights import ModelWeights


def needs_sampler(batch: StepBatch) -> bool:
    """Whether a host batch has a row that the step's greedy packing does not serve."""
    return bool(np.any(batch.temperature > 0) or np.any(batch.top_logprobs > 0))


def sample_rows(logits, sequences, *, max_top_logprobs: int, result_rows: int):
    """:func:`~shiftjax.sampling.pack_samples` of the upload's sequences, padded to ``result_rows``."""
    packed = pack_samples(logits, unpack_sequences(sequences), max_top_logprobs, skip_unneeded=False)
    return pad_result(packed, result_rows)


class Samplers:
    """Compiled :func:`sample_rows` per sequence bucket."""

    def __init__(self, compiled: dict[int, object], loaded_from_store: int = 0):
        self.compiled = compiled
        self.loaded_from_store = loaded_from_store

    @classmethod
    def compile(cls, weights: ModelWeights, ladder: BucketLadder, step_options: StepOptions,
                store: ExecutableStore | None = None, report: Callable[[str], None] | None = None) -> "Samplers":
        """Compiled for every sequence bucket of the steps that ``step_options`` build, or
        loaded from ``store`` (each loaded one is run once, as the engine runs its stored
        steps, and compiled again if that fails; what XLA compiles afresh is stored)."""
        sharding = batch_sharding(weights)
        max_pages = step_options.max_pages
        options = dict(max_top_logprobs=step_options.max_top_logprobs, result_rows=ladder.result_rows)
        sample = jax.jit(functools.partial(sample_rows, **options))
        devices = list(weights.mesh.devices.flat)
        compiled, loaded = {}, 0
        with JaxCompileEvents() as events:
            for seqs in ladder.seq_buckets:
                logits = jax.ShapeDtypeStruct((seqs, weights.config.vocab_size), np.float32, sharding=sharding)
                sequences = abstract_upload(1, seqs, max_pages, sharding).sequences
                key = None if store is None else sampler_key(weights, seqs=seqs, max_pages=max_pages, **options)
                executable = None if store is None else store.load(key, devices, report)
                if executable is not None and _runs(executable, logits, sequences, weights, report):
                    compiled[seqs], loaded = executable, loaded + 1
                    continue
                hits = events.cache_hits
                compiled[seqs] = sample.lower(logits, sequences).compile()
                if store is not None and events.cache_hits == hits:  # only fresh compiles (executable_store.py)
                    store.save_reporting(key, compiled[seqs], report)
        return cls(compiled, loaded)

    def __call__(self, logits: jax.Array, sequences: jax.Array) -> jax.Array:
        """The packed samples of a step from its logits and its upload's ``sequences``."""
        return self.compiled[logits.shape[0]](logits, sequences)


def _runs(executable, logits, sequences, weights: ModelWeights, report) -> bool:
    """Whether a stored sampler runs, on zeros (a deserialized program can load and fail)."""
    try:
        jax.block_until_ready(executable(*(place_replicated(np.zeros(x.shape, x.dtype), weights)
                                           for x in (logits, sequences))))
        return True
    except Exception as error:
        if report is not None:
            report(f"stored sampler failed when run ({type(error).__name__}: {error}); compiling it")
        return False
