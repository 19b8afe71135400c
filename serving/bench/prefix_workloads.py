"""Workloads for prefix caching: hash-id traces, a shared prefix, multi-turn chats.

- ``hash-trace``: a JSONL trace whose rows carry ``hash_ids`` (the Mooncake traces of
  FAST'25: one id per ``block_size``-token block of the prompt, equal ids equal blocks).
  Each id is turned into its block's tokens by a fixed function, so equal ids give equal
  blocks and distinct ids distinct ones, whatever the seed.
- ``shared-prefix``: N prompts of one shared L-token prefix and a unique S-token suffix
  each.
- ``multi-turn``: C conversations of T turns. Turn k's prompt is turn k-1's prompt, the
  answer the server gave to it and a new U-token user message, so a turn can only be sent
  once the one before it has finished: the load generator chains them (``previous``).
"""

from __future__ import annotations

import math

import numpy as np

from shiftjax.serving.bench.workloads import WorkloadRequest

HASH_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al., SplitMix64): a counter in, noise out."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def id_digits(max_id: int, num_allowed: int) -> int:
    """How many tokens of ``num_allowed`` values write every id up to ``max_id``."""
    digits, reach = 1, num_allowed
    while reach <= max_id:
        digits, reach = digits + 1, reach * num_allowed
    return digits


def hash_id_blocks(hash_ids, block_size: int, allowed_ids: np.ndarray, seed: int, digits: int) -> np.ndarray:
    """The tokens of the blocks of ``hash_ids``, one row each (``ids x block_size``).

    A block starts with its id written in base ``len(allowed_ids)`` in ``digits`` tokens
    (lowest digit first), so distinct ids below ``len(allowed_ids) ** digits`` can never
    give equal blocks; the rest is noise of the id, the position and the seed. A partial
    block is the head of the full one (a prompt ending inside a block), so a partial block
    shorter than ``digits`` tokens does not tell every id apart; ``digits`` is 1 or 2 for
    any real vocabulary, and no paged cache keeps such a sliver of a page anyway.
    """
    if digits > block_size:
        raise ValueError(f"--block-size {block_size} cannot hold a hash id of {digits} tokens "
                         f"of a {allowed_ids.size}-token vocabulary")
    ids = np.asarray(hash_ids, dtype=np.uint64)
    num_allowed = np.uint64(allowed_ids.size)
    counter = ids[:, None] * np.uint64(block_size) + np.arange(block_size, dtype=np.uint64)[None, :]
    noise = _splitmix64(counter ^ _splitmix64(np.full(1, seed, dtype=np.uint64)))
    index = noise % num_allowed
    for digit in range(digits):
        index[:, digit] = (ids // num_allowed ** np.uint64(digit)) % num_allowed
    return allowed_ids[index.astype(np.int64)]


def hash_trace_prompts(requests: list[WorkloadRequest], block_size: int, allowed_ids: np.ndarray,
                       seed: int) -> list[list[int]]:
    """One prompt per request of ``prompt_len`` tokens: the blocks of its first hash ids."""
    used = [r.hash_ids[:math.ceil(r.prompt_len / block_size)] for r in requests]
    digits = id_digits(max((max(ids) for ids in used if ids), default=0), allowed_ids.size)
    prompts = []
    for request, ids in zip(requests, used):
        if len(ids) * block_size < request.prompt_len:
            raise ValueError(f"a {request.prompt_len}-token prompt needs {math.ceil(request.prompt_len / block_size)} "
                             f"hash ids of {block_size}-token blocks, its trace row has {len(ids)}")
        blocks = hash_id_blocks(ids, block_size, allowed_ids, seed, digits)
        prompts.append(blocks.reshape(-1)[:request.prompt_len].tolist())
    return prompts


def check_hash_ids(rows, block_size: int) -> None:
    """Every row has the ids its ``input_length`` needs at ``block_size``: a wrong
    ``--block-size`` shows here, not as a bound that means nothing."""
    for position, row in enumerate(rows):
        if row.hash_ids is None:
            raise ValueError(f"--dataset hash-trace: trace row {position} (by time) has no hash_ids")
        if len(row.hash_ids) != math.ceil(row.prompt_len / block_size):
            raise ValueError(f"--dataset hash-trace: trace row {position} (by time) has {len(row.hash_ids)} hash_ids "
                             f"for {row.prompt_len} tokens; with --block-size {block_size} it would have "
                             f"{math.ceil(row.prompt_len / block_size)}")


def _distinct_heads(count: int, allowed_ids: np.ndarray, rng: np.random.Generator, what: str) -> np.ndarray:
    """``count`` distinct token ids: the first tokens of parts that must never be equal."""
    if count > allowed_ids.size:
        raise ValueError(f"{count} {what} need distinct first tokens, the prompt vocabulary has {allowed_ids.size}")
    return rng.choice(allowed_ids, size=count, replace=False)


def _draw(allowed_ids: np.ndarray, rng: np.random.Generator, length: int) -> list[int]:
    return allowed_ids[rng.integers(0, allowed_ids.size, size=length)].tolist()


def shared_prefix_requests(num_requests: int, prefix_len: int, suffix_len: int,
                           output_len: int) -> list[WorkloadRequest]:
    if num_requests < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError("--dataset shared-prefix needs --num-prompts, --prefix-len, --suffix-len and "
                         "--output-len >= 1")
    return [WorkloadRequest(prefix_len + suffix_len, output_len) for _ in range(num_requests)]


def shared_prefix_prompts(requests: list[WorkloadRequest], prefix_len: int, allowed_ids: np.ndarray,
                          rng: np.random.Generator) -> list[list[int]]:
    """One ``prefix_len``-token prefix for all, then a suffix each whose first tokens are
    distinct: any two prompts share exactly ``prefix_len`` tokens."""
    prefix = _draw(allowed_ids, rng, prefix_len)
    heads = _distinct_heads(len(requests), allowed_ids, rng, "suffixes")
    return [prefix + [int(head)] + _draw(allowed_ids, rng, r.prompt_len - prefix_len - 1)
            for r, head in zip(requests, heads)]


def multi_turn_requests(conversations: int, turns: int, turn_len: int, output_len: int,
                        prefix_len: int = 0) -> list[WorkloadRequest]:
    """Conversation by conversation, turn by turn. ``prompt_len`` is what the prompt will
    be if every answer has ``output_len`` tokens (with ``ignore_eos`` it has)."""
    if conversations < 1 or turns < 1 or turn_len < 1 or output_len < 1 or prefix_len < 0:
        raise ValueError("--dataset multi-turn needs --conversations, --turns, --turn-len and --output-len >= 1 "
                         "(and --prefix-len >= 0)")
    requests = []
    for conversation in range(conversations):
        for turn in range(turns):
            requests.append(WorkloadRequest(
                prefix_len + (turn + 1) * turn_len + turn * output_len, output_len, conversation=conversation,
                turn=turn, previous=len(requests) - 1 if turn else None))
    return requests


def multi_turn_messages(requests: list[WorkloadRequest], turn_len: int, prefix_len: int, allowed_ids: np.ndarray,
                        rng: np.random.Generator) -> list[list[int]]:
    """What each turn adds: the first turn's whole prompt (the shared ``prefix_len``-token
    system prompt, then its user message), a later turn's new user message only (the load
    generator puts the previous prompt and answer before it). First messages start with
    distinct tokens, so conversations share exactly the system prompt."""
    system = _draw(allowed_ids, rng, prefix_len)
    heads = iter(_distinct_heads(sum(r.turn == 0 for r in requests), allowed_ids, rng, "conversations"))
    return [system + [int(next(heads))] + _draw(allowed_ids, rng, turn_len - 1) if r.turn == 0
            else _draw(allowed_ids, rng, turn_len) for r in requests]


def conversation_offsets(requests: list[WorkloadRequest], starts: np.ndarray) -> list[float]:
    """Every turn's send offset is its conversation's start (later turns go when the turn
    before finishes; the load generator waits for that)."""
    return [float(starts[r.conversation]) for r in requests]

