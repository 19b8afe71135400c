"""RoPE on the new keys and the step's KV-cache write, from the q|k|v projection, in one kernel.

On XLA's path each layer launches two scatters, one per cache, with RoPE fused into the
K scatter: 2 x 2.5 us a layer on the H200 for one GPU's share of Llama-3-8B decoding 8
sequences (5% of the step's kernel time), almost all of it launch cost; XLA fuses no two
scatters into one kernel, and a single variadic scatter over both caches became a loop of
kernels (benchmarks/README.md, "One GPU" and "Tried and not kept"). The Pallas kernel (Triton backend) runs one program
per token: it reads the token's K and V heads straight from the projection's output,
rotates K, and stores both rows into the caches, which it aliases (in place under
donation).

Implementations behind ``write_qkv_to_cache``, as for attention: ``"reference"``
(``apply_rope`` then ``reference.write_kv_cache``), ``"pallas"``, and ``"auto"`` (Pallas on
a GPU backend). The kernel rounds as ``apply_rope`` does (cos and sin in the activation
dtype, products and sum in it); the two may differ by a rounding where a backend's cos or
sin does, or where one contracts a product and its sum into an FMA.

An FP8 cache (``float8_e4m3fn``) stores ``k / k_scale`` (K after RoPE) and ``v / v_scale``
clipped to +-448 and rounded to e4m3, both paths through ``reference.to_cache_dtype``;
other caches ignore the scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .reference import check_scales, is_fp8_cache, write_kv_cache

CacheArray = Float[Array, "layers kv_slots num_pages page_size head_dim"]
QkvHeads = Float[Array, "tokens heads head_dim"]
TokenInts = Int[Array, "tokens"]
Frequencies = Float[Array, "half"]
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[CacheArray, CacheArray]:
    """Rotate the K heads of ``qkv`` (heads: ``q_heads`` queries, then the caches' K slots,
    then their V slots) by RoPE at ``positions`` and write K and V into their slots.

    ``slot_mapping[t] = page * page_size + offset``; padding tokens point into page 0, the
    scratch page, and may collide there. ``interpret`` runs the Pallas kernel in Pallas's
    interpreter (tests on the CPU). ``k_scale`` / ``v_scale``: the static scales of an FP8
    cache (stored values are ``x / scale``); ignored for other cache dtypes.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(_IMPLEMENTATIONS)}.")
    kv_slots, head_dim = k_cache.shape[1], k_cache.shape[4]
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype}{list(k_cache.shape)} and v_cache {v_cache.dtype}"
                         f"{list(v_cache.shape)} must have one shape and dtype.")
    if qkv.shape[1:] != (q_heads + 2 * kv_slots, head_dim):
        raise ValueError(f"qkv {list(qkv.shape)} must be [tokens, {q_heads} + 2 x {kv_slots} heads, {head_dim}].")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq {list(inv_freq.shape)} must hold head_dim / 2 = {head_dim // 2} frequencies.")
    check_scales(k_scale, v_scale)
    if not is_fp8_cache(k_cache.dtype):
        k_scale = v_scale = 1.0  # ignored: the kernel's arithmetic is exactly the unscaled one
    if implementation == "auto":
        implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
    if implementation == "reference":
        k = apply_rope(qkv[:, q_heads:q_heads + kv_slots], positions, inv_freq)
        v = qkv[:, q_heads + kv_slots:]
        # write_kv_cache rounds once to the cache's dtype (a plain cast unless FP8).
        return write_kv_cache(k_cache, v_cache, k, v, slot_mapping, layer=layer, k_scale=k_scale, v_scale=v_scale)
    from .cache_write_gpu import write_qkv_to_cache_pallas  # Triton lowering only when asked

    return write_qkv_to_cache_pallas(k_cache, v_cache, qkv, positions, inv_freq, slot_mapping, q_heads=q_heads,
                                     layer=layer, interpret=interpret, k_scale=k_scale, v_scale=v_scale)
