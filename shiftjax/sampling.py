"""Sampling inside the step: greedy, temperature, top-k and top-p, one key per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int


def sample(
    logits: Float[Array, "seqs vocab"],
    temperature: Float[Array, "seqs"],
    top_p: Float[Array, "seqs"],
    top_k: Int[Array, "seqs"],
    seed: Int[Array, "seqs"],
    step_of_seq: Int[Array, "seqs"],
) -> tuple[Int[Array, "seqs"], Float[Array, "seqs"]]:
    """Returns the sampled token of every row and its log-probability under the model.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those
    filters. The key of row ``b`` is ``fold_in(key(seed[b]), step_of_seq[b])``, so a
    sequence's samples are reproducible whatever else shares its batch.
    """
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The filters sort the vocabulary (0.4-1.0 ms a step at 128k on the H200,
    # benchmarks/README.md); an all-greedy batch skips them.

    def draw():
        sampled = _filtered_sample(logits, temperature, top_p, top_k, seed, step_of_seq)
        return jnp.where(temperature > 0, sampled, greedy)

    tokens = lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
    chosen_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen_logprob


def _filtered_sample(logits, temperature, top_p, top_k, seed, step_of_seq):
    """Temperature, top-k and top-p, then a Gumbel-max draw with one key per row."""
    safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_temperature[:, None]
    descending = -jnp.sort(-scaled, axis=-1)
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)
    # top-p keeps the smallest prefix whose probability reaches top_p (at least one token).
    sorted_probs = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None]
    last_kept = jnp.sum(keep_sorted, axis=-1) - 1
    p_threshold = jnp.take_along_axis(descending, last_kept[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, p_threshold)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def gumbel(seed_b, step_b):
        key = jax.random.fold_in(jax.random.key(seed_b.astype(jnp.uint32)), step_b)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    noise = jax.vmap(gumbel)(seed, step_of_seq)
    return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)
