"""The engine's sampler: run after a step (made with ``sample_in_step=False``) whose batch
has a row that samples or asks for alternatives, on that step's logits.

The step itself packs the greedy tokens, so an all-greedy step never runs this, and this
never skips anything with a conditional: on a GPU a conditional blocks the host until the
device reaches it (``steps.make_step``). One executable per sequence bucket, compiled at
start like the steps.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from shiftjax.batch import StepBatch, empty_batch
from shiftjax.sampling import pack_samples
from shiftjax.serving.executables import BucketLadder, batch_sharding, to_device
from shiftjax.weights import ModelWeights


def needs_sampler(batch: StepBatch) -> bool:
    """Whether a host batch has a row that the step's greedy packing does not serve."""
    return bool(np.any(batch.temperature > 0) or np.any(batch.top_logprobs > 0))


class Samplers:
    """Compiled :func:`~shiftjax.sampling.pack_samples` per sequence bucket."""

    def __init__(self, compiled: dict[int, object], rows: dict[int, StepBatch]):
        self.compiled = compiled
        self.rows = rows  # per bucket: a placed one-token batch whose per-sequence fields a call replaces

    @classmethod
    def compile(cls, weights: ModelWeights, ladder: BucketLadder, max_top_logprobs: int) -> "Samplers":
        sharding = batch_sharding(weights)
        sample = jax.jit(functools.partial(pack_samples, max_top_logprobs=max_top_logprobs, skip_unneeded=False))
        compiled, rows = {}, {}
        for seqs in ladder.seq_buckets:
            # The sampler reads only the per-sequence fields: one token stands for every token bucket.
            rows[seqs] = to_device(empty_batch(1, seqs, 1), weights)
            logits = jax.ShapeDtypeStruct((seqs, weights.config.vocab_size), np.float32, sharding=sharding)
            compiled[seqs] = sample.lower(logits, rows[seqs]).compile()
        return cls(compiled, rows)

    def __call__(self, logits: jax.Array, batch: StepBatch) -> jax.Array:
        """The packed samples of a placed ``batch`` (any token bucket) from its step's logits."""
        rows = self.rows[batch.num_seqs].replace(**{name: getattr(batch, name) for name in PER_SEQUENCE})
        return self.compiled[batch.num_seqs](logits, rows)


PER_SEQUENCE = ("temperature", "top_p", "top_k", "seed", "seq_lens", "min_p", "top_logprobs")
