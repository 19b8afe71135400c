"""An all-gather feeding a GEMM along one mesh axis, ``all_gather(x, axis) @ w``: SP mode's
q|k|v projection when each device multiplies every token of the step by its own head block
(``model.sp_layer`` with ``qkv_exchange="gather"``).

Implementations behind one entry point, ``all_gather_matmul``:
- ``"reference"``: XLA's all-gather, then its GEMM; the oracle and the path off Hopper GPUs.
  XLA runs the two one after the other (2x H200: it overlapped no collective with a GEMM
  however asked; ``benchmarks/x2_results.md``, "Overlapping SP's all-to-alls");
- ``"mosaic"``: JAX's Mosaic GPU kernel ``all_gather_lhs_matmul``, which sends ``x``'s tiles
  to the next device while it multiplies the ones it has (2x H200, 2 x 2048 tokens, hidden
  4096, block 3072: 202 us against 237 us gathered then multiplied and 176 us for the GEMM
  alone; bit-identical; ``benchmarks/collective_matmul.py``);
- ``"auto"``: Mosaic where ``fused_kernel_fits`` says it can run, the reference elsewhere
  (so far never inside shiftjax's steps: their mesh has two axes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

_IMPLEMENTATIONS = ("auto", "reference", "mosaic")


@dataclasses.dataclass(frozen=True)
class GatherMatmulConfig:
    """Tiles of the Mosaic kernel (``hopper_matmul_mgpu.TuningConfig``'s fields that matter
    here). The default was the best of four on 2x H200 at the 8B shape
    (``benchmarks/results/x2_overlap/collective_matmul/``); 256-row tiles exceed shared memory."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4


def fused_kernel_fits(tokens: int, d_in: int, n: int, dtype, axis_size: int, mesh_axes: int = 1,
                      config: GatherMatmulConfig = GatherMatmulConfig()) -> str | None:
    """Why the Mosaic kernel cannot run this product here (``None``: it can). Static, so the
    choice is made per compiled shape. The kernel needs a Hopper GPU, bf16 or f16, tiles
    that divide the shapes, the gathered axis to span every device of a one-process run,
    and a mesh of that one axis: it names its peer by one device index, which a mesh of
    more axes refuses ("Number of device ids must match the number of mesh axes", JAX
    0.11.2 on 2x H200, with shiftjax's (sp, tp) mesh at tp = 1)."""
    if mesh_axes != 1:
        return f"a mesh of {mesh_axes} axes"
    devices = jax.devices()
    if devices[0].platform != "gpu" or getattr(devices[0], "compute_capability", "") != "9.0":
        return "not a Hopper GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)}"
    if axis_size != len(devices) or jax.process_count() != 1:
        return "the axis does not span every device of one process"
    if tokens % config.tile_m or n % config.tile_n or d_in % config.tile_k:
        return f"tiles {config.tile_m}x{config.tile_n}x{config.tile_k} do not divide {tokens}x{n}x{d_in}"
    return None


def all_gather_matmul(
    x: Float[Array, "tokens d_in"],
    w: Float[Array, "d_in n"],
    axis_name: str,
    *,
    implementation: str = "auto",
    config: GatherMatmulConfig = GatherMatmulConfig(),
) -> Float[Array, "all_tokens n"]:
    """``all_gather(x, axis_name, tiled) @ w`` inside ``shard_map``: every device's rows of
    ``x`` in device order, times this device's ``w``."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(_IMPLEMENTATIONS)}.")
    axis_size = lax.axis_size(axis_name)
    if implementation == "auto":
        mesh_axes = len(jax.sharding.get_abstract_mesh().axis_names)
        fits = fused_kernel_fits(x.shape[0], x.shape[1], w.shape[1], x.dtype, axis_size, mesh_axes, config)
        implementation = "reference" if fits else "mosaic"
    if implementation == "reference":
        return all_gather_matmul_reference(x, w, axis_name)
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as mosaic  # Mosaic only when asked

    tuning = mosaic.TuningConfig(
        tile_m=config.tile_m, tile_n=config.tile_n, tile_k=config.tile_k,
        max_concurrent_steps=config.max_concurrent_steps, grid_minor_dim=mosaic.MatmulDimension.N,
        grid_tile_width=config.grid_tile_width, wg_dimension=mosaic.MatmulDimension.N)
    return mosaic.all_gather_lhs_matmul(x, w, axis_name, config=tuning, dtype=x.dtype)


def all_gather_matmul_reference(
    x: Float[Array, "tokens d_in"], w: Float[Array, "d_in n"], axis_name: str
) -> Float[Array, "all_tokens n"]:
    return lax.all_gather(x, axis_name, axis=0, tiled=True) @ w
