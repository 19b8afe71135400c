"""The process-to-data mapping: which attention heads and KV heads each device holds.

Heads are cut into ``P = sp * tp`` head blocks; block ``b = t * sp + s`` lives on device
``(s, t)`` in both modes (the head order ``("tp", "sp")``; docs/architecture.md, "The cache"). Inside a block the
order of heads is free, because the query, output and cache columns of a head move
together; we use that freedom to give every block the *same* local query-head → KV-slot
map, which the SPMD program needs (one program, one static map).

- Query heads are padded to ``P * q_per_block``; a padded head has zero rows in ``wq``
  and ``wo``, so it contributes exactly nothing (vLLM and Arctic refuse ``H % P != 0``;
  SmolLM2-135M has 9 heads).
- Each block stores only the KV heads its query heads read, ``kv_per_block`` slots,
  duplicating a KV head on several blocks where ``n_kv_heads < P`` (the paper's cache
  replication). Where blocks straddle GQA groups, each block's groups are laid out
  largest first and every slot gets the largest group size seen at its rank, so the map
  is uniform; ``q_per_block`` grows (more zero heads) only if that does not fit.

The first design took the largest uniform group size ``g`` dividing ``q_per_block``; that
rule gives SmolLM2 at P = 2 five KV slots per device, this one two.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where every query head and KV head lives. All tables are static tuples.

    query_head_of[b][i]: the model's query head at local position ``i`` of block ``b``, or -1
      for a zero (padding) head.
    kv_head_of_slot[b][j]: the model's KV head stored in local slot ``j`` of block ``b``.
    kv_slot_of_head[i]: the local slot that local query position ``i`` reads (same in every block).
    """

    n_heads: int
    n_kv_heads: int
    sp: int
    tp: int
    q_per_block: int
    kv_per_block: int
    query_head_of: tuple[tuple[int, ...], ...]
    kv_head_of_slot: tuple[tuple[int, ...], ...]
    kv_slot_of_head: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return self.sp * self.tp

    @property
    def kv_slots(self) -> int:
        """Global number of KV-cache slots (the cache's head axis)."""
        return self.num_blocks * self.kv_per_block


def head_layout(n_heads: int, n_kv_heads: int, sp: int, tp: int) -> HeadLayout:
    """Computes the mapping for ``n_heads`` query and ``n_kv_heads`` KV heads over (sp, tp)."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("sp", sp), ("tp", tp)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    blocks = sp * tp
    group = n_heads // n_kv_heads
    q_per_block = math.ceil(n_heads / blocks)
    while True:
        block_groups = _groups_per_block(n_heads, group, blocks, q_per_block)
        kv_per_block = max(1, max(len(g) for g in block_groups))
        slot_sizes = [
            max((len(g[j][1]) for g in block_groups if j < len(g)), default=0)
            for j in range(kv_per_block)
        ]
        if sum(slot_sizes) <= q_per_block:
            break
        q_per_block += 1
    # Spare positions (all padding) go to the last slot, keeping each slot's heads contiguous.
    slot_sizes[-1] += q_per_block - sum(slot_sizes)
    kv_slot_of_head = tuple(j for j, size in enumerate(slot_sizes) for _ in range(size))

    query_head_of, kv_head_of_slot = [], []
    for groups in block_groups:
        heads, slots = [], []
        for j, size in enumerate(slot_sizes):
            kv_head, members = groups[j] if j < len(groups) else (groups[0][0] if groups else 0, [])
            heads += members + [-1] * (size - len(members))
            slots.append(kv_head)
        query_head_of.append(tuple(heads))
        kv_head_of_slot.append(tuple(slots))
    return HeadLayout(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        sp=sp,
        tp=tp,
        q_per_block=q_per_block,
        kv_per_block=kv_per_block,
        query_head_of=tuple(query_head_of),
        kv_head_of_slot=tuple(kv_head_of_slot),
        kv_slot_of_head=kv_slot_of_head,
    )


def _groups_per_block(n_heads: int, group: int, blocks: int, q_per_block: int):
    """For each block, its (kv_head, [query heads]) groups, largest first (stable)."""
    out = []
    for b in range(blocks):
        heads = range(b * q_per_block, min(n_heads, (b + 1) * q_per_block))
        groups: dict[int, list[int]] = {}
        for h in heads:
            groups.setdefault(h // group, []).append(h)
        out.append(sorted(groups.items(), key=lambda item: -len(item[1])))
    return out
