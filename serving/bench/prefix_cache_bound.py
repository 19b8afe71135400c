"""The best prefix-cache hit rate a workload allows: what an LRU cache of a given size could
reach on the requests of a run, to read beside the hit rate the server measured.

A prompt is a chain of blocks. A cache holds blocks keyed by the whole prefix up to and
including them (a block's key says what came before it, as vLLM's chained block hashes
do), so a request hits the longest run of its leading blocks still cached, and no block
after its first miss. Hit rate: hit tokens over prompt tokens.

The cache is the best one of its size could be: requests go in send order, each one's
blocks are cached as it is sent (none is held back by a request still running), and an
eviction takes the least recently used block. A request's own blocks are touched last to
first, so that its first block is the most recent and its tail goes first (vLLM frees a
request's blocks tail first for the same reason: a cached tail without its head can never
hit).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockChain:
    """One prompt as cache blocks: ``keys[i]`` names the prefix up to and including block
    ``i``, ``tokens[i]`` is how many prompt tokens block ``i`` holds."""

    keys: tuple[int, ...]
    tokens: tuple[int, ...]


class _PrefixKeys:
    """Exact prefix keys: ``(key of the prefix before, this block)`` to a small int, one
    dict for the chains of one computation (no hash collisions, unlike a hash of tokens)."""

    def __init__(self):
        self._keys: dict[tuple, int] = {}

    def chain(self, blocks) -> tuple[int, ...]:
        key, keys = -1, []
        for block in blocks:
            key = self._keys.setdefault((key, block), len(self._keys))
            keys.append(key)
        return tuple(keys)


def lru_hit_tokens(chains: Sequence[BlockChain], capacity_blocks: int | None,
                   inserted: Sequence[BlockChain] | None = None) -> list[int]:
    """For each chain, in order, the tokens of its leading blocks found in an LRU cache of
    ``capacity_blocks`` blocks (``None``: infinite) that every earlier chain went through.
    ``inserted[i]``: what request ``i`` leaves in the cache, when more than its lookup (the
    blocks its answer filled too, which a server that caches generated pages keeps)."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"--cache-blocks must be >= 0, got {capacity_blocks}")
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = []
    for chain, insert in zip(chains, inserted or chains):
        hit = 0
        for key, tokens in zip(chain.keys, chain.tokens):
            if key not in cache:
                break
            hit += tokens
        hits.append(hit)
        for key in reversed(insert.keys):
            cache[key] = None
            cache.move_to_end(key)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def hash_id_chains(hash_ids: Sequence[Sequence[int]], prompt_lens: Sequence[int], block_size: int) -> list[BlockChain]:
    """Chains of hash-id traces: one block per id, ``block_size`` tokens, the last one
    partial when the prompt ends inside it (only the ids a prompt of that length covers
    count). Equal ids are equal blocks; a partial block equals only a partial block of the
    same id and length (a trace clipped by --max-input-len cuts blocks short)."""
    keys = _PrefixKeys()
    chains = []
    for ids, length in zip(hash_ids, prompt_lens):
        count = math.ceil(length / block_size)
        if len(ids) < count:
            raise ValueError(f"a prompt of {length} tokens needs {count} hash ids of {block_size}-token blocks, "
                             f"the trace gives {len(ids)}")
        tokens = [block_size] * count
        tokens[-1] = length - block_size * (count - 1)
        blocks = [hash_id if n == block_size else (hash_id, n) for hash_id, n in zip(ids, tokens)]
        chains.append(BlockChain(keys.chain(blocks), tuple(tokens)))
    return chains


def token_chains(prompts: Sequence[Sequence[int]], block_size: int,
                 keys: _PrefixKeys | None = None) -> list[BlockChain]:
    """Chains of token-id prompts: their full ``block_size``-token blocks, keyed by content;
    a partial tail is no block (a paged cache holds only full pages)."""
    keys = keys or _PrefixKeys()
    chains = []
    for prompt in prompts:
        full = len(prompt) // block_size
        blocks = np.asarray(prompt[:full * block_size], dtype=np.int64).reshape(full, block_size)
        chains.append(BlockChain(keys.chain(block.tobytes() for block in blocks), (block_size,) * full))
    return chains


def served_token_chains(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int] | None],
                        block_size: int) -> tuple[list[BlockChain], list[BlockChain]]:
    """What a paged server's prefix cache can do with token-id prompts: each request looks
    up the full blocks of its prompt but its last token (which is always computed, for the
    logits it samples from: vLLM V1's rule, and shiftjax's), and leaves behind the full
    blocks of its prompt and answer (``None``: the answer is unknown, the prompt alone).
    Returns (lookups, inserted), keyed alike."""
    keys = _PrefixKeys()
    lookups = token_chains([prompt[:max(len(prompt) - 1, 0)] for prompt in prompts], block_size, keys)
    inserted = token_chains([list(prompt) + list(answer or []) for prompt, answer in zip(prompts, answers)],
                            block_size, keys)
    return lookups, inserted


def best_hit_rate(chains: Sequence[BlockChain], prompt_lens: Sequence[int], capacity_blocks: int | None,
                  counted: Sequence[bool] | None = None, inserted: Sequence[BlockChain] | None = None) -> float:
    """Hit tokens over prompt tokens of the ``counted`` chains (all by default), every chain
    passing through the cache in order (a warm-up's requests fill it and count for nothing)."""
    hits = lru_hit_tokens(chains, capacity_blocks, inserted)
    counted = [True] * len(chains) if counted is None else counted
    total = sum(length for length, keep in zip(prompt_lens, counted) if keep)
    return sum(hit for hit, keep in zip(hits, counted) if keep) / total if total else 0.0


def trace_best_hit_rate(rows, capacity_blocks: int | None, block_size: int = 512) -> float:
    """The best hit rate of a hash-id trace (rows with ``hash_ids`` and ``prompt_len``, in
    arrival order) on an LRU cache of ``capacity_blocks`` blocks, ``None`` for infinite."""
    rows = list(rows)
    lengths = [row.prompt_len for row in rows]
    return best_hit_rate(hash_id_chains([row.hash_ids for row in rows], lengths, block_size), lengths, capacity_blocks)
