"""The in-step sampler: greedy, filters, and draws that follow the model's distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from shiftjax.sampling import sample

LOGITS = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], jnp.float32)


def draw(n, temperature=1.0, top_p=1.0, top_k=0, logits=LOGITS):
    rows = jnp.repeat(logits, n, axis=0)
    fill = lambda v, dtype: jnp.full((n,), v, dtype)  # noqa: E731
    tokens, logprobs = jax.jit(sample)(rows, fill(temperature, jnp.float32), fill(top_p, jnp.float32),
                                       fill(top_k, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                                       fill(7, jnp.int32))
    return np.asarray(tokens), np.asarray(logprobs)


def test_greedy_and_logprob():
    tokens, logprobs = draw(4, temperature=0.0)
    assert (tokens == 0).all()
    np.testing.assert_allclose(logprobs, jax.nn.log_softmax(LOGITS)[0, 0], rtol=1e-6)


def test_draws_follow_the_softmax():
    tokens, _ = draw(4000)
    freq = np.bincount(tokens, minlength=6) / len(tokens)
    expected = np.asarray(jax.nn.softmax(LOGITS)[0])
    assert np.abs(freq - expected).max() < 0.03


def test_top_k_and_top_p_cut_the_tail():
    tokens, _ = draw(2000, top_k=2)
    assert set(tokens) == {0, 1}
    probs = np.asarray(jax.nn.softmax(LOGITS)[0])  # about .53 .20 .12 .07 .03 .00
    tokens, _ = draw(2000, top_p=float(probs[0] + probs[1] / 2))  # needs the first two
    assert set(tokens) == {0, 1}
    tokens, _ = draw(200, top_p=0.01)  # at least one token survives
    assert set(tokens) == {0}


def test_temperature_sharpens():
    hot, _ = draw(2000, temperature=2.0)
    cold, _ = draw(2000, temperature=0.25)
    assert (cold == 0).mean() > 0.95 > (hot == 0).mean()
