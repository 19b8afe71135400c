"""The activations of a ``w8a8`` GEMM quantized per row in one pass, fused with the
elementwise op that makes them: ``rms_norm`` (the qkv and gate|up GEMMs' input), ``swiglu``
(the down GEMM's) or nothing (the o GEMM's). The contract of the quantization is
:func:`fp8_gemm.quantize_rows`'s: each row in e4m3 with the float32 scale absmax / 448.

Per-row quantization needs the row's absmax before any value can be scaled. XLA makes that
two kernels, a reduction and then an elementwise pass that recomputes the op from its
input: on the H200, Llama-3.1-8B's MLP at 4,096 tokens read the 235 MB of gate|up twice
(63 + 111 us a layer, benchmarks/README.md, "Why served FP8 prefill was no faster than
bf16"). Here a program owns ``block_rows`` whole rows: it loads them once, keeps them in
registers (a row of 14,336 is 56 KiB of float32 across 16 warps), reduces, scales, and writes
e4m3 values and the scales: one read, one quarter-size write.

Each kernel rounds where its reference does (the op's bf16 result, then the division by
the scale), so they differ from the references only where Triton's and XLA's ``exp`` or
``rsqrt`` differ in the last float32 bit. Rows are padded to a power of two (Triton's blocks);
the padding is masked out of the reductions. The kernels run on Pallas's Triton backend:
Mosaic GPU's layouts have no cross-thread reduction of a row this long in JAX 0.11.2, and an
elementwise pass has nothing for wgmma or TMA to do. ``interpret=True`` runs them in
Pallas's interpreter (the CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from . import fp8_gemm

IMPLEMENTATIONS = ("reference", "pallas")
_BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """``block_rows`` rows a program, ``num_warps`` warps: at most ``elements_per_thread``
    float32 values of each input a thread (a larger row takes more warps, up to 32)."""

    block_rows: int = 1
    elements_per_thread: int = 32

    def __post_init__(self):
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"RowsConfig.block_rows must be a power of two, got {self.block_rows}")
        if self.elements_per_thread < 1:
            raise ValueError(f"RowsConfig.elements_per_thread must be >= 1, got {self.elements_per_thread}")

    def num_warps(self, block_width: int) -> int:
        warps = self.block_rows * block_width // (32 * self.elements_per_thread)
        return int(min(32, max(1, 1 << max(0, warps - 1).bit_length())))


DEFAULT_CONFIG = RowsConfig()


# ------------------------------------------------------------------------- references


def rms_norm_reference(x: Float[Array, "*rows d"], weight: Float[Array, "d"], eps: float) -> Float[Array, "*rows d"]:
    """``model.rms_norm``'s arithmetic: float32 statistics, the normalized row rounded to
    ``x.dtype``, then the weight multiplied in ``x.dtype`` (tests check the two agree)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def swiglu_reference(gate_up: Float[Array, "*rows two_f"]) -> Float[Array, "*rows f"]:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, in its dtype (the model's)."""
    ffn = gate_up.shape[-1] // 2
    return jax.nn.silu(gate_up[..., :ffn]) * gate_up[..., ffn:]


def rms_norm_quantized_reference(x, weight, eps: float):
    return fp8_gemm.quantize_rows(rms_norm_reference(x, weight, eps))


def swiglu_quantized_reference(gate_up):
    return fp8_gemm.quantize_rows(swiglu_reference(gate_up))


# ---------------------------------------------------------------------------- kernels


def _quantized_store(h32, valid, values_ref, scale_ref):
    """``fp8_gemm.quantize_rows`` of the rows ``h32`` [rows, width], padding masked out."""
    absmax = jnp.max(jnp.where(valid, jnp.abs(h32), 0.0), axis=1)
    scale = jnp.where(absmax > 0, absmax / fp8_gemm.FP8_MAX, 1.0)
    values = jnp.clip(h32 / scale[:, None], -fp8_gemm.FP8_MAX, fp8_gemm.FP8_MAX)
    values_ref[...] = values.astype(values_ref.dtype)
    scale_ref[...] = scale


def _valid(shape, width: int):
    return lax.broadcasted_iota(jnp.int32, shape, 1) < width


def _rms_norm_kernel(x_ref, w_ref, values_ref, scale_ref, *, width: int, eps: float):
    x = x_ref[...]
    valid = _valid(x.shape, width)
    x32 = jnp.where(valid, x.astype(jnp.float32), 0.0)
    inv_rms = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / width + eps)
    normed = (x32 * inv_rms[:, None]).astype(x.dtype)
    h = (w_ref[...][None, :].astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)
    _quantized_store(h.astype(jnp.float32), valid, values_ref, scale_ref)


def _swiglu_kernel(gate_ref, up_ref, values_ref, scale_ref, *, width: int):
    gate, up = gate_ref[...], up_ref[...]
    dtype = gate.dtype
    valid = _valid(gate.shape, width)
    g32 = jnp.where(valid, gate.astype(jnp.float32), 0.0)
    sigmoid = lax.logistic(g32).astype(dtype).astype(jnp.float32)
    silu = (g32 * sigmoid).astype(dtype).astype(jnp.float32)
    h = (silu * up.astype(jnp.float32)).astype(dtype)
    _quantized_store(h.astype(jnp.float32), valid, values_ref, scale_ref)


def _identity_kernel(x_ref, values_ref, scale_ref, *, width: int):
    x = x_ref[...]
    valid = _valid(x.shape, width)
    _quantized_store(x.astype(jnp.float32), valid, values_ref, scale_ref)


def _rows_call(kernel, inputs, in_specs, rows: int, width: int, config: RowsConfig, interpret: bool, name: str):
    from jax.experimental.pallas import triton as pltriton  # GPU lowering only when asked

    block_width = 1 << (width - 1).bit_length()
    out_specs = [pl.BlockSpec((config.block_rows, block_width), lambda i: (i, 0)),
                 pl.BlockSpec((config.block_rows,), lambda i: (i,))]
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, config.block_rows),),
        in_specs=in_specs(config.block_rows, block_width),
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((rows, width), fp8_gemm.FP8), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps(block_width), num_stages=1),
        interpret=interpret,
        name=name,
    )(*inputs)


def _flat_rows(x):
    return x.reshape(-1, x.shape[-1])


def _check(implementation: str):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")


def rms_norm_quantized(
    x: Float[Array, "*rows d"], weight: Float[Array, "d"], eps: float, *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows d"], Float[Array, "*rows"]]:
    """``quantize_rows(rms_norm(x, weight, eps))``: e4m3 values and float32 scales."""
    _check(implementation)
    if implementation == "reference":
        return rms_norm_quantized_reference(x, weight, eps)
    flat = _flat_rows(x)
    rows, width = flat.shape
    values, scale = _rows_call(
        functools.partial(_rms_norm_kernel, width=width, eps=eps), (flat, weight),
        lambda br, bw: [pl.BlockSpec((br, bw), lambda i: (i, 0)), pl.BlockSpec((bw,), lambda i: (0,))],
        rows, width, config, interpret, "fp8_rms_norm_quantized")
    return values.reshape(x.shape), scale.reshape(x.shape[:-1])


def swiglu_quantized(
    gate_up: Float[Array, "*rows two_f"], *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows f"], Float[Array, "*rows"]]:
    """``quantize_rows(silu(gate) * up)`` for ``gate_up = [gate | up]`` along its last axis."""
    _check(implementation)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last axis holds gate and up, so it must be even, got {gate_up.shape}")
    if implementation == "reference":
        return swiglu_quantized_reference(gate_up)
    flat = _flat_rows(gate_up)
    rows, width = flat.shape[0], flat.shape[1] // 2
    halves = flat.reshape(rows, 2, width)  # free: [gate | up] row by row
    values, scale = _rows_call(
        functools.partial(_swiglu_kernel, width=width), (halves, halves),
        lambda br, bw: [pl.BlockSpec((br, None, bw), lambda i: (i, 0, 0)),
                        pl.BlockSpec((br, None, bw), lambda i: (i, 1, 0))],
        rows, width, config, interpret, "fp8_swiglu_quantized")
    return values.reshape(*gate_up.shape[:-1], width), scale.reshape(gate_up.shape[:-1])


def quantized(
    x: Float[Array, "*rows k"], *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows k"], Float[Array, "*rows"]]:
    """``quantize_rows(x)`` in one pass."""
    _check(implementation)
    if implementation == "reference":
        return fp8_gemm.quantize_rows(x)
    flat = _flat_rows(x)
    rows, width = flat.shape
    values, scale = _rows_call(
        functools.partial(_identity_kernel, width=width), (flat,),
        lambda br, bw: [pl.BlockSpec((br, bw), lambda i: (i, 0))],
        rows, width, config, interpret, "fp8_quantized_rows")
    return values.reshape(x.shape), scale.reshape(x.shape[:-1])
