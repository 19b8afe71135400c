"""Pallas Mosaic GPU kernels (Hopper, sm_90a) behind ``fp8_gemm.fp8_matmul(...,
implementation="pallas")``: the contract, the references and the algorithm choice are in
:mod:`fp8_gemm`.

``w8a16`` computes ``out.T = W @ x.T`` so that the weight tile is wgmma's A operand (64
or 128 weight rows, the only side wgmma takes from registers) and the few tokens are its
N (a multiple of 8: the wrapper pads ``m``). Each step loads an e4m3 tile ``[tile_n,
tile_k]`` by TMA, converts it to bf16 in registers and issues the wgmma against the bf16
activations' tile ``[m, tile_k]`` from shared memory, K-major. sm_90 has no e4m3 -> bf16
instruction (Mosaic GPU emits one only for PTX ISA 9.2; the device's ptxas is 9.0), so the
weights go e4m3 -> float16 (``cvt.rn.f16x2.e4m3x2``, one instruction per two) -> float32
-> bf16, every step exact. Without split-K the kernel applies the channel scales to its
float32 accumulator and writes bf16 ``out.T``; with split-K (``split_k`` CTAs per 64-row
stripe, each a float32 partial, when ``n`` is too small to fill the 132 SMs) XLA sums the
partials and applies the scales in one small fusion. (Until 2026-12-06 the activations
were float16, divided per row by a power of two in an XLA pre-pass so that float16 held
them exactly: on an H100 the bf16 operand with the scales in the kernel took 8B's gate|up
at 16 tokens from 51.0 to 47.4 us, and q|k|v at 64 from 25.0 to 17.5;
benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache".)

``w8a8`` takes ``x`` quantized per row (:class:`fp8_gemm.QuantizedRows`, made by one of
:mod:`fp8_rows`'s one-pass kernels, fused with the op before it where the model can), then runs an
e4m3 x e4m3 wgmma GEMM with both operands K-major from shared memory (the weight
``[tile_n, tile_k]`` tile seen transposed), float32 accumulators, and the scales
``x_scale[m] * scale[n]`` applied to the accumulator in the epilogue before the one
rounding to bf16. Two warpgroups compute (each ``tile_m`` rows of a ``2 * tile_m`` CTA
tile) while a third only issues TMA copies.

A shape a config does not divide (``n`` by ``tile_n``; ``k`` by ``tile_k * split_k``, or
``tile_k``) falls back to the reference (XLA): ``W8A16Config.divides`` /
``W8A8Config.divides`` say which. Every Llama-3.1-8B/70B projection on one GPU divides
the default configs. ``m`` is padded (to 8 for w8a16, to the CTA tile for w8a8); w8a16
with ``m > 256`` runs in pieces of 256 (wgmma's N limit; not a decode case).

Both kernels take every layer's weights, stacked, with the layer's index (``layer=``) and
read that layer in place: XLA would copy a sliced operand out of the stack first. Measured
on the H200 (benchmarks/README.md, "FP8 weights and the FP8 KV cache"): w8a8 runs a 4,096-token
prefill step at 0.76x bf16's; w8a16, with float16 operands then, decoded 1 sequence at 1.01x
and 64 at 1.19x bf16's step (the Triton w8a16 kernel is faster at 16 rows). The same
section has the GEMM-level numbers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from . import fp8_gemm

_F32 = jnp.float32
_F16 = jnp.float16
_BF16 = jnp.bfloat16
_MAX_WGMMA_N = 256


def _tiled(block_minor: int, dtype) -> tuple:
    """TMA/wgmma shared-memory transforms for a tile whose minor dimension holds
    ``block_minor`` elements of ``dtype``: 8-row tiles, the widest swizzle that divides."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(block_minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


_SMEM_BYTES = 227 * 1024  # per block on the H200, less Mosaic's own few hundred bytes


def _fitting_stages(wanted: int, steps: int, stage_bytes: int, fixed_bytes: int) -> int:
    """The most pipeline stages, up to ``wanted`` and ``steps``, whose tiles fit in
    shared memory beside ``fixed_bytes`` (the epilogue's tile)."""
    fit = (_SMEM_BYTES - 1024 - fixed_bytes) // stage_bytes
    if fit < 1:
        raise ValueError(f"one pipeline stage of {stage_bytes} bytes does not fit in shared memory; use a smaller tile_k")
    return max(1, min(wanted, steps, fit))


# ---------------------------------------------------------------------------- w8a16


@dataclasses.dataclass(frozen=True)
class W8A16Config:
    """``tile_n`` weight rows (wgmma M: 64 or 128) by ``tile_k`` per pipeline step,
    ``stages`` steps in flight, the K axis cut into ``split_k`` independent CTAs."""

    tile_n: int = 64
    tile_k: int = 256
    stages: int = 4
    split_k: int = 1

    def __post_init__(self):
        if self.tile_n not in (64, 128):
            raise ValueError(f"W8A16Config.tile_n must be 64 or 128 (wgmma M), got {self.tile_n}")
        if self.tile_k % 128 or self.tile_k <= 0:
            raise ValueError(f"W8A16Config.tile_k must be a positive multiple of 128 (one 128-byte swizzle of e4m3), got {self.tile_k}")
        if self.stages < 1 or self.split_k < 1:
            raise ValueError(f"W8A16Config.stages and split_k must be >= 1, got {self.stages} and {self.split_k}")

    def divides(self, n: int, k: int) -> bool:
        return n % self.tile_n == 0 and k % (self.tile_k * self.split_k) == 0


def w8a16_config(n: int, k: int, m: int) -> W8A16Config:
    """The config used for an ``[m, k] @ [n, k].T`` decode GEMM: no split-K where there are
    half as many 64-row stripes as SMs or more (the kernel then scales and writes bf16 itself),
    otherwise split-K to 2 CTAs per SM, at least 4 steps per CTA. Measured on an H100
    (benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache"): q|k|v (96
    stripes) took 14.2 us at 16 tokens and 17.5 at 64 without split-K against 15.4 and
    21.0 with 4 pieces."""
    tile_k = 256 if m <= 64 else 128  # the x tile grows with m: [m, tile_k] bf16 per stage
    stripes = n // 64
    split = 1
    if stripes < fp8_gemm.SM_COUNT // 2:
        while stripes * split < 2 * fp8_gemm.SM_COUNT and k % (tile_k * split * 2) == 0 and k // (tile_k * split * 2) >= 4:
            split *= 2
    return W8A16Config(tile_n=64, tile_k=tile_k, stages=4, split_k=split)


def _w8a16_transposed(
    x: Float[Array, "m_pad k"], values: Float[Array, "layers n k"], scale: Float[Array, "layers n"],
    layer: Int[Array, "1"], config: W8A16Config,
) -> Float[Array, "n split_m"]:
    """``W @ x.T`` for bf16 ``x``: with one piece of K, bf16 ``[n, m_pad]`` with the
    layer's channel scales applied; with more, float32 ``[n, split * m_pad]``, a partial
    per piece."""
    m_pad, k = x.shape
    n = values.shape[1]
    tile_n, tile_k, split = config.tile_n, config.tile_k, config.split_k
    k_steps = k // (tile_k * split)
    scaled = split == 1
    out_dtype = _BF16 if scaled else _F32
    out_transforms = _tiled(m_pad, out_dtype)
    stages = _fitting_stages(config.stages, k_steps, tile_n * tile_k + m_pad * tile_k * 2,
                             tile_n * m_pad * jnp.dtype(out_dtype).itemsize)

    def kernel(layer_gmem, w_gmem, x_gmem, scale_gmem, out_gmem):
        stripe = lax.axis_index("n")
        part = lax.axis_index("split")
        first_stripe = layer_gmem[0] * (n // tile_n)  # the layer's first row of w_gmem, in tiles

        def step(_, w_smem, x_smem, acc_ref):
            w = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
            w = w.astype(_F16).astype(_F32).astype(_BF16)  # exact at every step
            w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)
            plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_smem, (1, 0)))
            plgpu.wgmma_wait(0)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_n, m_pad), _F32),
                           out_smem=plgpu.SMEM((tile_n, m_pad), out_dtype, transforms=out_transforms))
        def _scope(acc_ref, out_smem):
            plgpu.emit_pipeline(
                lambda idx, w_smem, x_smem: step(idx, w_smem, x_smem, acc_ref),
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((tile_n, tile_k), lambda j: (first_stripe + stripe, part * k_steps + j),
                                    transforms=_tiled(tile_k, fp8_gemm.FP8)),
                    plgpu.BlockSpec((m_pad, tile_k), lambda j: (0, part * k_steps + j),
                                    transforms=_tiled(tile_k, _BF16)),
                ],
                max_concurrent_steps=stages,
            )(w_gmem, x_gmem)
            acc = acc_ref[...]
            if scaled:
                rows = pl.ds((first_stripe + stripe) * tile_n, tile_n)
                channel = plgpu.load(scale_gmem.at[rows], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                acc = (acc * lax.broadcast_in_dim(channel, acc.shape, [0])).astype(out_dtype)
            out_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem, out_gmem.at[pl.ds(stripe * tile_n, tile_n), pl.ds(part * m_pad, m_pad)])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n, split * m_pad), out_dtype),
        grid=(n // tile_n, split),
        grid_names=("n", "split"),
    )(layer, _rows_of_every_layer(values), x, scale.reshape(-1))


def _rows_of_every_layer(values: Float[Array, "layers n k"]) -> Float[Array, "layers_n k"]:
    """The stack as one ``[layers * n, k]`` matrix (a bitcast, not a copy): the kernels
    address their layer by TMA row coordinate, and the TMA unit computes the byte offset,
    which for a 70B stack is far past 32 bits (the Triton kernels' offsets are 32-bit up to 4 GiB:
    ``triton_offsets``)."""
    return values.reshape(-1, values.shape[-1])


def w8a16_matmul(
    x: Float[Array, "m k"],
    values: Float[Array, "*layers n k"],
    scale: Float[Array, "*layers n"],
    config: W8A16Config | None = None,
    *,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "m n"]:
    """``(x @ values.T) * scale`` rounded once to ``x.dtype``, by the Mosaic GPU kernel
    (the reference where ``config`` does not divide ``n, k``). ``layer``: ``values`` and
    ``scale`` are every layer's, stacked, and the kernel reads this layer's in place."""
    values, scale, layer = fp8_gemm.stacked_layers(values, scale, layer)
    m, k = x.shape
    n = values.shape[1]
    config = config or w8a16_config(n, k, m)
    layer_scale = scale[layer[0]]
    if not config.divides(n, k):
        return fp8_gemm.w8a16_matmul_reference(x, values[layer[0]], layer_scale)
    if m > _MAX_WGMMA_N:  # wgmma's N holds the tokens: cut into pieces (not a decode case)
        pieces = [w8a16_matmul(x[i:i + _MAX_WGMMA_N], values, scale, config, layer=layer[0])
                  for i in range(0, m, _MAX_WGMMA_N)]
        return jnp.concatenate(pieces, axis=0)
    m_pad = max(8, -(-m // 8) * 8)
    x_pad = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    out_t = _w8a16_transposed(x_pad.astype(_BF16), values, scale, layer, config)
    if config.split_k == 1:  # scaled and rounded in the kernel
        return out_t.T[:m].astype(x.dtype)
    acc_t = out_t.reshape(n, config.split_k, m_pad).sum(axis=1)
    return (acc_t.T[:m] * layer_scale[None, :]).astype(x.dtype)


# ----------------------------------------------------------------------------- w8a8


@dataclasses.dataclass(frozen=True)
class W8A8Config:
    """Each of two compute warpgroups owns ``tile_m x tile_n`` of a ``2 * tile_m`` by
    ``tile_n`` CTA tile; ``tile_k`` per step, ``stages`` steps in flight."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 3
    warp_specialized: bool = True  # False: one warpgroup, no warp specialization (tile_m rows)
    # persistent: one CTA an SM walks the output tiles (``_w8a8_gemm_persistent``), so that a
    # tile's epilogue overlaps the next tile's first loads; warp-specialized only
    persistent: bool = False

    def __post_init__(self):
        if self.tile_m % 64 or self.tile_m <= 0:
            raise ValueError(f"W8A8Config.tile_m must be a positive multiple of 64 (wgmma M), got {self.tile_m}")
        if self.tile_n % 8 or not 0 < self.tile_n <= 256:
            raise ValueError(f"W8A8Config.tile_n must be a multiple of 8 up to 256 (wgmma N), got {self.tile_n}")
        if self.tile_k % 128 or self.tile_k <= 0:
            raise ValueError(f"W8A8Config.tile_k must be a positive multiple of 128, got {self.tile_k}")
        if self.stages < 2:
            raise ValueError(f"W8A8Config.stages must be >= 2, got {self.stages}")
        if self.persistent and not self.warp_specialized:
            raise ValueError("W8A8Config.persistent needs warp_specialized")

    @property
    def cta_m(self) -> int:
        return 2 * self.tile_m if self.warp_specialized else self.tile_m

    def divides(self, n: int, k: int) -> bool:
        return n % self.tile_n == 0 and k % self.tile_k == 0

    def replace(self, **changes) -> W8A8Config:
        return dataclasses.replace(self, **changes)


def w8a8_config(n: int, k: int, m: int) -> W8A8Config:
    """The config used for an ``[m, k] @ [n, k].T`` prefill GEMM."""
    del n, k
    if m <= 128:
        return W8A8Config(tile_m=64, tile_n=128, tile_k=128, stages=4)
    return W8A8Config(tile_m=128, tile_n=128, tile_k=128, stages=3, persistent=True)


def _w8a8_gemm(
    xq: Float[Array, "m_pad k"],
    x_scale: Float[Array, "m_pad"],
    values: Float[Array, "layers n k"],
    scale: Float[Array, "n"],
    layer: Int[Array, "1"],
    config: W8A8Config,
) -> Float[Array, "m_pad n"]:
    m_pad, k = xq.shape
    n = values.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    k_steps = k // tile_k
    operand = _tiled(tile_k, fp8_gemm.FP8)
    stages = _fitting_stages(config.stages, k_steps, (2 * tile_m + tile_n) * tile_k, 2 * tile_m * tile_n * 2)

    def kernel(layer_gmem, a_gmem, b_gmem, xs_gmem, ws_gmem, out_gmem, out_smem):
        first_col_tile = layer_gmem[0] * (n // tile_n)  # the layer's first row of b_gmem, in tiles
        mi = lax.axis_index("m")
        ni = lax.axis_index("n")
        wg = lax.axis_index("wg")
        rows = pl.ds(mi * 2 * tile_m + wg * tile_m, tile_m)
        cols = pl.ds(ni * tile_n, tile_n)

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), _F32))
            def _acc_scope(acc_ref):
                eval_pipeline(acc_ref)
                acc = acc_ref[...]
                xs = plgpu.load(xs_gmem.at[rows], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                ws = plgpu.load(ws_gmem.at[cols], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                acc = acc * lax.broadcast_in_dim(xs, acc.shape, [0])
                acc = acc * lax.broadcast_in_dim(ws, acc.shape, [1])
                out_smem[wg] = acc.astype(_BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def body(_, a_smem, b_smem, acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * tile_m, tile_m)], plgpu.transpose_ref(b_smem, (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((2 * tile_m, tile_k), lambda j: (mi, j), transforms=operand),
                plgpu.BlockSpec((tile_n, tile_k), lambda j: (first_col_tile + ni, j), transforms=operand),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )(a_gmem, b_gmem)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_pad, n), _BF16),
        grid=(m_pad // (2 * tile_m), n // tile_n),
        grid_names=("m", "n"),
        num_threads=3,
        thread_name="wg",
        scratch_types=dict(out_smem=plgpu.SMEM((2, tile_m, tile_n), _BF16, transforms=_tiled(tile_n, _BF16))),
    )(layer, xq, _rows_of_every_layer(values), x_scale, scale)


def _w8a8_gemm_persistent(
    xq: Float[Array, "m_pad k"],
    x_scale: Float[Array, "m_pad"],
    values: Float[Array, "layers n k"],
    scale: Float[Array, "n"],
    layer: Int[Array, "1"],
    config: W8A8Config,
) -> Float[Array, "m_pad n"]:
    """``_w8a8_gemm``'s arithmetic with one CTA per SM looping over the output tiles. A
    non-persistent CTA's epilogue (scales, the store) and its pipeline's first loads leave
    the SM's tensor cores idle, about a tenth of a 4,096-row tile's time; here the memory
    warpgroup loads the next tile while the compute warpgroups finish this one, and the
    store of a tile's result is waited for only before the next one is written."""
    m_pad, k = xq.shape
    n = values.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    k_steps = k // tile_k
    m_tiles, n_tiles = m_pad // (2 * tile_m), n // tile_n
    operand = _tiled(tile_k, fp8_gemm.FP8)
    stages = _fitting_stages(config.stages, k_steps, (2 * tile_m + tile_n) * tile_k, 2 * tile_m * tile_n * 2)

    def pipeline_of(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((2 * tile_m, tile_k), lambda j: (0, j), transforms=operand),
                plgpu.BlockSpec((tile_n, tile_k), lambda j: (0, j), transforms=operand),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

    def kernel(layer_gmem, a_gmem, b_gmem, xs_gmem, ws_gmem, out_gmem, out_smem):
        first_col_tile = layer_gmem[0] * n_tiles  # the layer's first row of b_gmem, in tiles
        wg = lax.axis_index("wg")
        unused = lambda *_, **__: None  # noqa: E731 (the allocations do not depend on the body)
        allocations = pipeline_of(unused, unused).get_allocations(
            a_gmem.at[pl.ds(0, 2 * tile_m)], b_gmem.at[pl.ds(0, tile_n)])

        @functools.partial(pl.run_scoped, allocations=allocations, collective_axes="wg")
        def _scope(allocations):
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
            def _tile(info):
                (index,) = info.index
                # m fastest (as a grid's x): a wave of tiles shares a few columns of weights
                mi, ni = plgpu.planar_snake(index, (m_tiles, n_tiles), 1, 1)
                rows = pl.ds(mi * 2 * tile_m + wg * tile_m, tile_m)
                cols = pl.ds(ni * tile_n, tile_n)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), _F32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        xs = plgpu.load(xs_gmem.at[rows], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                        ws = plgpu.load(ws_gmem.at[cols], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                        acc = acc * lax.broadcast_in_dim(xs, acc.shape, [0])
                        acc = acc * lax.broadcast_in_dim(ws, acc.shape, [1])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read out_smem
                        out_smem[wg] = acc.astype(_BF16)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, cols])

                def body(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * tile_m, tile_m)], plgpu.transpose_ref(b_smem, (1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline_of(body, compute_context)(
                    a_gmem.at[pl.ds(mi * 2 * tile_m, 2 * tile_m)],
                    b_gmem.at[pl.ds((first_col_tile + ni) * tile_n, tile_n)],
                    allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_pad, n), _BF16),
        grid=(min(_sm_count(), m_tiles * n_tiles),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        scratch_types=dict(out_smem=plgpu.SMEM((2, tile_m, tile_n), _BF16, transforms=_tiled(tile_n, _BF16))),
    )(layer, xq, _rows_of_every_layer(values), x_scale, scale)


def _sm_count() -> int:
    """The default device's SM count (``fp8_gemm.SM_COUNT`` where it does not say)."""
    return getattr(jax.devices()[0], "core_count", None) or fp8_gemm.SM_COUNT


def _w8a8_gemm_one_warpgroup(
    xq: Float[Array, "m_pad k"],
    x_scale: Float[Array, "m_pad"],
    values: Float[Array, "layers n k"],
    scale: Float[Array, "n"],
    layer: Int[Array, "1"],
    config: W8A8Config,
) -> Float[Array, "m_pad n"]:
    m_pad, k = xq.shape
    n = values.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    k_steps = k // tile_k
    operand = _tiled(tile_k, fp8_gemm.FP8)
    stages = _fitting_stages(config.stages, k_steps, (tile_m + tile_n) * tile_k, tile_m * tile_n * 2)

    def kernel(layer_gmem, a_gmem, b_gmem, xs_gmem, ws_gmem, out_gmem):
        first_col_tile = layer_gmem[0] * (n // tile_n)  # the layer's first row of b_gmem, in tiles
        mi = lax.axis_index("m")
        ni = lax.axis_index("n")
        rows = pl.ds(mi * tile_m, tile_m)
        cols = pl.ds(ni * tile_n, tile_n)

        def step(_, a_smem, b_smem, acc_ref):
            plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
            plgpu.wgmma_wait(0)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), _F32),
                           out_smem=plgpu.SMEM((tile_m, tile_n), _BF16, transforms=_tiled(tile_n, _BF16)))
        def _scope(acc_ref, out_smem):
            plgpu.emit_pipeline(
                lambda idx, a_smem, b_smem: step(idx, a_smem, b_smem, acc_ref),
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((tile_m, tile_k), lambda j: (mi, j), transforms=operand),
                    plgpu.BlockSpec((tile_n, tile_k), lambda j: (first_col_tile + ni, j), transforms=operand),
                ],
                max_concurrent_steps=stages,
            )(a_gmem, b_gmem)
            acc = acc_ref[...]
            xs = plgpu.load(xs_gmem.at[rows], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            ws = plgpu.load(ws_gmem.at[cols], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            acc = acc * lax.broadcast_in_dim(xs, acc.shape, [0])
            acc = acc * lax.broadcast_in_dim(ws, acc.shape, [1])
            out_smem[...] = acc.astype(_BF16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows, cols])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m_pad, n), _BF16),
        grid=(m_pad // tile_m, n // tile_n),
        grid_names=("m", "n"),
    )(layer, xq, _rows_of_every_layer(values), x_scale, scale)


def w8a8_matmul(
    x: Float[Array, "m k"] | fp8_gemm.QuantizedRows,
    values: Float[Array, "*layers n k"],
    scale: Float[Array, "*layers n"],
    config: W8A8Config | None = None,
    *,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "m n"]:
    """``x`` quantized per row, then ``(xq @ values.T) * x_scale * scale`` rounded once
    to bf16 (then to the activations' dtype), by the Mosaic GPU kernel (the reference
    where ``config`` does not divide ``n, k``). ``x`` quantized already (:class:`fp8_gemm.QuantizedRows`) is taken as it is;
    bf16 ``x`` is quantized by :func:`fp8_rows.quantized`'s one-pass kernel. ``layer`` as
    in :func:`w8a16_matmul`."""
    from . import fp8_rows  # Triton lowering only when asked

    values, scale, layer = fp8_gemm.stacked_layers(values, scale, layer)
    quantized = x if isinstance(x, fp8_gemm.QuantizedRows) else None
    m, k = (quantized.values if quantized else x).shape
    n = values.shape[1]
    config = config or w8a8_config(n, k, m)
    layer_scale = scale[layer[0]]  # n floats: XLA's copy of them costs nothing
    if not config.divides(n, k):
        return fp8_gemm.w8a8_quantized_matmul_reference(fp8_gemm.QuantizedRows.of(x), values[layer[0]], layer_scale)
    if quantized is None:
        quantized = fp8_gemm.QuantizedRows(*fp8_rows.quantized(x, implementation="pallas"), dtype=x.dtype)
    m_pad = -(-m // config.cta_m) * config.cta_m
    xq, x_scale = quantized.values, quantized.scale
    if m_pad != m:  # zero rows with scale 1, as quantize_rows makes them
        xq = jnp.pad(xq, ((0, m_pad - m), (0, 0)))
        x_scale = jnp.pad(x_scale, (0, m_pad - m), constant_values=1.0)
    gemm = (_w8a8_gemm_persistent if config.persistent else _w8a8_gemm) if config.warp_specialized \
        else _w8a8_gemm_one_warpgroup
    out = gemm(xq, x_scale, values, layer_scale, layer, config)
    return out[:m].astype(quantized.dtype)
