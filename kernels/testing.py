"""Random ragged batches and a float64 NumPy oracle, for the kernel tests (CPU and GPU).

Test support only; nothing in the model imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .metadata import AttentionMetadata


@dataclass(frozen=True)
class RaggedCase:
    q: np.ndarray  # [T, q_heads, head_dim]
    k_cache: np.ndarray  # [layers, kv_slots, num_pages, page_size, head_dim]
    v_cache: np.ndarray
    query_start: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    page_table: np.ndarray  # [B, max_pages]
    layer: int

    def metadata(self, xp=np) -> AttentionMetadata:
        return AttentionMetadata(
            xp.asarray(self.query_start), xp.asarray(self.seq_lens), xp.asarray(self.page_table)
        )


def deal_pages(rng: np.random.Generator, seq_lens: list[int], page_size: int, *,
               max_pages: int | None = None, num_pages: int | None = None, extra_pages: int = 0):
    """A page table giving each sequence the pages its length needs, dealt out shuffled from
    pages ``1 .. num_pages - 1`` (page 0 stays the scratch page; unused entries are 0).
    Returns ``(page_table, num_pages)``; the sizes default to as small as the lengths allow."""
    pages_needed = [-(-s // page_size) for s in seq_lens]
    max_pages = max_pages or max(1, max(pages_needed, default=1))
    num_pages = num_pages or 1 + sum(pages_needed) + extra_pages
    assert max(pages_needed, default=0) <= max_pages and 1 + sum(pages_needed) <= num_pages
    free = rng.permutation(np.arange(1, num_pages))
    page_table = np.zeros((len(seq_lens), max_pages), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        page_table[b, :n] = free[used : used + n]
        used += n
    return page_table, num_pages


def random_case(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    cached_lens: list[int],
    q_heads: int,
    kv_slots: int,
    head_dim: int,
    page_size: int,
    layers: int = 2,
    pad_tokens: int = 0,
    extra_pages: int = 2,
    num_tokens: int | None = None,
    max_pages: int | None = None,
    num_pages: int | None = None,
    dtype=np.float32,
) -> RaggedCase:
    """A batch whose sequence ``b`` has ``cached_lens[b]`` cached and ``q_lens[b]`` new tokens.

    Pages are dealt out shuffled (page 0 stays the scratch page); unused page-table
    entries are 0; the cache holds random values everywhere, scratch page included.
    ``num_tokens``, ``max_pages``, ``num_pages`` fix the padded shapes (so that one compiled
    function serves many cases); by default they are as small as the case allows.
    """
    seq_lens = [c + n for c, n in zip(cached_lens, q_lens)]
    page_table, num_pages = deal_pages(rng, seq_lens, page_size, max_pages=max_pages,
                                       num_pages=num_pages, extra_pages=extra_pages)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = num_tokens or int(query_start[-1]) + pad_tokens
    assert tokens >= query_start[-1]
    shape = (layers, kv_slots, num_pages, page_size, head_dim)
    return RaggedCase(
        q=rng.standard_normal((tokens, q_heads, head_dim)).astype(dtype),
        k_cache=rng.standard_normal(shape).astype(dtype),
        v_cache=rng.standard_normal(shape).astype(dtype),
        query_start=query_start,
        seq_lens=np.asarray(seq_lens, np.int32),
        page_table=page_table,
        layer=int(rng.integers(layers)),
    )


def numpy_attention(case: RaggedCase, *, sm_scale: float, slot_of_head) -> np.ndarray:
    """Float64 attention, one token at a time, straight from the definition."""
    q = np.asarray(case.q, np.float64)
    k_cache = np.asarray(case.k_cache, np.float64)[case.layer]
    v_cache = np.asarray(case.v_cache, np.float64)[case.layer]
    page_size = k_cache.shape[2]
    out = np.zeros_like(q)
    for b in range(len(case.seq_lens)):
        start, end = case.query_start[b], case.query_start[b + 1]
        for j, t in enumerate(range(start, end)):
            pos = case.seq_lens[b] - (end - start) + j
            keys = np.arange(pos + 1)
            pages = case.page_table[b, keys // page_size]
            for h, slot in enumerate(slot_of_head):
                k = k_cache[slot, pages, keys % page_size]
                v = v_cache[slot, pages, keys % page_size]
                s = k @ q[t, h] * sm_scale
                p = np.exp(s - s.max())
                out[t, h] = p @ v / p.sum()
    return out
