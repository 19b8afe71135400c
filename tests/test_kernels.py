"""Attention kernels on the CPU: the reference against a float64 NumPy oracle, the cache
write, and the Pallas kernels in interpret mode against the reference."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftjax.kernels import (
    AttentionMetadata,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_cache,
)
from shiftjax.kernels.metadata import kv_slot_map
from shiftjax.kernels.testing import numpy_attention, random_case

# Shape configurations (q_heads, kv_slots, kv_slot_of_head, page_size, head_dim): uniform
# GQA, uneven groups, MHA, MQA. Hypothesis varies lengths, chunk splits and page tables
# inside one padded shape per configuration, so each configuration compiles once.
SHAPES = [
    (4, 2, None, 4, 16),
    (5, 2, (0, 0, 0, 1, 1), 8, 8),
    (3, 3, None, 4, 8),
    (4, 1, None, 8, 16),
]
SEQS, MAX_Q, MAX_CACHED = 4, 10, 30


@st.composite
def ragged_lengths(draw):
    q_lens = draw(st.lists(st.integers(0, MAX_Q), min_size=SEQS, max_size=SEQS))
    q_lens = draw(st.sampled_from([q_lens, [min(n, 1) for n in q_lens]]))  # mixed or all-decode
    cached = draw(st.lists(st.integers(0, MAX_CACHED), min_size=SEQS, max_size=SEQS))
    cached = [c if n else 0 for c, n in zip(cached, q_lens)]  # q_len 0: an empty sequence
    return q_lens, cached, draw(st.integers(0, 2**31 - 1))


def make_case(shape, lengths, dtype=np.float32):
    q_heads, kv_slots, slots, page_size, head_dim = shape
    q_lens, cached, seed = lengths
    max_pages = -(-(MAX_Q + MAX_CACHED) // page_size)
    case = random_case(
        np.random.default_rng(seed), q_lens=q_lens, cached_lens=cached, q_heads=q_heads,
        kv_slots=kv_slots, head_dim=head_dim, page_size=page_size, dtype=dtype,
        num_tokens=SEQS * MAX_Q + 3, max_pages=max_pages, num_pages=1 + SEQS * max_pages + 2,
    )
    return case, slots


def case_args(case):
    return (jnp.asarray(case.q), jnp.asarray(case.k_cache), jnp.asarray(case.v_cache),
            case.metadata(jnp), jnp.int32(case.layer))


@functools.lru_cache(maxsize=None)
def compiled(fn, **static):
    return jax.jit(lambda q, k, v, md, layer: fn(q, k, v, md, layer=layer, **dict(static)))


def run(fn, case, **static):
    return np.asarray(compiled(fn, **static)(*case_args(case)))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@settings(max_examples=6, deadline=None)
@given(lengths=ragged_lengths())
def test_reference_matches_float64_oracle(shape, lengths):
    case, slots = make_case(shape, lengths)
    sm_scale = 1.0 / np.sqrt(case.q.shape[-1])
    out = run(ragged_paged_attention_reference, case, sm_scale=sm_scale, kv_slot_of_head=slots)
    expected = numpy_attention(
        case, sm_scale=sm_scale, slot_of_head=kv_slot_map(case.q.shape[1], case.k_cache.shape[1], slots)
    )
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    padding = slice(int(case.query_start[-1]), None)
    assert (out[padding] == 0).all(), "padding tokens must give zeros"


def test_reference_bf16_close_to_oracle():
    case = random_case(np.random.default_rng(1), q_lens=[5, 1, 3], cached_lens=[7, 30, 0],
                       q_heads=4, kv_slots=2, head_dim=16, page_size=8, pad_tokens=2)
    sm_scale = 0.25
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.q, case.k_cache, case.v_cache))
    out = compiled(ragged_paged_attention, sm_scale=sm_scale, implementation="reference")(
        q, k, v, case.metadata(jnp), jnp.int32(case.layer))
    assert out.dtype == jnp.bfloat16
    rounded = case.__class__(**{**case.__dict__, **{n: np.asarray(jnp.asarray(getattr(case, n), jnp.bfloat16), np.float32) for n in ("q", "k_cache", "v_cache")}})
    expected = numpy_attention(rounded, sm_scale=sm_scale, slot_of_head=(0, 0, 1, 1))
    err = np.linalg.norm(np.asarray(out, np.float64) - expected) / np.linalg.norm(expected)
    assert err < 1e-2


def test_reference_layer_is_traceable_in_scan():
    case = random_case(np.random.default_rng(2), q_lens=[3, 1], cached_lens=[4, 9],
                       q_heads=4, kv_slots=2, head_dim=8, page_size=4, layers=3)
    q, k, v = (jnp.asarray(x) for x in (case.q, case.k_cache, case.v_cache))
    md = case.metadata(jnp)

    def body(carry, layer):
        return carry, ragged_paged_attention_reference(q, k, v, md, layer=layer, sm_scale=0.3)

    _, per_layer = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32)))()
    direct = compiled(ragged_paged_attention_reference, sm_scale=0.3)
    for layer in range(3):
        np.testing.assert_allclose(per_layer[layer], direct(q, k, v, md, jnp.int32(layer)), atol=1e-6)


def test_write_kv_cache_writes_exactly_the_slots():
    rng = np.random.default_rng(3)
    layers, slots, pages, page_size, dim, tokens = 3, 2, 5, 4, 8, 6
    k_cache = rng.standard_normal((layers, slots, pages, page_size, dim)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    k = rng.standard_normal((tokens, slots, dim)).astype(np.float32)
    v = rng.standard_normal((tokens, slots, dim)).astype(np.float32)
    slot_mapping = np.array([9, 10, 17, 4, 0, 0], np.int32)  # last two: padding -> scratch page 0
    write = jax.jit(lambda kc, vc, k, v, s, l: write_kv_cache(kc, vc, k, v, s, layer=l), donate_argnums=(0, 1))
    new_k, new_v = write(jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, slot_mapping, jnp.int32(1))
    expect_k, expect_v = k_cache.copy(), v_cache.copy()
    for t in range(4):
        page, off = divmod(int(slot_mapping[t]), page_size)
        expect_k[1, :, page, off] = k[t]
        expect_v[1, :, page, off] = v[t]
    new_k, new_v = np.asarray(new_k), np.asarray(new_v)
    keep = np.ones(pages, bool)
    keep[0] = False  # the scratch page's contents are unspecified
    np.testing.assert_array_equal(new_k[:, :, keep], expect_k[:, :, keep])
    np.testing.assert_array_equal(new_v[:, :, keep], expect_v[:, :, keep])


def cache_buffer_ops(hlo: str, cache_shape) -> list[str]:
    """Instructions of an optimized HLO module that copy, slice or convert a buffer the
    size of the whole stacked cache or of one layer of it (with or without the layer
    axis), in any element type: each means the kernel moved cache data it should only
    have indexed."""
    layer = tuple(cache_shape[1:])
    shapes = {tuple(cache_shape), layer, (1, *layer)}
    ops = r"(copy|dynamic-slice|slice|convert|dynamic-update-slice)"
    return [m.group(0) for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} " + ops + r"\(", hlo)
            if tuple(int(d) for d in m.group(1).split(",") if d) in shapes]


def write_through_a_layer_slice(k_cache, v_cache, k, v, slot_mapping, *, layer):
    """Broken on purpose: takes one layer's cache out, writes it, puts it back (the copy
    the stacked cache with a layer index exists to avoid)."""
    page_size = k_cache.shape[3]
    page, offset = slot_mapping // page_size, slot_mapping % page_size

    def one(cache, new):
        layer_cache = jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False)
        layer_cache = layer_cache.at[:, page, offset].set(new.swapaxes(0, 1).astype(cache.dtype))
        return jax.lax.dynamic_update_index_in_dim(cache, layer_cache, layer, 0)

    return one(k_cache, k), one(v_cache, v)


def attention_of_a_layer_slice(q, k_cache, v_cache, metadata, *, layer, sm_scale):
    """Broken on purpose: hands the attention one layer's slice of the cache."""
    take = lambda cache: jax.lax.dynamic_index_in_dim(cache, layer, keepdims=True)  # noqa: E731
    return ragged_paged_attention_reference(q, take(k_cache), take(v_cache), metadata, layer=0, sm_scale=sm_scale)


CACHE_SHAPE = (4, 2, 64, 16, 32)  # layers, kv_slots, pages, page_size, head_dim
# The HLO checked is XLA:CPU's default code generation, which the test run's flags change for
# speed (tests/subprocess_env.py): its fusion emitters write a cache update inside a fusion
DEFAULT_CPU_CODEGEN = {"xla_cpu_use_fusion_emitters": True}


def write_hlo(write, dtype=jnp.bfloat16):
    k_cache = jnp.zeros(CACHE_SHAPE, dtype)
    k = jnp.ones((8, 2, 32), dtype)
    jitted = jax.jit(lambda kc, vc, k, v, s, l: write(kc, vc, k, v, s, layer=l), donate_argnums=(0, 1))
    lowered = jitted.lower(k_cache, k_cache, k, k, jnp.arange(8, dtype=jnp.int32), jnp.int32(2))
    return lowered.compile(DEFAULT_CPU_CODEGEN).as_text()


def attention_hlo(attention):
    case = random_case(np.random.default_rng(6), q_lens=[5, 1, 1], cached_lens=[0, 30, 70], q_heads=4,
                       kv_slots=2, head_dim=32, page_size=16, layers=4, num_pages=64, max_pages=8)
    q = jnp.asarray(case.q, jnp.bfloat16)
    cache = jax.ShapeDtypeStruct(CACHE_SHAPE, jnp.bfloat16)
    jitted = jax.jit(lambda q, kc, vc, md, l: attention(q, kc, vc, md, layer=l, sm_scale=0.2))
    return jitted.lower(q, cache, cache, case.metadata(jnp), jnp.int32(2)).compile(DEFAULT_CPU_CODEGEN).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_write_kv_cache_is_in_place_under_donation(dtype):
    ops = cache_buffer_ops(write_hlo(write_kv_cache, dtype), CACHE_SHAPE)
    assert not ops, f"the cache write copies the cache or a layer of it: {ops}"


def test_reference_attention_reads_the_stacked_cache_without_copying_a_layer():
    ops = cache_buffer_ops(attention_hlo(ragged_paged_attention_reference), CACHE_SHAPE)
    assert not ops, f"the attention copies the cache or a layer of it: {ops}"


@pytest.mark.parametrize("hlo", [lambda: write_hlo(write_through_a_layer_slice),
                                 lambda: attention_hlo(attention_of_a_layer_slice)],
                         ids=["write_through_a_layer_slice", "attention_of_a_layer_slice"])
def test_the_copy_check_rejects_a_per_layer_copy(hlo):
    ops = cache_buffer_ops(hlo(), CACHE_SHAPE)
    assert ops, "a kernel that slices out one layer of the cache went unnoticed"


def test_empty_sequences_and_all_padding():
    md = AttentionMetadata(jnp.array([0, 0, 0], jnp.int32), jnp.array([0, 0], jnp.int32),
                           jnp.zeros((2, 3), jnp.int32))
    q = jnp.full((4, 2, 8), 1.0)
    cache = jnp.full((1, 1, 4, 4, 8), jnp.nan)  # nothing may be read
    out = compiled(ragged_paged_attention_reference, sm_scale=1.0)(q, cache, cache, md, jnp.int32(0))
    assert (np.asarray(out) == 0).all()


def test_bad_arguments_fail_with_a_sentence():
    case = random_case(np.random.default_rng(4), q_lens=[2], cached_lens=[1], q_heads=3,
                       kv_slots=2, head_dim=8, page_size=4)
    args = (jnp.asarray(case.q), jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), case.metadata(jnp))
    with pytest.raises(ValueError, match="kv_slot_of_head"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0)
    with pytest.raises(ValueError, match="implementation"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0, kv_slot_of_head=(0, 1, 1), implementation="cuda")


# --- Pallas kernels, interpret mode on the CPU -------------------------------------------

from shiftjax.kernels.pallas_gpu import PallasAttentionConfig, ragged_paged_attention_pallas  # noqa: E402

# Small blocks so that tiny shapes still take several key blocks, decode splits and tiles.
TINY = PallasAttentionConfig(prefill_rows=16, prefill_block_k=16, decode_block_k=16, decode_splits=2, interpret=True)


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:], ids=str)
@settings(max_examples=4, deadline=None)
@given(lengths=ragged_lengths())
def test_pallas_interpret_matches_reference(shape, lengths):
    case, slots = make_case(shape, lengths)
    static = dict(sm_scale=1.0 / np.sqrt(case.q.shape[-1]), kv_slot_of_head=slots)
    expected = run(ragged_paged_attention_reference, case, **static)
    # Poisoned: every kernel output starts as NaN, so a row nobody writes stays NaN.
    out = run(ragged_paged_attention_pallas, case, **static, config=TINY, _poison=True)
    real = int(case.query_start[-1])
    assert np.isfinite(out[:real]).all(), "a real token's row was not written"
    np.testing.assert_allclose(out[:real], expected[:real], atol=2e-5, rtol=2e-5)
    # The public path: padding rows are zeros, not NaN.
    out = run(ragged_paged_attention, case, **static, implementation="pallas", config=TINY)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    assert (out[real:] == 0).all()


def test_pallas_interpret_bf16_and_default_splits():
    case = random_case(np.random.default_rng(5), q_lens=[1, 17, 1, 1], cached_lens=[40, 3, 0, 70],
                       q_heads=8, kv_slots=2, head_dim=16, page_size=16, pad_tokens=2)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.q, case.k_cache, case.v_cache))
    args = (q, k, v, case.metadata(jnp), jnp.int32(case.layer))
    expected = np.asarray(compiled(ragged_paged_attention_reference, sm_scale=0.25)(*args), np.float32)
    config = PallasAttentionConfig(prefill_rows=16, prefill_block_k=16, decode_block_k=16, interpret=True)
    out = compiled(ragged_paged_attention_pallas, sm_scale=0.25, config=config, _poison=True)(*args)
    assert out.dtype == jnp.bfloat16
    real = int(case.query_start[-1])
    out = np.asarray(out, np.float32)[:real]
    err = np.linalg.norm(out - expected[:real]) / np.linalg.norm(expected[:real])
    assert err < 2e-2, err
    # q in f32 over the bf16 cache (as a model may pass it): output in f32, same values.
    args32 = (q.astype(jnp.float32), *args[1:])
    out32 = compiled(ragged_paged_attention_pallas, sm_scale=0.25, config=config)(*args32)
    assert out32.dtype == jnp.float32
    err = np.linalg.norm(np.asarray(out32)[:real] - expected[:real]) / np.linalg.norm(expected[:real])
    assert err < 2e-2, err


def test_pallas_interpret_merges_the_splits_a_chunk_at_a_time(monkeypatch):
    """A merge tile smaller than the splits: the merge folds them a chunk a step, the last
    chunk part padding, and each decode sequence only the splits its context reached."""
    from shiftjax.kernels import pallas_gpu

    monkeypatch.setattr(pallas_gpu, "_MERGE_TILE_ELEMENTS", 64)  # group 2 x head_dim 16: 2 splits a step
    assert pallas_gpu._merge_tiles(7, 2, 16) == (2, 16)
    case = random_case(np.random.default_rng(11), q_lens=[1, 1, 3, 1], cached_lens=[103, 6, 20, 40],
                       q_heads=4, kv_slots=2, head_dim=16, page_size=16, max_pages=7, pad_tokens=3)
    config = PallasAttentionConfig(prefill_rows=16, prefill_block_k=16, decode_block_k=16, decode_splits=7,
                                   interpret=True)
    static = dict(sm_scale=0.25)
    expected = run(ragged_paged_attention_reference, case, **static)
    fn = jax.jit(lambda q, k, v, md, layer: ragged_paged_attention_pallas(
        q, k, v, md, layer=layer, config=config, _poison=True, **static))
    out = np.asarray(fn(*case_args(case)))
    real = int(case.query_start[-1])
    np.testing.assert_allclose(out[:real], expected[:real], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim,page_size,dtype", [(64, 16, jnp.bfloat16), (128, 128, jnp.float32), (64, 128, jnp.bfloat16), (128, 32, jnp.bfloat16)])
def test_pallas_lowers_to_triton(head_dim, page_size, dtype):
    """The Triton lowering (not only interpret mode) accepts the supported shapes; checked
    by lowering for CUDA on this CPU-only machine, which needs no GPU."""
    tokens, seqs, max_pages, pages, q_heads, kv_slots = 40, 4, 8, 40, 9, 3
    spec = jax.ShapeDtypeStruct
    args = (
        spec((tokens, q_heads, head_dim), dtype),
        spec((3, kv_slots, pages, page_size, head_dim), dtype),
        spec((3, kv_slots, pages, page_size, head_dim), dtype),
        AttentionMetadata(spec((seqs + 1,), jnp.int32), spec((seqs,), jnp.int32), spec((seqs, max_pages), jnp.int32)),
        spec((), jnp.int32),
    )
    fn = jax.jit(lambda q, k, v, md, layer: ragged_paged_attention_pallas(q, k, v, md, layer=layer, sm_scale=0.1))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # decode, merge and prefill kernels


def test_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="power of two"):
        PallasAttentionConfig(prefill_block_k=48)
    with pytest.raises(ValueError, match="warps"):
        PallasAttentionConfig(decode_num_warps=3)
    with pytest.raises(ValueError, match="decode_splits"):
        PallasAttentionConfig(decode_splits=0)
