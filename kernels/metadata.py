"""Step metadata and the query-head to KV-slot map shared by every attention path.

Pure index arithmetic on small arrays (sizes of order tokens or sequences); no cache-sized
work happens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Int


class AttentionMetadata(NamedTuple):
    """Where each sequence's queries sit in the flat token batch and where its keys live.

    A NamedTuple, so it is a pytree: it passes through ``jit``, ``scan`` and ``shard_map``.

    query_start: ``[B + 1]`` int32 token offsets of each sequence's queries in the flat
        batch; non-decreasing; ``query_start[B] <= T``; tokens ``>= query_start[B]`` are
        padding.
    seq_lens: ``[B]`` int32 context length of each sequence after this step (cached plus
        new tokens); 0 for an empty (padding) sequence.
    page_table: ``[B, max_pages]`` int32 page ids; entries past a sequence's pages are
        arbitrary valid ids (0, the scratch page, say).
    """

    query_start: Int[Array, "seqs_plus_one"]
    seq_lens: Int[Array, "seqs"]
    page_table: Int[Array, "seqs max_pages"]


def kv_slot_map(q_heads: int, kv_slots: int, kv_slot_of_head: Sequence[int] | None) -> tuple[int, ...]:
    """The cache slot each query head reads, checked; ``None`` means uniform GQA groups."""
    if kv_slot_of_head is None:
        if q_heads % kv_slots:
            raise ValueError(
                f"q has {q_heads} heads and the cache {kv_slots} KV slots; without "
                "kv_slot_of_head the heads must divide evenly into the slots. Pass "
                "kv_slot_of_head, one slot index per query head."
            )
        group = q_heads // kv_slots
        return tuple(h // group for h in range(q_heads))
    slots = tuple(int(s) for s in kv_slot_of_head)
    if len(slots) != q_heads:
        raise ValueError(
            f"kv_slot_of_head has {len(slots)} entries but q has {q_heads} heads; give "
            "one cache slot per query head."
        )
    if any(not 0 <= s < kv_slots for s in slots):
        raise ValueError(
            f"kv_slot_of_head={slots} names a slot outside the cache's {kv_slots} KV slots."
        )
    return slots


def heads_by_slot(slot_of_head: tuple[int, ...], kv_slots: int) -> tuple[tuple[int, ...], ...]:
    """For each cache slot, the query heads that read it, in head order."""
    return tuple(tuple(h for h, s in enumerate(slot_of_head) if s == j) for j in range(kv_slots))


def token_layout(
    metadata: AttentionMetadata, num_tokens: int
) -> tuple[Int[Array, "tokens"], Int[Array, "tokens"], jnp.ndarray]:
    """Per flat token: its sequence, its position in that sequence, and whether it is real.

    A token's position is ``seq_lens[b] - q_len[b] + j`` for the ``j``-th query of
    sequence ``b``; it sees keys at positions ``0 .. position``.
    """
    query_start = metadata.query_start.astype(jnp.int32)
    num_seqs = metadata.seq_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    # Sequence b owns tokens query_start[b] .. query_start[b+1]-1; counting the ends at or
    # before t skips empty sequences for free.
    seq = jnp.searchsorted(query_start[1:], tokens, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, num_seqs - 1)
    valid = tokens < query_start[num_seqs]
    q_len = query_start[seq + 1] - query_start[seq]
    position = metadata.seq_lens[seq] - q_len + (tokens - query_start[seq])
    return seq, position.astype(jnp.int32), valid
