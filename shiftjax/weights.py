"""Canonical parameters expanded onto the mesh: one set of buffers, a TP view and an SP view.

Column-parallel weights are fused per head block (``q | k | v`` and ``gate | up``) so each
mode runs one GEMM per block and SP mode moves q, k and v in one all-to-all. The embedding
and the LM head are split over the vocabulary on the head axes in both modes; biases and
norms are the same arrays in both views.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from shiftjax.config import ModelConfig
from shiftjax.layouts import blocks as blk
from shiftjax.layouts.heads import HeadLayout, head_layout
from shiftjax.layouts.mesh import SP, TP
from shiftjax.layouts.specs import EMBED_SPEC, LM_HEAD_SPEC, REPLICATED
from shiftjax.params import Params
from shiftjax.pytrees import unchecked_init


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


def shard_params(
    params: Params, config: ModelConfig, mesh: Mesh, storage: blk.WeightStorage = "aliased"
) -> ModelWeights:
    """Expands canonical ``params`` into the head-block layout of ``mesh`` and places them.

    The canonical arrays may live anywhere (host or device); the expanded blocks are
    produced on the mesh with their final sharding.
    """
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
                    attn_norm=layers.attn_norm, mlp_norm=layers.mlp_norm)

    out_shardings = dict(
        wqkv=blk.block_sharding(mesh, 4), wo=blk.block_sharding(mesh, 4),
        w_gate_up=blk.block_sharding(mesh, 4), w_down=blk.block_sharding(mesh, 4),
        bqkv=None if params.layers.bq is None else blk.block_sharding(mesh, 3),
        embed=NamedSharding(mesh, EMBED_SPEC),
        lm_head=None if params.lm_head is None else NamedSharding(mesh, LM_HEAD_SPEC),
        final_norm=replicated, attn_norm=replicated, mlp_norm=replicated,
    )
    expanded = jax.jit(expand, out_shardings=out_shardings)(params)

    tp_view, sp_view = {}, {}
    for name, kind in (("wqkv", "column"), ("wo", "row"), ("w_gate_up", "column"), ("w_down", "row")):
        tp_view[name], sp_view[name] = blk.store_blocks(expanded.pop(name), mesh, storage, kind)

    def view(weights):
        return ShardedParams(
            embed=expanded["embed"], final_norm=expanded["final_norm"], lm_head=expanded["lm_head"],
            layers=LayerWeights(attn_norm=expanded["attn_norm"], mlp_norm=expanded["mlp_norm"],
                                bqkv=expanded["bqkv"], **weights))

    return ModelWeights(config=config, layout=layout, dims=dims, mesh=mesh, storage=storage,
                        tp=view(tp_view), sp=view(sp_view))
