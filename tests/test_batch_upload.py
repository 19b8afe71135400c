"""A step's batch packed into two int32 arrays on the host and unpacked in a compiled
function gives back every field bit for bit (float32 ones included), and the token
sources padded with -1."""

import jax
import numpy as np

from shiftjax.batch import empty_batch
from shiftjax.serving.engine.batch_upload import TOKEN_ROWS, pack_batch, unpack_batch, unpack_sequences


def filled_batch(tokens=8, seqs=3, max_pages=5):
    rng = np.random.default_rng(0)
    batch = empty_batch(tokens, seqs, max_pages)
    for name in ("token_ids", "positions", "slot_mapping", "seq_lens", "sample_index", "top_k", "seed",
                 "top_logprobs"):
        getattr(batch, name)[:] = rng.integers(-1, 1000, getattr(batch, name).shape)
    batch.query_start[:] = np.sort(rng.integers(0, tokens, seqs + 1))
    batch.page_table[:] = rng.integers(0, 50, batch.page_table.shape)
    batch.temperature[:] = [0.0, 0.7, 1.3]
    batch.top_p[:] = [1.0, 0.9, np.nextafter(np.float32(0.5), np.float32(1))]  # one ulp matters
    batch.min_p[:] = [0.0, -0.0, 0.05]
    return batch


def test_unpacked_equals_packed():
    batch = filled_batch()
    source = np.array([-1, 2, 0], np.int32)  # shorter than the batch: the rest is -1
    upload = pack_batch(batch, source)
    assert upload.tokens.shape == (len(TOKEN_ROWS) + 1, 8) and upload.sequences.shape == (4, 9 + 5)
    unpacked, token_source = jax.jit(unpack_batch)(upload)
    np.testing.assert_array_equal(np.asarray(token_source), [-1, 2, 0, -1, -1, -1, -1, -1])
    for name, expected in vars(batch).items():
        got = np.asarray(getattr(unpacked, name))
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32), err_msg=name)
    alone = jax.jit(unpack_sequences)(upload.sequences)
    np.testing.assert_array_equal(np.asarray(alone.top_p).view(np.int32), batch.top_p.view(np.int32))


def test_without_sources_every_token_is_known():
    upload = pack_batch(filled_batch())
    np.testing.assert_array_equal(upload.tokens[len(TOKEN_ROWS)], -1)
