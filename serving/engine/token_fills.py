"""The device half of asynchronous scheduling: a step's batch takes the tokens that the
step before it sampled, without the host waiting for them.

The engine's step (``executables.engine_step``) does this gather first, on the previous
step's result that is still on the devices; the host only says, per token, which row of
that result holds it (``token_source``, -1 for a token the host knows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


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
