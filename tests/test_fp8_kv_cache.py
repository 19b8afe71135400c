"""The FP8 KV cache: K and V stored as float8_e4m3fn, divided by a static scale per cache.

On the CPU: the write (reference and the Pallas kernel in interpret mode) stores what
``to_cache_dtype`` defines, clipping included; attention over an FP8 cache equals attention
over the dequantised cache (the reference and both Pallas kernels, decode and prefill) and
is close to attention over the unquantised cache; a model step writes and reads the same
FP8 cache in TP and SP mode; the page size in bytes halves. The ``gpu`` tests repeat the
kernel checks compiled for the H200 (``-m gpu``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from shiftjax.kernels import ragged_paged_attention, write_kv_cache
from shiftjax.kernels.cache_write import write_qkv_to_cache
from shiftjax.kernels.pallas_gpu import PallasAttentionConfig
from shiftjax.kernels.reference import FP8_MAX, to_cache_dtype
from shiftjax.kernels.testing import random_case

FP8 = jnp.float8_e4m3fn
ON_GPU = jax.default_backend() == "gpu"
# Small blocks, so the tiny shapes still take several key blocks, decode splits and tiles.
TINY = PallasAttentionConfig(prefill_rows=16, prefill_block_k=16, decode_block_k=16, decode_splits=2,
                             interpret=not ON_GPU)
cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU checks (interpret mode); the gpu tests cover the device")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (JAX_PLATFORMS=cuda)")


def e4m3_of(x, scale):
    """The FP8 cache's contract in NumPy: x / scale (times the f32 reciprocal), clipped to
    +-448, rounded to nearest even by ml_dtypes."""
    x = np.asarray(x, np.float32) * np.float32(1.0 / scale)
    return np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)


def dequantised(cache, scale, dtype):
    return (jnp.asarray(cache).astype(jnp.float32) * scale).astype(dtype)


# --- the write ---------------------------------------------------------------------------


@cpu_only
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 3.0)])
def test_write_kv_cache_stores_the_scaled_rounding_and_clips(k_scale, v_scale):
    rng = np.random.default_rng(0)
    layers, slots, pages, page_size, dim = 2, 2, 5, 4, 16
    k = rng.standard_normal((6, slots, dim)).astype(np.float32) * 40
    v = rng.standard_normal((6, slots, dim)).astype(np.float32) * 40
    k[0, 0, :4] = [1e4, -1e4, 448.0 * k_scale * 1.5, -np.float32(449.0 * k_scale)]  # beyond +-448 after the scale
    v[1, 1, :2] = [3e5, -3e5]
    slot_mapping = np.array([4, 5, 9, 13, 17, 0], np.int32)  # the last: padding, scratch page 0
    empty = jnp.zeros((layers, slots, pages, page_size, dim), FP8)
    new_k, new_v = jax.jit(functools.partial(write_kv_cache, layer=1, k_scale=k_scale, v_scale=v_scale))(
        empty, empty, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot_mapping))
    assert new_k.dtype == new_v.dtype == FP8
    got_k, got_v = np.asarray(new_k), np.asarray(new_v)
    assert not np.isnan(got_k.astype(np.float32)).any() and not np.isnan(got_v.astype(np.float32)).any()
    for t in range(5):
        page, offset = divmod(int(slot_mapping[t]), page_size)
        np.testing.assert_array_equal(got_k[1, :, page, offset].view(np.uint8), e4m3_of(k[t], k_scale).view(np.uint8))
        np.testing.assert_array_equal(got_v[1, :, page, offset].view(np.uint8), e4m3_of(v[t], v_scale).view(np.uint8))
    assert list(got_k[1, 0, 1, 0, :4].astype(np.float32)) == [448.0, -448.0, 448.0, -448.0]
    assert list(got_v[1, 1, 1, 1, :2].astype(np.float32)) == [448.0, -448.0]
    assert not got_k[0].astype(np.float32).any(), "layer 0 was not written"


@cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 0.125), (0.3, 7.0)])
def test_pallas_write_matches_the_reference(dtype, k_scale, v_scale):
    """The write kernel (interpret mode) against the reference path: V byte for byte; K
    within one e4m3 step (the rotation may round differently by an FMA, as in
    tests/test_cache_write.py), and in practice equal."""
    rng = np.random.default_rng(1)
    tokens, q_heads, kv_slots, dim, page_size, pages = 7, 4, 2, 32, 4, 6
    qkv = rng.standard_normal((tokens, q_heads + 2 * kv_slots, dim)).astype(np.float32) * 30
    qkv[2, q_heads + kv_slots, :3] = [5e3, -5e3, 1e6]  # V rows past 448 * v_scale: clipped, not NaN
    qkv = jnp.asarray(qkv, dtype)
    positions = jnp.asarray(rng.integers(0, 5000, tokens), jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dim, 2) / dim), jnp.float32)
    slots = jnp.asarray([4, 7, 9, 13, 21, 22, 1], jnp.int32)
    cache = jnp.zeros((2, kv_slots, pages, page_size, dim), FP8)
    call = functools.partial(write_qkv_to_cache, cache, cache, qkv, positions, inv_freq, slots, q_heads=q_heads,
                             layer=1, k_scale=k_scale, v_scale=v_scale)
    want_k, want_v = call(implementation="reference")
    got_k, got_v = call(implementation="pallas", interpret=True)
    assert got_k.dtype == got_v.dtype == FP8
    written = (slice(None), slice(None), slice(1, None))
    np.testing.assert_array_equal(np.asarray(got_v)[written].view(np.uint8), np.asarray(want_v)[written].view(np.uint8))
    v_in = np.asarray(qkv[:, q_heads + kv_slots:], np.float32)
    np.testing.assert_array_equal(np.asarray(want_v)[1, :, 5, 2].view(np.uint8), e4m3_of(v_in[5], v_scale).view(np.uint8))
    assert not np.isnan(np.asarray(got_v, np.float32)).any()
    got_k, want_k = (np.asarray(x, np.float32)[written] for x in (got_k, want_k))
    assert (np.abs(got_k - want_k) <= 2.0 ** -3 * np.abs(want_k) + 2.0 ** -9).all()


@cpu_only
def test_scales_are_ignored_by_a_bf16_cache_and_checked():
    rng = np.random.default_rng(2)
    cache = jnp.asarray(rng.standard_normal((1, 2, 3, 4, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    slots = jnp.asarray([4, 5, 9], jnp.int32)
    plain = write_kv_cache(cache, cache, k, k, slots, layer=0)
    scaled = write_kv_cache(cache, cache, k, k, slots, layer=0, k_scale=2.0, v_scale=0.5)
    for a, b in zip(plain, scaled):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with pytest.raises(ValueError, match="k_scale=0.0: the FP8 cache's scales are positive finite"):
        write_kv_cache(cache, cache, k, k, slots, layer=0, k_scale=0.0)
    with pytest.raises(ValueError, match="float8_e5m2 is not supported"):
        to_cache_dtype(k, jnp.float8_e5m2)
    assert FP8_MAX == float(jnp.finfo(FP8).max)


# --- attention ---------------------------------------------------------------------------

# Mixed decode (one new token) and prefill (chunks after cached tokens), GQA 8 q / 2 KV,
# many pages per sequence; a padding token at the end.
Q_LENS, CACHED = [1, 9, 1, 20, 1], [37, 5, 0, 30, 70]


def fp8_case(seed, *, q_heads=8, kv_slots=2, head_dim=16, page_size=4, k_scale=1.0, v_scale=1.0, spread=3.0):
    """A random case whose cache is quantised: (the case with an f32 cache, the FP8 caches)."""
    case = random_case(np.random.default_rng(seed), q_lens=Q_LENS, cached_lens=CACHED, q_heads=q_heads,
                       kv_slots=kv_slots, head_dim=head_dim, page_size=page_size, pad_tokens=1)
    k = case.k_cache * spread
    v = case.v_cache * spread
    k_fp8, v_fp8 = (jnp.asarray(e4m3_of(x, s)) for x, s in ((k, k_scale), (v, v_scale)))
    return case, jnp.asarray(k), jnp.asarray(v), k_fp8, v_fp8


@functools.lru_cache(maxsize=None)
def attention(implementation, **static):
    config = TINY if implementation == "pallas" else None
    return jax.jit(lambda q, k, v, md, layer: ragged_paged_attention(
        q, k, v, md, layer=layer, implementation=implementation, config=config, **dict(static)))


def attend(implementation, case, q, k, v, **static):
    return np.asarray(attention(implementation, **static)(q, k, v, case.metadata(jnp), jnp.int32(case.layer)),
                      np.float32)


def relative_error(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


IMPLEMENTATIONS = [pytest.param("reference", marks=cpu_only), pytest.param("pallas", marks=cpu_only)]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 4.0), (0.3, 1.7)])
def test_fp8_attention_equals_attention_over_the_dequantised_cache(implementation, k_scale, v_scale):
    """f32 queries: the FP8 cache read as e4m3 * scale gives the f32 cache of those values'
    attention to f32 rounding (the scales folded in move one rounding: 2e-6 relative)."""
    case, _, _, k_fp8, v_fp8 = fp8_case(3, k_scale=k_scale, v_scale=v_scale)
    q = jnp.asarray(case.q)
    sm_scale = 0.25
    got = attend(implementation, case, q, k_fp8, v_fp8, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    want = attend(implementation, case, q, dequantised(k_fp8, k_scale, jnp.float32),
                  dequantised(v_fp8, v_scale, jnp.float32), sm_scale=sm_scale)
    real = int(case.query_start[-1])
    assert np.isfinite(got).all() and (got[real:] == 0).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_attention_with_bf16_queries_equals_the_bf16_cache_of_its_values(implementation):
    """bf16 queries, power-of-two scales: every e4m3 value times the scale is a bf16 value,
    so the bf16 cache of the dequantised values holds the same numbers; the FP8 path folds
    the scales in after rounding q, so the two agree to a bf16 rounding of q."""
    k_scale, v_scale = 0.5, 2.0
    case, _, _, k_fp8, v_fp8 = fp8_case(4, k_scale=k_scale, v_scale=v_scale)
    q = jnp.asarray(case.q, jnp.bfloat16)
    got = attend(implementation, case, q, k_fp8, v_fp8, sm_scale=0.25, k_scale=k_scale, v_scale=v_scale)
    want = attend(implementation, case, q, dequantised(k_fp8, k_scale, jnp.bfloat16),
                  dequantised(v_fp8, v_scale, jnp.bfloat16), sm_scale=0.25)
    assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_attention_is_close_to_the_unquantised_cache(implementation):
    """Against the f32 cache before quantisation: e4m3 keeps 3 mantissa bits (a relative
    rounding error up to 2**-4 per value), and these logits are sharp (std about 3), which
    amplifies K's error: measured 5.3% relative L2 error of the output, asserted below 8%.
    Values 1000x smaller lose much more with a scale of 1 (mostly e4m3 subnormals:
    measured 31%) and the same 5.3% with a scale of 1/1000."""
    case, k, v, k_fp8, v_fp8 = fp8_case(5, k_scale=1.0, v_scale=1.0)
    q = jnp.asarray(case.q)
    got = attend(implementation, case, q, k_fp8, v_fp8, sm_scale=0.25)
    want = attend(implementation, case, q, k, v, sm_scale=0.25)
    err = relative_error(got, want)
    assert err < 8e-2, err
    small = dict(spread=3e-3, sm_scale=250.0)
    case, k, v, k_fp8, v_fp8 = fp8_case(5, k_scale=1e-3, v_scale=1e-3, spread=small["spread"])
    got = attend(implementation, case, q, k_fp8, v_fp8, sm_scale=small["sm_scale"], k_scale=1e-3, v_scale=1e-3)
    want = attend(implementation, case, q, k, v, sm_scale=small["sm_scale"])
    assert abs(relative_error(got, want) - err) < 1e-2
    case, k, v, k_fp8, v_fp8 = fp8_case(5, spread=small["spread"])
    got = attend(implementation, case, q, k_fp8, v_fp8, sm_scale=small["sm_scale"])
    assert relative_error(got, want) > 0.2


@cpu_only
def test_pallas_fp8_equals_the_reference_fp8():
    case, _, _, k_fp8, v_fp8 = fp8_case(6, k_scale=0.3, v_scale=1.7)
    q = jnp.asarray(case.q)
    static = dict(sm_scale=0.25, k_scale=0.3, v_scale=1.7)
    got = attend("pallas", case, q, k_fp8, v_fp8, **static)
    want = attend("reference", case, q, k_fp8, v_fp8, **static)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@cpu_only
def test_fp8_kernels_lower_to_triton():
    """Pallas to Triton IR for CUDA on this CPU-only machine (nothing compiled): both
    attention kernels (and the merge of the decode splits) and the write kernel take e4m3
    caches at the Llama-3-8B shape."""
    spec = jax.ShapeDtypeStruct
    cache = spec((2, 8, 64, 16, 128), FP8)
    from shiftjax.kernels.metadata import AttentionMetadata
    md = AttentionMetadata(spec((5,), jnp.int32), spec((4,), jnp.int32), spec((4, 16), jnp.int32))
    attend_fn = jax.jit(lambda q, k, v, md: ragged_paged_attention(q, k, v, md, layer=1, sm_scale=0.1, k_scale=0.5,
                                                                   v_scale=2.0, implementation="pallas"))
    text = attend_fn.trace(spec((40, 32, 128), jnp.bfloat16), cache, cache, md).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    write_fn = jax.jit(lambda kc, vc, qkv, p, f, s: write_qkv_to_cache(
        kc, vc, qkv, p, f, s, q_heads=32, layer=1, k_scale=0.5, v_scale=2.0, implementation="pallas"))
    ints = spec((16,), jnp.int32)
    text = write_fn.trace(cache, cache, spec((16, 48, 128), jnp.bfloat16), ints, spec((64,), jnp.float32),
                          ints).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


# --- the cache geometry --------------------------------------------------------------------


def test_an_fp8_page_is_half_a_bf16_page():
    from shiftjax.cache import CacheConfig, CacheGeometry

    geometry = {dtype: CacheGeometry(32, 8, 16, 128, dtype) for dtype in ("bfloat16", "float8_e4m3fn")}
    bf16, fp8 = (geometry[d].page_bytes_per_device(1) for d in ("bfloat16", "float8_e4m3fn"))
    assert bf16 == 2 * 32 * 8 * 16 * 128 * 2 and fp8 * 2 == bf16
    gib = 1 << 30
    assert (gib // fp8) * 16 == 2 * (gib // bf16) * 16  # twice the tokens per GiB (Llama-3.1-8B: 8192 vs 16384)
    assert CacheConfig(num_pages=4, page_size=16, dtype="float8_e4m3fn").dtype == "float8_e4m3fn"
    for bad in ("fp8", "float8_e5m2", "int8"):
        with pytest.raises(ValueError, match="not a KV-cache dtype; use one of .*float8_e4m3fn"):
            CacheConfig(num_pages=4, page_size=16, dtype=bad)
    with pytest.raises(ValueError, match="CacheGeometry.dtype='fp8'"):
        CacheGeometry(32, 8, 16, 128, "fp8")


# --- a model step over an FP8 cache, TP and SP ---------------------------------------------


@cpu_only
def test_tp_and_sp_write_and_read_the_same_fp8_cache():
    """On a 2 x 2 mesh (sp 2, tp 2) the stepping scenario (chunked prefill, then decode) over
    an FP8 cache: TP mode, SP mode and alternating leave byte-identical FP8 pages and
    identical logits (bit for bit, as with an f32 cache here); those logits are within 5%
    (relative L2) of the f32 cache's."""
    import stepping

    from shiftjax.config import ModelConfig
    from shiftjax.params import random_params

    # tests/test_invariance.py's model: 9 q / 3 KV heads over 4 devices, QKV bias.
    CONFIG = ModelConfig(architecture="qwen2", vocab_size=120, hidden_size=64, intermediate_size=100, num_layers=2,
                         num_heads=9, num_kv_heads=3, head_dim=16, qkv_bias=True, max_position_embeddings=64)
    params = random_params(CONFIG, seed=3)
    runs = {"tp": ["tp"], "sp": ["sp"], "alternate": ["tp", "sp"]}
    results, _ = stepping.run_scenario(params, CONFIG, 2, 2, runs, cache_dtype="float8_e4m3fn")
    tp_logits, tp_caches = results["tp"]
    assert tp_caches.k.dtype == tp_caches.v.dtype == FP8
    k = np.asarray(tp_caches.k, np.float32)
    assert np.abs(k[:, :, stepping.PAGES[0][0]]).sum() > 0, "the scenario wrote nothing"
    for name, (logits, caches) in results.items():
        for kind in ("k", "v"):
            assert np.asarray(getattr(caches, kind)).tobytes() == np.asarray(getattr(tp_caches, kind)).tobytes(), (
                f"{name}: the FP8 {kind} cache differs from TP mode's")
        for step, (got, want) in enumerate(zip(logits, tp_logits)):  # one summation order on the CPU mesh
            np.testing.assert_array_equal(got, want, err_msg=f"{name} step {step}")
    f32, _ = stepping.run_scenario(params, CONFIG, 2, 2, {"tp": ["tp"]}, cache_dtype="float32")
    for step, (got, want) in enumerate(zip(tp_logits, f32["tp"][0])):
        assert relative_error(got, want) < 5e-2, step


# --- on the H200 (-m gpu) ------------------------------------------------------------------


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("q_heads,kv_slots,page_size", [(32, 8, 16), (8, 1, 64)])
def test_gpu_fp8_attention_matches_the_reference(q_heads, kv_slots, page_size):
    """Both compiled kernels (default config, Llama shapes, bf16 queries) against the
    reference over the same FP8 cache, on the GPU."""
    case = random_case(np.random.default_rng(7), q_lens=[1, 300, 1, 1, 129, 1], cached_lens=[700, 200, 1, 64, 0, 513],
                       q_heads=q_heads, kv_slots=kv_slots, head_dim=128, page_size=page_size, pad_tokens=3)
    k_fp8, v_fp8 = jnp.asarray(e4m3_of(case.k_cache * 4, 0.5)), jnp.asarray(e4m3_of(case.v_cache * 4, 0.5))
    q = jnp.asarray(case.q, jnp.bfloat16)
    kw = dict(layer=case.layer, sm_scale=128 ** -0.5, k_scale=0.5, v_scale=0.5)
    got = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="pallas"))(q, k_fp8, v_fp8, case.metadata(jnp))
    want = jax.jit(lambda *a: ragged_paged_attention(*a, **kw, implementation="reference"))(
        q, k_fp8, v_fp8, case.metadata(jnp))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert relative_error(got, want) < 1e-2



@pytest.mark.gpu
@gpu_only
def test_gpu_fp8_write_kernel_matches_the_reference():
    rng = np.random.default_rng(8)
    tokens, q_heads, kv_slots, dim = 64, 32, 8, 128
    qkv = rng.standard_normal((tokens, q_heads + 2 * kv_slots, dim)).astype(np.float32) * 100
    qkv = jnp.asarray(qkv, jnp.bfloat16)  # many values past 448 * scale: clipped
    positions = jnp.asarray(rng.integers(0, 8000, tokens), jnp.int32)
    inv_freq = jnp.asarray(500000.0 ** (-np.arange(0, dim, 2) / dim), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(16, 16 * 64))[:tokens], jnp.int32)
    cache = jnp.zeros((2, kv_slots, 64, 16, dim), FP8)
    call = functools.partial(write_qkv_to_cache, qkv=qkv, positions=positions, inv_freq=inv_freq,
                             slot_mapping=slots, q_heads=q_heads, layer=1, k_scale=0.3, v_scale=0.5)
    want_k, want_v = jax.jit(lambda kc, vc: call(kc, vc, implementation="reference"))(cache, cache)
    got_k, got_v = jax.jit(lambda kc, vc: call(kc, vc, implementation="pallas"))(cache, cache)
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint8), np.asarray(want_v).view(np.uint8))
    got_k, want_k = np.asarray(got_k, np.float32), np.asarray(want_k, np.float32)
    assert not np.isnan(got_k).any() and np.abs(got_k).max() == 448.0
    assert (np.abs(got_k - want_k) <= 2.0 ** -3 * np.abs(want_k) + 2.0 ** -9).all()
