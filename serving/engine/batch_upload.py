"""A step's batch as two int32 arrays, so that the host places a step with two transfers.

A :class:`~shiftjax.batch.StepBatch` is thirteen arrays; placing them one by one on the
mesh cost the host 0.77-1.64 ms of every decode step on 2x H200, where the host, not the
devices, bounds the engine's loop (benchmarks/README.md, "Async scheduling and the two uploads"). Packed, they are one array
per token and one per sequence; the step unpacks them by static slices, which XLA fuses
into their consumers. The float32 fields travel as their bit patterns. Measured there with
the token fill moved into the step as well: placing 0.26-0.39 ms instead of 0.67-0.94, and
a decode step 1.08-1.15x faster in the engine's loop.

The token array carries one more row than the batch: ``token_source``, the row of the
previous step's result whose sampled token this token is (async scheduling), or -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Int

from shiftjax.batch import PER_SEQUENCE_FIELDS, PER_TOKEN_FIELDS, BatchArray, StepBatch
from shiftjax.pytrees import unchecked_init

TOKEN_ROWS = PER_TOKEN_FIELDS  # then token_source
SEQUENCE_COLUMNS = PER_SEQUENCE_FIELDS
FLOAT32 = frozenset({"temperature", "top_p", "min_p"})
FIRST_PAGE_COLUMN = 1 + len(SEQUENCE_COLUMNS)  # after query_start and SEQUENCE_COLUMNS


@unchecked_init
@struct.dataclass
class BatchUpload:
    """``tokens``: rows ``TOKEN_ROWS`` and ``token_source``. ``sequences``: one row per
    sequence and one more, columns ``query_start``, ``SEQUENCE_COLUMNS`` and the page
    table; the extra row holds only ``query_start``'s last entry (zeros elsewhere)."""

    tokens: Int[BatchArray, "4 tokens"]
    sequences: Int[BatchArray, "seqs_plus_one columns"]


def pack_batch(batch: StepBatch, token_source: np.ndarray | None = None) -> BatchUpload:
    """A host batch packed (on the host); ``token_source`` (-1 where absent) may be shorter
    than the batch: it is padded with -1."""
    source = np.full(batch.num_tokens, -1, np.int32)
    if token_source is not None:
        source[:len(token_source)] = token_source
    tokens = np.stack([*(np.asarray(getattr(batch, name), np.int32) for name in TOKEN_ROWS), source])
    seqs = batch.num_seqs
    sequences = np.zeros((seqs + 1, FIRST_PAGE_COLUMN + batch.page_table.shape[1]), np.int32)
    sequences[:, 0] = batch.query_start
    for column, name in enumerate(SEQUENCE_COLUMNS, start=1):
        values = np.asarray(getattr(batch, name))
        sequences[:seqs, column] = values.astype(np.float32).view(np.int32) if name in FLOAT32 else values
    sequences[:seqs, FIRST_PAGE_COLUMN:] = batch.page_table
    return BatchUpload(tokens=tokens, sequences=sequences)


def unpack_batch(upload: BatchUpload) -> tuple[StepBatch, Int[jax.Array, "tokens"]]:
    """The batch and ``token_source``, inside a traced step (shapes come from the arrays)."""
    tokens, sequences = upload.tokens, upload.sequences
    seqs = sequences.shape[0] - 1
    fields = {name: tokens[row] for row, name in enumerate(TOKEN_ROWS)}
    for column, name in enumerate(SEQUENCE_COLUMNS, start=1):
        values = sequences[:seqs, column]
        fields[name] = jax.lax.bitcast_convert_type(values, jnp.float32) if name in FLOAT32 else values
    return StepBatch(query_start=sequences[:, 0], page_table=sequences[:seqs, FIRST_PAGE_COLUMN:],
                     **fields), tokens[len(TOKEN_ROWS)]


def unpack_sequences(sequences: Int[jax.Array, "seqs_plus_one columns"]) -> StepBatch:
    """The per-sequence fields alone (what a sampler reads), in a batch of one token."""
    return unpack_batch(BatchUpload(tokens=jnp.zeros((len(TOKEN_ROWS) + 1, 1), jnp.int32),
                                    sequences=sequences))[0]


def abstract_upload(num_tokens: int, num_seqs: int, max_pages: int, sharding) -> BatchUpload:
    """What a step of this bucket is compiled against."""
    return BatchUpload(
        tokens=jax.ShapeDtypeStruct((len(TOKEN_ROWS) + 1, num_tokens), jnp.int32, sharding=sharding),
        sequences=jax.ShapeDtypeStruct((num_seqs + 1, FIRST_PAGE_COLUMN + max_pages), jnp.int32,
                                       sharding=sharding))
