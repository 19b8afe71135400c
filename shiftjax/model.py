"""The Llama-family forward pass over one device's shards, for both modes.

Everything here runs inside ``shard_map``: arrays are local shards, collectives name the
mesh axes. The TP and SP layers share the attention core (bias, RoPE, cache write,
paged attention) and differ only in which tokens and which weight blocks a device
multiplies, and in their collectives.

Reductions are ordered so both modes add the same partial sums in the same order: TP
mode sums its ``sp`` block partials with ``psum`` over ``sp`` and then over ``tp``; SP mode
adds its ``sp`` block GEMMs in block order and then ``psum``s over ``tp``. With the aliased
weight storage the two modes then write the same cache bytes wherever the all-reduce adds
in device order (checked on the CPU mesh by the KV-invariance test). Both modes' layer sums
go through ``kernels.collectives`` with the step's one choice: XLA's ``psum``, or on two
GPUs the one-shot kernel, whose bf16(a + b) is psum's bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from shiftjax.batch import StepBatch
from shiftjax.kernels import AttentionMetadata, apply_rope, ragged_paged_attention, write_qkv_to_cache
from shiftjax.kernels.collectives import all_reduce, all_to_all, psum_reference
from shiftjax.kernels.fp8_gemm import DEFAULT_CHOICE, Fp8GemmChoice, QuantizedRows, fp8_matmul
from shiftjax.kernels.fp8_rows import rms_norm_quantized, rms_norm_reference, swiglu_quantized, swiglu_reference
from shiftjax.layouts.mesh import HEAD_AXES, SP, TP
from shiftjax.quantization import Fp8Weight
from shiftjax.weights import LayerWeights, LocalDims


def rms_norm(x: Float[Array, "tokens d"], weight: Float[Array, "d"], eps: float) -> Float[Array, "tokens d"]:
    """Float32 statistics, the normalized row in ``x.dtype`` times the weight. The arithmetic
    is ``kernels.fp8_rows``'s reference, beside the kernel that fuses it with w8a8's
    quantization, so the two cannot drift apart."""
    return rms_norm_reference(x, weight, eps)


def psum_head_axes(x, implementation: str = "xla"):
    """The TP-mode all-reduce, over ``sp`` first so it adds what SP mode adds locally;
    ``implementation``: ``kernels.collectives``'s (``xla`` or, on two GPUs, ``one_shot``)."""
    return all_reduce(x, (SP, TP), implementation)


class Context:
    """Static facts and per-step inputs that every layer of one step reads."""

    def __init__(self, dims: LocalDims, eps: float, inv_freq, batch: StepBatch, attention: str,
                 all_reduce: str = "xla", all_to_all: str = "xla", first_ordinal: int | None = None,
                 quantized_gemm: str = "reference", fp8_gemm: Fp8GemmChoice = DEFAULT_CHOICE):
        self.dims = dims
        self.eps = eps
        self.inv_freq = inv_freq
        self.batch = batch
        self.attention = attention
        self.all_reduce = all_reduce  # kernels.collectives.ALL_REDUCES: who sums the layers' partials
        self.all_to_all = all_to_all  # kernels.collectives.ALL_TO_ALLS: who does SP mode's exchanges
        self.first_ordinal = first_ordinal  # the mesh's first CUDA device (the exchange kernels' ranks)
        self.quantized_gemm = quantized_gemm  # kernels.fp8_gemm's implementation for Fp8Weight GEMMs
        self.fp8_gemm = fp8_gemm  # and the kernel it picks for a GEMM's rows
        # Chosen from the step's token count, which both modes share (SP mode's devices each
        # multiply a slice of it), so both modes quantize the same activations the same way.
        self.fp8_algorithm = fp8_gemm.algorithm(batch.token_ids.shape[0])

    @property
    def fp8_reads_stacked_layers(self) -> bool:
        """Whether this step's FP8 GEMMs get the stacked weights and the layer's index (the
        Pallas kernels read their layer in place); the reference takes each layer's weights
        sliced statically, as bf16 GEMMs do, which XLA's dots read where they lie."""
        return self.quantized_gemm == "pallas"

    @property
    def metadata(self) -> AttentionMetadata:
        batch = self.batch
        return AttentionMetadata(query_start=batch.query_start, seq_lens=batch.seq_lens, page_table=batch.page_table)

    def with_batch(self, batch: StepBatch) -> "Context":
        """This context with ``batch`` (what the jitted layer receives), every other field kept."""
        context = copy.copy(self)
        context.batch = batch
        return context


def attention_core(qkv: Float[Array, "tokens qkv"], w: LayerWeights, k_cache, v_cache, layer, ctx: Context):
    """Bias, q/k norms, RoPE, cache write and paged attention for all tokens of the local
    head block (``w``: the layer's weights; bias ``[1, qkv]``, norms ``[head_dim]``)."""
    dims = ctx.dims
    if w.bqkv is not None:
        qkv = qkv + w.bqkv[0]
    if w.q_norm is not None:
        qkv = qk_normed(qkv, w.q_norm, w.k_norm, dims, ctx.eps)
    tokens = qkv.shape[0]
    q_width = dims.q_heads * dims.head_dim
    q = apply_rope(qkv[:, :q_width].reshape(tokens, dims.q_heads, dims.head_dim), ctx.batch.positions, ctx.inv_freq)
    k_cache, v_cache = write_qkv_to_cache(
        k_cache, v_cache, qkv.reshape(tokens, -1, dims.head_dim), ctx.batch.positions, ctx.inv_freq,
        ctx.batch.slot_mapping, q_heads=dims.q_heads, layer=layer, implementation=ctx.attention)
    out = ragged_paged_attention(
        q, k_cache, v_cache, ctx.metadata, layer=layer, sm_scale=dims.head_dim ** -0.5,
        kv_slot_of_head=dims.kv_slot_of_head, implementation=ctx.attention)
    return out.reshape(tokens, q_width), k_cache, v_cache


def qk_normed(qkv: Float[Array, "tokens qkv"], q_norm: Float[Array, "head_dim"], k_norm: Float[Array, "head_dim"],
              dims: LocalDims, eps: float) -> Float[Array, "tokens qkv"]:
    """Qwen3's per-head RMSNorm of every q and k head (v as it is). Padded heads are zero
    columns and stay zero; a KV head duplicated over slots is normed alike in each."""
    tokens, q_heads, kv_slots = qkv.shape[0], dims.q_heads, dims.kv_slots
    heads = qkv.reshape(tokens, -1, dims.head_dim)

    def normed(part, weight):
        return rms_norm(part.reshape(-1, dims.head_dim), weight, eps).reshape(part.shape)

    heads = jnp.concatenate([normed(heads[:, :q_heads], q_norm), normed(heads[:, q_heads:q_heads + kv_slots], k_norm),
                             heads[:, q_heads + kv_slots:]], axis=1)
    return heads.reshape(tokens, -1)


def tp_layer(x, w: LayerWeights, k_cache, v_cache, layer, ctx: Context):
    """One layer in TP mode: all tokens, this device's head block and FFN block."""
    qkv = matmul(normed_for(x, w.attn_norm, w.wqkv, ctx), w.wqkv, ctx)
    attn, k_cache, v_cache = attention_core(qkv, w, k_cache, v_cache, layer, ctx)
    x = x + psum_head_axes(matmul(attn, w.wo, ctx), ctx.all_reduce)
    gate_up = matmul(normed_for(x, w.mlp_norm, w.w_gate_up, ctx), w.w_gate_up, ctx)
    act = swiglu_for(gate_up, w.w_down, ctx.dims.ffn, ctx)
    x = x + psum_head_axes(matmul(act, w.w_down, ctx), ctx.all_reduce)
    return x, k_cache, v_cache


def sp_layer(x, w: LayerWeights, k_cache, v_cache, layer, ctx: Context):
    """One layer in SP mode: local tokens through the whole TP shard, Ulysses attention."""
    dims = ctx.dims
    local_tokens = x.shape[0]
    qkv = _column_blocks(normed_for(x, w.attn_norm, w.wqkv, ctx), w.wqkv, dims.sp, ctx)  # [local_tokens, sp, qkv]
    # One all-to-all for q, k and v: split head blocks over sp, gather all tokens.
    qkv = all_to_all(qkv, SP, 1, ctx.all_to_all, ctx.first_ordinal)
    attn, k_cache, v_cache = attention_core(qkv[:, 0], w, k_cache, v_cache, layer, ctx)
    # The inverse: split tokens over sp, gather every head block of the TP shard.
    attn = attn.reshape(dims.sp, local_tokens, -1)
    attn = all_to_all(attn, SP, 0, ctx.all_to_all, ctx.first_ordinal)
    attn = jnp.swapaxes(attn, 0, 1)  # [local_tokens, sp, q_width]
    x = x + all_reduce(_row_blocks(attn, w.wo, ctx), (TP,), ctx.all_reduce)
    gate_up = _column_blocks(normed_for(x, w.mlp_norm, w.w_gate_up, ctx), w.w_gate_up, dims.sp, ctx)
    act = swiglu_for(gate_up, w.w_down, dims.ffn, ctx)
    x = x + all_reduce(_row_blocks(act, w.w_down, ctx), (TP,), ctx.all_reduce)
    return x, k_cache, v_cache


def _takes_quantized_rows(weight, ctx: Context) -> bool:
    """Whether the GEMM by ``weight`` (one, or SP's tuple of blocks) is ``w8a8`` over FP8
    weights, whose activations are quantized per row first."""
    first = weight[0] if isinstance(weight, tuple) else weight
    return isinstance(first, Fp8Weight) and ctx.fp8_algorithm == "w8a8"


def normed_for(x, norm_weight, weight, ctx: Context):
    """``rms_norm(x)`` as the GEMM by ``weight`` takes it: for ``w8a8``, quantized per row
    by one kernel with the norm (``kernels.fp8_rows``), not two passes of XLA after it."""
    if _takes_quantized_rows(weight, ctx):
        return QuantizedRows(*rms_norm_quantized(x, norm_weight, ctx.eps, implementation=ctx.quantized_gemm), dtype=x.dtype)
    return rms_norm(x, norm_weight, ctx.eps)


def swiglu_for(gate_up, weight, ffn: int, ctx: Context):
    """``silu(gate) * up`` as the down GEMM by ``weight`` takes it (as :func:`normed_for`)."""
    if gate_up.shape[-1] != 2 * ffn:
        raise ValueError(f"gate_up must hold gate and up of {ffn} each, got shape {gate_up.shape}")
    if _takes_quantized_rows(weight, ctx):
        return QuantizedRows(*swiglu_quantized(gate_up, implementation=ctx.quantized_gemm), dtype=gate_up.dtype)
    return swiglu_reference(gate_up)


def matmul(x: Float[Array, "tokens k"] | QuantizedRows, weight, ctx: Context) -> Float[Array, "tokens n"]:
    """``x @ weight[0]`` for this device's block: a bf16 array ``[1, k, n]``, or an
    :class:`~shiftjax.quantization.Fp8Weight` (values ``[1, n, k]``), multiplied by
    ``kernels.fp8_gemm`` with the step's algorithm."""
    if isinstance(weight, Fp8Weight):
        values, scale = weight.values, weight.scale
        if weight.layer is None:  # this layer's [1, n, k]
            values, scale = values[0], scale[0]
        else:  # every layer's [layers, 1, n, k]: the block axis is 1 on a device
            values, scale = values.reshape(values.shape[0], *values.shape[2:]), scale.reshape(scale.shape[0], -1)
        return fp8_matmul(x, values, scale, algorithm=ctx.fp8_algorithm, implementation=ctx.quantized_gemm,
                          choice=ctx.fp8_gemm, layer=weight.layer)
    return x @ weight[0]


def _column_blocks(x, weight, sp: int, ctx: Context):
    """``x @ block_j`` for the sp blocks of the TP shard, as ``[tokens, sp, n]``."""
    if isinstance(weight, tuple):  # aliased storage: sp separate GEMMs
        # Without a barrier per block XLA's DotMerger fuses the sp GEMMs that share x and
        # concatenates their weights on every call, a copy of the whole TP shard (H200:
        # 138.7 -> 85.7 us for Llama-70B qkv at 8 tokens a device;
        # benchmarks/README.md, "One GPU: the Llama-3-70B layer and the weight storages").
        return jnp.stack([matmul(lax.optimization_barrier(x), w, ctx) for w in weight], axis=1)
    out = x @ weight[0]  # contiguous storage: one GEMM, outputs in block order
    return out.reshape(x.shape[0], sp, -1)


def _row_blocks(x, weight, ctx: Context):
    """``sum_j x[:, j] @ block_j``, added in block order."""
    if isinstance(weight, tuple):
        block = lambda j: jax.tree.map(lambda a: a[:, j], x)  # x may be QuantizedRows
        total = matmul(block(0), weight[0], ctx)
        for j in range(1, len(weight)):
            total = total + matmul(block(j), weight[j], ctx)
        return total
    return x.reshape(x.shape[0], -1) @ weight[0]


def embed_tokens(token_ids, embed, dims: LocalDims):
    """Rows of the vocabulary-sharded table for all ``token_ids``, summed over devices."""
    block = lax.axis_index(HEAD_AXES)
    local = token_ids - block * dims.vocab
    mine = (local >= 0) & (local < dims.vocab)
    rows = jnp.take(embed, jnp.clip(local, 0, dims.vocab - 1), axis=0)
    # once a step: XLA's psum, whatever sums the layers
    return psum_reference(jnp.where(mine[:, None], rows, jnp.zeros((), embed.dtype)), (SP, TP))


# The LM head multiplies at least this many rows. XLA on GPUs makes a one-row bf16 product
# with float32 results a matrix-vector call that first converts the whole table to float32:
# on one H200, Llama-3.1-8B shape, 0.75 ms for the conversion and 0.50 ms for the call in
# every one-sequence step, against 0.24 ms for the GEMM of eight rows (shift_x2.py's engine
# part with --engine-tp 1; benchmarks/README.md, "LM head rows").
MIN_LOGIT_ROWS = 8


def lm_logits(hidden: Float[Array, "seqs d"], embed, lm_head, dims: LocalDims) -> Float[Array, "seqs vocab"]:
    """Full-vocabulary float32 logits for the sampled rows (replicated on every device)."""
    rows = hidden.shape[0]
    if rows < MIN_LOGIT_ROWS:
        hidden = jnp.pad(hidden, ((0, MIN_LOGIT_ROWS - rows), (0, 0)))
    if lm_head is None:
        local = jnp.einsum("bd,vd->bv", hidden, embed, preferred_element_type=jnp.float32)
    else:
        local = jnp.einsum("bd,dv->bv", hidden, lm_head, preferred_element_type=jnp.float32)
    logits = lax.all_gather(local, HEAD_AXES, axis=1, tiled=True)
    return logits[:rows, :dims.vocab_size]  # drop the padding of the last vocabulary block


def _is_fp8(node) -> bool:
    return isinstance(node, Fp8Weight)


def run_layers(layer_fn, x, layers: LayerWeights, k_cache, v_cache, ctx: Context, *, unrolled: bool = False):
    """Applies ``layer_fn`` over the stacked layers; the caches are threaded through.

    ``lax.scan`` keeps compile time flat in depth (H200: 3.5 s at 2 layers, 3.2 s at 80),
    but XLA copies each layer's weights out of the stack (a dynamic-slice feeding the
    GEMMs), which made a Llama-3-8B decode step of 8 sequences 12.8 ms instead of 5.7 ms
    unrolled, whose static slices fuse (57% of the read-only weight floor; unrolled
    compiles in ~30 s at 32 layers). ``--xla_gpu_enable_dynamic_slice_fusion`` did not
    change it (measured on an H200; benchmarks/README.md, "Layer loop"). The caches are
    never sliced either way.
    """
    num_layers = layers.attn_norm.shape[0]
    if unrolled:
        # The layer is traced and lowered once and called num_layers times (XLA inlines the
        # calls, so the program is the same): with every layer's Pallas kernels lowered apart,
        # a 32-layer step took 5.3 s to trace and lower, 0.2 s now (benchmarks/README.md, "CPU").
        # Where a kernel reads its layer out of the stack, FP8 weights stay stacked, bound to
        # the layer's index: a custom call's operand sliced by XLA is copied first.
        in_place = ctx.fp8_reads_stacked_layers

        @jax.jit
        def layer(x, weights, k_cache, v_cache, index, batch):
            if in_place:
                weights = jax.tree.map(lambda w: dataclasses.replace(w, layer=index) if _is_fp8(w) else w,
                                       weights, is_leaf=_is_fp8)
            return layer_fn(x, weights, k_cache, v_cache, index, ctx.with_batch(batch))

        def weights_of(w, i):
            if _is_fp8(w):
                return w if in_place else Fp8Weight(values=w.values[i], scale=w.scale[i])
            return w[i]

        for i in range(num_layers):
            weights = jax.tree.map(lambda w, i=i: weights_of(w, i), layers, is_leaf=_is_fp8)
            x, k_cache, v_cache = layer(x, weights, k_cache, v_cache, jnp.int32(i), ctx.batch)
        return x, k_cache, v_cache

    def body(carry, xs):
        x, k_cache, v_cache = carry
        weights, layer = xs
        return layer_fn(x, weights, k_cache, v_cache, layer, ctx), None

    (x, k_cache, v_cache), _ = lax.scan(
        body, (x, k_cache, v_cache), (layers, jnp.arange(num_layers, dtype=jnp.int32)))
    return x, k_cache, v_cache
