"""The decode GEMM (``w8a16``) as a Pallas kernel on the Triton backend, beside the Mosaic
GPU one in :mod:`fp8_gemm_mosaic`; the contract and the reference are in :mod:`fp8_gemm`.

A program owns ``block_n`` output channels (weight rows) and one of ``split_k`` pieces of
the contraction. Each step loads an e4m3 tile ``[block_n, block_k]`` and the activations'
bf16 tile ``[m, block_k]``, converts the weights to bf16 in registers (exact: every e4m3
value is a bf16 value) and accumulates ``x @ w.T`` in float32; Triton's software pipeline
keeps ``num_stages`` tiles in flight. Without split-K there is no post-pass: the program
applies the channel scales and writes bf16. With split-K each piece writes a float32
partial and XLA sums them and applies the scales in one fusion.

The tokens are the dot's M, padded to a power of two of at least 16 (``tl.dot``'s minimum;
Triton's blocks are powers of two); a decode step has 16 to 64. A shape whose ``n`` or ``k``
the config does not divide falls back to the reference. Runs in Pallas's interpreter on the
CPU (``interpret=True``: the tests).

Weight stacks past 2 GiB: Pallas's Triton lowering computes a ref's element offsets in 32
bits unless the ref holds more than 4 GiB, and the pointer arithmetic reads those bits as
signed, so the elements of a 2-4 GiB ref past 2**31 are out of reach (Llama-3.1-8B's gate|up
over 32 layers, 3.5 GiB of e4m3: on the H200 its last layer gave products 100x off;
benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache"). The kernel refuses
such a stack, which ``Fp8GemmChoice`` sends to the Mosaic kernel; past 4 GiB (every
Llama-3.1-70B stack) the offsets are 64-bit and the kernel reads any layer. (Reading a 2-4
GiB stack as uint16 pairs of e4m3 values was tried: correct, but 8B's gate|up took 77 us
against the Mosaic kernel's 51 us on an H100.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from . import fp8_gemm, triton_offsets

_MIN_DOT_M = 16
_SMEM_BYTES = 227 * 1024 - 16 * 1024  # per program on the H200, less room for Triton's own buffers


@dataclasses.dataclass(frozen=True)
class TritonW8A16Config:
    """``block_n`` weight rows by ``block_k`` per step, ``split_k`` pieces of K, and the
    Triton program's warps and pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TritonW8A16Config.{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"TritonW8A16Config.split_k, num_warps and num_stages must be >= 1, got {self}")

    def divides(self, n: int, k: int) -> bool:
        return n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0


def triton_w8a16_config(n: int, k: int, m: int) -> TritonW8A16Config:
    """The config for an ``[m, k] @ [n, k].T`` decode GEMM: 32-row blocks, and split-K until
    there are 1.5 programs per SM (or the pieces get shorter than 4 steps). Measured at 16
    tokens on an H100 (benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache"):
    against the 64-row blocks with split-K to 2 programs per SM used before, Llama-3.1-8B's
    q|k|v took 14.5 us against 16.1, o 11.2 against 11.9, down 28.4 against 35.3 (XLA's sum
    of the partials included)."""
    del m
    block_n, block_k = 32, 256
    split = 1
    while ((n // block_n) * split < 3 * fp8_gemm.SM_COUNT // 2 and k % (block_k * split * 2) == 0
           and k // (block_k * split * 2) >= 4):
        split *= 2
    return TritonW8A16Config(block_n=block_n, block_k=block_k, split_k=split)


def _kernel(layer_ref, x_ref, w_ref, scale_ref, out_ref, *, block_n: int, block_k: int, steps: int, scaled: bool):
    layer = layer_ref[0]
    rows = pl.ds(pl.program_id(0) * block_n, block_n)
    first = pl.program_id(1) * steps

    def step(i, acc):
        cols = pl.ds((first + i) * block_k, block_k)
        x = x_ref[:, cols]
        w = w_ref[layer, rows, cols].astype(x.dtype)
        return acc + pltriton.dot(x, w, trans_b=True)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    if scaled:
        out_ref[...] = (acc * scale_ref[layer, rows][None, :]).astype(out_ref.dtype)
    else:
        out_ref[...] = acc


def w8a16_matmul(
    x: Float[Array, "m k"],
    values: Float[Array, "*layers n k"],
    scale: Float[Array, "*layers n"],
    config: TritonW8A16Config | None = None,
    *,
    layer: Int[Array, ""] | int | None = None,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """``(x @ values.T) * scale`` rounded once to ``x.dtype`` (bf16 activations), by the
    Triton kernel (the reference where ``config`` does not divide ``n, k``).

    ``layer``: ``values`` and ``scale`` are every layer's, stacked, and the kernel reads
    layer ``layer`` where it lies. A slice taken in XLA instead would be copied out of the
    stack on every call (a custom call's operand is a buffer of its own): on the H200 that
    copy made the FP8 decode step slower than bf16's."""
    if not triton_offsets.reaches(values.size, values.dtype.itemsize):
        raise ValueError(f"the Triton w8a16 kernel cannot address a weight of {values.size} elements (shape "
                         f"{values.shape}): Pallas gives a 2-4 GiB operand 32-bit offsets; use the Mosaic GPU kernel")
    values, scale, layer = fp8_gemm.stacked_layers(values, scale, layer)
    m, k = x.shape
    n = values.shape[1]
    config = config or triton_w8a16_config(n, k, m)
    if not config.divides(n, k):
        return fp8_gemm.w8a16_matmul_reference(x, values[layer[0]], scale[layer[0]])
    m_pad = max(_MIN_DOT_M, 1 << (m - 1).bit_length())  # Triton's blocks are powers of two
    x_pad = x if m_pad == m else jnp.pad(x, ((0, m_pad - m), (0, 0)))
    split = config.split_k
    steps = k // (config.block_k * split)
    stage_bytes = config.block_n * config.block_k + m_pad * config.block_k * x.dtype.itemsize
    stages = max(1, min(config.num_stages, _SMEM_BYTES // stage_bytes))  # more rows, fewer stages
    scaled = split == 1
    out_dtype = x.dtype if scaled else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=config.block_n, block_k=config.block_k, steps=steps, scaled=scaled),
        grid=(n // config.block_n, split),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=pl.BlockSpec((None, m_pad, config.block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((split, m_pad, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=stages),
        interpret=interpret,
        name="fp8_w8a16_matmul",
    )(layer, x_pad, values, scale)
    if scaled:
        return out[0, :m]
    return (out.sum(axis=0)[:m] * scale[layer[0]][None, :]).astype(x.dtype)
