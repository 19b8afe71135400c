"""RoPE and the KV-cache write from the q|k|v projection (kernels/cache_write.py): the Pallas
kernel in interpret mode on the CPU against its reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftjax.kernels import write_kv_cache
from shiftjax.kernels.cache_write import apply_rope, write_qkv_to_cache


def case(rng, tokens, q_heads, kv_slots, head_dim, layers=3, pages=6, page_size=4, dtype=jnp.float32):
    shape = (layers, kv_slots, pages, page_size, head_dim)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    qkv = jnp.asarray(rng.standard_normal((tokens, q_heads + 2 * kv_slots, head_dim)), dtype)
    positions = jnp.asarray(rng.integers(0, 5000, tokens), jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, head_dim, 2) / head_dim), jnp.float32)
    return k_cache, v_cache, qkv, positions, inv_freq


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_kernel_matches_the_reference(data):
    """Random slots (padding colliding in the scratch page 0 included), layer, heads, dtype:
    outside page 0, V byte for byte and K within one rounding of the reference."""
    page_size, pages = 4, 6
    tokens = data.draw(st.integers(1, 9))
    kv_slots = data.draw(st.integers(1, 3))
    dtype = data.draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    real = data.draw(st.lists(st.integers(page_size, pages * page_size - 1), max_size=tokens, unique=True))
    slots = jnp.asarray(real + [data.draw(st.integers(0, page_size - 1)) for _ in range(tokens - len(real))], jnp.int32)
    layer = data.draw(st.integers(0, 2))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    k_cache, v_cache, qkv, positions, inv_freq = case(rng, tokens, 2 * kv_slots, kv_slots, 32, pages=pages,
                                                      page_size=page_size, dtype=dtype)
    kwargs = dict(q_heads=2 * kv_slots, layer=jnp.int32(layer))
    want = write_qkv_to_cache(k_cache, v_cache, qkv, positions, inv_freq, slots, implementation="reference", **kwargs)
    got = write_qkv_to_cache(k_cache, v_cache, qkv, positions, inv_freq, slots, implementation="pallas",
                             interpret=True, **kwargs)
    (got_k, got_v), (want_k, want_v) = got, want
    assert got_k.dtype == got_v.dtype == want_k.dtype == dtype
    written = (slice(None), slice(None), slice(1, None))  # page 0 is the scratch page
    np.testing.assert_array_equal(np.asarray(got_v)[written].view(np.uint8), np.asarray(want_v)[written].view(np.uint8))
    # K: the same products and sum, but whether a backend contracts a product and its sum
    # into one FMA is its own: apart by a rounding of the products (near-cancelling sums
    # make that large against the result, so the bound is on the inputs' scale).
    ulp = 2.0 ** -23 if dtype == jnp.float32 else 2.0 ** -7
    got_k, want_k = (np.asarray(x[:, :, 1:], np.float64) for x in (got_k, want_k))
    bound = 2 * ulp * (np.abs(want_k) + float(jnp.abs(qkv.astype(jnp.float32)).max()))
    assert (np.abs(got_k - want_k) <= bound).all(), float(np.abs(got_k - want_k).max())


def test_reference_is_rope_then_the_write():
    """The reference path is the model's arithmetic of before: apply_rope on K, then the write."""
    k_cache, v_cache, qkv, positions, inv_freq = case(np.random.default_rng(0), 5, 4, 2, 32)
    slots = jnp.asarray([4, 5, 9, 22, 0], jnp.int32)
    got = write_qkv_to_cache(k_cache, v_cache, qkv, positions, inv_freq, slots, q_heads=4, layer=1,
                             implementation="reference")
    k = apply_rope(qkv[:, 4:6], positions, inv_freq)
    want = write_kv_cache(k_cache, v_cache, k, qkv[:, 6:], slots, layer=1)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    page, offset = divmod(22, 4)
    np.testing.assert_array_equal(got[1][1, :, page, offset], qkv[3, 6:])  # V lands unrotated


def test_the_kernel_lowers_to_triton_at_llama_shapes():
    """Pallas to Triton IR for CUDA without a GPU (nothing compiled): one GPU's share of
    Llama-3-8B over two (16 q, 4 KV heads, head_dim 128), bf16. The GPU run is
    tests/test_kernels_gpu.py's."""
    cache = jax.ShapeDtypeStruct((32, 4, 1024, 16, 128), jnp.bfloat16)
    qkv = jax.ShapeDtypeStruct((16, 24, 128), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct((16,), jnp.int32)
    inv_freq = jax.ShapeDtypeStruct((64,), jnp.float32)
    fn = jax.jit(lambda kc, vc, qkv, p, f, s: write_qkv_to_cache(kc, vc, qkv, p, f, s, q_heads=16, layer=3,
                                                                   implementation="pallas"))
    assert "triton" in fn.trace(cache, cache, qkv, ints, inv_freq, ints).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_arguments_fail_with_a_sentence():
    k_cache, v_cache, qkv, positions, inv_freq = case(np.random.default_rng(1), 2, 4, 2, 32)
    slots = jnp.zeros(2, jnp.int32)
    defaults = dict(k_cache=k_cache, v_cache=v_cache, qkv=qkv, positions=positions, inv_freq=inv_freq,
                    slot_mapping=slots, q_heads=4, layer=0)
    call = lambda **kw: write_qkv_to_cache(**{**defaults, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="implementation"):
        call(implementation="cuda")
    with pytest.raises(ValueError, match="must be \\[tokens, 3 \\+ 2 x 2 heads"):
        call(q_heads=3)
    with pytest.raises(ValueError, match="one shape and dtype"):
        call(v_cache=v_cache.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="head_dim / 2 = 16 frequencies"):
        call(inv_freq=inv_freq[:8], implementation="pallas")
    k24, v24, qkv24, _, _ = case(np.random.default_rng(2), 2, 4, 2, 24)
    with pytest.raises(ValueError, match="power of two"):
        call(k_cache=k24, v_cache=v24, qkv=qkv24, inv_freq=inv_freq[:12], implementation="pallas")


def test_f32_activations_over_a_bf16_cache():
    """A model may carry activations in f32 over a bf16 cache: K rotated in f32, then rounded
    once to the cache's dtype, as the reference does."""
    k_cache, v_cache, qkv, positions, inv_freq = case(np.random.default_rng(3), 6, 4, 2, 32, dtype=jnp.bfloat16)
    qkv = qkv.astype(jnp.float32) * 1.001  # values a bf16 cache cannot hold exactly
    slots = jnp.asarray([4, 9, 13, 17, 21, 2], jnp.int32)
    kwargs = dict(q_heads=4, layer=2)
    want = write_qkv_to_cache(k_cache, v_cache, qkv, positions, inv_freq, slots, implementation="reference", **kwargs)
    got = write_qkv_to_cache(k_cache, v_cache, qkv, positions, inv_freq, slots, implementation="pallas",
                             interpret=True, **kwargs)
    for a, b in zip(got, want):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a[:, :, 1:], np.float32), np.asarray(b[:, :, 1:], np.float32))
