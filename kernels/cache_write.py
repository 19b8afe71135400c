"""RoPE on the new keys and the step's KV-cache write, from the q|k|v projection, in one kernel.

On XLA's path each layer launches two scatters, one per cache, with RoPE fused into the
K scatter: 2 x 2.5 us a layer on the H200 for one GPU's share of Llama-3-8B decoding 8
sequences (5% of the step's kernel time), almost all of it launch cost; XLA fuses no two
scatters into one kernel, and a single variadic scatter over both caches became a loop of
kernels (benchmarks/x2_results.md). The Pallas kernel (Triton backend) runs one program
per token: it reads the token's K and V heads straight from the projection's output,
rotates K, and stores both rows into the caches, which it aliases (in place under
donation).

Implementations behind ``write_qkv_to_cache``, as for attention: ``"reference"``
(``apply_rope`` then ``reference.write_kv_cache``), ``"pallas"``, and ``"auto"`` (Pallas on
a GPU backend). The kernel rounds as ``apply_rope`` does (cos and sin in the activation
dtype, products and sum in it), so the two differ only where the backends' cos and sin do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from .reference import write_kv_cache

CacheArray = Float[Array, "layers kv_slots num_pages page_size head_dim"]
_IMPLEMENTATIONS = ("auto", "reference", "pallas")


def apply_rope(
    x: Float[Array, "tokens heads head_dim"],
    positions: Int[Array, "tokens"],
    inv_freq: Float[Array, "half"],
) -> Float[Array, "tokens heads head_dim"]:
    """Rotary embedding in Hugging Face's ``rotate_half`` layout."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1).astype(x.dtype)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def write_qkv_to_cache(
    k_cache: CacheArray,
    v_cache: CacheArray,
    qkv: Float[Array, "tokens heads head_dim"],
    positions: Int[Array, "tokens"],
    inv_freq: Float[Array, "half"],
    slot_mapping: Int[Array, "tokens"],
    *,
    q_heads: int,
    layer: Int[Array, ""] | int,
    implementation: str = "auto",
    interpret: bool = False,
) -> tuple[CacheArray, CacheArray]:
    """Rotate the K heads of ``qkv`` (heads: ``q_heads`` queries, then the caches' K slots,
    then their V slots) by RoPE at ``positions`` and write K and V into their slots.

    ``slot_mapping[t] = page * page_size + offset``; padding tokens point into page 0, the
    scratch page, and may collide there. ``interpret`` runs the Pallas kernel in Pallas's
    interpreter (tests on the CPU).
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(_IMPLEMENTATIONS)}.")
    kv_slots, head_dim = k_cache.shape[1], k_cache.shape[4]
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype}{list(k_cache.shape)} and v_cache {v_cache.dtype}"
                         f"{list(v_cache.shape)} must have one shape and dtype.")
    if qkv.shape[1:] != (q_heads + 2 * kv_slots, head_dim):
        raise ValueError(f"qkv {list(qkv.shape)} must be [tokens, {q_heads} + 2 x {kv_slots} heads, {head_dim}].")
    if implementation == "auto":
        implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
    if implementation == "reference":
        k = apply_rope(qkv[:, q_heads:q_heads + kv_slots], positions, inv_freq)
        v = qkv[:, q_heads + kv_slots:]
        return write_kv_cache(k_cache, v_cache, k.astype(k_cache.dtype), v.astype(v_cache.dtype), slot_mapping,
                              layer=layer)
    if head_dim < 4 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the kernel's half rows need a power of two (Triton's shapes).")
    args = [slot_mapping.astype(jnp.int32), positions.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
            inv_freq.astype(jnp.float32), qkv, k_cache, v_cache]
    return pl.pallas_call(
        functools.partial(_kernel, q_heads=q_heads, kv_slots=kv_slots, page_size=k_cache.shape[3]),
        grid=(qkv.shape[0],),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2,
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_qkv_to_cache",
    )(*args)


def _kernel(slot_ref, position_ref, layer_ref, inv_freq_ref, qkv_ref, _k_in, _v_in, k_ref, v_ref, *,
            q_heads, kv_slots, page_size):
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
        k_ref[layer, j, page, offset, lo] = (k_lo * cos + (-k_hi) * sin).astype(k_ref.dtype)
        k_ref[layer, j, page, offset, hi] = (k_hi * cos + k_lo * sin).astype(k_ref.dtype)
        v_ref[layer, j, page, offset, :] = qkv_ref[token, q_heads + kv_slots + j, :].astype(v_ref.dtype)
