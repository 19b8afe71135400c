"""The process-to-data mapping and the weights-stored-once layout."""

import itertools

import jax
import numpy as np
import pytest

from shiftjax.config import ModelConfig
from shiftjax.layouts.heads import head_layout
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import random_params
from shiftjax.weights import shard_params

SHAPES = [(64, 8), (32, 8), (9, 3), (4, 1), (16, 8), (12, 4), (28, 4), (8, 2), (6, 6), (40, 8)]
MESHES = [(sp, tp) for sp, tp in itertools.product((1, 2, 4, 8, 16), repeat=2) if sp * tp <= 16]


@pytest.mark.parametrize("n_heads,n_kv", SHAPES)
@pytest.mark.parametrize("sp,tp", MESHES)
def test_every_head_once_and_reads_its_kv_head(n_heads, n_kv, sp, tp):
    layout = head_layout(n_heads, n_kv, sp, tp)
    placed = [h for block in layout.query_head_of for h in block if h >= 0]
    assert sorted(placed) == list(range(n_heads))
    assert all(len(block) == layout.q_per_block for block in layout.query_head_of)
    assert all(len(slots) == layout.kv_per_block for slots in layout.kv_head_of_slot)
    assert len(layout.kv_slot_of_head) == layout.q_per_block
    group = n_heads // n_kv
    for block, heads in enumerate(layout.query_head_of):
        for i, h in enumerate(heads):
            if h >= 0:  # the slot a query head reads holds its KV head
                assert layout.kv_head_of_slot[block][layout.kv_slot_of_head[i]] == h // group
    # Never more KV slots per device than query heads, nor than needed when blocks align.
    assert layout.kv_per_block <= layout.q_per_block
    if n_heads % (sp * tp) == 0 and (n_heads // (sp * tp)) % group == 0:
        assert layout.kv_per_block == n_heads // (sp * tp) // group


def test_known_layouts():
    llama70b = head_layout(64, 8, 8, 1)
    assert (llama70b.q_per_block, llama70b.kv_per_block) == (8, 1)
    replicated = head_layout(64, 8, 16, 1)  # P = 16: each KV head on two devices
    assert replicated.kv_per_block == 1 and replicated.kv_head_of_slot[0] == replicated.kv_head_of_slot[1]
    smol = head_layout(9, 3, 2, 1)  # 5 heads a device, 2 KV slots (the aligned-g rule gives 5)
    assert (smol.q_per_block, smol.kv_per_block) == (5, 2)
    assert smol.query_head_of == ((0, 1, 2, 3, 4), (6, 7, 8, 5, -1))
    smol8 = head_layout(9, 3, 8, 1)
    assert (smol8.q_per_block, smol8.kv_per_block) == (3, 1)


def test_head_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        head_layout(9, 2, 1, 1)
    with pytest.raises(ValueError, match="sp must be a positive integer"):
        head_layout(8, 2, 0, 1)


CONFIG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16)


def _buffers(tree) -> dict[int, int]:
    """Unique device buffers (pointer -> bytes) under a pytree of arrays."""
    found = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            found[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return found


@pytest.mark.parametrize("sp,tp", [(2, 2), (4, 2), (8, 1)])
def test_default_storage_adds_no_weight_memory(sp, tp):
    weights = shard_params(random_params(CONFIG), CONFIG, make_mesh(sp, tp))
    assert weights.storage == "aliased"
    tp_buffers, sp_buffers = _buffers(weights.tp), _buffers(weights.sp)
    assert set(tp_buffers) <= set(sp_buffers), "the TP view owns buffers of its own"
    # Every TP-view shard is exactly one SP-view buffer: device (s, t) holds block t*sp+s.
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        tp_view, shards = getattr(weights.tp.layers, name), getattr(weights.sp.layers, name)
        assert len(shards) == sp
        for shard in tp_view.addressable_shards:
            s = next(i for i in range(sp) if shard.device in weights.mesh.devices[i])
            owner = {x.device: x.data for x in shards[s].addressable_shards}[shard.device]
            assert shard.data.unsafe_buffer_pointer() == owner.unsafe_buffer_pointer()
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(owner))


def test_two_copies_costs_one_over_sp_more():
    sp, tp = 4, 2
    aliased = shard_params(random_params(CONFIG), CONFIG, make_mesh(sp, tp))
    copies = shard_params(random_params(CONFIG), CONFIG, make_mesh(sp, tp), storage="two_copies")
    block_bytes = lambda w: sum(_buffers([getattr(w.tp.layers, n) for n in ("wqkv", "wo", "w_gate_up", "w_down")]  # noqa: E731
                                        + [getattr(w.sp.layers, n) for n in ("wqkv", "wo", "w_gate_up", "w_down")]).values())
    assert block_bytes(copies) == pytest.approx(block_bytes(aliased) * (1 + 1 / sp))
