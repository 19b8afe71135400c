"""The Pallas kernel behind ``cache_write.write_qkv_to_cache`` (Triton backend, as the
attention kernels in ``pallas_gpu.py``): one program per token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Int

from .cache_write import CacheArray, Frequencies, QkvHeads, TokenInts
from .reference import to_cache_dtype


def write_qkv_to_cache_pallas(
    k_cache: CacheArray, v_cache: CacheArray, qkv: QkvHeads, positions: TokenInts, inv_freq: Frequencies,
    slot_mapping: TokenInts, *, q_heads: int, layer: Int[Array, ""] | int, interpret: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[CacheArray, CacheArray]:
    """``write_qkv_to_cache``'s Pallas path (same contract; the caller checked the shapes and
    the scales). An FP8 cache's rows go through ``to_cache_dtype`` inside the kernel, in f32
    (e4m3 stores need compute capability 8.9 or later: the H200 is 9.0)."""
    head_dim = k_cache.shape[4]
    if head_dim < 4 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the kernel's half rows need a power of two (Triton's shapes); "
                         "use implementation='reference' otherwise.")
    args = [slot_mapping.astype(jnp.int32), positions.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            inv_freq.astype(jnp.float32), qkv, k_cache, v_cache]
    return pl.pallas_call(
        functools.partial(_kernel, q_heads=q_heads, kv_slots=k_cache.shape[1], page_size=k_cache.shape[3],
                          k_scale=k_scale, v_scale=v_scale),
        grid=(qkv.shape[0],),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2,
        input_output_aliases={5: 0, 6: 1},  # k_cache, v_cache: written in place
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_qkv_to_cache",
    )(*args)


def _kernel(slot_ref, position_ref, layer_ref, inv_freq_ref, qkv_ref, _k_in, _v_in, k_ref, v_ref, *,
            q_heads, kv_slots, page_size, k_scale, v_scale):
    token = pl.program_id(0)
    slot = slot_ref[token]
    page, offset, layer = slot // page_size, slot % page_size, layer_ref[0]
    half = inv_freq_ref.shape[0]
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    dtype = qkv_ref.dtype
    angles = position_ref[token].astype(jnp.float32) * inv_freq_ref[...]
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    for j in range(kv_slots):  # few and static
        k_lo, k_hi = qkv_ref[token, q_heads + j, lo], qkv_ref[token, q_heads + j, hi]
        # rotate_half: [x_lo, x_hi] -> [-x_hi, x_lo], each product and the sum rounded as in apply_rope
        k_ref[layer, j, page, offset, lo] = to_cache_dtype(k_lo * cos + (-k_hi) * sin, k_ref.dtype, k_scale)
        k_ref[layer, j, page, offset, hi] = to_cache_dtype(k_hi * cos + k_lo * sin, k_ref.dtype, k_scale)
        v_ref[layer, j, page, offset, :] = to_cache_dtype(qkv_ref[token, q_heads + kv_slots + j, :], v_ref.dtype,
                                                          v_scale)
