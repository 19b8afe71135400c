"""The compiled token fill of asynchronous scheduling against its host reference, on a
2 x 2 mesh, for every (token bucket, previous sequence bucket) a ladder compiles."""

import numpy as np
import pytest

from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.serving.executables import BucketLadder, place_replicated
from shiftjax.serving.token_fills import TokenFills, take_sampled_tokens_reference
from shiftjax.weights import shard_params

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def weights():
    return shard_params(random_params(CONFIG, seed=1), CONFIG, make_mesh(2, 2))


def test_fills_match_the_reference_for_every_shape(weights):
    ladder = BucketLadder((4, 16), (1, 4))
    fills = TokenFills.compile(weights, ladder, max_top_logprobs=2)
    assert set(fills.compiled) == {(4, 1), (4, 4), (16, 1), (16, 4)}
    rng = np.random.default_rng(0)
    for (tokens, previous_seqs) in fills.compiled:
        token_ids = rng.integers(0, 96, tokens).astype(np.int32)
        packed = rng.integers(0, 96, (previous_seqs, 6)).astype(np.int32)
        used = rng.integers(1, tokens + 1)  # the unpadded step: the fill pads its sources with -1
        source = np.where(rng.random(used) < 0.5, rng.integers(0, previous_seqs, used), -1).astype(np.int32)
        got = fills(place_replicated(token_ids, weights), place_replicated(packed, weights), source, weights)
        padded = np.concatenate([source, np.full(tokens - used, -1, np.int32)])
        expected = take_sampled_tokens_reference(token_ids, packed, padded)
        np.testing.assert_array_equal(np.asarray(got), expected)
        assert got.sharding.is_fully_replicated
