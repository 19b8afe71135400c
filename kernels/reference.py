"""Pure-JAX ragged paged attention and the KV-cache write: the oracle and the CPU path.

The reference is also what the model runs on the CPU (SmolLM2-135M: T up to ~512 tokens,
contexts up to ~2048), so it is written to stay small in memory: query tokens go through
in tiles of consecutive tokens of one sequence, and each tile gathers its sequence's
pages once, straight from the stacked cache with the layer index inside the gather
(``k_cache[layer]`` would copy a whole layer on the CPU). Tiles are processed in groups
whose gathered K/V (``[group, max_pages * page_size, head_dim]`` per slot) and scores
(``[group, tile * group_heads, max_pages * page_size]``) fit a fixed budget. Measured on
a 2-core CPU at SmolLM2-135M shapes (9 q / 3 kv heads, D 64, 2048 positions, 16
sequences, bf16 cache of 30 layers), per layer: 16 decode tokens 0.09 s, 64 tokens 0.16 s,
a 497-token chunk plus 15 decode tokens 0.41 s.

FP8 caches. A cache of dtype ``float8_e4m3fn`` holds ``x / scale`` clipped to +-448 (the
largest finite e4m3 value; a plain cast of anything beyond it gives NaN) and rounded to
nearest even, with one static scale per cache for K and one for V (``k_scale``,
``v_scale``; 1.0 is vLLM's default for ``--kv-cache-dtype fp8`` without calibrated
scales). ``to_cache_dtype`` is the one definition of that rounding: the reference write
and the Pallas write kernel both call it. Readers convert e4m3 exactly to the compute
dtype and fold the scales in: ``k_scale`` into the softmax scale, ``v_scale`` into the
normalised output. Any other cache dtype ignores the scales and is read and written
exactly as before they existed.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .metadata import AttentionMetadata, heads_by_slot, kv_slot_map

# Bytes of gathered K and V (as f32) one chunk of query tokens may hold at once.
_CHUNK_BUDGET_BYTES = 64 << 20

FP8_CACHE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # jnp.finfo(float8_e4m3fn).max


def is_fp8_cache(dtype) -> bool:
    """Whether a cache of ``dtype`` stores scaled e4m3 (the only 8-bit cache dtype there is)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and dtype != FP8_CACHE_DTYPE:
        raise ValueError(f"A KV cache of dtype {dtype.name} is not supported; the 8-bit cache dtype is "
                         "float8_e4m3fn.")
    return dtype == FP8_CACHE_DTYPE


def check_scales(k_scale: float, v_scale: float) -> None:
    """The caches' scales must be positive finite Python numbers (static, not traced)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(value, numbers.Real) or not 0.0 < float(value) < float("inf"):
            raise ValueError(f"{name}={value!r}: the FP8 cache's scales are positive finite Python floats "
                             "(static per cache, 1.0 without calibration).")


def to_cache_dtype(x, dtype, scale: float = 1.0):
    """``x`` as a cache of ``dtype`` stores it: for ``float8_e4m3fn``, ``x / scale`` (as a
    multiplication by the f32 reciprocal: exactly rounded on every backend, where a GPU's
    f32 division need not be) clipped to +-448, then rounded to nearest even; for any other
    dtype a plain cast, the scale ignored. Also runs inside the Pallas write kernel."""
    dtype = jnp.dtype(dtype)
    if not is_fp8_cache(dtype):
        return x.astype(dtype)
    x = x.astype(jnp.float32)  # exact from bf16/f16: one rounding, to e4m3, below
    if scale != 1.0:
        x = x * jnp.float32(1.0 / scale)
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(dtype)


def write_kv_cache(
    k_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    v_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    k: Float[Array, "tokens kv_slots head_dim"],
    v: Float[Array, "tokens kv_slots head_dim"],
    slot_mapping: Int[Array, "tokens"],
    *,
    layer: Int[Array, ""] | int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[
    Float[Array, "layers kv_slots num_pages page_size head_dim"],
    Float[Array, "layers kv_slots num_pages page_size head_dim"],
]:
    """Write the step's new K/V rows into their cache slots of one layer.

    Rows are stored as ``to_cache_dtype`` makes them: an FP8 cache holds ``k / k_scale``
    and ``v / v_scale`` clipped and rounded to e4m3; other caches ignore the scales.

    ``slot_mapping[t] = page * page_size + offset``; padding tokens point into page 0,
    the scratch page, and may collide there (whichever write lands is irrelevant). One
    scatter per cache: under ``jit`` with the caches donated, or as a ``lax.scan`` carry,
    XLA updates the buffer in place. ``layer`` may be traced.
    """
    page_size = k_cache.shape[3]
    page = slot_mapping // page_size
    offset = slot_mapping % page_size
    layer = jnp.asarray(layer, jnp.int32)
    check_scales(k_scale, v_scale)
    k, v = to_cache_dtype(k, k_cache.dtype, k_scale), to_cache_dtype(v, v_cache.dtype, v_scale)
    # Advanced indices split by a slice put the token axis first: the indexed shape is
    # [tokens, kv_slots, head_dim], exactly k's.
    return (_scatter_bits(k_cache, layer, page, offset, k), _scatter_bits(v_cache, layer, page, offset, v))


def _scatter_bits(cache, layer, page, offset, rows):
    """``cache.at[layer, :, page, offset].set(rows)`` done on same-width unsigned integers:
    XLA's CPU backend otherwise widens a bf16 scatter to f32, converting the whole stacked
    cache there and back every layer (tests/test_kernels.py's in-place check caught it);
    a bitcast of equal width is free, so the scatter stays in place."""
    updated = _as_bits(cache).at[layer, :, page, offset].set(_as_bits(rows.astype(cache.dtype)),
                                                              mode="promise_in_bounds")
    return lax.bitcast_convert_type(updated, cache.dtype)


def _gather_pages(cache_bits, dtype, layer, slot: int, pages):
    """``cache[layer, slot, pages]`` as f32 ``[chunk, max_pages * page_size, head_dim]``.

    One gather per slot keeps the result contiguous in the layout the dots want (gathering
    all slots at once and slicing one out ran 5x slower on the CPU). The cache is gathered
    as same-width unsigned integers: XLA's CPU backend otherwise widens a bf16 gather to
    f32 and hoists that convert of the *whole stacked cache* out of any enclosing loop
    (seen on the CPU with a loop over query chunks: 2.5 s instead of ~50 ms for 16 decode
    tokens, 30 layers x 2049 pages).
    """
    raw = cache_bits[layer, slot, pages]  # [chunk, max_pages, page_size, head_dim]
    values = lax.bitcast_convert_type(raw, dtype).astype(jnp.float32)
    return values.reshape(raw.shape[0], raw.shape[1] * raw.shape[2], raw.shape[3])


def _tile_size(num_tokens: int, num_seqs: int, q_heads: int, kv_width: int) -> int:
    """Query rows per tile, trading padded rows (each sequence pads its last tile) against
    gathers (each tile gathers its sequence's whole context)."""
    def cost(tile):
        tiles = -(-num_tokens // tile) + num_seqs
        return tiles * tile * q_heads + 2 * tiles * kv_width
    return min((1, 2, 4, 8, 16, 32, 64, 128), key=cost)


def _tiles(metadata: AttentionMetadata, tile: int, num_tiles: int):
    """Tiles of up to ``tile`` consecutive query tokens of one sequence each.

    Returns per tile: its sequence, first token, first token's position, and number of
    real rows (0 for the spare tiles past the last sequence).
    """
    query_start = metadata.query_start.astype(jnp.int32)
    num_seqs = metadata.seq_lens.shape[0]
    q_len = query_start[1:] - query_start[:-1]
    tiles_per_seq = (q_len + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles_per_seq)
    w = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, w, side="right", method="compare_all"), num_seqs - 1).astype(jnp.int32)
    index = w - (tiles_end[seq] - tiles_per_seq[seq])
    token0 = query_start[seq] + index * tile
    rows = jnp.clip(query_start[seq + 1] - token0, 0, tile)
    rows = jnp.where(w < tiles_end[num_seqs - 1], rows, 0)
    pos0 = metadata.seq_lens[seq] - q_len[seq] + index * tile
    return seq, token0, pos0, rows


def _as_bits(cache):
    return lax.bitcast_convert_type(cache, jnp.dtype(f"uint{8 * cache.dtype.itemsize}"))


def ragged_paged_attention_reference(
    q: Float[Array, "tokens q_heads head_dim"],
    k_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    v_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    metadata: AttentionMetadata,
    *,
    layer: Int[Array, ""] | int,
    sm_scale: float,
    kv_slot_of_head: Sequence[int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads head_dim"]:
    """Causal attention of each sequence's queries over its paged keys, written plainly.

    Scores and accumulation in f32; rows with no visible key (padding tokens) give zeros.
    An FP8 cache is read as f32 (exact), ``k_scale`` multiplies the softmax scale and
    ``v_scale`` the normalised output; other caches ignore the scales.
    """
    num_tokens, q_heads, head_dim = q.shape
    _, kv_slots, _, page_size, _ = k_cache.shape
    max_pages = metadata.page_table.shape[1]
    context = max_pages * page_size
    groups = heads_by_slot(kv_slot_map(q_heads, kv_slots, kv_slot_of_head), kv_slots)
    layer = jnp.asarray(layer, jnp.int32)
    check_scales(k_scale, v_scale)
    score_scale = sm_scale * k_scale if is_fp8_cache(k_cache.dtype) else sm_scale
    out_scale = v_scale if is_fp8_cache(v_cache.dtype) and v_scale != 1.0 else None

    num_seqs = metadata.seq_lens.shape[0]
    tile = _tile_size(num_tokens, num_seqs, q_heads, kv_slots * head_dim)
    # Each sequence adds at most one partial tile; no tile is empty.
    num_tiles = min(-(-num_tokens // tile) + num_seqs, num_tokens)
    tile_seq, tile_token0, tile_pos0, tile_rows = _tiles(metadata, tile, num_tiles)
    k_bits, v_bits = _as_bits(k_cache), _as_bits(v_cache)

    per_tile = 2 * context * kv_slots * head_dim * 4 + 3 * tile * q_heads * context * 4
    group = max(1, min(num_tiles, _CHUNK_BUDGET_BYTES // per_tile))

    def attend(w):  # tiles w (a static slice): [n] each
        seq_w, tok0_w, pos0_w, rows_w = tile_seq[w], tile_token0[w], tile_pos0[w], tile_rows[w]
        r = jnp.arange(tile, dtype=jnp.int32)
        q_w = q[jnp.clip(tok0_w[:, None] + r, 0, num_tokens - 1)].astype(jnp.float32)  # [n, C, H, D]
        pages = metadata.page_table[seq_w]  # [n, max_pages]
        key_pos = jnp.arange(context, dtype=jnp.int32)
        pos = pos0_w[:, None] + r  # [n, C]
        visible = (key_pos <= pos[:, :, None]) & (r < rows_w[:, None])[:, :, None]  # [n, C, ctx]
        outs = []
        for slot, heads in enumerate(groups):
            if not heads:
                continue
            k_s = _gather_pages(k_bits, k_cache.dtype, layer, slot, pages)  # [n, ctx, D]
            v_s = _gather_pages(v_bits, v_cache.dtype, layer, slot, pages)
            q_g = q_w[:, :, jnp.array(heads)]  # [n, C, g, D]
            n, _, g, _ = q_g.shape
            s = jnp.einsum("nrd,nsd->nrs", q_g.reshape(n, tile * g, head_dim), k_s) * score_scale
            s = s.reshape(n, tile, g, context)
            s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
            m = jnp.max(s, axis=-1, keepdims=True)
            m = jnp.where(jnp.isfinite(m), m, 0.0)  # no visible key: keep exp() at 0
            p = jnp.exp(s - m)
            l = jnp.sum(p, axis=-1, keepdims=True)
            o = jnp.einsum("nrs,nsd->nrd", p.reshape(n, tile * g, context), v_s)
            o = o.reshape(n, tile, g, head_dim) / jnp.where(l > 0, l, 1.0)
            outs.append(o if out_scale is None else o * out_scale)
        order = [h for heads in groups for h in heads]
        inverse = [order.index(h) for h in range(q_heads)]
        return jnp.concatenate(outs, axis=2)[:, :, jnp.array(inverse)]  # [n, C, H, D]

    # Tiles are unrolled in Python in groups that fit the budget, not looped with lax.map:
    # on XLA's CPU backend the same body inside a while loop ran ~10x slower (1.1 s
    # against 0.15 s for 16 decode tokens over 2048 positions, SmolLM2-135M shapes).
    tiles_out = jnp.concatenate(
        [attend(slice(i, min(i + group, num_tiles))) for i in range(0, num_tiles, group)]
    )
    r = jnp.arange(tile, dtype=jnp.int32)
    # Rows past a tile's end go to a scratch row (index num_tokens), sliced off below.
    dest = jnp.where(r < tile_rows[:, None], tile_token0[:, None] + r, num_tokens)
    out = jnp.zeros((num_tokens + 1, q_heads, head_dim), jnp.float32)
    out = out.at[dest.reshape(-1)].set(tiles_out.reshape(-1, q_heads, head_dim))
    out = out[:num_tokens].astype(q.dtype)
    return out
