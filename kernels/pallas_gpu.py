"""Pallas GPU kernels for ragged paged attention: a split-K decode kernel and a prefill kernel.

Backend: Pallas's Triton backend (``pl.pallas_call`` with ``plgpu.CompilerParams``). It is
deprecated since JAX 0.11 in favour of Mosaic GPU, but it still runs on the H200 under JAX
0.11.2, it runs in Pallas interpret mode on the CPU (so the CPU tests exercise the same
kernel bodies), its lowering can be checked on a machine without a GPU, and its
pointer-per-element loads express page-table gathers directly. A Mosaic GPU port (TMA
page copies, wgmma, warp specialisation) is the way to the last 10-30% on Hopper and the
way off the deprecated backend; it was not written for lack of time, not because the
Triton kernels are the better design.

Both kernels take the whole stacked cache ``[layers, kv_slots, num_pages, page_size,
head_dim]`` plus the layer index as a one-element int32 array and index the layer inside
the kernel, so a layer scan never slices (copies) the cache.

Layout. The query heads that share a KV slot are processed together: per slot ``j`` the
group's heads (padded with copies to ``group``, a power of two, which Triton's tile shapes
need) are interleaved token-major into rows, ``q_rows[j, t * group + g] = q[t, head(j, g)]``.
One program then multiplies ``tokens x group`` query rows against each K block it loads,
so K/V bytes are read once per slot, not once per head.

- Decode (sequences with exactly one new token), grid ``(seqs, kv_slots, splits)``: each
  program runs online softmax over its share of the context and writes an unnormalised
  partial (``o``, running max ``m``, sum ``l``); a third kernel, grid ``(seqs, kv_slots,
  head_dim slices)``, merges the splits each sequence's context reached (flash-decoding).
  Splits are chosen so that the grid fills the GPU when the batch is small. (XLA's merge,
  elementwise over every static split, took 7.4 us a layer at one sequence on an H100, the
  kernel 2.1 us: served one-request TPOT 0.97x in bf16, 0.95x in FP8; benchmarks/README.md,
  "The merge of the decode splits as a Pallas kernel".)
- Prefill (sequences with more than one new token), grid ``(tiles, kv_slots)``: a tile is
  up to ``block_q`` consecutive query tokens of one sequence; flash attention over the
  sequence's pages, causal mask only on the blocks that cross the diagonal; rows are
  stored with a mask, so tiles of neighbouring sequences never overwrite each other.

One ``ragged_paged_attention_pallas`` call launches both for a mixed batch; each kernel's
programs whose sequence belongs to the other path exit at once.

Measured on the H200 (benchmarks/README.md, "Attention kernels"): decode 64 x 4096,
32 q / 8 KV, D128 bf16 at 86% of the copy bandwidth; 8 q / 1 KV only 34% (134 MB per call,
so fixed per-call costs dominate); prefill 2048 after 2048 at 58% of cuDNN's FLOP/s.

FP8 caches (``float8_e4m3fn``): the kernels load e4m3 blocks (half the bytes of bf16) and
convert them in registers to the compute dtype, q's (exact: every e4m3 value is a bf16
value), so the dots are the bf16 cache's dots over the dequantised values. ``k_scale`` is
folded into the softmax scale (one scalar product on the host, applied to q as
``sm_scale`` already is) and ``v_scale`` into the normalised output (one multiply per
output element, in the merge of the decode splits and in the prefill kernel's epilogue), so no per-key
work is added. Against a bf16 cache holding ``e4m3 * scale`` this moves one rounding
(of q times the scales instead of the cache times its scale); with power-of-two scales
the two agree exactly. Other caches ignore the scales. Measured on the H200 (Llama-3.1-8B
shape, 8k context; benchmarks/README.md, "One GPU: FP8 weights and the FP8 KV cache"):
correct (2.7e-3 relative to the reference), but the decode kernel takes the bf16 cache's
time (14.7 / 69.7 / 472 us against 14.7 / 71.1 / 502 us at 1 / 8 / 64 sequences, so 25-49%
of the read stream on half the bytes), and larger key blocks, 8 warps or 4 stages did not
help: per key, not per byte, work bounds it (the e4m3 conversion, presumably; not
profiled). The FP8 cache buys capacity (twice the tokens per GiB), not decode speed, until
a kernel converts cheaper.

Caches of more than 2**31 elements per array are read correctly at their far end (checked
on the H200 with a 2.2e9-element bf16 cache, 4.4 GiB: tests/test_kernels_gpu.py
::test_cache_larger_than_int32_offsets): past 4 GiB Pallas's Triton lowering uses 64-bit
offsets. An FP8 array of 2 to 4 GiB gets 32-bit ones that cannot reach its upper half
(``triton_offsets``); the engine never makes one (``CacheGeometry.triton_unreachable_pages``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from .metadata import AttentionMetadata, heads_by_slot, kv_slot_map, token_layout
from .reference import check_scales, is_fp8_cache

# Finite, so that exp(mask - m) is 0 without inf - inf; every block a program visits has
# at least one visible key for its real rows, so masked logits never win a row max.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_SM_COUNT_H200 = 132


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class PallasAttentionConfig:
    """Tuning knobs of the two kernels; checked at construction.

    prefill_rows: query rows (tokens x group heads) per prefill program; the tile holds
        ``prefill_rows // group`` tokens. Stages, then rows, are lowered at call time where
        q plus the pipelined K/V blocks would not fit in shared memory (f32, head_dim 128).
    prefill_block_k / decode_block_k: keys per inner step (a multiple of the page size;
        a page larger than the block is taken whole).
    decode_splits: context splits per decode sequence; ``None`` picks enough programs for
        about four per multiprocessor (132 on the H200).
    """

    prefill_rows: int = 128
    # Defaults: the fastest of the variants benchmarks/attention_bench.py tried on the H200
    # (benchmarks/README.md, "Attention kernels"): prefill rows 128 x block_k 128, 8 warps, 2 stages;
    # decode block_k 128, 2 stages (Llama-3-8B shapes).
    prefill_block_k: int = 128
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    decode_block_k: int = 128
    decode_splits: int | None = None
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    interpret: bool = False

    def __post_init__(self):
        for name in ("prefill_rows", "prefill_block_k", "decode_block_k"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value < 16:
                raise ValueError(
                    f"PallasAttentionConfig.{name}={value}: Triton tiles need a power of two "
                    "of at least 16."
                )
        for name in ("prefill_num_warps", "decode_num_warps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"PallasAttentionConfig.{name}={value}: use 1, 2, 4, 8 or 16 warps.")
        for name in ("prefill_num_stages", "decode_num_stages"):
            if not 1 <= getattr(self, name) <= 6:
                raise ValueError(f"PallasAttentionConfig.{name}={getattr(self, name)}: use 1 to 6 stages.")
        if self.decode_splits is not None and self.decode_splits < 1:
            raise ValueError(f"PallasAttentionConfig.decode_splits={self.decode_splits}: use None or >= 1.")


# Shared memory the pipelined K/V blocks and the q tile may take: the H200 has 227 KiB per
# block, and Triton needs some more for layout conversions between the two dots.
_SHARED_MEMORY_BUDGET = 160 * 1024


def _fit_shared_memory(rows, block_k, stages, *, page_size, head_dim, itemsize, cache_itemsize, min_rows):
    """Shrink stages (to 2), then the key block (to a page, or 32), then rows, then stages
    (to 1) until q plus ``stages`` pipelined K and V blocks fit the budget. ``itemsize`` is
    q's (the compute dtype's), ``cache_itemsize`` the pipelined blocks' (1 for FP8: the
    blocks are converted in registers; the layout conversions take the budget's headroom,
    as for bf16)."""
    block_k = max(block_k, page_size)

    def fits():
        return (rows * itemsize + 2 * stages * block_k * cache_itemsize) * head_dim <= _SHARED_MEMORY_BUDGET
    while not fits() and stages > 2:
        stages -= 1
    while not fits() and block_k > max(page_size, 32):
        block_k //= 2
    while not fits() and rows > min_rows:
        rows //= 2
    while not fits() and stages > 1:
        stages -= 1
    return rows, block_k, stages


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_LOG2E = math.log2(math.e)


def _scaled_q(q, sm_scale):
    """q times sm_scale * log2(e), so logits come out in base 2 (exp2 in the loop)."""
    return (q.astype(jnp.float32) * (sm_scale * _LOG2E)).astype(q.dtype)


def _online_softmax_step(q, k, v, carry, mask):
    """One flash step: fold a [rows, block_k] block of base-2 logits into (o, m, l)."""
    o, m, l = carry
    if k.dtype != q.dtype:  # an FP8 cache: e4m3 to the compute dtype, exact
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = plgpu.dot(q, k, trans_b=True, precision=precision)  # f32 [rows, block_k]
    if mask is not None:
        s = jnp.where(mask, s, _MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    correction = jnp.exp2(m - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l * correction + p.sum(axis=1)
    o_next = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o_next, m_next, l_next


def _initial_carry(rows: int, head_dim: int):
    """(o, m, l) of an online softmax that has seen no key yet."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), _MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def _load_block(cache_ref, layer, slot, page_table_ref, seq, block, block_k, page_size):
    """Keys ``block * block_k ..`` of sequence ``seq``: [block_k, head_dim], via its pages.

    ``cache_ref`` is the cache viewed as ``[layers, kv_slots, num_pages * page_size, D]``;
    each row's page id is looked up on its own (the repeats hit L1), which gives a plain
    2-D gather whose rows Triton can load as contiguous vectors, with no reshape.
    """
    r = jnp.arange(block_k, dtype=jnp.int32)
    page = page_table_ref[seq, block * (block_k // page_size) + r // page_size]
    return cache_ref[layer, slot, page * page_size + r % page_size]


def _decode_kernel(
    query_start_ref, seq_lens_ref, page_table_ref, layer_ref, q_ref, k_ref, v_ref,
    o_ref, m_ref, l_ref, *, group, rows, block_k, page_size, blocks_per_split, sm_scale,
):
    seq, slot, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    start = query_start_ref[seq]
    is_decode = query_start_ref[seq + 1] - start == 1
    kv_len = seq_lens_ref[seq]
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(kv_len, block_k))
    last = jnp.where(is_decode, last, first)
    full = jnp.clip(kv_len // block_k, first, last)  # blocks with every key visible
    layer = layer_ref[0]

    carry = _initial_carry(rows, head_dim)

    @pl.when(last > first)
    def _():
        q = _scaled_q(q_ref[slot, pl.ds(start * group, rows), :], sm_scale)

        def step(block, carry, masked):
            k = _load_block(k_ref, layer, slot, page_table_ref, seq, block, block_k, page_size)
            v = _load_block(v_ref, layer, slot, page_table_ref, seq, block, block_k, page_size)
            mask = None
            if masked:
                key_pos = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
                mask = jnp.broadcast_to((key_pos < kv_len)[None, :], (rows, block_k))
            return _online_softmax_step(q, k, v, carry, mask)

        out = lax.fori_loop(first, full, functools.partial(step, masked=False), carry)
        o, m, l = lax.fori_loop(full, last, functools.partial(step, masked=True), out)
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l

    @pl.when(last <= first)
    def _():
        o, m, l = carry
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l


# The merge's tile: up to this many float32 partial elements a program holds at once.
_MERGE_TILE_ELEMENTS = 8192


def _merge_tiles(splits: int, group: int, head_dim: int) -> tuple[int, int]:
    """(splits per step, head_dim columns per program) of the merge: every split in one step
    where the tile allows, a narrower slice of head_dim before fewer splits a step."""
    splits_pow2 = _next_power_of_two(splits)
    block_d = head_dim
    while splits_pow2 * group * block_d > _MERGE_TILE_ELEMENTS and block_d > 16:
        block_d //= 2
    return max(1, min(splits_pow2, _MERGE_TILE_ELEMENTS // (group * block_d))), block_d


def _merge_kernel(
    query_start_ref, seq_lens_ref, o_ref, m_ref, l_ref, out_ref, *, group, chunk, block_d, block_k,
    blocks_per_split, out_scale,
):
    """One (sequence, slot, head_dim slice): the decode kernel's partials of the splits its
    context reached, merged by online softmax ``chunk`` splits a step; ``out = o / l``."""
    seq, slot, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    is_decode = query_start_ref[seq + 1] - query_start_ref[seq] == 1
    # the decode kernel's programs with keys: split s holds blocks s * blocks_per_split ..
    reached = pl.cdiv(pl.cdiv(seq_lens_ref[seq], block_k), blocks_per_split)
    reached = jnp.where(is_decode, reached, 0)

    def step(c, carry):
        m_run, l_run, o_run = carry
        split = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        valid = split < reached
        splits = pl.ds(c * chunk, chunk)
        row_mask = jnp.broadcast_to(valid[:, None], (chunk, group))
        m = plgpu.load(m_ref.at[seq, slot, splits, pl.ds(0, group)], mask=row_mask, other=_MASK_VALUE)
        l = plgpu.load(l_ref.at[seq, slot, splits, pl.ds(0, group)], mask=row_mask, other=0.0)
        o = plgpu.load(o_ref.at[seq, slot, splits, pl.ds(0, group), pl.ds(d * block_d, block_d)],
                       mask=jnp.broadcast_to(valid[:, None, None], (chunk, group, block_d)), other=0.0)
        m_next = jnp.maximum(m_run, m.max(axis=0))
        weight = jnp.exp2(m - m_next[None, :])  # [chunk, group]; m is in base 2
        correction = jnp.exp2(m_run - m_next)
        l_next = l_run * correction + (weight * l).sum(axis=0)
        o_next = o_run * correction[:, None] + (weight[:, :, None] * o).sum(axis=0)
        return m_next, l_next, o_next

    carry = (jnp.full((group,), _MASK_VALUE, jnp.float32), jnp.zeros((group,), jnp.float32),
             jnp.zeros((group, block_d), jnp.float32))
    _, l, o = lax.fori_loop(0, pl.cdiv(reached, chunk), step, carry)
    out = o / jnp.where(l > 0, l, 1.0)[:, None]
    if out_scale is not None:  # an FP8 cache's v_scale
        out = out * out_scale
    out_ref[...] = out.astype(out_ref.dtype)


def _prefill_kernel(
    tile_seq_ref, tile_token0_ref, tile_pos0_ref, tile_rows_ref, page_table_ref, layer_ref,
    q_ref, k_ref, v_ref, out_init_ref, out_ref, *, group, block_q, block_k, page_size, sm_scale, out_scale,
):
    del out_init_ref  # aliased with out_ref: rows no tile owns keep their initial value
    tile, slot = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[-1]
    rows = block_q * group
    num_rows = tile_rows_ref[tile]

    @pl.when(num_rows > 0)
    def _():
        seq = tile_seq_ref[tile]
        token0 = tile_token0_ref[tile]
        pos0 = tile_pos0_ref[tile]
        layer = layer_ref[0]
        q = _scaled_q(q_ref[slot, pl.ds(token0 * group, rows), :], sm_scale)
        row_token = jnp.arange(rows, dtype=jnp.int32) // group
        row_pos = pos0 + row_token
        # Blocks whose every key is at or before the tile's first position need no mask.
        full = (pos0 + 1) // block_k
        end = pl.cdiv(pos0 + num_rows, block_k)

        def step(block, carry, masked):
            k = _load_block(k_ref, layer, slot, page_table_ref, seq, block, block_k, page_size)
            v = _load_block(v_ref, layer, slot, page_table_ref, seq, block, block_k, page_size)
            mask = None
            if masked:
                key_pos = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
                mask = key_pos[None, :] <= row_pos[:, None]
            return _online_softmax_step(q, k, v, carry, mask)

        carry = _initial_carry(rows, head_dim)
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
        o, _, l = lax.fori_loop(full, end, functools.partial(step, masked=True), carry)
        o = o / l[:, None]
        if out_scale is not None:  # an FP8 cache's v_scale
            o = o * out_scale
        row_valid = (row_token < num_rows)[:, None]
        plgpu.store(
            out_ref.at[slot, pl.ds(token0 * group, rows), :],
            o.astype(out_ref.dtype),
            mask=jnp.broadcast_to(row_valid, (rows, head_dim)),
        )


def _prefill_tiles(metadata: AttentionMetadata, block_q: int, num_tiles: int):
    """Tiles of up to ``block_q`` consecutive query tokens of one prefill sequence.

    Per tile: sequence, first token, first token's position, real rows (0 for spare
    tiles and for tiles of decode sequences, which the decode kernel takes).
    """
    query_start = metadata.query_start.astype(jnp.int32)
    num_seqs = metadata.seq_lens.shape[0]
    q_len = query_start[1:] - query_start[:-1]
    tiles_per_seq = jnp.where(q_len > 1, (q_len + block_q - 1) // block_q, 0)
    tiles_end = jnp.cumsum(tiles_per_seq)
    w = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, w, side="right", method="compare_all"), num_seqs - 1).astype(jnp.int32)
    index = w - (tiles_end[seq] - tiles_per_seq[seq])
    token0 = query_start[seq] + index * block_q
    rows = jnp.clip(query_start[seq + 1] - token0, 0, block_q)
    rows = jnp.where(w < tiles_end[num_seqs - 1], rows, 0)
    pos0 = metadata.seq_lens[seq] - q_len[seq] + index * block_q
    return seq, token0, pos0, rows.astype(jnp.int32)


def ragged_paged_attention_pallas(
    q: Float[Array, "tokens q_heads head_dim"],
    k_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    v_cache: Float[Array, "layers kv_slots num_pages page_size head_dim"],
    metadata: AttentionMetadata,
    *,
    layer: Int[Array, ""] | int,
    sm_scale: float,
    kv_slot_of_head: Sequence[int] | None = None,
    config: PallasAttentionConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    _poison: bool = False,
) -> Float[Array, "tokens q_heads head_dim"]:
    """The Pallas path of ``ragged_paged_attention`` (same contract).

    ``_poison`` (tests only) fills every kernel output with NaN before the kernels run, so
    a row a kernel should write and does not shows up; padding rows then stay NaN.
    """
    config = config or PallasAttentionConfig()
    num_tokens, q_heads, head_dim = q.shape
    _, kv_slots, _, page_size, _ = k_cache.shape
    num_seqs, max_pages = metadata.page_table.shape
    if not _is_power_of_two(head_dim) or not _is_power_of_two(page_size):
        raise ValueError(
            f"head_dim={head_dim} and page_size={page_size}: the Pallas kernels need powers of "
            "two (Triton tile shapes); use implementation='reference' otherwise."
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; use one dtype.")
    check_scales(k_scale, v_scale)
    fp8 = is_fp8_cache(k_cache.dtype)
    # The dots run in the cache's dtype (a model may carry q in f32 over a bf16 cache);
    # over an FP8 cache they run in q's, the blocks converted after loading.
    compute_dtype = q.dtype if fp8 else k_cache.dtype
    if fp8:
        sm_scale = sm_scale * k_scale
    out_scale = v_scale if fp8 and v_scale != 1.0 else None
    groups = heads_by_slot(kv_slot_map(q_heads, kv_slots, kv_slot_of_head), kv_slots)
    group = _next_power_of_two(max(len(heads) for heads in groups))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    # Rows: q_rows[slot, token * group + g] = q[token, groups[slot][g]] (padded groups repeat
    # a head of the slot, or head 0 for a slot no head reads; their rows are dropped).
    head_of_row = [[(heads[g] if g < len(heads) else (heads[0] if heads else 0)) for g in range(group)] for heads in groups]
    fit = functools.partial(_fit_shared_memory, page_size=page_size, head_dim=head_dim,
                            itemsize=jnp.dtype(compute_dtype).itemsize, cache_itemsize=k_cache.dtype.itemsize)
    prefill_rows, prefill_block_k, prefill_stages = fit(
        max(config.prefill_rows, group), config.prefill_block_k, config.prefill_num_stages, min_rows=max(16, group))
    decode_rows = max(16, group)
    _, decode_block_k, decode_stages = fit(
        decode_rows, config.decode_block_k, config.decode_num_stages, min_rows=decode_rows)
    p_ppb, d_ppb = prefill_block_k // page_size, decode_block_k // page_size
    block_q = max(1, prefill_rows // group)
    pad_tokens = max(block_q, -(-decode_rows // group))
    # The output comes back in q's dtype.
    q_rows = q.astype(compute_dtype)[:, jnp.array(head_of_row)]  # [T, kv, group, D]
    q_rows = jnp.pad(q_rows, ((0, pad_tokens), (0, 0), (0, 0), (0, 0)))
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(kv_slots, (num_tokens + pad_tokens) * group, head_dim)

    # Pad the page table so every block's page slice is in bounds (page 0 is valid).
    lcm_pages = math.lcm(p_ppb, d_ppb)
    page_table = jnp.pad(metadata.page_table.astype(jnp.int32), ((0, 0), (0, -max_pages % lcm_pages)))
    query_start = metadata.query_start.astype(jnp.int32)
    seq_lens = metadata.seq_lens.astype(jnp.int32)

    # --- decode ---
    d_blocks = -(-max_pages // d_ppb)
    splits = config.decode_splits
    if splits is None:
        splits = _next_power_of_two(max(1, -(-4 * _SM_COUNT_H200 // (num_seqs * kv_slots))))
    splits = min(splits, d_blocks)
    blocks_per_split = -(-d_blocks // splits)
    splits = -(-d_blocks // blocks_per_split)
    merge_chunk, merge_block_d = _merge_tiles(splits, group, head_dim)
    # The partials' split axis is padded to whole merge chunks; the merge masks the padding
    # (never written) as it masks the splits a sequence's context did not reach.
    padded_splits = -(-splits // merge_chunk) * merge_chunk
    part_shapes = [
        jax.ShapeDtypeStruct((num_seqs, kv_slots, padded_splits, decode_rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, kv_slots, padded_splits, decode_rows), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, kv_slots, padded_splits, decode_rows), jnp.float32),
    ]
    # [layers, kv_slots, num_pages * page_size, D]: merging two contiguous axes is free.
    k_flat = k_cache.reshape(*k_cache.shape[:2], -1, head_dim)
    v_flat = v_cache.reshape(*v_cache.shape[:2], -1, head_dim)
    decode_args = [query_start, seq_lens, page_table, layer, q_rows, k_flat, v_flat]
    decode_aliases = {}
    if _poison:
        decode_aliases = {len(decode_args) + i: i for i in range(3)}
        decode_args += [jnp.full(s.shape, jnp.nan, s.dtype) for s in part_shapes]
    decode_kernel = functools.partial(
        _decode_kernel, group=group, rows=decode_rows, block_k=decode_block_k, page_size=page_size,
        blocks_per_split=blocks_per_split, sm_scale=sm_scale,
    )
    if _poison:
        inner = decode_kernel
        decode_kernel = lambda *refs: inner(*refs[:7], *refs[10:])  # noqa: E731 (skip the aliased inits)
    o_part, m_part, l_part = pl.pallas_call(
        decode_kernel,
        grid=(num_seqs, kv_slots, splits),
        in_specs=[pl.no_block_spec] * len(decode_args),
        out_specs=[
            pl.BlockSpec((None, None, None, decode_rows, head_dim), lambda b, j, s: (b, j, s, 0, 0)),
            pl.BlockSpec((None, None, None, decode_rows), lambda b, j, s: (b, j, s, 0)),
            pl.BlockSpec((None, None, None, decode_rows), lambda b, j, s: (b, j, s, 0)),
        ],
        out_shape=part_shapes,
        input_output_aliases=decode_aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.decode_num_warps, num_stages=decode_stages
        ),
        interpret=config.interpret,
        name="ragged_paged_attention_decode",
    )(*decode_args)
    # Merge the splits (flash-decoding) in a kernel that reads only the splits the sequence's
    # context reached: an XLA merge, elementwise over the static splits, read all of them
    # for every output element (40 at one sequence with a 5,120-token page table).
    decode_out = pl.pallas_call(
        functools.partial(_merge_kernel, group=group, chunk=merge_chunk, block_d=merge_block_d, block_k=decode_block_k,
                          blocks_per_split=blocks_per_split, out_scale=out_scale),
        grid=(num_seqs, kv_slots, head_dim // merge_block_d),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.BlockSpec((None, None, group, merge_block_d), lambda b, j, d: (b, j, 0, d)),
        out_shape=jax.ShapeDtypeStruct((num_seqs, kv_slots, group, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=config.interpret,
        name="ragged_paged_attention_merge",
    )(query_start, seq_lens, o_part, m_part, l_part)

    # --- prefill ---
    num_tiles = min(-(-num_tokens // block_q) + num_seqs, num_tokens)
    tiles = _prefill_tiles(metadata, block_q, num_tiles)
    fill = jnp.nan if _poison else 0.0
    out_init = jnp.full((kv_slots, (num_tokens + pad_tokens) * group, head_dim), fill, q.dtype)
    prefill_args = [*tiles, page_table, layer, q_rows, k_flat, v_flat, out_init]
    out_rows = pl.pallas_call(
        functools.partial(
            _prefill_kernel, group=group, block_q=block_q, block_k=prefill_block_k, page_size=page_size,
            sm_scale=sm_scale, out_scale=out_scale,
        ),
        grid=(num_tiles, kv_slots),
        in_specs=[pl.no_block_spec] * len(prefill_args),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(out_init.shape, q.dtype),
        input_output_aliases={len(prefill_args) - 1: 0},
        compiler_params=plgpu.CompilerParams(
            num_warps=config.prefill_num_warps, num_stages=prefill_stages
        ),
        interpret=config.interpret,
        name="ragged_paged_attention_prefill",
    )(*prefill_args)

    # Back to [T, q_heads, D]: head h is row (slot, index within its group).
    where = {h: (j, g) for j, heads in enumerate(groups) for g, h in enumerate(heads)}
    slot_idx = jnp.array([where[h][0] for h in range(q_heads)])
    group_idx = jnp.array([where[h][1] for h in range(q_heads)])
    out = out_rows.reshape(kv_slots, num_tokens + pad_tokens, group, head_dim)
    out = out[slot_idx, :num_tokens, group_idx].transpose(1, 0, 2)  # [T, H, D]
    # A decode sequence's one token takes the decode kernel's row. A select over tokens,
    # not a scatter over sequences: XLA fuses it with the re-layout and the merge of the
    # splits (one kernel where the scatter and the merge took two or three).
    seq_of_token, _, real = token_layout(metadata, num_tokens)
    is_decode = query_start[1:] - query_start[:-1] == 1
    takes_decode = is_decode[seq_of_token] & real
    decode_heads = decode_out[:, slot_idx, group_idx]  # [B, H, D]
    return jnp.where(takes_decode[:, None, None], decode_heads[seq_of_token], out)
