"""Ragged paged attention for a flat batch mixing prefill chunks and decode tokens.

Cache layout: ``[layers, kv_slots, num_pages, page_size, head_dim]``: each layer's
``[kv_slots, num_pages, page_size, head_dim]`` cache, stacked on a leading axis
(docs/architecture.md, "The cache"), and every function here takes the
whole stack plus the layer index as a scalar (possibly traced inside ``lax.scan``), so no
caller ever slices out a layer and no path copies one.

Implementations behind one entry point, ``ragged_paged_attention``:
- ``"reference"``: pure JAX (``reference.py``), the oracle and the CPU path;
- ``"pallas"``: Pallas GPU kernels (``pallas_gpu.py``), a decode kernel with split-K and a
  prefill kernel, both launched by one call for a mixed batch;
- ``"auto"``: Pallas on a GPU backend, the reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import Array, Float, Int

from .metadata import AttentionMetadata
from .reference import ragged_paged_attention_reference

_IMPLEMENTATIONS = ("auto", "reference", "pallas")


def ragged_paged_attention(
    q: Float[Array, "tokens q_heads head_dim"],
    k_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    v_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    metadata: AttentionMetadata,
    *,
    layer: Int[Array, ""] | int,
    sm_scale: float,
    kv_slot_of_head: Sequence[int] | None = None,
    implementation: str = "auto",
    config: Any = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads head_dim"]:
    """Causal attention of every query token over its sequence's paged keys.

    Sequence ``b``'s queries are tokens ``query_start[b] .. query_start[b+1]-1``; its
    ``j``-th query sits at position ``seq_lens[b] - q_len[b] + j`` and sees keys at
    positions ``0 ..`` that position, found at ``page_table[b, pos // page_size]``, offset
    ``pos % page_size``. The new tokens' K/V must already be in the cache
    (``write_kv_cache``, or ``write_qkv_to_cache``). ``kv_slot_of_head`` is a static tuple
    naming the cache slot of each query head (GQA, also uneven groups such as
    ``(0, 0, 0, 1, 1)``); ``None`` means head ``h`` reads slot ``h // (q_heads // kv_slots)``.
    Padding tokens give zeros.
    Returns ``q.dtype``, accumulated in f32. ``config``: a ``PallasAttentionConfig`` for the
    Pallas path (ignored by the reference).

    The caches' dtype is read from the arrays. An FP8 cache (``float8_e4m3fn``) holds
    ``k / k_scale`` and ``v / v_scale`` (``write_qkv_to_cache``); it is read as
    ``e4m3 * scale``, with ``k_scale`` folded into ``sm_scale`` and ``v_scale`` into the
    output. Other caches ignore the scales.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r}; choose one of {', '.join(_IMPLEMENTATIONS)}."
        )
    if implementation == "auto":
        implementation = "pallas" if jax.default_backend() == "gpu" else "reference"
    if implementation == "reference":
        return ragged_paged_attention_reference(
            q, k_cache, v_cache, metadata, layer=layer, sm_scale=sm_scale,
            kv_slot_of_head=kv_slot_of_head, k_scale=k_scale, v_scale=v_scale,
        )
    from .pallas_gpu import ragged_paged_attention_pallas  # Triton lowering only when asked

    return ragged_paged_attention_pallas(
        q, k_cache, v_cache, metadata, layer=layer, sm_scale=sm_scale,
        kv_slot_of_head=kv_slot_of_head, config=config, k_scale=k_scale, v_scale=v_scale,
    )
