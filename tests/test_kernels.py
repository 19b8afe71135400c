"""Attention kernels on the CPU: the reference against a float64 NumPy oracle, the cache
write, and the Pallas kernels in interpret mode against the reference."""

from __future__ import annotations

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

# (q_heads, kv_slots, kv_slot_of_head): uniform GQA, uneven groups, MHA, MQA.
HEAD_MAPS = [(4, 2, None), (5, 2, (0, 0, 0, 1, 1)), (3, 3, None), (4, 1, None), (3, 2, (1, 0, 1))]


@st.composite
def ragged_batches(draw, max_seqs=4, max_q=6, max_cached=20):
    num_seqs = draw(st.integers(1, max_seqs))
    q_lens = draw(st.lists(st.integers(0, max_q), min_size=num_seqs, max_size=num_seqs))
    cached = draw(st.lists(st.integers(0, max_cached), min_size=num_seqs, max_size=num_seqs))
    cached = [c if n else 0 for c, n in zip(cached, q_lens)]  # q_len 0: empty sequence
    return dict(
        q_lens=q_lens,
        cached_lens=cached,
        pad_tokens=draw(st.integers(0, 3)),
        page_size=draw(st.sampled_from([4, 8])),
        heads=draw(st.sampled_from(HEAD_MAPS)),
        head_dim=draw(st.sampled_from([8, 16])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_case(batch, dtype=np.float32):
    q_heads, kv_slots, slots = batch["heads"]
    case = random_case(
        np.random.default_rng(batch["seed"]),
        q_lens=batch["q_lens"], cached_lens=batch["cached_lens"], q_heads=q_heads,
        kv_slots=kv_slots, head_dim=batch["head_dim"], page_size=batch["page_size"],
        pad_tokens=batch["pad_tokens"], dtype=dtype,
    )
    if case.q.shape[0] == 0:  # the API needs at least one token row
        case = random_case(
            np.random.default_rng(batch["seed"]), q_lens=batch["q_lens"],
            cached_lens=batch["cached_lens"], q_heads=q_heads, kv_slots=kv_slots,
            head_dim=batch["head_dim"], page_size=batch["page_size"], pad_tokens=1, dtype=dtype,
        )
    return case, slots


@settings(max_examples=12, deadline=None)
@given(ragged_batches())
def test_reference_matches_float64_oracle(batch):
    case, slots = make_case(batch)
    sm_scale = 1.0 / np.sqrt(case.q.shape[-1])
    out = ragged_paged_attention_reference(
        jnp.asarray(case.q), jnp.asarray(case.k_cache), jnp.asarray(case.v_cache),
        case.metadata(jnp), layer=case.layer, sm_scale=sm_scale, kv_slot_of_head=slots,
    )
    expected = numpy_attention(
        case, sm_scale=sm_scale, slot_of_head=kv_slot_map(case.q.shape[1], case.k_cache.shape[1], slots)
    )
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    padding = slice(int(case.query_start[-1]), None)
    assert (out[padding] == 0).all(), "padding tokens must give zeros"


def test_reference_bf16_close_to_oracle():
    case = random_case(np.random.default_rng(1), q_lens=[5, 1, 3], cached_lens=[7, 30, 0],
                       q_heads=4, kv_slots=2, head_dim=16, page_size=8, pad_tokens=2)
    sm_scale = 0.25
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (case.q, case.k_cache, case.v_cache))
    out = ragged_paged_attention(q, k, v, case.metadata(jnp), layer=case.layer, sm_scale=sm_scale,
                                 implementation="reference")
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

    _, per_layer = jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))
    for layer in range(3):
        direct = ragged_paged_attention_reference(q, k, v, md, layer=layer, sm_scale=0.3)
        np.testing.assert_allclose(per_layer[layer], direct, atol=1e-6)


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


def test_write_kv_cache_is_in_place_under_donation():
    shape = (4, 2, 64, 16, 32)
    k_cache = jnp.zeros(shape, jnp.bfloat16)
    k = jnp.ones((8, 2, 32), jnp.bfloat16)
    write = jax.jit(lambda kc, vc, k, v, s, l: write_kv_cache(kc, vc, k, v, s, layer=l), donate_argnums=(0, 1))
    hlo = write.lower(k_cache, k_cache, k, k, jnp.arange(8, dtype=jnp.int32), jnp.int32(2)).compile().as_text()
    cache_type = "bf16[" + ",".join(map(str, shape)) + "]"
    copies = [line for line in hlo.splitlines() if cache_type in line and (" copy(" in line or "dynamic-slice(" in line)]
    assert not copies, f"the cache write copies the cache: {copies}"


def test_empty_sequences_and_all_padding():
    md = AttentionMetadata(jnp.array([0, 0, 0], jnp.int32), jnp.array([0, 0], jnp.int32),
                           jnp.zeros((2, 3), jnp.int32))
    q = jnp.full((4, 2, 8), 1.0)
    cache = jnp.full((1, 1, 4, 4, 8), jnp.nan)  # nothing may be read
    out = ragged_paged_attention_reference(q, cache, cache, md, layer=0, sm_scale=1.0)
    assert (np.asarray(out) == 0).all()


def test_bad_arguments_fail_with_a_sentence():
    case = random_case(np.random.default_rng(4), q_lens=[2], cached_lens=[1], q_heads=3,
                       kv_slots=2, head_dim=8, page_size=4)
    args = (jnp.asarray(case.q), jnp.asarray(case.k_cache), jnp.asarray(case.v_cache), case.metadata(jnp))
    with pytest.raises(ValueError, match="kv_slot_of_head"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0)
    with pytest.raises(ValueError, match="implementation"):
        ragged_paged_attention(*args, layer=0, sm_scale=1.0, kv_slot_of_head=(0, 1, 1), implementation="cuda")
