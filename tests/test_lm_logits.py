"""The LM head pads fewer than ``MIN_LOGIT_ROWS`` sampled rows and drops them again: every
row count gives the plain product's logits, from a vocabulary split over the (sp, tp) mesh,
as an untied head and as the tied embedding table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shiftjax.layouts.mesh import HEAD_AXES, make_mesh
from shiftjax.model import MIN_LOGIT_ROWS, lm_logits
from shiftjax.weights import LocalDims

D_MODEL, VOCAB_SIZE, SP, TP = 16, 50, 2, 2
BLOCK = -(-VOCAB_SIZE // (SP * TP))  # 13 rows a block: the last block holds 2 of padding


def _dims() -> LocalDims:
    return LocalDims(head_dim=4, q_heads=1, kv_slots=1, kv_slot_of_head=(0,), ffn=8, vocab=BLOCK,
                     vocab_size=VOCAB_SIZE, sp=SP, tp=TP)


@pytest.mark.parametrize("rows", [1, MIN_LOGIT_ROWS - 1, MIN_LOGIT_ROWS, MIN_LOGIT_ROWS + 1])
@pytest.mark.parametrize("tied", [False, True])
def test_every_row_count_gives_the_plain_product(rows, tied):
    mesh = make_mesh(SP, TP, jax.devices()[:SP * TP])
    rng = np.random.default_rng(rows)
    hidden = jnp.asarray(rng.standard_normal((rows, D_MODEL)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((SP * TP * BLOCK, D_MODEL)), jnp.float32)  # [vocab (padded), d]
    dims = _dims()
    if tied:
        weight, spec = table, P(HEAD_AXES, None)
        run = lambda h, w: lm_logits(h, w, None, dims)  # noqa: E731
    else:
        weight, spec = table.T, P(None, HEAD_AXES)
        run = lambda h, w: lm_logits(h, None, w, dims)  # noqa: E731
    logits = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(), spec), out_specs=P(),
                                 check_vma=False))(hidden, weight)
    expected = np.asarray(hidden, np.float64) @ np.asarray(table, np.float64)[:VOCAB_SIZE].T
    assert logits.shape == (rows, VOCAB_SIZE) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)
