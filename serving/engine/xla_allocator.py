"""Which device-memory allocator JAX's GPU client uses, chosen before the client starts.

XLA launches a step's kernels as CUDA graphs (command buffers) and, before each launch,
re-records the commands whose buffers moved since the last one. With JAX's default BFC
allocator, whole stretches of steps re-recorded every graph of the step, most likely
because the step's temporary buffer landed somewhere new each time; with XLA's VMM
allocator (``vmm``) no phase of the engine's decode loop measured on 2x H200 did
(benchmarks/README.md, "GPU allocator", with the figures). Served,
though, ``vmm`` decoded one request at a time 1.13-1.27x slower than the default and 8 or 64
concurrent ones alike (the same table): the
default stays the default.

JAX reads the choice from ``XLA_PYTHON_CLIENT_ALLOCATOR`` when it registers its GPU plugin
and creates the client, so it must be made before anything touches a device; CPUs ignore
it. The VMM allocator keeps no memory statistics (``memory_stats()`` is None), so the KV
cache is sized from what the CUDA driver says is free (``serving/engine/cuda_free_memory.py``).
"""

from __future__ import annotations

import os

GPU_ALLOCATORS = ("default", "vmm")
JAX_ALLOCATOR_VARIABLE = "XLA_PYTHON_CLIENT_ALLOCATOR"


def use_gpu_allocator(allocator: str) -> None:
    """Makes ``allocator`` the one JAX's GPU client will use; ``default`` changes nothing.
    Raises RuntimeError once JAX has registered its plugins or started a backend (the
    choice would be silently ignored)."""
    if allocator not in GPU_ALLOCATORS:
        raise ValueError(f"allocator must be one of {GPU_ALLOCATORS}, got {allocator!r}")
    if allocator == "default":
        return
    from jax._src import xla_bridge  # private: JAX has no public "has a backend started"

    if xla_bridge.backends_are_initialized() or getattr(xla_bridge, "_plugins_registered", False):
        raise RuntimeError(f"--gpu-allocator {allocator}: JAX has already set up its devices; "
                           f"choose the allocator before anything touches a device")
    os.environ[JAX_ALLOCATOR_VARIABLE] = allocator
