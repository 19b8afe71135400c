"""The paged KV cache shared by both modes: same arrays, same PartitionSpec.

Per model one K and one V array ``[layers, kv_slots, num_pages, page_size, head_dim]``
(slot-major, so one device's pages for one slot are contiguous), with the slot axis split
over the head axes ``("tp", "sp")``. Layers are stacked so that the forward pass scans
over them; the attention and cache-write kernels take the whole stack and the layer index,
so no step ever copies a layer's slice. Page 0 is the scratch page: padding tokens write
there and no sequence owns it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from shiftjax.layouts.specs import CACHE_SPEC
from shiftjax.pytrees import unchecked_init

SCRATCH_PAGE = 0


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
        jnp.dtype(self.dtype)  # raises on an unknown dtype name


def allocate_cache(mesh: Mesh, num_layers: int, kv_slots: int, head_dim: int, cache: CacheConfig) -> KVCache:
    """Zeroed caches, allocated on the devices with their final sharding (never on the host)."""
    shape = (num_layers, kv_slots, cache.num_pages, cache.page_size, head_dim)
    sharding = NamedSharding(mesh, CACHE_SPEC)

    def zeros():
        return KVCache(k=jnp.zeros(shape, cache.dtype), v=jnp.zeros(shape, cache.dtype))

    return jax.jit(zeros, out_shardings=sharding)()
