"""The paged KV cache shared by both modes: same arrays, same PartitionSpec.

Per model one K and one V array ``[layers, kv_slots, num_pages, page_size, head_dim]``
(slot-major, so one device's pages for one slot are contiguous), with the slot axis split
over the head axes ``("tp", "sp")``. Layers are stacked so that the forward pass scans
over them; the attention and cache-write kernels take the whole stack and the layer index,
so no step ever copies a layer's slice. Page 0 is the scratch page: padding tokens write
there and no sequence owns it.

The dtype is the activations' (bf16, f32) or ``float8_e4m3fn``: an FP8 cache stores K and
V divided by a static per-cache scale and rounded to e4m3 (``kernels/reference.py``), half
the bytes of bf16 per page, so twice the tokens per GiB. The CLI's spelling "fp8" is mapped
to it before it gets here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from shiftjax.kernels import triton_offsets
from shiftjax.layouts.specs import CACHE_SPEC
from shiftjax.pytrees import unchecked_init

CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
CACHE_DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}  # as vLLM's --kv-cache-dtype spells it


def cache_dtype_named(name: str) -> str:
    """``name`` with its alias resolved (``fp8`` is ``float8_e4m3fn``)."""
    return CACHE_DTYPE_ALIASES.get(name, name)


def check_cache_dtype(dtype: str, where: str) -> None:
    """Raises with a sentence unless ``dtype`` names a dtype the kernels can keep a cache in."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in CACHE_DTYPES:
        raise ValueError(f"{where}.dtype={dtype!r} is not a KV-cache dtype; use one of {', '.join(CACHE_DTYPES)} "
                         "(float8_e4m3fn is the FP8 cache).")


@unchecked_init
@struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    num_pages: int
    page_size: int
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        check_cache_dtype(self.dtype, "CacheConfig")


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens (the one rounding every page count uses)."""
    return -(-tokens // page_size)


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Everything about one model's cache but its page count: the one home of its shape."""

    num_layers: int
    kv_slots: int  # all devices' KV slots (layouts.heads)
    page_size: int
    head_dim: int
    dtype: str

    def __post_init__(self):
        check_cache_dtype(self.dtype, "CacheGeometry")

    def shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, self.kv_slots, num_pages, self.page_size, self.head_dim)

    def page_bytes_per_device(self, num_devices: int) -> int:
        """Bytes one page takes on one device: K and V, every layer, this device's share of
        the slots (the slot axis is split over all devices). An FP8 cache's is half of bf16's."""
        local_slots = -(-self.kv_slots // num_devices)
        return 2 * self.num_layers * local_slots * self.page_size * self.head_dim * jnp.dtype(self.dtype).itemsize

    def triton_unreachable_pages(self, num_devices: int) -> range:
        """The page counts whose K (or V) array on a device the GPU's Pallas Triton kernels
        (attention, the cache write) cannot address whole (``triton_offsets``): for an FP8
        cache, those that make it 2 to 4 GiB a device; none for bf16."""
        local_slots = -(-self.kv_slots // num_devices)
        elements_per_page = self.num_layers * local_slots * self.page_size * self.head_dim
        return triton_offsets.unreachable_counts(elements_per_page, jnp.dtype(self.dtype).itemsize)

    def abstract(self, mesh: Mesh, num_pages: int = 2) -> KVCache:
        """The cache as ``ShapeDtypeStruct`` s with its sharding (by default two pages: enough
        to lower a probe step without allocating anything)."""
        leaf = jax.ShapeDtypeStruct(self.shape(num_pages), jnp.dtype(self.dtype),
                                    sharding=NamedSharding(mesh, CACHE_SPEC))
        return KVCache(k=leaf, v=leaf)

    def allocate(self, mesh: Mesh, num_pages: int) -> KVCache:
        """Zeroed caches, allocated on the devices with their final sharding (never on the host)."""
        shape, dtype = self.shape(num_pages), self.dtype

        def zeros():
            return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

        return jax.jit(zeros, out_shardings=NamedSharding(mesh, CACHE_SPEC))()


def allocate_cache(mesh: Mesh, num_layers: int, kv_slots: int, head_dim: int, cache: CacheConfig) -> KVCache:
    """Zeroed caches of ``cache.num_pages`` pages (:meth:`CacheGeometry.allocate`)."""
    return CacheGeometry(num_layers, kv_slots, cache.page_size, head_dim, cache.dtype).allocate(mesh, cache.num_pages)
