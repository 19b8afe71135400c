"""The inputs of one step: a flat, ragged batch of tokens padded to a bucket."""

from __future__ import annotations

import jax
import numpy as np
from flax import struct
from jaxtyping import Float, Int

from shiftjax.pytrees import unchecked_init

# A batch is built on the host (numpy), compiled against as ShapeDtypeStructs and run as
# device arrays; the annotations check shapes and dtypes in all three forms.
BatchArray = jax.Array | np.ndarray | jax.ShapeDtypeStruct


@unchecked_init
@struct.dataclass
class StepBatch:
    """One step's tokens (prefill chunks and decode tokens mixed) and per-sequence data.

    Padding tokens have ``slot_mapping`` in page 0, the scratch page, and sit after
    ``query_start[-1]``; padding sequences have an empty query range and ``seq_lens`` 0.
    ``sample_index[b]`` is the token whose logits are sampled for sequence ``b``, or -1.
    ``top_logprobs[b]`` is how many alternatives sequence ``b`` wants (0: none); the step
    packs as many as it was compiled for and the host keeps what was asked. The random key
    of a sample is derived from ``seed`` and ``seq_lens``, so a sequence's tokens do not
    depend on what else is in the batch.
    """

    token_ids: Int[BatchArray, "tokens"]
    positions: Int[BatchArray, "tokens"]
    slot_mapping: Int[BatchArray, "tokens"]
    query_start: Int[BatchArray, "seqs_plus_one"]
    seq_lens: Int[BatchArray, "seqs"]
    page_table: Int[BatchArray, "seqs max_pages"]
    sample_index: Int[BatchArray, "seqs"]
    temperature: Float[BatchArray, "seqs"]
    top_p: Float[BatchArray, "seqs"]
    top_k: Int[BatchArray, "seqs"]
    seed: Int[BatchArray, "seqs"]
    min_p: Float[BatchArray, "seqs"]
    top_logprobs: Int[BatchArray, "seqs"]  # alternatives wanted (0: none; the step packs its max)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


# The fields of one entry per token and of one entry per sequence (besides query_start,
# which has one more, and page_table, one row per sequence).
PER_TOKEN_FIELDS = ("token_ids", "positions", "slot_mapping")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p", "top_logprobs")  # a request's SamplingParams
PER_SEQUENCE_FIELDS = ("seq_lens", "sample_index", *SAMPLING_FIELDS)


def empty_batch(num_tokens: int, num_seqs: int, max_pages: int) -> StepBatch:
    """An all-padding host batch of the given bucket, to fill in or to compile against."""
    return StepBatch(
        token_ids=np.zeros(num_tokens, np.int32),
        positions=np.zeros(num_tokens, np.int32),
        slot_mapping=np.zeros(num_tokens, np.int32),
        query_start=np.zeros(num_seqs + 1, np.int32),
        seq_lens=np.zeros(num_seqs, np.int32),
        page_table=np.zeros((num_seqs, max_pages), np.int32),
        sample_index=np.full(num_seqs, -1, np.int32),
        temperature=np.zeros(num_seqs, np.float32),
        top_p=np.ones(num_seqs, np.float32),
        top_k=np.zeros(num_seqs, np.int32),
        seed=np.zeros(num_seqs, np.int32),
        min_p=np.zeros(num_seqs, np.float32),
        top_logprobs=np.zeros(num_seqs, np.int32),
    )
