"""Every PartitionSpec of the model, in one place.

Head blocks, vocabulary blocks and KV-cache slots are all split over ``HEAD_AXES =
("tp", "sp")``, so block ``b`` of each lives on device ``(s, t)`` with ``b = t * sp + s`` in
both modes. Step inputs (token metadata) and outputs (sampled tokens) are replicated.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from shiftjax.layouts.mesh import HEAD_AXES, TP

REPLICATED = P()


def blocks_spec(ndim: int) -> P:
    """``[layers, P, ...]`` block weights: the block axis over the head axes (TP view)."""
    return P(None, HEAD_AXES, *([None] * (ndim - 2)))


def tp_shard_spec(ndim: int) -> P:
    """``[layers, tp, ...]``: one TP shard per ``tp`` index, replicated over ``sp`` (SP view)."""
    return P(None, TP, *([None] * (ndim - 2)))


EMBED_SPEC = P(HEAD_AXES, None)  # [vocab, d_model], vocabulary rows over the head axes
LM_HEAD_SPEC = P(None, HEAD_AXES)  # [d_model, vocab]
CACHE_SPEC = P(None, HEAD_AXES, None, None, None)  # [layers, kv_slots, pages, page_size, head_dim]
