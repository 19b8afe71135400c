"""Attention kernels over the stacked paged KV cache: pure-JAX reference and Pallas GPU."""

from .attention import ragged_paged_attention
from .cache_write import apply_rope, write_qkv_to_cache
from .metadata import AttentionMetadata
from .reference import ragged_paged_attention_reference, write_kv_cache

__all__ = [
    "AttentionMetadata",
    "apply_rope",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv_cache",
    "write_qkv_to_cache",
]
