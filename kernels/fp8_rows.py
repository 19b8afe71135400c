"""The activations of a ``w8a8`` GEMM quantized per row in one pass, fused with the
elementwise op that makes them: ``rms_norm`` (the qkv and gate|up GEMMs' input), ``swiglu``
(the down GEMM's) or nothing (the o GEMM's). The contract of the quantization is
:func:`fp8_gemm.quantize_rows`'s: each row in e4m3 with the float32 scale absmax / 448.

Per-row quantization needs the row's absmax before any value can be scaled. XLA makes that
two kernels, a reduction and then an elementwise pass that recomputes the op from its
input: on the H200, Llama-3.1-8B's MLP at 4,096 tokens read the 235 MB of gate|up twice
(63 + 111 us a layer, benchmarks/README.md, "Why served FP8 prefill was no faster than
bf16"). Here a program owns one row: it loads it once, in power-of-two chunks that divide it
(Triton's tiles are powers of two, and a tile past the row's end would be neither masked nor
safe: Pallas's Triton lowering does not mask a block wider than its array), keeps the chunks
in registers (a row of 14,336 is 56 KiB of float32 across 16 warps), reduces, scales, and
writes e4m3 values and the scale: one read, one quarter-size write.

Each kernel rounds where its reference does (the op's bf16 results, then the division by
the scale), so they differ from the references where Triton's and XLA's ``logistic`` or
``rsqrt`` differ in the last float32 bit, and in the order of the float32 sum of squares.
They use Pallas's Triton backend (deprecated in JAX 0.11.2; it warns), not Mosaic GPU as the
GEMMs do: an elementwise pass with a row reduction has no use for wgmma or TMA, and no Mosaic
GPU version was written to compare. ``interpret=True`` runs them in Pallas's interpreter (the
CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from . import fp8_gemm, triton_offsets

IMPLEMENTATIONS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """A program owns one row, loaded in chunks of at most ``max_chunk`` elements (the
    largest power of two dividing the row, at most ``max_chunks`` of them, all held in
    registers), with enough warps for ``elements_per_thread`` float32 values of each input
    a thread (at most 32 warps). A row that needs more chunks goes to the reference."""

    max_chunk: int = 2048
    max_chunks: int = 64
    elements_per_thread: int = 64

    def __post_init__(self):
        if self.max_chunk < 1 or self.max_chunk & (self.max_chunk - 1):
            raise ValueError(f"RowsConfig.max_chunk must be a power of two, got {self.max_chunk}")
        if self.max_chunks < 1 or self.elements_per_thread < 1:
            raise ValueError(f"RowsConfig.max_chunks and elements_per_thread must be >= 1, got {self}")

    def chunk(self, width: int) -> int | None:
        """The chunk a row of ``width`` is loaded in, or None: too many chunks."""
        chunk = min(self.max_chunk, width & -width)
        return chunk if width // chunk <= self.max_chunks else None

    def num_warps(self, width: int) -> int:
        warps = -(-width // (32 * self.elements_per_thread))
        return int(min(32, 1 << max(0, warps - 1).bit_length()))


DEFAULT_CONFIG = RowsConfig()  # the fastest measured on an H200 (benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache")


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


def _row_chunks(ref, row, first: int, width: int, chunk: int) -> list:
    """Row ``row`` of ``ref``, columns ``[first, first + width)``, as float32 ``[1, chunk]`` pieces."""
    return [ref[pl.ds(row, 1), pl.ds(first + c * chunk, chunk)].astype(jnp.float32) for c in range(width // chunk)]


def _rounded(a, dtype):
    return a.astype(dtype).astype(jnp.float32)


def _quantized_store(h32: list, row, values_ref, scale_ref):
    """``fp8_gemm.quantize_rows`` of one row, given as float32 chunks."""
    absmax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(h), axis=1) for h in h32])
    scale = jnp.where(absmax > 0, absmax / fp8_gemm.FP8_MAX, 1.0)
    chunk = h32[0].shape[1]
    for c, h in enumerate(h32):
        values = jnp.clip(h / scale[:, None], -fp8_gemm.FP8_MAX, fp8_gemm.FP8_MAX)
        values_ref[pl.ds(row, 1), pl.ds(c * chunk, chunk)] = values.astype(values_ref.dtype)
    scale_ref[pl.ds(row, 1)] = scale


def _rms_norm_kernel(x_ref, w_ref, values_ref, scale_ref, *, width: int, chunk: int, eps: float):
    row = pl.program_id(0)
    dtype = x_ref.dtype
    x32 = _row_chunks(x_ref, row, 0, width, chunk)
    inv_rms = lax.rsqrt(sum(jnp.sum(x * x, axis=1) for x in x32) / width + eps)
    w32 = [w_ref[pl.ds(c * chunk, chunk)].astype(jnp.float32)[None, :] for c in range(width // chunk)]
    h32 = [_rounded(w * _rounded(x * inv_rms[:, None], dtype), dtype) for x, w in zip(x32, w32)]
    _quantized_store(h32, row, values_ref, scale_ref)


def _swiglu_kernel(gate_up_ref, values_ref, scale_ref, *, width: int, chunk: int):
    row = pl.program_id(0)
    dtype = gate_up_ref.dtype
    gate32 = _row_chunks(gate_up_ref, row, 0, width, chunk)
    up32 = _row_chunks(gate_up_ref, row, width, width, chunk)
    silu32 = [_rounded(g * _rounded(lax.logistic(g), dtype), dtype) for g in gate32]
    _quantized_store([_rounded(s * u, dtype) for s, u in zip(silu32, up32)], row, values_ref, scale_ref)


def _identity_kernel(x_ref, values_ref, scale_ref, *, width: int, chunk: int):
    row = pl.program_id(0)
    _quantized_store(_row_chunks(x_ref, row, 0, width, chunk), row, values_ref, scale_ref)


def _rows_call(kernel, x, width: int, chunk: int, weights: tuple, config: RowsConfig, interpret: bool, name: str):
    """``kernel`` over every row of ``x`` (its leading axes flattened), ``weights`` passed
    whole: e4m3 values ``[*rows, width]`` and float32 scales ``[*rows]``."""
    from jax.experimental.pallas import triton as pltriton  # GPU lowering only when asked

    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    values, scale = pl.pallas_call(
        functools.partial(kernel, width=width, chunk=chunk),
        grid=(rows,),
        in_specs=[pl.no_block_spec] * (1 + len(weights)),
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((rows, width), fp8_gemm.FP8), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps(width), num_stages=1),
        interpret=interpret,
        name=name,
    )(flat, *weights)
    return values.reshape(*x.shape[:-1], width), scale.reshape(x.shape[:-1])


def _kernel_chunk(implementation: str, x, width: int, config: RowsConfig) -> int | None:
    """The chunk the kernel loads ``x``'s rows of ``width`` in, or None where the reference
    runs: asked for, too many chunks, or more elements than Triton's 32-bit offsets reach
    (``triton_offsets.MAX_32_BIT_ELEMENTS``)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    if implementation == "reference" or x.size > triton_offsets.MAX_32_BIT_ELEMENTS:
        return None
    return config.chunk(width)


def rms_norm_quantized(
    x: Float[Array, "*rows d"], weight: Float[Array, "d"], eps: float, *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows d"], Float[Array, "*rows"]]:
    """``quantize_rows(rms_norm(x, weight, eps))``: e4m3 values and float32 scales."""
    chunk = _kernel_chunk(implementation, x, x.shape[-1], config)
    if chunk is None:
        return rms_norm_quantized_reference(x, weight, eps)
    return _rows_call(functools.partial(_rms_norm_kernel, eps=eps), x, x.shape[-1], chunk, (weight,), config,
                      interpret, "fp8_rms_norm_quantized")


def swiglu_quantized(
    gate_up: Float[Array, "*rows two_f"], *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows f"], Float[Array, "*rows"]]:
    """``quantize_rows(silu(gate) * up)`` for ``gate_up = [gate | up]`` along its last axis."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last axis holds gate and up, so it must be even, got {gate_up.shape}")
    width = gate_up.shape[-1] // 2
    chunk = _kernel_chunk(implementation, gate_up, width, config)
    if chunk is None:
        return swiglu_quantized_reference(gate_up)
    return _rows_call(_swiglu_kernel, gate_up, width, chunk, (), config, interpret, "fp8_swiglu_quantized")


def quantized(
    x: Float[Array, "*rows k"], *,
    implementation: str = "reference", config: RowsConfig = DEFAULT_CONFIG, interpret: bool = False,
) -> tuple[Float[Array, "*rows k"], Float[Array, "*rows"]]:
    """``quantize_rows(x)`` in one pass."""
    chunk = _kernel_chunk(implementation, x, x.shape[-1], config)
    if chunk is None:
        return fp8_gemm.quantize_rows(x)
    return _rows_call(_identity_kernel, x, x.shape[-1], chunk, (), config, interpret, "fp8_quantized_rows")
