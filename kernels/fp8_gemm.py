"""GEMMs over FP8 (``float8_e4m3fn``) weights with per-output-channel scales.

A quantized weight is stored ``[n, k]`` (output channels first, the contraction axis
minor: Hopper's FP8 tensor cores take both operands K-major) with a float32 scale per
output channel, ``w ~= values * scale[:, None]``. Two algorithms, chosen per step by the
step's token count (the same for TP and SP mode, so both modes do the same arithmetic):

- ``w8a16`` (decode): activations stay bf16; the weights are converted in registers.
  ``out = (x @ values.T) * scale``. A decode step is bound by the weight bytes it reads,
  which this halves.
- ``w8a8`` (prefill): activations are quantized per row (token) to e4m3 with a float32
  scale, ``x ~= xq * x_scale[:, None]``, and the product runs on FP8 tensor cores:
  ``out = (xq @ values.T) * x_scale[:, None] * scale[None, :]``.

Both accumulate in float32 and round once, to bf16, after the scales. Implementations
behind :func:`fp8_matmul`: ``"reference"`` (XLA, any backend: the oracle and the CPU path)
and ``"pallas"`` (Hopper: the Pallas kernels of ``fp8_gemm_mosaic`` and ``fp8_gemm_triton``,
and XLA's cuBLASLt FP8 GEMM where :class:`Fp8GemmChoice` says it was measured faster).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from . import triton_offsets

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
ALGORITHMS = ("w8a16", "w8a8")
SM_COUNT = 132  # H100 and H200: the SMs the kernels' tile and split-K choices are tuned to fill
_IMPLEMENTATIONS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class Fp8GemmChoice:
    """Which algorithm a step of ``tokens`` tokens uses, and which GPU kernel runs it.

    The algorithm is chosen from the step's token count (all devices' rows, before SP splits
    them), so TP and SP mode do the same arithmetic: ``w8a16`` up to ``w8a16_max_tokens``,
    ``w8a8`` above. The kernel (``implementation="pallas"``) is chosen from the rows of the
    GEMM itself, which changes only the order of float32 additions: ``w8a16`` of at most
    ``triton_max_rows`` rows runs the Triton kernel, above that the Mosaic GPU one; ``w8a8``
    of at most ``cublas_max_rows`` rows runs as XLA's e4m3 dot (cuBLASLt's FP8 GEMM), above
    that the Mosaic GPU kernel.

    The defaults are the H200's measurements (benchmarks/README.md, "One GPU: FP8 weights
    and the FP8 KV cache"). Alone, cuBLASLt's FP8 GEMM was the fastest decode GEMM on the
    H200, but inside an unrolled step XLA copies each layer's weight out of the stack before a
    cuBLASLt call, statically sliced or not, and the copy made that step slower than bf16's;
    the Pallas kernels read their layer in place (``layer=``)."""

    w8a16_max_tokens: int = 64
    triton_max_rows: int = 16
    cublas_max_rows: int = 64

    def __post_init__(self):
        for name in ("w8a16_max_tokens", "triton_max_rows", "cublas_max_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"Fp8GemmChoice.{name} must be >= 0, got {getattr(self, name)}")

    def algorithm(self, tokens: int) -> str:
        return "w8a16" if tokens <= self.w8a16_max_tokens else "w8a8"

    def kernel(self, algorithm: str, rows: int, weight_elements: int = 0) -> str:
        """The GPU kernel of ``algorithm`` for a GEMM of ``rows`` rows whose e4m3 weight
        operand (every layer's, where the kernel reads a layer of the stack) has
        ``weight_elements`` elements: ``triton``, ``mosaic`` or ``cublas``. A weight the
        Triton kernel cannot address (:func:`triton_offsets.reaches`) goes to the Mosaic kernel."""
        if algorithm == "w8a16":
            return "triton" if rows <= self.triton_max_rows and triton_offsets.reaches(weight_elements, 1) else "mosaic"
        return "cublas" if rows <= self.cublas_max_rows else "mosaic"


DEFAULT_CHOICE = Fp8GemmChoice()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """A ``w8a8`` GEMM's activations already quantized per row (``quantize_rows``'s
    result), as the fused kernels of :mod:`fp8_rows` make them; ``dtype``: the activations'
    own, which the product is rounded to."""

    values: Float[Array, "*rows k"]  # float8_e4m3fn
    scale: Float[Array, "*rows"]  # float32
    dtype: jnp.dtype = jnp.bfloat16

    @classmethod
    def of(cls, x: Float[Array, "*rows k"] | QuantizedRows) -> QuantizedRows:
        """``x``'s rows quantized by :func:`quantize_rows` (``x`` itself if it is quantized already)."""
        return x if isinstance(x, QuantizedRows) else cls(*quantize_rows(x), dtype=x.dtype)


def quantize_rows(x: Float[Array, "*rows k"]) -> tuple[Float[Array, "*rows k"], Float[Array, "*rows"]]:
    """Each row of ``x`` in e4m3 with its float32 scale (absmax / 448); an all-zero row
    gets scale 1 (its values are zeros)."""
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
    values = jnp.clip(x32 / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return values, scale


def stacked_layers(
    values: Float[Array, "*layers n k"], scale: Float[Array, "*layers n"], layer: Int[Array, ""] | int | None
) -> tuple[Float[Array, "layers n k"], Float[Array, "layers n"], Int[Array, "1"]]:
    """``values`` and ``scale`` with a leading layer axis (one layer's get one), and the
    layer as int32[1]: the operand by which the Pallas kernels read their layer in place."""
    if layer is None:
        return values[None], scale[None], jnp.zeros((1,), jnp.int32)
    return values, scale, jnp.asarray(layer, jnp.int32).reshape(1)


def _dequantized(values, scale):
    """``values * scale`` per row in float32, transposed to ``[k, n]``."""
    return (values.astype(jnp.float32) * scale[:, None]).T


def w8a16_matmul_reference(
    x: Float[Array, "m k"], values: Float[Array, "n k"], scale: Float[Array, "n"]
) -> Float[Array, "m n"]:
    """``x @ (values * scale[:, None]).T`` in float32, rounded once to ``x.dtype``.

    The scale multiplies the weight, not the product: a multiply after the dot fuses with
    what follows it (a bias add, a residual) into an FMA on the CPU in one mode and not in
    the other (XLA drops optimization barriers before it fuses), and TP and SP mode would
    no longer agree bit for bit. A kernel scales its float32 accumulator instead; the two
    differ by float32 roundings."""
    acc = jnp.dot(x.astype(jnp.float32), _dequantized(values, scale), preferred_element_type=jnp.float32)
    return acc.astype(x.dtype)


def w8a8_matmul_reference(
    x: Float[Array, "m k"], values: Float[Array, "n k"], scale: Float[Array, "n"]
) -> Float[Array, "m n"]:
    """``x`` quantized per row, then ``(xq * x_scale) @ (values * scale).T`` in float32,
    rounded once to ``x.dtype`` (scales on the operands, as in :func:`w8a16_matmul_reference`).
    e4m3 values and their products are exact in float32, so a tensor-core kernel that
    scales its accumulator differs from this by float32 roundings only."""
    return w8a8_quantized_matmul_reference(QuantizedRows.of(x), values, scale)


def w8a8_quantized_matmul_reference(
    x: QuantizedRows, values: Float[Array, "n k"], scale: Float[Array, "n"]
) -> Float[Array, "m n"]:
    """:func:`w8a8_matmul_reference` of activations quantized already."""
    x_dequantized = x.values.astype(jnp.float32) * x.scale[:, None]
    acc = jnp.dot(x_dequantized, _dequantized(values, scale), preferred_element_type=jnp.float32)
    return acc.astype(x.dtype)


def w8a8_matmul_cublas(
    x: Float[Array, "m k"] | QuantizedRows, values: Float[Array, "n k"], scale: Float[Array, "n"]
) -> Float[Array, "m n"]:
    """``w8a8`` as XLA's e4m3 x e4m3 dot with a float32 result (cuBLASLt's FP8 GEMM on
    Hopper), the scales applied to the float32 product, rounded once to ``x.dtype``."""
    quantized = QuantizedRows.of(x)
    acc = jax.lax.dot_general(quantized.values, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * quantized.scale[:, None] * scale[None, :]).astype(quantized.dtype)


def fp8_matmul(
    x: Float[Array, "m k"] | QuantizedRows,
    values: Float[Array, "*layers n k"],
    scale: Float[Array, "*layers n"],
    *,
    algorithm: str,
    implementation: str = "reference",
    choice: Fp8GemmChoice = DEFAULT_CHOICE,
    layer: Int[Array, ""] | None = None,
) -> Float[Array, "m n"]:
    """``x @ w.T`` for the quantized weight ``w ~= values * scale[:, None]`` by
    ``algorithm`` (``w8a16`` or ``w8a8``) and ``implementation``: the XLA ``reference``,
    or ``pallas``, the GPU kernels ``choice`` picks for this many rows. ``layer``:
    ``values`` and ``scale`` hold every layer, and the product uses this one's; the Pallas
    kernels read it in place, XLA's dots (the reference, cuBLASLt's) take it sliced, which
    on a GPU copies it first. ``x`` may be :class:`QuantizedRows` (``w8a8`` only): the
    activations quantized already, by a kernel fused with the op that made them."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(_IMPLEMENTATIONS)}, got {implementation!r}")
    quantized = isinstance(x, QuantizedRows)
    if quantized and algorithm != "w8a8":
        raise ValueError(f"activations quantized per row are w8a8's operand, not {algorithm}'s")
    rows = (x.values if quantized else x).shape[0]
    kernel = choice.kernel(algorithm, rows, values.size) if implementation == "pallas" else "reference"
    if kernel == "triton":
        from . import fp8_gemm_triton  # GPU lowering only when asked

        return fp8_gemm_triton.w8a16_matmul(x, values, scale, layer=layer)
    if kernel == "mosaic":
        from . import fp8_gemm_mosaic  # Mosaic GPU lowering only when asked

        mosaic = fp8_gemm_mosaic.w8a16_matmul if algorithm == "w8a16" else fp8_gemm_mosaic.w8a8_matmul
        return mosaic(x, values, scale, layer=layer)
    if layer is not None:
        values = jax.lax.dynamic_index_in_dim(values, layer, keepdims=False)
        scale = jax.lax.dynamic_index_in_dim(scale, layer, keepdims=False)
    if kernel == "cublas":
        return w8a8_matmul_cublas(x, values, scale)
    if algorithm == "w8a16":
        return w8a16_matmul_reference(x, values, scale)
    return w8a8_quantized_matmul_reference(QuantizedRows.of(x), values, scale)


def gpu_supports_fp8(device: jax.Device) -> bool:
    """Whether ``device`` has the FP8 tensor cores the Pallas kernels use (Hopper, sm_90)."""
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return False
    return major == 9
