"""The token fill of asynchronous scheduling against its host reference, compiled for
shapes a ladder meets (the previous result has the steps' result rows)."""

import jax
import numpy as np
import pytest

from shiftjax.serving.engine.token_fills import take_sampled_tokens, take_sampled_tokens_reference


@pytest.mark.parametrize("tokens,previous_rows", [(1, 1), (4, 4), (16, 4), (64, 64)])
def test_fills_match_the_reference(tokens, previous_rows):
    rng = np.random.default_rng(tokens * 100 + previous_rows)
    token_ids = rng.integers(0, 96, tokens).astype(np.int32)
    packed = rng.integers(100, 196, (previous_rows, 6)).astype(np.int32)  # never a host token
    source = np.where(rng.random(tokens) < 0.5, rng.integers(0, previous_rows, tokens), -1).astype(np.int32)
    source[0] = previous_rows - 1  # at least one taken, from the last row
    got = np.asarray(jax.jit(take_sampled_tokens)(token_ids, packed, source))
    np.testing.assert_array_equal(got, take_sampled_tokens_reference(token_ids, packed, source))
    np.testing.assert_array_equal(got != token_ids, source >= 0)
