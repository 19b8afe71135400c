"""FP8 weights: the layer GEMM weights in ``float8_e4m3fn`` with a scale per output channel.

Quantization is data, not a mode: a quantized block weight is an :class:`Fp8Weight` in
place of the bf16 array, in the same block layout and sharding (TP blocks ``[layers, P,
...]``, aliased SP shards ``[layers, tp, ...]`` over the same device buffers), so TP and SP
mode still share one copy and the cache is untouched. The embedding, the norms, the biases
and the LM head stay in the activations' dtype.

Values are stored ``[.., n, k]`` (output channel first, contraction minor), as Hopper's
FP8 tensor cores take them (``kernels/fp8_gemm.py``); ``scale`` is float32 ``[.., n]``.

The scales do not depend on the mesh: a column-parallel weight's output channels live in
one block, so each block's per-column absmax is the canonical one; a row-parallel weight
(``wo``, ``w_down``) is cut along its input, so its per-output-channel absmax is taken over
every block and the same scale is stored with each block. A model therefore quantizes to
the same values on one device and on any ``sp x tp`` mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import NamedSharding
from jaxtyping import Array, Float, Int

from shiftjax.kernels.fp8_gemm import FP8, FP8_MAX
from shiftjax.pytrees import unchecked_init

QUANTIZATIONS = ("none", "fp8")


@unchecked_init
@struct.dataclass
class Fp8Weight:
    """A GEMM weight ``w[.., k, n] ~= (values * scale[.., :, None]).T`` of one mode's view.

    ``layer``: set inside an unrolled step's layer (``model.run_layers``), where ``values``
    and ``scale`` are still every layer's and a kernel reads this layer's rows in place."""

    values: Float[Array, "*lead n k"]  # float8_e4m3fn
    scale: Float[Array, "*lead n"]  # float32, per output channel
    layer: Int[Array, ""] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The bf16 weight's shape ``[.., k, n]`` (what the layer code multiplies by)."""
        *lead, n, k = self.values.shape
        return (*lead, k, n)


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return quantization


def _channel_scale(absmax: jax.Array) -> jax.Array:
    return jnp.where(absmax > 0, absmax / FP8_MAX, 1.0).astype(jnp.float32)


def _quantize_layer(w: jax.Array, scale: jax.Array) -> jax.Array:
    """One layer's ``[P, k, n]`` blocks as e4m3 ``[P, n, k]`` under ``scale[P, n]``."""
    values = jnp.clip(w.astype(jnp.float32) / scale[:, None, :], -FP8_MAX, FP8_MAX).astype(FP8)
    return jnp.swapaxes(values, 1, 2)


def fp8_shardings(block_sharding) -> tuple:
    """The shardings of an :class:`Fp8Weight`'s values and scales made from blocks of
    ``block_sharding`` (``[layers, P, ...]``, cut along ``P``): the same cut of the lead axes."""
    if not isinstance(block_sharding, NamedSharding):
        return (None, None)
    lead = tuple(block_sharding.spec)[:2]
    spec = jax.sharding.PartitionSpec(*(lead + (None,) * (2 - len(lead))))
    return (NamedSharding(block_sharding.mesh, spec),) * 2


def empty_fp8_blocks(shape: tuple[int, ...], block_sharding) -> Fp8Weight:
    """Zeros for the FP8 form of blocks ``[layers, P, k, n]``, for :func:`quantize_blocks`
    to fill. Made before the blocks themselves, they sit below them in the allocator's pool,
    and freeing the blocks leaves its free space in one piece (Llama-70B on one H200: with
    each FP8 form made after its bf16 blocks, 62 GiB were free but no hole held the KV
    cache's 25 GiB half)."""
    layers, blocks_per_layer, k, n = shape
    return Fp8Weight(*jax.jit(lambda: (jnp.zeros((layers, blocks_per_layer, n, k), FP8),
                                      jnp.zeros((layers, blocks_per_layer, n), jnp.float32)),
                             out_shardings=fp8_shardings(block_sharding))())


def quantize_blocks(blocks: jax.Array, kind: str, into: Fp8Weight | None = None) -> Fp8Weight:
    """``blocks`` (``[layers, P, k, n]``, any sharding along ``P``) quantized per output
    channel, in the same sharding. ``kind``: ``"column"`` (the channel is a block's column)
    or ``"row"`` (cut along ``k``: the channel's absmax is over every block). ``into``: the
    :func:`empty_fp8_blocks` to write (donated), made here if not given.

    One layer per call, written into donated outputs: device memory holds ``blocks``, its
    FP8 form and one layer's float32 temporaries. (One program mapping over the layers
    copied ``blocks`` into its loop first: Llama-70B's gate|up, 70 GiB in bf16, ran out of
    an H200's memory.) The caller drops ``blocks`` afterwards; the outputs' dtypes differ
    from its, so donating it would reuse nothing."""
    if kind not in ("column", "row"):
        raise ValueError(f"kind must be column or row, got {kind!r}")
    layers, blocks_per_layer, k, n = blocks.shape
    if into is None:
        into = empty_fp8_blocks(blocks.shape, blocks.sharding)
    if into.values.shape != (layers, blocks_per_layer, n, k) or into.scale.shape != (layers, blocks_per_layer, n):
        raise ValueError(f"quantize_blocks: outputs {into.values.shape} / {into.scale.shape} do not fit "
                         f"blocks {blocks.shape}")

    def quantize_layer(blocks, values, scales, index):
        w = lax.dynamic_index_in_dim(blocks, index, keepdims=False)  # [P, k, n]
        absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1)  # [P, n]
        if kind == "row":
            absmax = jnp.broadcast_to(jnp.max(absmax, axis=0), absmax.shape)
        scale = _channel_scale(absmax)
        values = lax.dynamic_update_index_in_dim(values, _quantize_layer(w, scale), index, 0)
        return values, lax.dynamic_update_index_in_dim(scales, scale, index, 0)

    step = jax.jit(quantize_layer, donate_argnums=(1, 2), out_shardings=(into.values.sharding, into.scale.sharding))
    values, scales = into.values, into.scale
    for index in range(layers):
        values, scales = step(blocks, values, scales, jnp.int32(index))
    return Fp8Weight(values=values, scale=scales)


def dequantize(weight: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """The ``[.., k, n]`` weight the values and scales stand for (tests, accuracy checks)."""
    w = weight.values.astype(jnp.float32) * weight.scale[..., None]
    return jnp.swapaxes(w, -1, -2).astype(dtype)


def describe(quantization: str, weights_dtype) -> str:
    """One line for the start-up log and ServerInfo."""
    if quantization == "fp8":
        return (f"fp8: the layer GEMM weights in float8_e4m3fn with per-output-channel scales; "
                f"embedding, norms and LM head {jnp.dtype(weights_dtype).name}")
    return f"none: every weight {jnp.dtype(weights_dtype).name}"
