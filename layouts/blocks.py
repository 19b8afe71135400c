"""Weight blocks: canonical weights cut into ``P`` head-ordered blocks, and how they are stored.

A column-parallel weight (fused q|k|v, fused gate|up) becomes ``[layers, P, d_in, n]`` and
a row-parallel one (o, down) ``[layers, P, n, d_out]``; block ``b`` belongs to device
``(s, t)`` with ``b = t * sp + s``.

Storage (``WeightStorage``):

- ``"aliased"`` (default): ``sp`` arrays ``A_j = blocks[:, j::sp]`` of shape
  ``[layers, tp, ...]``, sharded over ``tp`` and replicated over ``sp``. SP mode runs ``sp``
  GEMMs over them; TP mode gets an array built from the shards of ``A_s`` that already sit
  on device ``(s, t)``, with ``jax.make_array_from_single_device_arrays``: the same device
  buffers, no copy, no extra memory.
- ``"two_copies"``: TP mode keeps the blocks as they are and SP mode a second, contiguous
  copy of its TP shard (``+1/sp`` weight memory, Arctic Inference's choice), so SP mode
  runs one GEMM per weight.

Why not slice one contiguous array per mode at run time: on the H200 XLA copies a
dynamically sliced weight instead of fusing the slice into the GEMM (3.0-3.1x the
presliced GEMM per Llama-70B layer in TP mode).

Measured on the H200 (benchmarks/README.md, "Weight storage"; Llama-3-70B layer, one device of 8):
aliased storage gives TP mode exactly the two-copy GEMMs, but SP mode's 8 split GEMMs cost
+49%, +43%, +32%, +19% on the projections at 8, 64, 512, 4096 tokens per device. Block-major
contiguous storage with one GEMM costs SP mode nothing (1.00-1.05x), but TP mode then needs
a Pallas GEMM that reads its block by offset, which a short tuning brought to 0.96-1.21x of
cuBLAS. No zero-memory layout meets "no mode slower than two copies" yet; aliased is the
default because the latency mode (TP) is at parity with it and the two modes add partial
sums in the same order, so they write bit-identical caches. ``two_copies`` is the option
for SP-mode throughput parity at +1/sp weight memory.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float

from shiftjax.layouts.mesh import SP, TP
from shiftjax.layouts.specs import blocks_spec, tp_shard_spec

WeightStorage = Literal["aliased", "two_copies"]
STORAGES = ("aliased", "two_copies")


def padded_size(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gather_heads(
    w: Float[Array, "*lead features"], table: tuple[tuple[int, ...], ...], head_dim: int
) -> Float[Array, "*lead blocks block_features"]:
    """Columns of ``w`` (heads of ``head_dim`` along the last axis) rearranged into blocks.

    ``table[b][i]`` names the head at position ``i`` of block ``b``; -1 gives zero columns.
    """
    index = np.asarray(table, dtype=np.int32)
    heads = w.reshape(*w.shape[:-1], w.shape[-1] // head_dim, head_dim)
    picked = jnp.take(heads, np.maximum(index, 0).reshape(-1), axis=-2)
    mask = (index.reshape(-1) >= 0)[:, None]
    picked = jnp.where(mask, picked, jnp.zeros((), w.dtype))
    return picked.reshape(*w.shape[:-1], index.shape[0], index.shape[1] * head_dim)


def split_features(
    w: Float[Array, "*lead features"], blocks: int
) -> Float[Array, "*lead blocks block_features"]:
    """The last axis cut into ``blocks`` equal parts, zero-padded to a multiple of ``blocks``."""
    size = w.shape[-1]
    padded = padded_size(size, blocks)
    if padded != size:
        w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, padded - size)])
    return w.reshape(*w.shape[:-1], blocks, padded // blocks)


def head_feature_index(table: tuple[tuple[int, ...], ...], head_dim: int) -> np.ndarray:
    """``[blocks, positions * head_dim]`` canonical feature indices that :func:`gather_heads`
    takes into each block (-1: a zero column of a padding head).

    This is ``gather_heads`` as an index table, so that a loader can read, for each block,
    only the canonical rows or columns the block needs.
    """
    heads = np.asarray(table, dtype=np.int64)
    index = heads[:, :, None] * head_dim + np.arange(head_dim)
    index = np.where(heads[:, :, None] >= 0, index, -1)
    return index.reshape(heads.shape[0], -1)


def feature_index(size: int, blocks: int) -> np.ndarray:
    """``[blocks, padded / blocks]`` canonical indices of :func:`split_features` (-1: padding)."""
    index = np.arange(padded_size(size, blocks), dtype=np.int64)
    return np.where(index < size, index, -1).reshape(blocks, -1)


def shard_block_ids(sp: int, tp: int, j: int) -> tuple[int, ...]:
    """The blocks in aliased shard ``A_j`` (``[layers, tp, ...]``), by TP index: ``t * sp + j``."""
    return tuple(t * sp + j for t in range(tp))


def block_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """``[layers, P, ...]`` with the block axis over the head axes (the TP-mode layout)."""
    return NamedSharding(mesh, blocks_spec(ndim))


def shard_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """``[layers, tp, ...]`` sharded over ``tp``, replicated over ``sp`` (one TP shard each)."""
    return NamedSharding(mesh, tp_shard_spec(ndim))


def store_blocks(blocks: jax.Array, mesh: Mesh, storage: WeightStorage, kind: str):
    """Returns ``(tp_view, sp_view)`` of one block weight laid out as ``storage`` says.

    ``blocks`` is ``[layers, P, ...]`` with :func:`block_sharding`. ``kind`` is ``"column"``
    (``[.., d_in, n]``, SP mode concatenates block outputs) or ``"row"`` (``[.., n, d_out]``,
    SP mode sums them). The SP view is a tuple of ``sp`` arrays (aliased) or one array
    ``[layers, tp, d_in, sp * n]`` / ``[layers, tp, sp * n, d_out]`` (two copies).
    """
    if storage not in STORAGES:
        raise ValueError(f"weight storage must be one of {STORAGES}, got {storage!r}")
    sp, tp = mesh.shape[SP], mesh.shape[TP]
    if storage == "two_copies":
        return blocks, _contiguous_shard(blocks, sp, tp, mesh, kind)
    out = shard_sharding(mesh, blocks.ndim)
    if sp == 1:
        # The one shard is the blocks themselves (the two shardings are equivalent): a
        # transfer that moves nothing, where shard_j would copy the stack (a 70B model's FP8
        # gate|up on one GPU: 37.6 GB more at the load's peak)
        return blocks, (jax.device_put(blocks, out),)

    def shard_j(b, j):
        # blocks t * sp + j for every t. Written as reshape + index: XLA 0.10.2's CPU SPMD
        # partitioner returned block 0 for the strided slice b[:, 7::8] (checked on 8 devices).
        return b.reshape(b.shape[0], tp, sp, *b.shape[2:])[:, :, j]

    shards = tuple(jax.jit(shard_j, static_argnums=1, out_shardings=out)(blocks, j) for j in range(sp))
    return tp_view_of_shards(shards, mesh), shards


def _contiguous_shard(blocks, sp, tp, mesh, kind):
    def contiguous(b):
        layers, _, d0, d1 = b.shape
        b = b.reshape(layers, tp, sp, d0, d1)
        if kind == "column":  # [.., d_in, sp * n]: one GEMM, outputs in block order
            return b.transpose(0, 1, 3, 2, 4).reshape(layers, tp, d0, sp * d1)
        return b.reshape(layers, tp, sp * d0, d1)  # [.., sp * n, d_out]

    return jax.jit(contiguous, out_shardings=shard_sharding(mesh, blocks.ndim))(blocks)


def tp_view_of_shards(shards: tuple[jax.Array, ...], mesh: Mesh) -> jax.Array:
    """The TP-mode array ``[layers, P, ...]`` made of the buffers of ``shards`` (no copy).

    Device ``(s, t)`` holds block ``t * sp + s``, which is ``shards[s]``'s shard ``t``.
    """
    first = shards[0]
    layers, tp, *rest = first.shape
    sp = len(shards)
    sharding = block_sharding(mesh, first.ndim)
    sp_index = {mesh.devices[s, t]: s for s in range(sp) for t in range(tp)}
    by_device = {}
    for s, array in enumerate(shards):
        for shard in array.addressable_shards:
            if sp_index[shard.device] == s:
                by_device[shard.device] = shard.data
    arrays = [by_device[d] for d in sharding.addressable_devices_indices_map((layers, sp * tp, *rest))]
    return jax.make_array_from_single_device_arrays((layers, sp * tp, *rest), sharding, arrays)
