"""Canonical parameters expanded onto the mesh: one set of buffers, a TP view and an SP view.

Column-parallel weights are fused per head block (``q | k | v`` and ``gate | up``) so each
mode runs one GEMM per block and SP mode moves q, k and v in one all-to-all. The embedding
and the LM head are split over the vocabulary on the head axes in both modes; biases and
norms are the same arrays in both views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from shiftjax.config import ModelConfig
from shiftjax.layouts import blocks as blk
from shiftjax.layouts.heads import HeadLayout, head_layout
from shiftjax.layouts.mesh import SP, TP
from shiftjax.layouts.specs import EMBED_SPEC, LM_HEAD_SPEC, REPLICATED
from shiftjax.params import Params, param_shapes, params_from_flat
from shiftjax.pytrees import unchecked_init
from shiftjax.quantization import Fp8Weight, check_quantization, empty_fp8_blocks, quantize_blocks


@dataclasses.dataclass(frozen=True)
class LocalDims:
    """Static sizes of one device's share, shared by both modes."""

    head_dim: int
    q_heads: int  # query heads per block (padding included)
    kv_slots: int  # KV-cache slots per block
    kv_slot_of_head: tuple[int, ...]
    ffn: int  # FFN columns per block
    vocab: int  # vocabulary rows per block
    vocab_size: int  # the model's true vocabulary (columns past it are padding)
    sp: int
    tp: int

    @property
    def qkv(self) -> int:
        return (self.q_heads + 2 * self.kv_slots) * self.head_dim

    @property
    def blocks(self) -> int:
        return self.sp * self.tp


def local_dims(config: ModelConfig, layout: HeadLayout) -> LocalDims:
    blocks = layout.num_blocks
    return LocalDims(
        head_dim=config.head_dim,
        q_heads=layout.q_per_block,
        kv_slots=layout.kv_per_block,
        kv_slot_of_head=layout.kv_slot_of_head,
        ffn=blk.padded_size(config.intermediate_size, blocks) // blocks,
        vocab=blk.padded_size(config.vocab_size, blocks) // blocks,
        vocab_size=config.vocab_size,
        sp=layout.sp,
        tp=layout.tp,
    )


@unchecked_init
@struct.dataclass
class LayerWeights:
    """Stacked layer weights of one mode. Block weights are ``[layers, P, ...]`` arrays in
    the TP view, and a tuple of ``sp`` ``[layers, tp, ...]`` arrays (aliased storage) or one
    contiguous ``[layers, tp, ...]`` array (two copies) in the SP view."""

    attn_norm: jax.Array
    mlp_norm: jax.Array
    wqkv: object
    wo: object
    w_gate_up: object
    w_down: object
    bqkv: jax.Array | None  # [layers, P, qkv], added after the all-to-all in SP mode
    # [layers, head_dim]: the RMSNorm weights of every q and every k head (Qwen3), replicated
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None


@unchecked_init
@struct.dataclass
class ShardedParams:
    embed: jax.Array  # [vocab_padded, d_model], vocabulary over the head axes
    final_norm: jax.Array
    lm_head: jax.Array | None  # [d_model, vocab_padded]; None when tied to embed
    layers: LayerWeights


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    """What the engine holds: both views (sharing buffers) and the static layout."""

    config: ModelConfig
    layout: HeadLayout
    dims: LocalDims
    mesh: Mesh
    storage: str
    tp: ShardedParams
    sp: ShardedParams
    quantization: str = "none"  # shiftjax.quantization.QUANTIZATIONS


def shard_params(
    params: Params, config: ModelConfig, mesh: Mesh, storage: blk.WeightStorage = "aliased",
    quantization: str = "none",
) -> ModelWeights:
    """Expands canonical ``params`` into the head-block layout of ``mesh`` and places them.

    The canonical arrays may live anywhere (host or device); the expanded blocks are
    produced on the mesh with their final sharding. Placed on the devices, the canonical
    arrays cost their own memory on top: loaders use :func:`assemble_weights` instead
    (``checkpoints.load.restore_weights``, ``checkpoints.dummy.dummy_weights``), and their
    tests compare with this function.
    """
    check_storage(storage, quantization)
    sp, tp = mesh.shape[SP], mesh.shape[TP]
    layout = head_layout(config.num_heads, config.num_kv_heads, sp, tp)
    dims = local_dims(config, layout)
    blocks = layout.num_blocks
    hd = config.head_dim
    kv_table = layout.kv_head_of_slot
    replicated = NamedSharding(mesh, REPLICATED)

    def qkv_blocks(wq, wk, wv):
        return jnp.concatenate(
            [blk.gather_heads(wq, layout.query_head_of, hd),
             blk.gather_heads(wk, kv_table, hd),
             blk.gather_heads(wv, kv_table, hd)], axis=-1)

    def to_blocks_first(x):  # [L, d_in, P, n] -> [L, P, d_in, n]
        return jnp.moveaxis(x, -2, 1)

    def expand(p: Params):
        layers = p.layers
        wqkv = to_blocks_first(qkv_blocks(layers.wq, layers.wk, layers.wv))
        wo_rows = jnp.swapaxes(layers.wo, 1, 2)  # heads on the last axis
        wo = jnp.swapaxes(to_blocks_first(blk.gather_heads(wo_rows, layout.query_head_of, hd)), 2, 3)
        gate = blk.split_features(layers.w_gate, blocks)
        up = blk.split_features(layers.w_up, blocks)
        w_gate_up = to_blocks_first(jnp.concatenate([gate, up], axis=-1))
        down = blk.split_features(jnp.swapaxes(layers.w_down, 1, 2), blocks)  # [L, D, P, f]
        w_down = jnp.swapaxes(to_blocks_first(down), 2, 3)  # [L, P, f, D]
        bqkv = None
        if layers.bq is not None:
            bqkv = qkv_blocks(layers.bq, layers.bk, layers.bv)
        vocab_pad = blocks * dims.vocab - config.vocab_size
        embed = jnp.pad(p.embed, ((0, vocab_pad), (0, 0)))
        lm_head = None if p.lm_head is None else jnp.pad(p.lm_head, ((0, 0), (0, vocab_pad)))
        return dict(wqkv=wqkv, wo=wo, w_gate_up=w_gate_up, w_down=w_down, bqkv=bqkv,
                    embed=embed, lm_head=lm_head, final_norm=p.final_norm,
                    attn_norm=layers.attn_norm, mlp_norm=layers.mlp_norm,
                    q_norm=layers.q_norm, k_norm=layers.k_norm)

    out_shardings = dict(
        wqkv=blk.block_sharding(mesh, 4), wo=blk.block_sharding(mesh, 4),
        w_gate_up=blk.block_sharding(mesh, 4), w_down=blk.block_sharding(mesh, 4),
        bqkv=None if params.layers.bq is None else blk.block_sharding(mesh, 3),
        embed=NamedSharding(mesh, EMBED_SPEC),
        lm_head=None if params.lm_head is None else NamedSharding(mesh, LM_HEAD_SPEC),
        final_norm=replicated, attn_norm=replicated, mlp_norm=replicated,
        q_norm=None if params.layers.q_norm is None else replicated,
        k_norm=None if params.layers.k_norm is None else replicated,
    )
    expanded = jax.jit(expand, out_shardings=out_shardings)(params)

    tp_view, sp_view = {}, {}
    for name, kind in (("wqkv", "column"), ("wo", "row"), ("w_gate_up", "column"), ("w_down", "row")):
        tp_view[name], sp_view[name] = store_block_weight(expanded.pop(name), mesh, storage, kind, quantization)

    def view(weights):
        return ShardedParams(
            embed=expanded["embed"], final_norm=expanded["final_norm"], lm_head=expanded["lm_head"],
            layers=LayerWeights(attn_norm=expanded["attn_norm"], mlp_norm=expanded["mlp_norm"],
                                bqkv=expanded["bqkv"], q_norm=expanded["q_norm"], k_norm=expanded["k_norm"],
                                **weights))

    return ModelWeights(config=config, layout=layout, dims=dims, mesh=mesh, storage=storage,
                        tp=view(tp_view), sp=view(sp_view), quantization=quantization)


def check_storage(storage: str, quantization: str) -> None:
    """Refuses a storage and quantization that cannot go together, before any weight is made."""
    if storage not in blk.STORAGES:
        raise ValueError(f"weight storage must be one of {blk.STORAGES}, got {storage!r}")
    check_quantization(quantization)
    if quantization != "none" and storage != "aliased":
        # The contiguous SP copy multiplies a row weight's sp blocks in one GEMM, which would
        # quantize its activations per token over all of them, and TP mode per block: the
        # modes would no longer compute the same thing.
        raise ValueError(f"quantization {quantization} needs weight storage 'aliased', got {storage!r}")


def store_block_weight(blocks: jax.Array, mesh: Mesh, storage: str, kind: str, quantization: str,
                       into: Fp8Weight | None = None):
    """``(tp_view, sp_view)`` of one layer GEMM weight given as its ``[layers, P, ...]``
    blocks: :func:`blocks.store_blocks`, after quantizing per output channel where asked
    (into ``into`` where given; the values and the scales are then stored alike, so the TP
    view of each is made of the SP shards' buffers)."""
    if quantization == "none":
        return blk.store_blocks(blocks, mesh, storage, kind)
    weight = quantize_blocks(blocks, kind, into)
    tp_values, sp_values = blk.store_blocks(weight.values, mesh, storage, kind)
    tp_scale, sp_scale = blk.store_blocks(weight.scale, mesh, storage, kind)
    return (Fp8Weight(values=tp_values, scale=tp_scale),
            tuple(Fp8Weight(values=v, scale=s) for v, s in zip(sp_values, sp_scale)))


# --- The block layout as a plan: which canonical rows each block takes -------------------
#
# ``shard_params`` expands canonical arrays with XLA gathers; a loader that must never hold a
# canonical tensor whole (sharded restore, random weights made on the devices) instead
# builds each device's blocks from this plan, reading or generating only what they need.


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """Part of every block, taken from one canonical tensor along the block's cut axis."""

    tensor: str  # canonical path, e.g. "layers.wq"
    index: np.ndarray  # [blocks, n] canonical indices along the cut axis; -1 gives zeros


@dataclasses.dataclass(frozen=True, eq=False)
class BlockWeight:
    """One array of the block layout. Block ``b`` is the concatenation of its segments'
    rows ``segment.index[b]``, each taken along ``cut_axis`` of the canonical tensor.

    ``kind``: ``"column"`` / ``"row"`` (layer GEMM weights, global ``[layers, P, ...]``),
    ``"bias"`` (``[layers, P, n]``) or ``"vocab"`` (no block axis: the blocks are
    concatenated along ``cut_axis``, e.g. the embedding's rows).
    """

    name: str
    kind: str
    cut_axis: int
    segments: tuple[Segment, ...]

    @property
    def stacked(self) -> bool:
        """Whether the global array has the block axis at 1 (``[layers, P, ...]``)."""
        return self.kind != "vocab"

    @property
    def width(self) -> int:
        return sum(segment.index.shape[1] for segment in self.segments)

    def block_shape(self, canonical_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """One block's shape (without a block axis)."""
        shape = list(canonical_shapes[self.segments[0].tensor])
        shape[self.cut_axis] = self.width
        return tuple(shape)

    def global_shape(self, canonical_shapes, positions: int) -> tuple[int, ...]:
        """The global array holding ``positions`` blocks."""
        shape = list(self.block_shape(canonical_shapes))
        if self.stacked:
            return (shape[0], positions, *shape[1:])
        shape[self.cut_axis] *= positions
        return tuple(shape)

    @property
    def block_axis(self) -> int:
        """The global axis along which blocks sit (and which the sharding cuts)."""
        return 1 if self.stacked else self.cut_axis


def replicated_tensors(config: ModelConfig) -> tuple[str, ...]:
    """The canonical tensors every device holds whole (norm weights), in both views."""
    qk_norms = ("layers.q_norm", "layers.k_norm") if config.qk_norm else ()
    return ("final_norm", "layers.attn_norm", "layers.mlp_norm", *qk_norms)


def block_plan(config: ModelConfig, layout: HeadLayout) -> dict[str, BlockWeight]:
    """Every block array of the layout, keyed by its ``ShardedParams`` path, with the
    canonical indices each block takes; the index form of ``shard_params``'s expansion."""
    blocks, hd = layout.num_blocks, config.head_dim
    q_index = blk.head_feature_index(layout.query_head_of, hd)
    kv_index = blk.head_feature_index(layout.kv_head_of_slot, hd)
    ffn_index = blk.feature_index(config.intermediate_size, blocks)
    vocab_index = blk.feature_index(config.vocab_size, blocks)
    qkv = (Segment("layers.wq", q_index), Segment("layers.wk", kv_index), Segment("layers.wv", kv_index))
    plan = [
        BlockWeight("layers.wqkv", "column", 2, qkv),
        BlockWeight("layers.wo", "row", 1, (Segment("layers.wo", q_index),)),
        BlockWeight("layers.w_gate_up", "column", 2,
                    (Segment("layers.w_gate", ffn_index), Segment("layers.w_up", ffn_index))),
        BlockWeight("layers.w_down", "row", 1, (Segment("layers.w_down", ffn_index),)),
        BlockWeight("embed", "vocab", 0, (Segment("embed", vocab_index),)),
    ]
    if config.qkv_bias:
        plan.append(BlockWeight("layers.bqkv", "bias", 1, (
            Segment("layers.bq", q_index), Segment("layers.bk", kv_index), Segment("layers.bv", kv_index))))
    if not config.tie_word_embeddings:
        plan.append(BlockWeight("lm_head", "vocab", 1, (Segment("lm_head", vocab_index),)))
    return {weight.name: weight for weight in plan}


# make_blocks(weight, global_shape, sharding, blocks_at) -> the global array whose shard at
# position i along ``weight.block_axis`` is block ``blocks_at[i]``.
MakeBlocks = Callable[[BlockWeight, tuple[int, ...], NamedSharding, tuple[int, ...]], jax.Array]
# make_replicated(canonical path, sharding) -> that (small) canonical tensor, replicated.
MakeReplicated = Callable[[str, NamedSharding], jax.Array]


def assemble_weights(config: ModelConfig, mesh: Mesh, storage: blk.WeightStorage,
                     make_blocks: MakeBlocks, make_replicated: MakeReplicated,
                     quantization: str = "none") -> ModelWeights:
    """Builds ``ModelWeights`` array by array from a block source, each array straight in
    its final sharding (the same layout ``shard_params`` gives).

    With aliased storage the source makes the ``sp`` shards ``A_j`` and the TP view is built
    from their buffers, so device memory never holds more than the final weights. With two
    copies it makes the TP blocks and ``store_blocks`` derives the contiguous SP copy.
    """
    check_storage(storage, quantization)
    sp, tp = mesh.shape[SP], mesh.shape[TP]
    layout = head_layout(config.num_heads, config.num_kv_heads, sp, tp)
    shapes = param_shapes(config)
    plan = block_plan(config, layout)
    all_blocks = tuple(range(layout.num_blocks))

    def blocks_of(weight: BlockWeight, sharding: NamedSharding, blocks_at: tuple[int, ...]):
        return make_blocks(weight, weight.global_shape(shapes, len(blocks_at)), sharding, blocks_at)

    tp_view, sp_view = {}, {}
    # Largest first, each FP8 form made before the blocks it is quantized from (see
    # ``empty_fp8_blocks``): the weights pack the bottom of the pool, the rest stays one piece.
    for name in ("w_gate_up", "w_down", "wqkv", "wo"):
        weight = plan[f"layers.{name}"]
        ndim = len(weight.block_shape(shapes)) + 1
        into = None
        if quantization != "none":
            into = empty_fp8_blocks(weight.global_shape(shapes, layout.num_blocks), blk.block_sharding(mesh, ndim))
        if storage == "aliased":
            shards = tuple(blocks_of(weight, blk.shard_sharding(mesh, ndim), blk.shard_block_ids(sp, tp, j))
                           for j in range(sp))
            if quantization == "none":
                tp_view[name], sp_view[name] = blk.tp_view_of_shards(shards, mesh), shards
                continue
            # quantized from the TP view of the shards (their own buffers, no copy)
            blocks = blk.tp_view_of_shards(shards, mesh)
            del shards
        else:
            blocks = blocks_of(weight, blk.block_sharding(mesh, ndim), all_blocks)
        tp_view[name], sp_view[name] = store_block_weight(blocks, mesh, storage, weight.kind, quantization, into)
        del blocks, into
    bqkv = None
    if "layers.bqkv" in plan:
        bqkv = blocks_of(plan["layers.bqkv"], blk.block_sharding(mesh, 3), all_blocks)
    embed = blocks_of(plan["embed"], NamedSharding(mesh, EMBED_SPEC), all_blocks)
    lm_head = None
    if "lm_head" in plan:
        lm_head = blocks_of(plan["lm_head"], NamedSharding(mesh, LM_HEAD_SPEC), all_blocks)
    replicated = NamedSharding(mesh, REPLICATED)
    norms = {name: make_replicated(name, replicated) for name in replicated_tensors(config)}

    def view(weights):
        return ShardedParams(
            embed=embed, final_norm=norms["final_norm"], lm_head=lm_head,
            layers=LayerWeights(attn_norm=norms["layers.attn_norm"], mlp_norm=norms["layers.mlp_norm"],
                                bqkv=bqkv, q_norm=norms.get("layers.q_norm"), k_norm=norms.get("layers.k_norm"),
                                **weights))

    return ModelWeights(config=config, layout=layout, dims=local_dims(config, layout), mesh=mesh,
                        storage=storage, tp=view(tp_view), sp=view(sp_view), quantization=quantization)


def canonical_params(weights: ModelWeights) -> Params:
    """The canonical parameters ``weights`` were expanded from (the inverse of
    :func:`shard_params`), made on the devices from the TP view: each canonical column or row
    is read from the first block that holds it (a KV head duplicated over blocks is the same
    in each; padding is dropped). FP8 weights are refused: their canonical form is not kept."""
    if weights.quantization != "none":
        raise ValueError(f"the canonical form of {weights.quantization} weights is not kept; "
                         "load the checkpoint they were quantized from instead")
    config, view = weights.config, weights.tp
    layers = view.layers
    arrays = {"layers.wqkv": layers.wqkv, "layers.wo": layers.wo, "layers.w_gate_up": layers.w_gate_up,
              "layers.w_down": layers.w_down, "layers.bqkv": layers.bqkv, "embed": view.embed,
              "lm_head": view.lm_head}
    flat = {}
    for name, weight in block_plan(config, weights.layout).items():
        offset = 0
        for segment in weight.segments:
            flat[segment.tensor] = _segment_of(arrays[name], weight, segment, offset)
            offset += segment.index.shape[1]
    replicated = {"final_norm": view.final_norm, "layers.attn_norm": layers.attn_norm,
                  "layers.mlp_norm": layers.mlp_norm, "layers.q_norm": layers.q_norm, "layers.k_norm": layers.k_norm}
    flat.update({name: replicated[name] for name in replicated_tensors(config)})
    return params_from_flat(flat)


def _segment_of(array: jax.Array, weight: BlockWeight, segment: Segment, offset: int) -> jax.Array:
    """The canonical tensor of ``segment`` out of the global block array ``array``."""
    blocks, width = segment.index.shape
    first = {}  # canonical position -> its first place in the blocks, as block * weight.width + column
    for block in range(blocks):
        for column, position in enumerate(segment.index[block]):
            if position >= 0 and position not in first:
                first[int(position)] = block * weight.width + offset + column
    places = np.array([first[position] for position in range(len(first))], np.int32)
    if weight.stacked:  # [layers, P, ...]: the block axis next to the cut one, then merged with it
        cut = weight.cut_axis + 1
        merged = jnp.moveaxis(array, 1, cut - 1)
        shape = merged.shape
        array = merged.reshape(*shape[:cut - 1], shape[cut - 1] * shape[cut], *shape[cut + 1:])
    return jnp.take(array, places, axis=weight.cut_axis)
