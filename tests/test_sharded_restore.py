"""Sharded restore: a checkpoint read straight into the block layout, bit-identical to the
old path (canonical model replicated on every device, then ``shard_params``), while each
device reads and receives only its own blocks."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from subprocess_env import environ_without_device_count

from shiftjax.checkpoints.dummy import write_checkpoint
from shiftjax.checkpoints.format import PARAMS_DIR
from shiftjax.checkpoints.load import CanonicalReader, load_checkpoint, restore_weights
from shiftjax.config import ModelConfig
from shiftjax.layouts.mesh import make_mesh
from shiftjax.params import param_shapes, random_params
from shiftjax.layouts.heads import head_layout
from shiftjax.weights import block_plan, replicated_tensors, shard_params

# 9 query heads over 3 KV heads (SmolLM2's pattern: padded heads at every P > 1, GQA groups
# straddling blocks, KV heads duplicated at P = 4 and 8); odd vocabulary and FFN sizes, so
# the last vocabulary and FFN blocks are padded too. Tied embeddings.
SMOL_HF = dict(architectures=["LlamaForCausalLM"], vocab_size=99, hidden_size=24, intermediate_size=44,
               num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
               tie_word_embeddings=True)
# Qwen2: QKV biases and an untied LM head; 8 heads over 2 KV heads (each KV head on 4 devices at P = 8).
QWEN_HF = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
               tie_word_embeddings=False)
# Qwen3: its q/k norm weights restored whole beside the other norms (one mesh is enough)
QWEN3_HF = QWEN_HF | dict(architectures=["Qwen3ForCausalLM"], head_dim=12)
CONFIGS = {"smol": SMOL_HF, "qwen": QWEN_HF, "qwen3": QWEN3_HF}
MESHES = [(1, 1), (2, 2), (1, 4), (4, 2)]


def held_bytes_per_device(weights) -> collections.Counter:
    """Bytes of distinct non-norm weight buffers on each device, under both views; asserts
    on the way that no such weight is whole on every device and every shard has its shape."""
    held, seen = collections.Counter(), set()
    for name, leaf in weight_leaves(weights).items():
        if not name.endswith("norm"):
            assert not leaf.sharding.is_fully_replicated, f"{name} is replicated on every device"
        for shard in leaf.addressable_shards:
            assert shard.data.shape == leaf.sharding.shard_shape(leaf.shape), name
            # (device, pointer): on the CPU a device_put may alias the host array, so two
            # devices can share a pointer.
            buffer = (shard.device, shard.data.unsafe_buffer_pointer())
            if buffer not in seen and not name.endswith("norm"):
                seen.add(buffer)
                held[shard.device] += shard.data.nbytes
    return held


def weight_leaves(weights) -> dict[str, jax.Array]:
    """Every array of both views, keyed by view and path."""
    leaves = {}
    for view in ("tp", "sp"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(weights, view)):
            leaves[view + jax.tree_util.keystr(path)] = leaf
    return leaves


def assert_same_weights(new, old):
    """Same arrays in both views: names, shapes, dtypes, shardings and every bit."""
    new_leaves, old_leaves = weight_leaves(new), weight_leaves(old)
    assert new_leaves.keys() == old_leaves.keys()
    assert (new.layout, new.dims, new.storage) == (old.layout, old.dims, old.storage)
    for name, a in new_leaves.items():
        b = old_leaves[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (name, a.sharding, b.sharding)
        a_host, b_host = np.asarray(a), np.asarray(b)
        assert np.array_equal(a_host.view(np.uint8), b_host.view(np.uint8)), f"{name} differs"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Float32 checkpoints of random weights (norms near one, so a misplaced norm shows)."""
    made = {}
    for name, hf in CONFIGS.items():
        config = ModelConfig.from_hf_dict(hf)
        made[name] = write_checkpoint(random_params(config, seed=7), hf, tmp_path_factory.mktemp(name) / "ckpt")
    return made


def old_path(path, mesh, dtype, storage="aliased"):
    """What LLM did before: the whole canonical model replicated, then expanded."""
    config, params = load_checkpoint(path, dtype=dtype, shardings=NamedSharding(mesh, P()))
    return shard_params(params, config, mesh, storage)


@pytest.mark.parametrize("name,sp,tp", [(name, *mesh) for name in ("smol", "qwen") for mesh in MESHES]
                         + [("qwen3", 4, 2)])
def test_restore_is_bit_identical_to_the_old_path(checkpoints, name, sp, tp):
    mesh = make_mesh(sp, tp)
    config, new = restore_weights(checkpoints[name], mesh=mesh, dtype="float32")
    assert config == ModelConfig.from_hf_dict(CONFIGS[name])
    assert_same_weights(new, old_path(checkpoints[name], mesh, "float32"))


def test_restore_casts_and_stores_two_copies_like_the_old_path(checkpoints):
    mesh = make_mesh(2, 2)
    _, new = restore_weights(checkpoints["qwen"], mesh=mesh, dtype="bfloat16", weight_storage="two_copies")
    assert new.tp.layers.wqkv.dtype == np.dtype("bfloat16")
    assert_same_weights(new, old_path(checkpoints["qwen"], mesh, "bfloat16", "two_copies"))


class RecordingReader(CanonicalReader):
    """Records every slice read: (tensor, axis, start, stop)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = []

    def read(self, name, axis=None, start=0, stop=None):
        self.reads.append((name, axis, start, stop))
        return super().read(name, axis, start, stop)


@pytest.mark.parametrize("sp,tp", [(4, 2), (1, 4)])
def test_each_block_reads_only_its_rows(checkpoints, sp, tp):
    path = checkpoints["smol"]
    config = ModelConfig.from_hf_dict(SMOL_HF)
    shapes = param_shapes(config)
    reader = RecordingReader(path / PARAMS_DIR, shapes, np.float32)
    restore_weights(path, mesh=make_mesh(sp, tp), dtype="float32", reader=reader)
    plan = block_plan(config, head_layout(config.num_heads, config.num_kv_heads, sp, tp))
    widths = {segment.tensor: segment.index.shape[1] for weight in plan.values() for segment in weight.segments}
    # Only norms are read whole; every other read is a slice along the cut axis, no wider
    # than the block it fills.
    assert {name for name, axis, *_ in reader.reads if axis is None} == set(replicated_tensors(config))
    for name, axis, start, stop in reader.reads:
        if axis is not None:
            assert 0 < stop - start <= widths[name], (name, start, stop)
    # Tensors cut into disjoint runs (query heads, FFN and vocabulary features): every
    # canonical element is read exactly once over all devices (replicas share one read).
    for name in ("layers.wq", "layers.wo", "layers.w_gate", "layers.w_up", "layers.w_down", "embed"):
        assert reader.bytes_read[name] == np.prod(shapes[name]) * 4, name
    # KV heads shared by several blocks are read by each of them, but no block reads all.
    assert reader.bytes_read["layers.wk"] < np.prod(shapes["layers.wk"]) * 4 * sp * tp


def test_devices_receive_only_their_blocks(checkpoints, monkeypatch):
    """``memory_stats()`` is None on the CPU, so every host-to-device transfer of the restore
    is recorded instead: a block goes to one device, only norms are replicated, and each
    device receives exactly the bytes of its final weights."""
    mesh = make_mesh(4, 2)
    received = collections.Counter()
    replicated_puts = []
    real_put = jax.device_put

    def recording_put(x, device=None, *args, **kwargs):
        if isinstance(device, jax.Device):
            received[device] += np.asarray(x).nbytes
        else:
            replicated_puts.append(np.shape(x))
        return real_put(x, device, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_put)
    config, weights = restore_weights(checkpoints["smol"], mesh=mesh, dtype="float32")
    monkeypatch.undo()

    shapes = param_shapes(config)
    assert sorted(replicated_puts) == sorted(shapes[name] for name in replicated_tensors(config))
    held = held_bytes_per_device(weights)
    assert received == held
    # Aliased storage: each device holds sp blocks of every layer weight (its TP shard) and
    # one block of the vocabulary arrays and biases, nothing more.
    sp = mesh.shape["sp"]
    plan = block_plan(config, weights.layout)
    final_bytes = sum(np.prod(w.block_shape(shapes)) * 4 * (sp if w.kind in ("column", "row") else 1)
                      for w in plan.values())
    assert set(held.values()) == {final_bytes}


@pytest.mark.slow
def test_restore_gpu_script_smoke(tmp_path):
    """benchmarks/restore_gpu.py end to end on the CPU (tiny configs, every phase in its own
    process): each phase exits cleanly, restored weights equal the dummy model they were
    written from, and the 70B stand-in runs a step to finite logits."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = environ_without_device_count()  # the script sets its own device count
    proc = subprocess.run([sys.executable, "benchmarks/restore_gpu.py", "--smoke", "--out", str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "restore_gpu.json").read_text())
    phases = result["phases"]
    assert set(phases) == {"write", "restore_1x2", "restore_2x1", "old_1x2", "dummy70b_1x2"}
    assert phases["restore_1x2"]["equal_to_dummy_weights"] and phases["restore_2x1"]["equal_to_dummy_weights"]
    assert phases["dummy70b_1x2"]["step_logits_finite"] is True
    # tp = 2 holds half of what sp = 2 (aliased: every block on both devices) holds
    tp_bytes = phases["restore_1x2"]["devices"][0]["final_weight_bytes"]
    assert tp_bytes < phases["restore_2x1"]["devices"][0]["final_weight_bytes"]
    assert phases["old_1x2"]["devices"][0]["final_weight_bytes"] == tp_bytes
