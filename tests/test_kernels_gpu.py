"""Pallas kernels compiled for the GPU (attention, the KV-cache write), against their
references on the same GPU.

Run on the H200 with ``-m gpu``; skipped without a CUDA device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftjax.kernels import ragged_paged_attention, ragged_paged_attention_reference
from shiftjax.kernels import reference as _reference
from shiftjax.kernels.cache_write import write_qkv_to_cache
from shiftjax.kernels.pallas_gpu import PallasAttentionConfig, ragged_paged_attention_pallas
from shiftjax.kernels import triton_offsets
from shiftjax.kernels.testing import random_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (JAX_PLATFORMS=cuda)"),
]

# (q_heads, kv_slots, kv_slot_of_head, head_dim, page_size, dtype)
SHAPES = [
    (32, 8, None, 128, 16, jnp.bfloat16),  # Llama-3-8B on one GPU
    (8, 1, None, 128, 64, jnp.bfloat16),  # Llama-3-70B TP-8 shard
    (9, 3, None, 64, 128, jnp.float32),  # SmolLM2-135M, f32
    (5, 2, (0, 0, 0, 1, 1), 64, 32, jnp.bfloat16),  # uneven GQA groups
    (4, 4, None, 128, 16, jnp.float32),  # MHA
]
SEQS, MAX_Q, MAX_CACHED = 6, 300, 700
# The reference is the oracle here; on the GPU it may hold more at once (faster compile).
_reference._CHUNK_BUDGET_BYTES = 2 << 30
DEFAULT = PallasAttentionConfig()
SMALL_BLOCKS = PallasAttentionConfig(decode_splits=3, decode_block_k=64, prefill_rows=64)
CASES = [(shape, DEFAULT) for shape in SHAPES] + [(SHAPES[0], SMALL_BLOCKS), (SHAPES[3], SMALL_BLOCKS)]


@st.composite
def ragged_lengths(draw):
    q_lens = draw(st.lists(st.sampled_from([0, 1, 1, 2, 17, 64, 300]) | st.integers(0, MAX_Q), min_size=SEQS, max_size=SEQS))
    cached = draw(st.lists(st.integers(0, MAX_CACHED), min_size=SEQS, max_size=SEQS))
    cached = [c if n else 0 for c, n in zip(cached, q_lens)]
    return q_lens, cached, draw(st.integers(0, 2**31 - 1))


@functools.lru_cache(maxsize=None)
def compiled(fn, **static):
    return jax.jit(lambda q, k, v, md, layer: fn(q, k, v, md, layer=layer, **dict(static)))


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _case_id(case):
    (q_heads, kv_slots, _, head_dim, page_size, dtype), config = case
    return f"{q_heads}q{kv_slots}kv_d{head_dim}_p{page_size}_{jnp.dtype(dtype).name}_{'default' if config == DEFAULT else 'small'}"


@pytest.mark.parametrize("shape,config", CASES, ids=[_case_id(c) for c in CASES])
@settings(max_examples=2, deadline=None)
@given(lengths=ragged_lengths())
def test_pallas_matches_reference_on_gpu(shape, config, lengths):
    q_heads, kv_slots, slots, head_dim, page_size, dtype = shape
    q_lens, cached, seed = lengths
    max_pages = -(-(MAX_Q + MAX_CACHED) // page_size)
    case = random_case(
        np.random.default_rng(seed), q_lens=q_lens, cached_lens=cached, q_heads=q_heads, kv_slots=kv_slots,
        head_dim=head_dim, page_size=page_size, layers=3, num_tokens=SEQS * MAX_Q + 5,
        max_pages=max_pages, num_pages=1 + SEQS * max_pages + 3,
    )
    args = (*(jnp.asarray(x, dtype) for x in (case.q, case.k_cache, case.v_cache)), case.metadata(jnp), jnp.int32(case.layer))
    static = dict(sm_scale=1.0 / np.sqrt(head_dim), kv_slot_of_head=slots)
    # The oracle's f32 dots at full precision: XLA's default on the GPU is TF32, whose 10-bit
    # mantissa alone exceeds the f32 tolerance where one key dominates (a 1-token context:
    # the reference's output is v rounded to TF32); the kernels' f32 dots are HIGHEST.
    with jax.default_matmul_precision("highest"):
        expected = np.asarray(compiled(ragged_paged_attention_reference, **static)(*args), np.float32)
    poisoned = np.asarray(compiled(ragged_paged_attention_pallas, **static, config=config, _poison=True)(*args), np.float32)
    real = int(case.query_start[-1])
    assert np.isfinite(poisoned[:real]).all(), "a real token's row was not written"
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    if real:
        assert relative_error(poisoned[:real], expected[:real]) < tol
    out = np.asarray(compiled(ragged_paged_attention, **static, implementation="auto", config=config)(*args), np.float32)
    assert (out[real:] == 0).all(), "padding tokens must give zeros"
    if real:
        assert relative_error(out[:real], expected[:real]) < tol


def test_layer_scan_on_gpu():
    case = random_case(np.random.default_rng(1), q_lens=[1, 40, 1], cached_lens=[500, 30, 0], q_heads=8,
                       kv_slots=2, head_dim=128, page_size=16, layers=4)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.q, case.k_cache, case.v_cache))
    md = case.metadata(jnp)

    @jax.jit
    def per_layer(q, k, v, md):
        def body(carry, layer):
            return carry, ragged_paged_attention(q, k, v, md, layer=layer, sm_scale=0.1, implementation="pallas")
        return jax.lax.scan(body, None, jnp.arange(4, dtype=jnp.int32))[1]

    got = per_layer(q, k, v, md)
    for layer in range(4):
        want = compiled(ragged_paged_attention_reference, sm_scale=0.1)(q, k, v, md, jnp.int32(layer))
        assert relative_error(got[layer], want) < 2e-2
    hlo = per_layer.lower(q, k, v, md).compile().as_text()
    cache_type = "bf16[" + ",".join(map(str, k.shape)) + "]"
    assert not [line for line in hlo.splitlines() if cache_type in line and (" copy(" in line or "dynamic-slice(" in line)], \
        "the layer scan copies or slices the cache"


_PAGE_ELEMENTS = 4 * 8 * 16 * 128  # layers x KV slots x page size x head_dim


@pytest.mark.parametrize("dtype,num_pages", [
    ("bfloat16", 2**31 // _PAGE_ELEMENTS + 1024),       # past 2**31 elements and 4 GiB: 64-bit offsets
    ("float8_e4m3fn", 2**31 // _PAGE_ELEMENTS - 1),     # the last count below the gap (triton_offsets)
    ("float8_e4m3fn", 2**32 // _PAGE_ELEMENTS + 1024),  # past the gap: 64-bit offsets
])
def test_cache_larger_than_int32_offsets(dtype, num_pages):
    """A stacked cache of about 2**31 elements per array or more, read at its far end.

    Element offsets past 2**31 overflow if the kernel's pointer arithmetic is 32-bit; an
    FP8 array of 2 to 4 GiB would (``CacheGeometry.triton_unreachable_pages``: the engine
    makes none). The reference (XLA gathers) is the oracle.
    """
    layers, kv_slots, page_size, head_dim = 4, 8, 16, 128
    shape = (layers, kv_slots, num_pages, page_size, head_dim)
    assert triton_offsets.reaches(int(np.prod(shape)), jnp.dtype(dtype).itemsize)
    rng = np.random.default_rng(0)
    q_lens, seq_lens = [1, 40, 1], [97, 120, 33]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    top = rng.permutation(np.arange(num_pages - 64, num_pages))  # the last pages of the array
    page_table = np.zeros((3, max(pages_needed)), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        page_table[b, :n] = top[used:used + n]
        used += n
    layer = layers - 1

    @jax.jit
    def make_caches(key):
        k_key, v_key = jax.random.split(key)
        k = jnp.zeros(shape, dtype)
        v = jnp.zeros(shape, dtype)
        rows = jnp.asarray(top[:used])
        fill = (kv_slots, used, page_size, head_dim)
        k = k.at[layer, :, rows].set(jax.random.normal(k_key, fill, jnp.bfloat16).transpose(1, 0, 2, 3).astype(dtype))
        v = v.at[layer, :, rows].set(jax.random.normal(v_key, fill, jnp.bfloat16).transpose(1, 0, 2, 3).astype(dtype))
        return k, v

    k_cache, v_cache = make_caches(jax.random.key(1))
    from shiftjax.kernels import AttentionMetadata

    metadata = AttentionMetadata(
        query_start=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        seq_lens=jnp.asarray(seq_lens, jnp.int32), page_table=jnp.asarray(page_table))
    q = jnp.asarray(rng.standard_normal((48, 32, head_dim)), jnp.bfloat16)
    kwargs = dict(layer=jnp.int32(layer), sm_scale=head_dim ** -0.5)
    want = jax.jit(lambda *a: ragged_paged_attention_reference(*a, **kwargs))(q, k_cache, v_cache, metadata)
    got = jax.jit(lambda *a: ragged_paged_attention_pallas(*a, **kwargs))(q, k_cache, v_cache, metadata)
    rows = int(sum(q_lens))
    assert relative_error(got[:rows], want[:rows]) < 2e-2
    assert float(jnp.abs(want[:rows].astype(jnp.float32)).max()) > 0  # the far pages were read


@pytest.mark.parametrize("tokens", [16, 64])
def test_cache_write_on_gpu(tokens):
    """One GPU's share of Llama-3-8B over two (16 q, 4 KV heads, head_dim 128), bf16: K and V
    rows in place, V byte for byte, K within a rounding of the reference's RoPE."""
    rng = np.random.default_rng(tokens)
    shape = (4, 4, 64, 16, 128)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    qkv = jnp.asarray(rng.standard_normal((tokens, 24, 128)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 100_000, tokens), jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** (-np.arange(0, 128, 2) / 128), jnp.float32)
    slots = jnp.asarray(rng.choice(np.arange(16, 64 * 16), tokens, replace=False), jnp.int32)

    def write(implementation):
        fn = jax.jit(lambda kc, vc: write_qkv_to_cache(kc, vc, qkv, positions, inv_freq, slots, q_heads=16,
                                                         layer=jnp.int32(2), implementation=implementation),
                     donate_argnums=(0, 1))
        return fn, [np.asarray(c) for c in fn(jnp.copy(k_cache), jnp.copy(v_cache))]

    fn, (got_k, got_v) = write("pallas")
    _, (want_k, want_v) = write("reference")
    np.testing.assert_array_equal(got_v.view(np.uint16), want_v.view(np.uint16))
    diff = np.abs(got_k.astype(np.float32) - want_k.astype(np.float32))
    assert diff.max() <= 2 * 2.0 ** -7 * (np.abs(want_k.astype(np.float32)) + 5.0).max(), diff.max()
    hlo = fn.lower(k_cache, v_cache).compile().as_text()
    assert "write_qkv_to_cache" in hlo
    assert not [line for line in hlo.splitlines() if "bf16[4,4,64,16,128]" in line and " copy(" in line], \
        "the write copies a cache"
