"""The page pool against the GPU kernels' reach: an FP8 cache whose K and V arrays are 2 to
4 GiB a device lies partly past Pallas Triton's 32-bit offsets (kernels/triton_offsets.py),
so the engine neither sizes nor accepts one."""

from __future__ import annotations

import pytest

from shiftjax.cache import CacheGeometry
from shiftjax.kernels import triton_offsets
from shiftjax.serving.engine.page_budget import size_pool

LLAMA_8B = dict(num_layers=32, kv_slots=8, page_size=16, head_dim=128)  # 2**19 elements a page


class _Device:
    platform, local_hardware_id = "gpu", 0

    def __init__(self, limit: int, in_use: int):
        self._stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self._stats


def test_only_an_fp8_cache_of_2_to_4_gib_an_array_is_out_of_reach():
    fp8 = CacheGeometry(**LLAMA_8B, dtype="float8_e4m3fn")
    assert fp8.triton_unreachable_pages(1) == range(4096, 8193)   # 2**31 .. 2**32 elements
    assert fp8.triton_unreachable_pages(2) == range(8192, 16385)  # half the slots a device
    bf16 = CacheGeometry(**LLAMA_8B, dtype="bfloat16")
    assert bf16.triton_unreachable_pages(1) == range(4096, 4097)  # exactly 2**31 elements: 4 GiB, kept out
    assert triton_offsets.reaches(2**31 - 1, 1) and not triton_offsets.reaches(2**31, 1)
    assert triton_offsets.reaches(2**32 + 1, 1) and not triton_offsets.reaches(2**32, 1)


def test_given_pages_in_the_gap_are_refused_with_the_counts_that_work():
    unreachable = CacheGeometry(**LLAMA_8B, dtype="float8_e4m3fn").triton_unreachable_pages(1)
    common = dict(kv_memory_fraction=None, fallback_pages=64, page_bytes=2**20, mesh_devices=[_Device(0, 0)],
                  unreachable=unreachable)
    with pytest.raises(ValueError, match="--num-pages 5000 makes each K and V cache array 2 to 4 GiB a device.*"
                                         "at most 4095 or at least 8193 pages"):
        size_pool(num_pages=5000, **common)
    assert size_pool(num_pages=4095, **common).num_pages == 4095
    assert size_pool(num_pages=8193, **common).num_pages == 8193


def test_a_pool_sized_into_the_gap_is_cut_below_it():
    geometry = CacheGeometry(**LLAMA_8B, dtype="float8_e4m3fn")
    page_bytes = geometry.page_bytes_per_device(1)  # K and V: 1 MiB a page
    common = dict(num_pages=None, kv_memory_fraction=0.5, fallback_pages=64, page_bytes=page_bytes,
                  unreachable=geometry.triton_unreachable_pages(1))
    pool = size_pool(mesh_devices=[_Device(16 * 2**30, 4 * 2**30)], **common)  # 6 GiB: 6144 pages
    assert pool.num_pages == 4095 and "cut from 6144 pages" in pool.explanation
    pool = size_pool(mesh_devices=[_Device(24 * 2**30, 4 * 2**30)], **common)  # 10 GiB: past the gap
    assert pool.num_pages == 10240 and "cut" not in pool.explanation


def test_a_fallback_pool_in_the_gap_is_cut_as_well():
    """A GPU that reports no memory (another process's) takes the fallback count, which the
    kernels' reach bounds as it bounds a pool sized from memory."""
    silent = _Device(0, 0)
    silent._stats, silent.local_hardware_id = None, None
    geometry = CacheGeometry(**LLAMA_8B, dtype="float8_e4m3fn")
    pool = size_pool(num_pages=None, kv_memory_fraction=None, fallback_pages=5000, page_bytes=2**20,
                     mesh_devices=[silent], unreachable=geometry.triton_unreachable_pages(1))
    assert pool.sized_by == "fallback" and pool.num_pages == 4095 and "cut from 5000 pages" in pool.explanation
