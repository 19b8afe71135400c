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

import jax
import numpy as np

from shiftjax.batch import StepBatch
from shiftjax.sampling import pack_samples
from shiftjax.serving.batch_upload import abstract_upload, unpack_sequences
from shiftjax.serving.executables import BucketLadder, batch_sharding, pad_result
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

    def __init__(self, compiled: dict[int, object]):
        self.compiled = compiled

    @classmethod
    def compile(cls, weights: ModelWeights, ladder: BucketLadder, max_top_logprobs: int,
                max_pages: int) -> "Samplers":
        sharding = batch_sharding(weights)
        sample = jax.jit(functools.partial(sample_rows, max_top_logprobs=max_top_logprobs,
                                           result_rows=ladder.result_rows))
        compiled = {}
        for seqs in ladder.seq_buckets:
            logits = jax.ShapeDtypeStruct((seqs, weights.config.vocab_size), np.float32, sharding=sharding)
            sequences = abstract_upload(1, seqs, max_pages, sharding).sequences
            compiled[seqs] = sample.lower(logits, sequences).compile()
        return cls(compiled)

    def __call__(self, logits: jax.Array, sequences: jax.Array) -> jax.Array:
        """The packed samples of a step from its logits and its upload's ``sequences``."""
        return self.compiled[logits.shape[0]](logits, sequences)
