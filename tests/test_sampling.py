"""The in-step sampler: greedy, filters, and draws that follow the model's distribution.

Draws are checked with a chi-square goodness-of-fit test against the distribution that
transformers' own warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``) give for the same logits. Seeds are fixed, so every test is
deterministic; ``test_the_checks_reject_broken_samplers`` shows that the same checks
reject a temperature off by 7%, a sampler that never emits the two least likely tokens,
and a top-p that keeps one token too many.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from shiftjax.sampling import sample

# Twelve tokens with probabilities from .36 down to .0005 (softmax at temperature 1).
ROW = np.array([2.0, 1.5, 1.1, 0.7, 0.3, 0.0, -0.4, -1.0, -1.6, -2.3, -3.2, -4.5], np.float32)
# 40000 draws: a temperature off by 7% gives a chi-square non-centrality of ~140 and
# dropping the two least likely tokens ~100, against a critical value of 35.7 (11 degrees
# of freedom at ALPHA). Every cell expects at least 20 draws.
DRAWS = 40_000
ALPHA = 1e-4  # the check rejects a sampler when the fit's p-value is below this


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for a chi-square variable with ``dof`` degrees of freedom
    (regularized upper incomplete gamma; scipy is not a dependency)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def hf_probs(row, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """The distribution transformers samples from: temperature, then top-k, then top-p."""
    scores = torch.tensor(np.asarray(row, np.float32))[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores.double(), dim=-1)[0].numpy()


def assert_follows(tokens: np.ndarray, expected: np.ndarray, what: str = "") -> float:
    """Fails unless ``tokens`` fit the distribution ``expected``: never a token of
    probability 0, and a chi-square p-value over the rest of at least ``ALPHA``."""
    counts = np.bincount(tokens, minlength=len(expected))
    outside = np.flatnonzero((expected == 0) & (counts > 0))
    assert not outside.size, f"{what}: drew tokens {outside.tolist()}, which the filters remove"
    support = expected > 0
    predicted = expected[support] * len(tokens)
    statistic = float((((counts[support] - predicted) ** 2) / predicted).sum())
    dof = int(support.sum()) - 1
    p_value = chi2_sf(statistic, dof) if dof else 1.0
    assert p_value >= ALPHA, (f"{what}: chi-square {statistic:.1f} on {dof} degrees of freedom, "
                              f"p = {p_value:.1e} < {ALPHA}; counts {counts.tolist()}, "
                              f"expected {np.round(expected * len(tokens)).astype(int).tolist()}")
    return p_value


@functools.lru_cache(maxsize=None)
def jitted(sampler):
    return jax.jit(sampler)


def draw(sampler=sample, *, n=DRAWS, row=ROW, temperature=1.0, top_p=1.0, top_k=0, seed0=0):
    """``n`` draws from one row, every draw with its own seed (the key of a row is its seed
    folded with its step); returns tokens and log-probabilities."""
    rows = jnp.broadcast_to(jnp.asarray(row, jnp.float32), (n, len(row)))
    fill = lambda v, dtype: jnp.full((n,), v, dtype)  # noqa: E731
    tokens, logprobs = jitted(sampler)(rows, temperature=fill(temperature, jnp.float32),
                                       top_p=fill(top_p, jnp.float32), top_k=fill(top_k, jnp.int32),
                                       seed=seed0 + jnp.arange(n, dtype=jnp.int32),
                                       step_of_seq=fill(7, jnp.int32))
    return np.asarray(tokens), np.asarray(logprobs)


# --- deliberately broken samplers: each check below must reject the one it targets -----

def hot_by_7_percent(logits, *, temperature, **rest):
    return sample(logits, temperature=temperature * 1.07, **rest)


def never_the_two_least_likely(logits, *, temperature, top_k, **rest):
    vocab = logits.shape[-1]
    return sample(logits, temperature=temperature, top_k=jnp.where(top_k > 0, top_k, vocab - 2), **rest)


def top_p_one_token_too_many(logits, *, temperature, top_p, **rest):
    """Top-p that keeps the smallest prefix reaching top_p plus the next token."""
    probs = jax.nn.softmax(logits / temperature[:, None], axis=-1)
    descending = -jnp.sort(-probs, axis=-1)
    cumulative = jnp.cumsum(descending, axis=-1)
    kept = jnp.sum(cumulative - descending < top_p[:, None], axis=-1)  # the right count
    widened = jnp.take_along_axis(cumulative, kept[:, None], axis=-1)[:, 0] - 1e-4
    return sample(logits, temperature=temperature, top_p=jnp.where(top_p < 1, widened, top_p), **rest)


# The checks, each as (name, function(sampler)); a broken sampler must fail its check.
def check_temperature(sampler, temperature=1.0):
    tokens, _ = draw(sampler, temperature=temperature)
    assert_follows(tokens, hf_probs(ROW, temperature), f"temperature {temperature}")


def check_top_p(sampler, top_p=0.8):
    tokens, _ = draw(sampler, top_p=top_p)
    assert_follows(tokens, hf_probs(ROW, top_p=top_p), f"top_p {top_p}")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.8])
def test_draws_follow_the_tempered_softmax(temperature):
    check_temperature(sample, temperature)


@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_top_k_matches_transformers(top_k):
    tokens, _ = draw(temperature=0.9, top_k=top_k)
    assert_follows(tokens, hf_probs(ROW, 0.9, top_k=top_k), f"top_k {top_k}")


# Cumulative probabilities .358 .575 .721 .819 .884 .933 .965: top_p 0.3 keeps one token,
# 0.8 four, 0.95 seven; none sits within 0.015 of a boundary.
@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_matches_transformers(top_p):
    check_top_p(sample, top_p)


@pytest.mark.parametrize("top_k,top_p", [
    (6, 0.8),   # top-p binds: 4 tokens either way
    (3, 0.95),  # top-k binds: 3 tokens
    # top-p over the top-k survivors renormalized, as transformers and vLLM compose them:
    # 2 tokens (mass before the third .703 >= .65); top-p over the whole distribution
    # would keep 3 (.575 < .65), as shiftjax/sampling.py at 170c369 did.
    (4, 0.65),
])
def test_top_k_and_top_p_together_match_transformers(top_k, top_p):
    tokens, _ = draw(temperature=1.0, top_k=top_k, top_p=top_p)
    assert_follows(tokens, hf_probs(ROW, 1.0, top_k=top_k, top_p=top_p), f"top_k {top_k} top_p {top_p}")


def test_ties_are_kept_together_and_drawn_uniformly():
    # Tokens 1, 2 and 3 tie for second place.
    row = np.array([1.5, 1.0, 1.0, 1.0, 0.0, -1.0], np.float32)
    # top_k=2 cuts inside the tie: all tied tokens survive (transformers' TopK does the same).
    tokens, _ = draw(row=row, top_k=2, n=20_000)
    assert_follows(tokens, hf_probs(row, top_k=2), "top_k 2 inside a tie")
    assert set(np.unique(tokens)) == {0, 1, 2, 3}
    # top_p reaching into the tie keeps all three tied tokens (transformers keeps the ones
    # its sort happens to put last, an arbitrary subset, so it is no oracle here).
    probs = hf_probs(row)
    tokens, _ = draw(row=row, top_p=float(probs[0] + probs[1] / 2), n=20_000)
    expected = np.where(row >= 1.0, probs, 0.0)
    assert_follows(tokens, expected / expected.sum(), "top_p ending inside a tie")
    # Greedy among exact ties picks the lowest index, every time.
    tokens, _ = draw(row=np.array([0.5, 2.0, 2.0, 2.0], np.float32), temperature=0.0, n=64)
    assert (tokens == 1).all()


def test_greedy_and_sampled_rows_in_one_batch():
    rows = np.stack([ROW, ROW[::-1], np.roll(ROW, 5)]).astype(np.float32)
    n = 3 * 20_000
    logits = jnp.asarray(np.tile(rows, (n // 3, 1)))
    which = np.arange(n) % 3
    temperature = np.where(which == 1, 0.0, np.where(which == 0, 1.0, 0.7)).astype(np.float32)
    top_k = np.where(which == 2, 4, 0).astype(np.int32)
    tokens, logprobs = jitted(sample)(logits, temperature=jnp.asarray(temperature),
                                      top_p=jnp.ones((n,), jnp.float32), top_k=jnp.asarray(top_k),
                                      seed=jnp.arange(n, dtype=jnp.int32), step_of_seq=jnp.zeros((n,), jnp.int32))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert (tokens[which == 1] == len(ROW) - 1).all(), "a greedy row sampled"
    assert_follows(tokens[which == 0], hf_probs(rows[0]), "sampled row beside greedy rows")
    assert_follows(tokens[which == 2], hf_probs(rows[2], 0.7, top_k=4), "top-k row beside greedy rows")
    # Every row's log-probability is the token's under the unfiltered, untempered model.
    model_logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(logprobs, model_logprobs[np.arange(n), tokens], rtol=1e-6, atol=1e-6)


def test_greedy_and_logprob():
    tokens, logprobs = draw(temperature=0.0, n=4)
    assert (tokens == 0).all()
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(ROW)[0], rtol=1e-6)


def test_tiny_top_p_keeps_one_token():
    tokens, _ = draw(top_p=0.01, n=200)
    assert set(tokens) == {0}


def test_a_sequence_draws_the_same_token_in_any_batch():
    batch, _ = draw(n=200, seed0=0)
    shifted, _ = draw(n=100, seed0=100)
    np.testing.assert_array_equal(batch[100:], shifted)


@pytest.mark.parametrize("check,broken", [
    (check_temperature, hot_by_7_percent),
    (check_temperature, never_the_two_least_likely),
    (check_top_p, top_p_one_token_too_many),
], ids=["temperature_x1.07", "never_two_least_likely", "top_p_one_token_too_many"])
def test_the_checks_reject_broken_samplers(check, broken):
    check(sample)  # the real sampler passes the check...
    with pytest.raises(AssertionError):  # ...and the broken one fails it
        check(broken)
