"""The device half of asynchronous scheduling: a step's batch takes the tokens that the
step before it sampled, without the host waiting for them.

One tiny gather per (token bucket, sequence bucket of the previous step), compiled at
start like the steps, so the serving path never compiles. It runs on the devices after
the previous step (it reads its result) and before the next (which reads its output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from shiftjax.serving.executables import BucketLadder, batch_sharding, place_replicated
from shiftjax.weights import ModelWeights


def take_sampled_tokens(
    token_ids: Int[Array, "tokens"],
    previous_packed: Int[Array, "previous_seqs columns"],
    token_source: Int[Array, "tokens"],
) -> Int[Array, "tokens"]:
    """``token_ids`` where ``token_source`` is -1, else the token sampled in that row of
    the previous step (column 0 of its packed result)."""
    sampled = jnp.take(previous_packed[:, 0], jnp.maximum(token_source, 0))
    return jnp.where(token_source >= 0, sampled, token_ids)


def take_sampled_tokens_reference(token_ids: np.ndarray, previous_packed: np.ndarray,
                                  token_source: np.ndarray) -> np.ndarray:
    """The same on the host, one token at a time."""
    out = np.array(token_ids, copy=True)
    for i, row in enumerate(token_source):
        if row >= 0:
            out[i] = previous_packed[row, 0]
    return out


class TokenFills:
    """Compiled :func:`take_sampled_tokens` for every shape a step can meet."""

    def __init__(self, compiled: dict[tuple[int, int], object]):
        self.compiled = compiled

    @classmethod
    def compile(cls, weights: ModelWeights, ladder: BucketLadder, max_top_logprobs: int) -> "TokenFills":
        sharding = batch_sharding(weights)
        columns = 2 + 2 * max_top_logprobs  # steps.StepOutput.packed

        def spec(*shape):
            return jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)

        fill = jax.jit(take_sampled_tokens)
        return cls({(t, b): fill.lower(spec(t), spec(b, columns), spec(t)).compile()
                    for t in ladder.token_buckets for b in ladder.seq_buckets})

    def __call__(self, token_ids: jax.Array, previous_packed: jax.Array, token_source: np.ndarray,
                 weights: ModelWeights) -> jax.Array:
        """``token_source`` (host, unpadded) is padded with -1 to ``token_ids``' bucket."""
        padded = np.full(token_ids.shape[0], -1, np.int32)
        padded[:len(token_source)] = token_source
        source = place_replicated(padded, weights)
        return self.compiled[(token_ids.shape[0], previous_packed.shape[0])](token_ids, previous_packed, source)
