"""min_p against transformers' warpers, top_logprobs against a numpy log-softmax top-k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

from shiftjax.sampling import filter_logits, sample, top_logprobs

ROWS, VOCAB = 6, 300
MIN_PS = [0.01, 0.05, 0.1, 0.3, 0.7, 1.0]


def random_logits(seed):
    return np.random.default_rng(seed).normal(0.0, 3.0, (ROWS, VOCAB)).astype(np.float32)


def kept(logits, temperature=1.0, top_k=0, min_p=MIN_PS):
    rows = logits.shape[0]
    filtered = jax.jit(filter_logits)(jnp.asarray(logits / temperature), jnp.ones(rows, jnp.float32),
                                      jnp.full(rows, top_k, jnp.int32), jnp.asarray(min_p, jnp.float32))
    return np.isfinite(np.asarray(filtered))


def transformers_kept(logits, temperature=1.0, top_k=0, min_p=MIN_PS):
    rows = []
    for row, p in zip(logits, min_p):
        scores = torch.from_numpy(row[None].copy())
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        rows.append(torch.isfinite(MinPLogitsWarper(p)(None, scores))[0].numpy())
    return np.stack(rows)


def assert_same_kept(ours, theirs, logits, temperature):
    """Equal masks, except for tokens within float rounding of the min_p cut."""
    scaled = logits / temperature
    log_probs = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - scaled.max(-1, keepdims=True)
    cut = log_probs.max(-1, keepdims=True) + np.log(np.asarray(MIN_PS))[:, None]
    ambiguous = np.abs(log_probs - cut) < 1e-4
    assert ((ours == theirs) | ambiguous).all()
    assert ours.sum() < ours.size  # the filter removed something


@pytest.mark.parametrize("seed,temperature", [(0, 1.0), (1, 0.7), (2, 1.8)])
def test_min_p_matches_transformers(seed, temperature):
    logits = random_logits(seed)
    ours, theirs = kept(logits, temperature), transformers_kept(logits, temperature)
    assert_same_kept(ours, theirs, logits, temperature)
    counts = ours.sum(-1)
    assert counts[-1] == 1 and counts[0] > 1  # min_p 1 keeps the top token only


def test_min_p_composes_with_top_k_as_transformers_does():
    logits = random_logits(3)
    ours, theirs = kept(logits, top_k=10), transformers_kept(logits, top_k=10)
    assert_same_kept(ours, theirs, logits, 1.0)
    assert (ours.sum(-1) <= 10).all()


def test_min_p_zero_and_defaults_keep_everything():
    logits = random_logits(4)
    assert kept(logits, min_p=[0.0] * ROWS).all()


def test_draws_with_min_p_stay_in_the_kept_set():
    n = 2000
    logits = jnp.asarray(np.tile(random_logits(5)[:1], (n, 1)))
    min_p = 0.2
    tokens, logprobs = jax.jit(sample)(logits, jnp.ones(n), jnp.ones(n), jnp.zeros(n, jnp.int32),
                                       jnp.arange(n, dtype=jnp.int32), jnp.zeros(n, jnp.int32),
                                       min_p=jnp.full(n, min_p))
    probs = np.asarray(jax.nn.softmax(logits[0]))
    allowed = set(np.flatnonzero(probs >= min_p * probs.max()).tolist())
    drawn = set(np.asarray(tokens).tolist())
    assert drawn <= allowed and len(drawn) >= min(2, len(allowed))
    # the reported log-probability is the model's, not the filtered distribution's
    np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[np.asarray(tokens)]), rtol=1e-4, atol=1e-5)


def test_top_logprobs_match_numpy():
    logits = random_logits(6)
    wanted = jnp.asarray([True, False, False, False, False, False])
    ids, values = jax.jit(top_logprobs, static_argnums=2)(jnp.asarray(logits), wanted, 20)
    shifted = logits - logits.max(-1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected_ids = np.argsort(-reference, axis=-1)[:, :20]
    np.testing.assert_array_equal(np.asarray(ids), expected_ids)
    np.testing.assert_allclose(np.asarray(values), np.take_along_axis(reference, expected_ids, -1),
                               rtol=1e-5, atol=1e-5)


def test_top_logprobs_are_skipped_when_no_row_asks():
    ids, values = jax.jit(top_logprobs, static_argnums=2)(jnp.asarray(random_logits(7)),
                                                          jnp.zeros(ROWS, bool), 20)
    assert not np.asarray(ids).any() and not np.asarray(values).any()
