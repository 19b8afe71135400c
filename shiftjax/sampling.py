"""Sampling on the device: greedy, temperature, top-k, top-p and min-p, one key per
sequence, within the tokens a structured-output grammar allows; the model's most likely
alternatives for ``top_logprobs``; and the packing of both into the one small int32 array a
step sends to the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from shiftjax.batch import StepBatch


def greedy(logits: Float[Array, "seqs vocab"], allowed: Bool[Array, "seqs vocab"] | None = None
           ) -> tuple[Int[Array, "seqs"], Float[Array, "seqs"]]:
    """The most likely token of every row (of the ``allowed`` ones, if given) and its
    log-probability under the model."""
    logits = logits.astype(jnp.float32)
    chosen_from = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
    tokens = jnp.argmax(chosen_from, axis=-1).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def allowed_tokens(bitmask: Int[Array, "seqs words"], vocab: int) -> Bool[Array, "seqs vocab"]:
    """A grammar's bitmask unpacked: token ``i`` of a row is allowed when bit ``i % 32`` of
    the row's word ``i // 32`` is set (llguidance's layout; ``serving/engine/grammar.py``)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool)


def sample(
    logits: Float[Array, "seqs vocab"],
    temperature: Float[Array, "seqs"],
    top_p: Float[Array, "seqs"],
    top_k: Int[Array, "seqs"],
    seed: Int[Array, "seqs"],
    step_of_seq: Int[Array, "seqs"],
    *,
    min_p: Float[Array, "seqs"] | None = None,
    allowed: Bool[Array, "seqs vocab"] | None = None,
    skip_draw_if_greedy: bool = True,
) -> tuple[Int[Array, "seqs"], Float[Array, "seqs"]]:
    """Returns the sampled token of every row and its log-probability under the model
    (before temperature, filters and grammar, as vLLM reports it).

    ``allowed`` (a grammar's tokens, :func:`allowed_tokens`): every other token's logit is
    ``-inf`` before anything is chosen, greedy included, so that the filters and the draw
    see only what the grammar allows.

    ``temperature == 0`` is greedy; ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    disable those filters. The key of row ``b`` is ``fold_in(key(seed[b]), step_of_seq[b])``,
    so a sequence's samples are reproducible whatever else shares its batch.

    ``skip_draw_if_greedy``: an all-greedy batch skips the filters (a ``lax.cond``). XLA's
    GPU conditional copies its predicate to the host and blocks the host until the device
    reaches it, so code that must not stall the host passes False and draws always.
    """
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    most_likely = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if min_p is None:
        min_p = jnp.zeros_like(temperature)
    # The filters sort the vocabulary (0.3 ms a step at 8 sequences, 1.1 ms at 64, 128k
    # vocabulary, measured on an H200; benchmarks/README.md, "Sampling outside the step");
    # an all-greedy batch skips them.

    def draw():
        safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
        filtered = filter_logits(logits / safe_temperature[:, None], top_p, top_k, min_p)
        sampled = _gumbel_max(filtered, seed, step_of_seq)
        return jnp.where(temperature > 0, sampled, most_likely)

    if skip_draw_if_greedy:
        tokens = lax.cond(jnp.any(temperature > 0), draw, lambda: most_likely)
    else:
        tokens = draw()
    chosen_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen_logprob


def filter_logits(
    scaled: Float[Array, "seqs vocab"],
    top_p: Float[Array, "seqs"],
    top_k: Int[Array, "seqs"],
    min_p: Float[Array, "seqs"],
) -> Float[Array, "seqs vocab"]:
    """``scaled`` (logits already divided by the temperature) with the tokens that top-k,
    min-p and top-p remove set to ``-inf``, composed as vLLM composes them: top-k and
    min-p (a token survives when its probability is at least ``min_p`` times the most
    likely one's) are thresholds on the same values, and top-p then keeps the smallest
    prefix whose mass, renormalised over the survivors, reaches ``top_p``. The most likely
    token always survives."""
    descending = -jnp.sort(-scaled, axis=-1)
    vocab = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)
    # p >= min_p * p_max  <=>  logit >= logit_max + log(min_p); log(0) = -inf keeps all.
    min_p_value = descending[:, :1] + jnp.log(min_p)[:, None]
    cut = jnp.maximum(kth_value, min_p_value)
    survivors = jnp.where(descending >= cut, descending, -jnp.inf)
    sorted_probs = jax.nn.softmax(survivors, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (descending >= cut)
    last_kept = jnp.maximum(jnp.sum(keep_sorted, axis=-1) - 1, 0)
    p_threshold = jnp.take_along_axis(descending, last_kept[:, None], axis=-1)
    threshold = jnp.maximum(cut, p_threshold)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _gumbel_max(
    filtered: Float[Array, "seqs vocab"], seed: Int[Array, "seqs"], step_of_seq: Int[Array, "seqs"]
) -> Int[Array, "seqs"]:
    """A draw from ``softmax(filtered)`` per row, with one key per row."""
    vocab = filtered.shape[-1]

    def gumbel(seed_b, step_b):
        key = jax.random.fold_in(jax.random.key(seed_b.astype(jnp.uint32)), step_b)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    noise = jax.vmap(gumbel)(seed, step_of_seq)
    return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)


def top_logprobs(
    logits: Float[Array, "seqs vocab"],
    wanted: Bool[Array, "seqs"],
    count: int,
    *,
    skip_if_unwanted: bool = True,
) -> tuple[Int[Array, "seqs count"], Float[Array, "seqs count"]]:
    """The ``count`` most likely tokens of every row and their log-probabilities under the
    model, most likely first; zeros when no row of the batch asked (``wanted``), so a step
    without ``top_logprobs`` requests skips the top-k over the vocabulary (a ``lax.cond``:
    one executable serves both, where a static choice would double the executables;
    ``skip_if_unwanted=False`` computes them always, as :func:`sample` explains)."""

    def compute():
        values, ids = lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), count)
        return ids.astype(jnp.int32), values

    def skip():
        rows = logits.shape[0]
        return jnp.zeros((rows, count), jnp.int32), jnp.zeros((rows, count), jnp.float32)

    return lax.cond(jnp.any(wanted), compute, skip) if skip_if_unwanted else compute()


def pack_samples(logits: Float[Array, "seqs vocab"], batch: StepBatch, max_top_logprobs: int, *,
                 bitmask: Int[Array, "seqs words"] | None = None,
                 skip_unneeded: bool = True) -> Int[Array, "seqs columns"]:
    """Samples every row with its sequence's parameters from ``batch``, within ``bitmask``'s
    allowed tokens if given, and packs the result as ``[seqs, 2 + 2 * max_top_logprobs]``
    int32: the token, the bit pattern of its float32 log-probability, then the
    ``max_top_logprobs`` most likely tokens' ids and their log-probability bits (all under
    the model, unmasked). ``skip_unneeded``: see :func:`sample`."""
    allowed = None if bitmask is None else allowed_tokens(bitmask, logits.shape[-1])
    tokens, logprobs = sample(logits, batch.temperature, batch.top_p, batch.top_k, batch.seed, batch.seq_lens,
                              min_p=batch.min_p, allowed=allowed, skip_draw_if_greedy=skip_unneeded)
    columns = [tokens[:, None], lax.bitcast_convert_type(logprobs, jnp.int32)[:, None]]
    if max_top_logprobs:
        top_ids, top_values = top_logprobs(logits, batch.top_logprobs > 0, max_top_logprobs,
                                           skip_if_unwanted=skip_unneeded)
        columns += [top_ids, lax.bitcast_convert_type(top_values, jnp.int32)]
    return jnp.concatenate(columns, axis=1)


def pack_greedy(logits: Float[Array, "seqs vocab"], max_top_logprobs: int,
                bitmask: Int[Array, "seqs words"] | None = None) -> Int[Array, "seqs columns"]:
    """:func:`pack_samples` of an all-greedy batch that wants no alternatives (their
    columns zero), with no conditional and no sort."""
    tokens, logprobs = greedy(logits, None if bitmask is None else allowed_tokens(bitmask, logits.shape[-1]))
    zeros = jnp.zeros((logits.shape[0], 2 * max_top_logprobs), jnp.int32)
    return jnp.concatenate([tokens[:, None], lax.bitcast_convert_type(logprobs, jnp.int32)[:, None], zeros], axis=1)
