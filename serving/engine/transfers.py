"""Host <-> device for the steps: a batch placed on the mesh (two transfers, as
``batch_upload.py`` packs it), and a step's one small result array copied back and
unpacked by static offsets (``StepOutput.packed``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int

from shiftjax.batch import StepBatch
from shiftjax.layouts.specs import REPLICATED
from shiftjax.serving.engine.batch_upload import BatchUpload, pack_batch
from shiftjax.weights import ModelWeights


def batch_sharding(weights: ModelWeights) -> NamedSharding:
    return NamedSharding(weights.mesh, REPLICATED)


def to_device(batch: StepBatch, weights: ModelWeights) -> StepBatch:
    """The host batch, replicated on the mesh, as ``make_step``'s step takes it (tests,
    benchmarks, notebooks; the engine places :func:`place_upload`'s two arrays instead).
    Every process holds the same host batch (the scheduler is deterministic), so each
    places only its own devices' copies."""
    sharding = batch_sharding(weights)
    return jax.tree.map(lambda x: _place(x, sharding), batch)


def place_upload(batch: StepBatch, weights: ModelWeights, token_source: np.ndarray | None = None) -> BatchUpload:
    """A padded host batch packed and placed like :func:`to_device`: two transfers."""
    sharding = batch_sharding(weights)
    return jax.tree.map(lambda x: _place(x, sharding), pack_batch(batch, token_source))


def place_replicated(x: np.ndarray, weights: ModelWeights) -> jax.Array:
    """A host array replicated on the mesh (each process places its own devices' copies)."""
    return _place(x, batch_sharding(weights))


def _place(x, sharding: NamedSharding) -> jax.Array:
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def result_columns(max_top_logprobs: int) -> int:
    return 2 + 2 * max_top_logprobs  # StepOutput.packed


def pad_result(packed: Int[Array, "seqs columns"], rows: int) -> Int[Array, "rows columns"]:
    return jnp.pad(packed, ((0, rows - packed.shape[0]), (0, 0)))


def empty_result(weights: ModelWeights, result_rows: int, max_top_logprobs: int) -> jax.Array:
    """The ``previous`` of a step that takes no sampled tokens (placed once, read by many)."""
    return place_replicated(np.zeros((result_rows, result_columns(max_top_logprobs)), np.int32), weights)


def start_host_copy(packed: jax.Array) -> jax.Array:
    """The copy of a step's ``[result_rows, 2 + 2K]`` result that the host reads (replicated: any
    local shard), its transfer to the host requested now, so that it lands when the step
    ends instead of when the host asks (``copy_to_host_async``)."""
    shard = packed.addressable_shards[0].data
    shard.copy_to_host_async()
    return shard


def packed_to_host(host_copy: jax.Array) -> np.ndarray:
    """The result as a host array (waits for the step): ``host_copy`` from :func:`start_host_copy`."""
    return np.asarray(host_copy)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step's samples on the host, unpacked by static offsets."""

    tokens: np.ndarray  # [seqs] int32
    logprobs: np.ndarray  # [seqs] float32, under the model
    top_ids: np.ndarray  # [seqs, K] int32, most likely first (K = 0 when not compiled in)
    top_logprobs: np.ndarray  # [seqs, K] float32


def unpack_host(packed: Int[np.ndarray, "seqs columns"]) -> StepResult:
    k = (packed.shape[1] - 2) // 2
    return StepResult(tokens=packed[:, 0], logprobs=packed[:, 1].copy().view(np.float32),
                      top_ids=packed[:, 2:2 + k], top_logprobs=packed[:, 2 + k:].copy().view(np.float32))
