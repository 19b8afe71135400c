"""w8a8's activations quantized per row in one pass (kernels/fp8_rows.py): the kernels in
Pallas's interpreter on the CPU against their references, and on an H200 (``-m gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shiftjax.kernels import fp8_gemm
from shiftjax.kernels import fp8_rows

ON_GPU = jax.default_backend() == "gpu"


def _bf16(shape, seed: int, scale: float = 3.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(jnp.bfloat16)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check_close(got, want, *, max_differing: float, bf16_steps: int = 1):
    """Two quantizations of (nearly) the same rows: the scales within ``bf16_steps`` bf16
    steps of the absmax, every value within one e4m3 step of the other's, few differing."""
    (v_got, s_got), (v_want, s_want) = got, want
    assert v_got.dtype == fp8_gemm.FP8 and s_got.dtype == jnp.float32
    assert v_got.shape == v_want.shape and s_got.shape == s_want.shape
    np.testing.assert_allclose(_f64(s_got), _f64(s_want), rtol=bf16_steps * 2.0**-7)
    back_got = _f64(v_got) * _f64(s_got)[..., None]
    back_want = _f64(v_want) * _f64(s_want)[..., None]
    bound = 2.0**-3 * np.abs(back_want) + 2.0**-8 * _f64(s_want)[..., None]
    assert np.all(np.abs(back_got - back_want) <= bound)
    assert np.mean(_f64(v_got) != _f64(v_want)) <= max_differing


CASES = [(5, 576), (3, 1024), (4, 100)]  # the default model's width, a power of two, a ragged one


@pytest.mark.parametrize("rows,width", CASES)
def test_quantized_kernel_is_quantize_rows(rows, width):
    x = _bf16((rows, width), rows).at[1].set(0)
    values, scale = fp8_rows.quantized(x, implementation="pallas", interpret=True)
    want_values, want_scale = fp8_gemm.quantize_rows(x)
    assert values.tobytes() == want_values.tobytes() and scale.tobytes() == want_scale.tobytes()
    assert float(scale[1]) == 1.0  # an all-zero row, as quantize_rows leaves it


@pytest.mark.parametrize("rows,width", CASES)
def test_rms_norm_kernel_matches_reference(rows, width):
    x = _bf16((rows, width), width)
    weight = (1 + 0.2 * jax.random.normal(jax.random.key(7), (width,))).astype(jnp.bfloat16)
    got = fp8_rows.rms_norm_quantized(x, weight, 1e-5, implementation="pallas", interpret=True)
    _check_close(got, fp8_rows.rms_norm_quantized_reference(x, weight, 1e-5), max_differing=0.0)


@pytest.mark.parametrize("rows,width", CASES)
def test_swiglu_kernel_matches_reference(rows, width):
    gate_up = _bf16((rows, 2 * width), width + 1)
    got = fp8_rows.swiglu_quantized(gate_up, implementation="pallas", interpret=True)
    # silu's logistic is computed apart (the interpreter's XLA expands it in float32 for
    # the kernel, in bf16 for the reference): a bf16 step or two apart now and then
    _check_close(got, fp8_rows.swiglu_quantized_reference(gate_up), max_differing=0.05, bf16_steps=2)


def test_kernels_take_leading_row_axes_and_rows_in_chunks():
    """SP mode's [tokens, sp, n] rows, quantized per (token, block); rows in several chunks."""
    gate_up = _bf16((5, 2, 2 * 96), 3)
    config = fp8_rows.RowsConfig(max_chunk=16)
    values, scale = fp8_rows.swiglu_quantized(gate_up, implementation="pallas", config=config, interpret=True)
    assert values.shape == (5, 2, 96) and scale.shape == (5, 2)
    want = [fp8_rows.swiglu_quantized_reference(gate_up[:, j]) for j in range(2)]
    for j in range(2):
        _check_close((values[:, j], scale[:, j]), want[j], max_differing=0.05, bf16_steps=2)
    x = _bf16((7, 3, 64), 4)
    values, scale = fp8_rows.quantized(x, implementation="pallas", config=config, interpret=True)
    want_values, want_scale = fp8_gemm.quantize_rows(x)
    assert values.tobytes() == want_values.tobytes() and scale.tobytes() == want_scale.tobytes()


def test_reference_is_what_the_model_computed_before_fusing():
    """The references are the unfused ops: ``quantize_rows`` of the model's rms_norm and swiglu."""
    from shiftjax.model import rms_norm

    x = _bf16((4, 64), 9)
    weight = _bf16((64,), 10, 1.0)
    values, scale = fp8_rows.rms_norm_quantized(x, weight, 1e-6)
    want_values, want_scale = fp8_gemm.quantize_rows(rms_norm(x, weight, 1e-6))
    assert values.tobytes() == want_values.tobytes() and scale.tobytes() == want_scale.tobytes()
    gate_up = _bf16((4, 128), 11)
    values, _ = fp8_rows.swiglu_quantized(gate_up)
    want, _ = fp8_gemm.quantize_rows(jax.nn.silu(gate_up[:, :64]) * gate_up[:, 64:])
    assert values.tobytes() == want.tobytes()


def test_quantized_rows_feed_w8a8_as_the_bf16_rows_do():
    x = _bf16((6, 128), 12)
    w = jax.random.normal(jax.random.key(13), (32, 128)) * 0.05
    w_scale = jnp.max(jnp.abs(w), axis=1) / fp8_gemm.FP8_MAX
    w_values = (w / w_scale[:, None]).astype(fp8_gemm.FP8)
    got = fp8_gemm.fp8_matmul(fp8_gemm.QuantizedRows.of(x), w_values, w_scale, algorithm="w8a8")
    want = fp8_gemm.fp8_matmul(x, w_values, w_scale, algorithm="w8a8")
    assert got.dtype == x.dtype and got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="w8a8's operand, not w8a16's"):
        fp8_gemm.fp8_matmul(fp8_gemm.QuantizedRows.of(x), w_values, w_scale, algorithm="w8a16")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="implementation must be one of reference, pallas, got 'xla'"):
        fp8_rows.quantized(_bf16((2, 16), 0), implementation="xla")
    with pytest.raises(ValueError, match="must be even"):
        fp8_rows.swiglu_quantized(_bf16((2, 15), 0))
    with pytest.raises(ValueError, match="max_chunk must be a power of two, got 3"):
        fp8_rows.RowsConfig(max_chunk=3)
    with pytest.raises(ValueError, match="max_chunks and elements_per_thread must be >= 1"):
        fp8_rows.RowsConfig(elements_per_thread=0)
    config = fp8_rows.RowsConfig(elements_per_thread=32)
    assert config.num_warps(14336) == 16 and config.num_warps(64) == 1 and config.num_warps(10**6) == 32
    assert config.chunk(14336) == 2048 and config.chunk(576) == 64 and config.chunk(100) == 4
    assert fp8_rows.RowsConfig(max_chunks=8).chunk(576) is None  # 9 chunks: the reference


def test_an_operand_past_32_bit_offsets_goes_to_the_reference():
    """Triton's offsets are int32: ``quantized`` of 2**31 elements (shapes only) is XLA's."""
    x = jax.ShapeDtypeStruct((2**17, 2**14), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x: fp8_rows.quantized(x, implementation="pallas"))(x)
    assert "pallas_call" not in str(jaxpr)
    small = jax.make_jaxpr(lambda x: fp8_rows.quantized(x, implementation="pallas"))(
        jax.ShapeDtypeStruct((4, 64), jnp.bfloat16))
    assert "pallas_call" in str(small)


def test_a_row_of_too_many_chunks_goes_to_the_reference():
    x = _bf16((3, 36), 5)  # chunks of 4: 9 of them
    got = fp8_rows.quantized(x, implementation="pallas", config=fp8_rows.RowsConfig(max_chunks=8))
    want = fp8_gemm.quantize_rows(x)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


# ------------------------------------------------------------------------------- GPU

GPU_CASES = [(4096, 4096), (1000, 14336), (37, 576), (256, 8192)]  # Llama-3.1-8B, 8B's MLP, ragged, 70B


@pytest.mark.parametrize("rows,width", GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_kernels_on_the_gpu(rows, width):
    x = _bf16((rows, width), rows)
    weight = (1 + 0.2 * jax.random.normal(jax.random.key(1), (width,))).astype(jnp.bfloat16)
    gate_up = _bf16((rows, 2 * width), width)
    pallas = dict(implementation="pallas")
    _check_close(jax.jit(lambda x: fp8_rows.quantized(x, **pallas))(x), jax.jit(fp8_gemm.quantize_rows)(x),
                 max_differing=1e-3)
    _check_close(jax.jit(lambda x, w: fp8_rows.rms_norm_quantized(x, w, 1e-5, **pallas))(x, weight),
                 jax.jit(lambda x, w: fp8_rows.rms_norm_quantized_reference(x, w, 1e-5))(x, weight),
                 max_differing=0.02)
    _check_close(jax.jit(lambda g: fp8_rows.swiglu_quantized(g, **pallas))(gate_up),
                 jax.jit(fp8_rows.swiglu_quantized_reference)(gate_up), max_differing=0.05, bf16_steps=2)
