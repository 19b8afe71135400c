"""Which device-memory allocator JAX's GPU client uses, chosen before the client starts.

XLA launches a step's kernels as CUDA graphs (command buffers) and, before each launch,
re-records every command whose buffers moved since the last one. With JAX's default BFC
allocator the step's temporary buffer lands at a new address in whole stretches of steps,
and then every graph of the step is re-recorded: on 2x H200 (Llama-3.1-8B shape, TP decode
in the engine's loop) 63-73 graph updates a step per GPU, 3.5-5.3 ms of host time, against
33-42 updates and 0.3-1.0 ms otherwise, and such steps took 1.5-1.8x as long. With XLA's
VMM allocator (``vmm``) none of 28 stretches measured did that; in one device call, one
process each, the engine's loop ran 1.5-1.8x faster with it than with the default, which
spent every stretch re-recording (benchmarks/x2_results.md, "Command buffers re-recorded").

JAX reads the choice from ``XLA_PYTHON_CLIENT_ALLOCATOR`` when it creates the GPU client,
so it must be made before anything touches a device; CPUs ignore it. The VMM allocator
keeps no memory statistics (``memory_stats()`` is None), so the KV cache cannot be sized
from free memory: ``vmm`` needs ``--num-pages``.
"""

from __future__ import annotations

import os

GPU_ALLOCATORS = ("default", "vmm")
ENVIRONMENT_VARIABLE = "XLA_PYTHON_CLIENT_ALLOCATOR"


def gpu_allocator_error(allocator: str, num_pages: int | None) -> str | None:
    """Why this choice cannot serve, or None."""
    if allocator not in GPU_ALLOCATORS:
        return f"--gpu-allocator must be one of {GPU_ALLOCATORS}, got {allocator!r}"
    if allocator == "vmm" and num_pages is None:
        return ("--gpu-allocator vmm keeps no memory statistics to size the KV cache from: "
                "give --num-pages")
    return None


def use_gpu_allocator(allocator: str) -> None:
    """Makes ``allocator`` the one JAX's GPU client will use; ``default`` changes nothing.
    Raises RuntimeError once JAX's backends have started (the choice would be ignored)."""
    if allocator == "default":
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(f"--gpu-allocator {allocator}: JAX's backends have already started; "
                           f"choose the allocator before anything touches a device")
    os.environ[ENVIRONMENT_VARIABLE] = allocator
