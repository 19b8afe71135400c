"""How many KV-cache pages the engine allocates: given, or what device memory leaves."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from shiftjax.serving.engine.cuda_free_memory import cuda_free_and_total

DEFAULT_KV_MEMORY_FRACTION = 0.9  # of what weights and temporaries leave; the rest is headroom


@dataclasses.dataclass(frozen=True)
class PagePool:
    """The chosen pool and a sentence saying how it was chosen (reported at start)."""

    num_pages: int  # including page 0, the scratch page
    sized_by: str  # "num_pages" | "memory" | "fallback"
    explanation: str


def jax_memory_fraction() -> float:
    """The share of each GPU's memory JAX lets its allocator take, read as jaxlib reads it
    (``xla_client``): ``XLA_CLIENT_MEM_FRACTION``, else the deprecated
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (both set: jaxlib refuses to start), an empty value
    unset; default 0.75. The VMM allocator holds to it as its physical budget: a pool sized
    past it failed every step on an H200 (benchmarks/README.md, "GPU allocator")."""
    fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION", "") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    return float(fraction) if fraction else 0.75


def device_memory(devices, driver_memory=cuda_free_and_total) -> tuple[int, int] | None:
    """``(limit, in_use)`` bytes of the fullest device: JAX's allocator's statistics; on a
    GPU whose allocator keeps none (XLA's VMM allocator), the driver's: ``limit`` JAX's share
    of the device's memory (``jax_memory_fraction``), ``in_use`` all that is taken on it, by
    any allocator or process; None where neither answers (the CPU)."""
    stats = []
    for device in devices:
        try:
            memory = device.memory_stats()
        except Exception:  # backends without statistics raise or return None
            memory = None
        if memory and "bytes_limit" in memory:
            stats.append((int(memory["bytes_limit"]), int(memory.get("bytes_in_use", 0))))
            continue
        # (another process's GPU has no local id: left unknown, as its statistics are)
        local = device.platform == "gpu" and device.local_hardware_id is not None
        free_total = driver_memory(device.local_hardware_id) if local else None
        if free_total is None:
            return None
        free, total = free_total
        stats.append((int(jax_memory_fraction() * total), total - free))
    return min(stats, key=lambda s: s[0] - s[1])


def size_pool(*, num_pages: int | None, kv_memory_fraction: float | None, fallback_pages: int,
              page_bytes: int, mesh_devices, temporary_bytes=None, unreachable: range = range(0)) -> PagePool:
    """``num_pages`` when given; else ``kv_memory_fraction`` (default 0.9) of the device
    memory left after the weights already placed and the executables' temporaries
    (``temporary_bytes()``, called only when needed: it compiles the largest steps, or reads
    their size from the executable store); on a
    backend without memory statistics, ``fallback_pages`` (every sequence slot can reach
    max_model_len), saying so.

    The limit is the JAX allocator's (``bytes_limit``: 75% of the GPU's memory unless JAX is
    told otherwise), or under the VMM allocator that share of the GPU's memory less all that
    the driver says is taken. On a 2-GPU mesh with Llama-3.1-8B's shape unrolled, the default ran
    out of memory allocating the cache (seen on two H200s): the temporaries estimate can fall
    short there; give ``--kv-memory-fraction`` or ``--num-pages`` until it is measured.

    ``unreachable``: page counts the GPU kernels cannot address (an FP8 cache of 2 to 4 GiB
    a device, ``CacheGeometry.triton_unreachable_pages``). A pool sized into that range
    (from memory or the fallback) is cut to the last count below it; a pool given there is
    refused."""
    pool = _sized_pool(num_pages=num_pages, kv_memory_fraction=kv_memory_fraction, fallback_pages=fallback_pages,
                       page_bytes=page_bytes, mesh_devices=mesh_devices, temporary_bytes=temporary_bytes)
    if pool.num_pages not in unreachable:
        return pool
    if pool.sized_by == "num_pages":
        raise ValueError(
            f"--num-pages {num_pages} makes each K and V cache array 2 to 4 GiB a device, and the GPU's "
            f"Pallas Triton kernels address such an array (of 1-byte FP8 elements) with 32-bit signed "
            f"offsets that cannot reach its upper half: give at most {unreachable.start - 1} or at least "
            f"{unreachable.stop} pages")
    pages = unreachable.start - 1
    return dataclasses.replace(pool, num_pages=pages, explanation=(
        f"{pool.explanation}; cut from {pool.num_pages} pages to {pages}: {pool.num_pages} would make each K and "
        f"V array 2 to 4 GiB a device, past what the GPU kernels' 32-bit offsets reach"))


def _sized_pool(*, num_pages, kv_memory_fraction, fallback_pages, page_bytes, mesh_devices, temporary_bytes) -> PagePool:
    """:func:`size_pool`'s choice before the kernels' reach is taken into account."""
    if num_pages is not None:
        return PagePool(num_pages, "num_pages", f"KV cache: {num_pages} pages (--num-pages)")
    devices = list(np.asarray(mesh_devices).flat)
    memory = device_memory(devices)
    if memory is None:
        note = (f"KV cache: {fallback_pages} pages (max_num_seqs x pages per max_model_len + 1): "
                f"{devices[0].platform} devices report no memory statistics, so "
                f"--kv-memory-fraction cannot apply; use --num-pages to choose")
        return PagePool(fallback_pages, "fallback", note)
    fraction = DEFAULT_KV_MEMORY_FRACTION if kv_memory_fraction is None else kv_memory_fraction
    limit, in_use = memory
    temporaries = int(temporary_bytes()) if temporary_bytes is not None else 0
    left = limit - in_use - temporaries
    pages = int(fraction * left) // page_bytes
    if pages < 2:
        raise ValueError(
            f"no room for a KV cache: {limit / 2**30:.2f} GiB per device, {in_use / 2**30:.2f} GiB in use "
            f"(weights), {temporaries / 2**30:.2f} GiB of step temporaries; use a smaller model or "
            f"batch, or give --num-pages")
    note = (f"KV cache: {pages} pages of {page_bytes / 2**20:.2f} MiB per device = "
            f"{pages * page_bytes / 2**30:.2f} GiB, {fraction:.0%} of the {left / 2**30:.2f} GiB left of "
            f"{limit / 2**30:.2f} GiB after what is in use (weights; under --gpu-allocator vmm all the "
            f"driver reports, {in_use / 2**30:.2f} GiB) and step temporaries ({temporaries / 2**30:.2f} GiB)")
    return PagePool(pages, "memory", note)
